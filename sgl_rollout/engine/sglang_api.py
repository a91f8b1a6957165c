"""Every place this package touches SGLang, checked against an SGLang release's source without importing it.

SGLang's serving modules do not import on a machine without its GPU stack, so :func:`check_source` reads
the release's files with :mod:`ast`: the classes, methods, parameters and fields this package calls or
fills, the environment variables it sets, and two rules of the weight-sync path. Each touch point names
where this package relies on it. The CPU tests run it on every release of
:data:`~.sglang_version.TESTED` (``tests/test_sglang_versions.py``), and on the newest release to show
why it is refused.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

#: ``Engine`` methods (``sglang/srt/entrypoints/engine.py``) and the parameters this package passes.
ENGINE_METHODS: Dict[str, Tuple[str, ...]] = {
    "async_generate": ("input_ids", "sampling_params", "return_logprob", "rid", "lora_path", "logprob_start_len",
                       "top_logprobs_num", "image_data", "video_data"),  # engine/generate.py
    "shutdown": (),  # engine/lifecycle.py
}
#: Coroutines of the tokenizer manager (or one of its mixins) the engine awaits on its loop
#: (engine/memory_calls.py, weight_calls.py, lora_calls.py) -> how many positional arguments it passes
#: (the request object and None for the HTTP request; none to ``flush_cache``).
TOKENIZER_COROUTINES = {"release_memory_occupation": 2, "resume_memory_occupation": 2,
                        "update_weights_from_tensor": 2, "flush_cache": 0, "load_lora_adapter_from_tensors": 2,
                        "unload_lora_adapter": 2}
#: Request objects (``sglang/srt/managers/io_struct.py``) and the fields this package fills (engine/io_struct.py).
REQUEST_FIELDS: Dict[str, Tuple[str, ...]] = {
    "ReleaseMemoryOccupationReqInput": ("tags",),
    "ResumeMemoryOccupationReqInput": ("tags",),
    "UpdateWeightsFromTensorReqInput": ("serialized_named_tensors", "load_format", "flush_cache"),
    "LoadLoRAAdapterFromTensorsReqInput": ("lora_name", "config_dict", "serialized_tensors", "load_format"),
    "UnloadLoRAAdapterReqInput": ("lora_name",),
    "GenerateReqInput": ("input_ids", "sampling_params", "return_logprob", "rid", "lora_path", "logprob_start_len",
                         "top_logprobs_num", "image_data", "video_data"),
}
#: ``ServerArgs`` fields (``sglang/srt/server_args.py``) this package may set (config.RolloutConfig.to_server_args,
#: engine/layout.py, engine/core.py).
SERVER_ARGS = ("model_path", "dtype", "tp_size", "mem_fraction_static", "enable_memory_saver",
               "enable_weights_cpu_backup", "disable_cuda_graph", "disable_piecewise_cuda_graph",
               "max_running_requests", "load_format", "enable_lora", "max_lora_rank", "lora_target_modules",
               "max_loras_per_batch", "custom_weight_loader", "custom_sigquit_handler", "nnodes", "node_rank",
               "dist_init_addr", "nccl_port", "port", "base_gpu_id", "gpu_id_step", "skip_tokenizer_init",
               "log_level")
#: ``SamplingParams.__init__`` parameters (``sglang/srt/sampling/sampling_params.py``) this package sends or lets
#: a caller send: engine/generate.py, integrations/verl_server.py, and TRL's ``generation_kwargs``
#: (integrations/trl_sampling.py).
SAMPLING_PARAMS = ("max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
                   "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos",
                   "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "logit_bias",
                   "sampling_seed", "regex", "json_schema", "ebnf", "structural_tag")
#: Environment variables this package sets or reads (patches/tp_memory_imbalance.py, memory tags, logprobs).
ENV_VARS = ("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", "SGLANG_MEMORY_SAVER_CUDA_GRAPH")
#: Memory tags (``sglang/srt/constants.py``) by constant, as this package names them (memory.py).
TAGS = {"GPU_MEMORY_TYPE_WEIGHTS": "weights", "GPU_MEMORY_TYPE_KV_CACHE": "kv_cache",
        "GPU_MEMORY_TYPE_CUDA_GRAPH": "cuda_graph"}
#: ``FlattenedTensorMetadata`` fields (``sglang/srt/weight_sync/tensor_bucket.py``; weight_sync/bucket.py).
BUCKET_METADATA = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")


@dataclass
class _Tree:
    """The parsed files of one SGLang source tree (``root`` holds the ``sglang`` package)."""

    root: Path
    _parsed: Dict[str, Optional[ast.Module]] = field(default_factory=dict)

    def module(self, rel: str) -> Optional[ast.Module]:
        if rel not in self._parsed:
            path = self.root / rel
            self._parsed[rel] = ast.parse(path.read_text()) if path.is_file() else None
        return self._parsed[rel]

    def text(self, rel: str) -> str:
        path = self.root / rel
        return path.read_text() if path.is_file() else ""

    def modules_under(self, rel_dir: str) -> Iterable[Tuple[str, ast.Module]]:
        for path in sorted((self.root / rel_dir).rglob("*.py")):
            rel = str(path.relative_to(self.root))
            tree = self.module(rel)
            if tree is not None:
                yield rel, tree


def _classes(tree: Optional[ast.Module]) -> Dict[str, ast.ClassDef]:
    return {} if tree is None else {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def _methods(cls: ast.ClassDef) -> Dict[str, ast.AST]:
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _params(fn) -> List[str]:
    a = fn.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]


def _takes_positional(fn, n: int) -> bool:
    """Whether ``fn(self, *n args)`` binds: at most its positional parameters, at least those without defaults."""
    a = fn.args
    positional = len(a.posonlyargs) + len(a.args) - 1  # less self
    required = positional - len(a.defaults)
    required_kw = [k for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    return not required_kw and required <= n and (n <= positional or a.vararg is not None)


def _fields(classes: Dict[str, ast.ClassDef], name: str, seen=()) -> List[str]:
    """Annotated fields of a class and of its bases found in the same module."""
    cls = classes.get(name)
    if cls is None or name in seen:
        return []
    out = [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    for base in cls.bases:
        if isinstance(base, ast.Name):
            out += _fields(classes, base.id, seen + (name,))
    return out


def _check_engine(t: _Tree) -> List[str]:
    rel = "sglang/srt/entrypoints/engine.py"
    engine = _classes(t.module(rel)).get("Engine")
    if engine is None:
        return [f"{rel}: no class Engine"]
    problems, methods = [], _methods(engine)
    for name, wanted in ENGINE_METHODS.items():
        if name not in methods:
            problems.append(f"{rel}: Engine.{name} is missing")
            continue
        missing = [p for p in wanted if p not in _params(methods[name])]
        if missing:
            problems.append(f"{rel}: Engine.{name} takes no {missing}")
    if "SGLANG_BLOCK_NONZERO_RANK_CHILDREN" not in t.text(rel):
        problems.append(f"{rel}: SGLANG_BLOCK_NONZERO_RANK_CHILDREN is gone (a node-rank>0 engine would not return)")
    return problems


def _check_tokenizer_manager(t: _Tree) -> List[str]:
    found: Dict[str, Tuple[str, ast.AST]] = {}
    abort = generate = None
    for rel, tree in t.modules_under("sglang/srt/managers"):
        for cls in _classes(tree).values():
            methods = _methods(cls)
            for name in TOKENIZER_COROUTINES:
                if name in methods and isinstance(methods[name], ast.AsyncFunctionDef) and name not in found:
                    found[name] = (f"{rel}:{cls.name}", methods[name])
            if cls.name == "TokenizerManager":
                abort, generate = methods.get("abort_request"), methods.get("generate_request")
    problems = [f"sglang/srt/managers: no coroutine {n} on the tokenizer manager"
                for n in TOKENIZER_COROUTINES if n not in found]
    problems += [f"{where}.{n} cannot be called with {TOKENIZER_COROUTINES[n]} positional argument(s)"
                 for n, (where, fn) in found.items() if not _takes_positional(fn, TOKENIZER_COROUTINES[n])]
    if abort is None or not {"rid", "abort_all"} <= set(_params(abort)):
        problems.append("sglang/srt/managers/tokenizer_manager.py: TokenizerManager.abort_request(rid, abort_all) is gone")
    if generate is None:
        problems.append("sglang/srt/managers/tokenizer_manager.py: TokenizerManager.generate_request is gone")
    sessions = [rel for rel, tree in t.modules_under("sglang/srt/managers")
                if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "begin_weight_update"
                       for n in ast.walk(tree))]
    if sessions:
        problems.append(f"{sessions[0]}: weight updates need a begin_weight_update/end_weight_update session, "
                        "which sgl-rollout does not open (every sync would fail)")
    return problems


def _check_requests(t: _Tree) -> List[str]:
    rel = "sglang/srt/managers/io_struct.py"
    classes = _classes(t.module(rel))
    problems = []
    for name, wanted in REQUEST_FIELDS.items():
        if name not in classes:
            problems.append(f"{rel}: no {name}")
            continue
        missing = [f for f in wanted if f not in _fields(classes, name)]
        if missing:
            problems.append(f"{rel}: {name} has no field {missing}")
    return problems


def server_args_fields(t: _Tree) -> List[str]:
    """The annotated fields of ``class ServerArgs`` in ``sglang/srt/server_args.py``."""
    return _fields(_classes(t.module("sglang/srt/server_args.py")), "ServerArgs")


def _check_server_args(t: _Tree) -> List[str]:
    have = set(server_args_fields(t))
    missing = [f for f in SERVER_ARGS if f not in have]
    return [f"sglang/srt/server_args.py: ServerArgs has no field {missing}"] if missing else []


def _check_weight_loading(t: _Tree) -> List[str]:
    problems = []
    candidates = ["sglang/srt/model_executor/model_runner.py",
                  "sglang/srt/model_executor/model_runner_components/weight_updater.py"]
    bodies = [ast.get_source_segment(t.text(rel), n) or "" for rel in candidates if t.module(rel) is not None
              for n in ast.walk(t.module(rel)) if isinstance(n, ast.FunctionDef) and n.name == "update_weights_from_tensor"]
    if not any("custom_weight_loader" in b and "flattened_bucket" in b for b in bodies):
        problems.append("model_runner: update_weights_from_tensor no longer dispatches load_format to a "
                        "custom_weight_loader and to flattened_bucket (the fast path's in-scheduler loader)")
    rel = "sglang/srt/weight_sync/tensor_bucket.py"
    fields_ = _fields(_classes(t.module(rel)), "FlattenedTensorMetadata")
    if tuple(fields_) != BUCKET_METADATA:
        problems.append(f"{rel}: FlattenedTensorMetadata fields are {fields_}, not {list(BUCKET_METADATA)}")
    return problems


def _check_sampling_params(t: _Tree) -> List[str]:
    rel = "sglang/srt/sampling/sampling_params.py"
    cls = _classes(t.module(rel)).get("SamplingParams")
    init = None if cls is None else _methods(cls).get("__init__")
    if init is None:
        return [f"{rel}: no SamplingParams.__init__"]
    missing = [p for p in SAMPLING_PARAMS if p not in _params(init)]
    return [f"{rel}: SamplingParams takes no {missing}"] if missing else []


def _check_env_and_tags(t: _Tree) -> List[str]:
    problems = []
    environ = t.text("sglang/srt/environ.py")
    problems += [f"sglang/srt/environ.py: no {v}" for v in ENV_VARS if v not in environ]
    consts = t.module("sglang/srt/constants.py")
    values = {}
    for node in [] if consts is None else consts.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            values.update({tg.id: node.value.value for tg in node.targets if isinstance(tg, ast.Name)})
    problems += [f"sglang/srt/constants.py: {k} is {values.get(k)!r}, not {v!r}" for k, v in TAGS.items()
                 if values.get(k) != v]
    return problems


CHECKS = (_check_engine, _check_tokenizer_manager, _check_requests, _check_server_args, _check_weight_loading,
          _check_sampling_params, _check_env_and_tags)


def check_source(root, checks: Sequence = CHECKS) -> List[str]:
    """Every touch point of this package that SGLang's source under ``root`` breaks.

    Args:
        root: a folder holding the ``sglang`` package (site-packages, or an unpacked wheel).

    Returns:
        One line per problem (``"<file>: <what>"``); empty when every touch point holds.

    Raises:
        FileNotFoundError: ``root`` holds no ``sglang/srt/entrypoints/engine.py``.
    """
    t = _Tree(Path(root))
    if t.module("sglang/srt/entrypoints/engine.py") is None:
        raise FileNotFoundError(f"no SGLang source under {root}")
    return [p for check in checks for p in check(t)]
