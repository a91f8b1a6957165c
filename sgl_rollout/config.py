"""Rollout settings, validated with pydantic.

Key names follow verl's rollout config (``verl/workers/config/rollout.py``) wherever verl has
one, so a verl user can pass ``actor_rollout_ref.rollout`` through unchanged. Everything else
SGLang understands goes in ``engine_kwargs``, which is checked against the fields of SGLang's
``ServerArgs`` dataclass (``sglang/srt/server_args.py``) of the installed SGLang.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from typing import Any, Dict, List, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# engine_kwargs keys that this config owns: (ServerArgs name -> config key to use instead).
MANAGED_SERVER_ARGS: Dict[str, str] = {
    "model_path": "model_path",
    "dtype": "dtype",
    "tp_size": "tensor_model_parallel_size",
    "mem_fraction_static": "gpu_memory_utilization",
    "enable_memory_saver": "(always on: the memory saver is what makes release/resume free memory)",
    "enable_weights_cpu_backup": "enable_weights_cpu_backup",
    "disable_cuda_graph": "enforce_eager",
    "max_running_requests": "max_num_seqs",
    "load_format": "load_format",
    "disable_piecewise_cuda_graph": "piecewise_cuda_graph (off by default: their memory is never released)",
    "enforce_piecewise_cuda_graph": "piecewise_cuda_graph (it lets SGLang's own checks turn them off where they "
                                    "do not work; enforcing skips those checks)",
    "custom_sigquit_handler": "(set by sgl-rollout: its handler keeps the trainer alive when the engine dies)",
    "enable_lora": "lora_rank (> 0 starts the engine with LoRA)",
    "max_lora_rank": "lora_rank",
    "lora_target_modules": "lora_target_modules",
    "max_loras_per_batch": "max_loras",
}

#: LoRA target modules SGLang 0.5.10 serves (``SUPPORTED_LORA_TARGET_MODULES`` in
#: ``sglang/srt/utils/common.py``; a test checks the installed SGLang's list).
SGLANG_LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                              "qkv_proj", "gate_up_proj", "embed_tokens", "lm_head")
#: What PEFT's ``target_modules="all-linear"`` selects in a decoder LM (every linear layer but the output
#: layer): the engine serves these. SGLang's own ``"all"`` would also wrap ``embed_tokens`` and ``lm_head``.
ALL_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_settings_from_peft(peft_config) -> Dict[str, Any]:
    """``lora_rank``, ``lora_alpha`` and ``lora_target_modules`` of a PEFT LoRA config.

    Args:
        peft_config: a ``peft.LoraConfig``, or its ``to_dict()`` (verl passes either; enums and sets
            as PEFT leaves them are fine).

    Returns:
        dict for :class:`RolloutConfig` (``RolloutConfig(model_path=..., **lora_settings_from_peft(c))``);
        ``lora_target_modules`` is ``"all-linear"`` or a sorted list of module names.

    Raises:
        ValueError: not a LoRA config (``peft_type``), or no ``r``.
    """
    d = peft_config if isinstance(peft_config, Mapping) else peft_config.to_dict()
    peft_type = d.get("peft_type", "LORA")
    peft_type = str(getattr(peft_type, "value", peft_type))
    if peft_type.upper() != "LORA":
        raise ValueError(f"peft_config: peft_type={peft_type!r}; only LORA adapters are served")
    if not d.get("r"):
        raise ValueError("peft_config: no rank 'r'")
    targets = d.get("target_modules") or "all-linear"
    if not isinstance(targets, str):
        targets = sorted(targets)
    return {"lora_rank": int(d["r"]), "lora_alpha": float(d.get("lora_alpha", 8)), "lora_target_modules": targets}


#: Dotted path of the fast-path loader that runs inside SGLang's scheduler; SGLang's
#: ``custom_weight_loader`` launch argument must list it (``ModelRunner.update_weights_from_tensor``
#: calls ``load_format`` only if it is listed there).
FAST_SYNC_LOADER = "sgl_rollout.weight_sync.receiver.load_weights"


@functools.lru_cache(maxsize=1)
def server_args_fields() -> frozenset:
    """Names of the fields of the installed SGLang's ``ServerArgs`` dataclass.

    The source of ``sglang/srt/server_args.py`` is parsed, not imported: importing it pulls in
    SGLang's whole serving stack (openai, fastapi, ...), which a config check must not need.

    Returns:
        frozenset of str: the annotated class attributes of ``ServerArgs``.

    Raises:
        ImportError: SGLang is not installed.
        RuntimeError: the file has no ``ServerArgs`` class (an SGLang layout this code does not know).
    """
    spec = importlib.util.find_spec("sglang.srt.server_args")
    if spec is None or spec.origin is None:
        raise ImportError("sglang is not installed: cannot validate engine_kwargs")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=spec.origin)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "ServerArgs":
            return frozenset(
                stmt.target.id
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            )
    raise RuntimeError(f"no ServerArgs class in {spec.origin}")


class RolloutConfig(BaseModel):
    """Settings of one SGLang rollout engine.

    Attributes:
        name: rollout backend; only ``"sglang"``.
        model_path: Hugging Face model folder (or hub id) given to SGLang.
        dtype: weight and activation dtype of the engine (``"auto"``, ``"bfloat16"``, ...).
        tensor_model_parallel_size: TP size of the engine, 1 to 1024 (SGLang ``tp_size``).
        gpu_memory_utilization: fraction of GPU memory SGLang takes for weights and KV cache,
            in (0, 1] (SGLang ``mem_fraction_static``).
        free_cache_engine: release GPU memory on ``sleep()`` and resume it on wake up. When False,
            sleep and wake up do nothing (verl's meaning).
        sleep_level: 1 releases the KV cache (and CUDA-graph memory); 2 also releases weights.
        enable_weights_cpu_backup: keep a CPU copy of the weights when they are released, so a wake
            up without a weight sync restores them (SGLang ``enable_weights_cpu_backup``).
        update_weights_bucket_megabytes: largest flattened bucket in MiB for the weight sync; a
            tensor larger than this travels alone. Peak extra GPU memory on the sending side is one
            bucket, and on the fast path about one gather step (256 MiB,
            :data:`~sgl_rollout.weight_sync.fast_path.GATHER_STEP_BYTES`) of the trainer's tensors held.
        enforce_eager: disable the decode CUDA graphs (SGLang ``disable_cuda_graph``). Piecewise ones
            follow ``piecewise_cuda_graph`` alone, as in SGLang (``disable_cuda_graph`` does not cover them)
            and in verl's built-in server, which maps verl's ``enforce_eager`` onto ``disable_cuda_graph``
            only (``verl/workers/rollout/sglang_rollout/async_sglang_server.py``): the same verl command
            gives both rollouts the same graphs. Until 2026-11-28 it turned piecewise graphs off too, and
            every ``bench verl`` row run with ``enforce_eager=true`` had them on the built-in's side only.
        max_num_seqs: most requests running at once (SGLang ``max_running_requests``); None lets
            SGLang choose.
        load_format: SGLang load format; ``"dummy"`` gives random weights without reading files.
        piecewise_cuda_graph: let SGLang capture piecewise CUDA graphs for prefill and extend batches
            (SGLang 0.5.10's default, which verl's built-in server keeps; SGLang still turns them off for
            LoRA, GGUF, multimodal models and more, ``ServerArgs._handle_piecewise_cuda_graph`` in
            ``sglang/srt/server_args.py``). Off by default here: they are captured outside
            torch-memory-saver's regions (``sglang/srt/model_executor/piecewise_cuda_graph_runner.py``), so
            sleep does not release them and their memory (about 1.15 GB per GPU for a 1.1B model at TP=2;
            docs/benchmarks.md) stays held while the trainer runs. On through verl
            (:func:`sgl_rollout.integrations.verl_config.rollout_config_from_verl`), as in verl's built-in
            server: without them a TP=2 replica served each step slower than verl's in four runs out of
            four. SGLang ``disable_piecewise_cuda_graph`` is its inverse; ``enforce_eager`` leaves them.
        fast_sync: sync weights through this package's copy-plan loader inside SGLang
            (:mod:`sgl_rollout.weight_sync.receiver`, registered as SGLang's ``custom_weight_loader``):
            one IPC buffer per TP rank and one batched copy per bucket on each side. Models
            whose layout the plan does not cover go through SGLang's ``load_weights`` inside the same
            loader; without CUDA or a weight manifest the sync takes SGLang's ``flattened_bucket`` path
            (the reason logged once). On by default since the worker's GPU suite passed on it (one
            H100, 2026-11-26; bit-exactness at TP=1 and TP=2; docs/fast-path.md). The
            buffer (at most one bucket per TP rank) is freed after each sync, before the KV cache comes
            back, with ``free_cache_engine``; without it, kept for the next sync. Through verl:
            ``engine_kwargs.sgl_rollout.fast_sync`` (:mod:`sgl_rollout.integrations.verl_config`).
        layered_summon: gather the trainer's weights one decoder layer at a time for the sync
            (verl's ``rollout.layered_summon``), so the trainer's extra peak is one layer plus one
            bucket instead of a full copy of the weights; buckets close at layer boundaries.
        validate_sync: check every weight sync against the model's weight manifest (Hugging Face
            names, shapes, dtypes read from ``model_path``; :mod:`sgl_rollout.weight_sync.manifest`)
            before any byte reaches the engine.
        lora_rank: 0 (default): no LoRA. > 0: the engine starts with LoRA (SGLang ``enable_lora``,
            ``max_lora_rank``) and serves adapters of up to this rank on top of its base weights
            (:mod:`sgl_rollout.weight_sync.lora`). :func:`lora_settings_from_peft` reads it from a PEFT config.
        lora_alpha: the adapters' default ``lora_alpha`` (an adapter's own PEFT config wins).
        lora_target_modules: modules adapters may target (SGLang ``lora_target_modules``): ``"all-linear"``
            (PEFT's meaning: q/k/v/o/gate/up/down projections), ``"all"`` (SGLang's: those plus
            ``embed_tokens`` and ``lm_head``), or a list of names from :data:`SGLANG_LORA_TARGET_MODULES`
            (a dotted PEFT name such as ``"self_attn.q_proj"`` counts by its last part).
        max_loras: adapters one batch may use (SGLang ``max_loras_per_batch``); each takes a slot of
            GPU memory for ``lora_rank`` on every target module. Requests without an adapter count as
            one. 1 serves one policy adapter, as an RL rollout needs.
        freeze_gc: once the engine has answered its first generate, freeze Python's garbage collector's
            view of the heap in the engine's processes (SGLang's ``TokenizerManager.freeze_gc``,
            ``sglang/srt/managers/tokenizer_manager.py``: ``gc.freeze()`` in the scheduler, the detokenizer
            and the process that hosts the engine's tokenizer manager: verl's server actor, or the trainer's
            process under TRL), so full collections skip every object alive then. On 4×H200 (verl 0.9.1,
            1.1B at TP=2) something held the server actor's GIL 0.41-0.53 s at a time on both rollouts, most
            likely full collections (not yet confirmed); where one fell in the request window the last
            request reached SGLang 0.45-0.95 s after the first instead of about 0.3 s (docs/verl.md). Once
            per start (again after a restart); skipped where SGLang has no ``freeze_gc``. False: SGLang's
            default, nothing frozen in SGLang's processes. (The in-process :class:`~sgl_rollout.worker.RolloutWorker`
            also freezes its own process at start and after its first sync, whatever this says:
            :func:`sgl_rollout.memory.freeze_long_lived`, which collects first.)
        empty_cache: the staged wake's empty-cache step before the KV cache returns
            (:mod:`sgl_rollout.switch`): ``"auto"`` (default) skips it where this process measured that the
            device already has room for the KV cache's resume with 2 GiB to spare, keeping the trainer's
            cached blocks (3.6-11.9 ms a wake under TRL on an H200); ``"always"`` runs it at every wake, as
            before 923c806 and as verl's built-in rollout does, handing this process's cached blocks back to
            the driver (``python -m sgl_rollout.bench trl --empty-cache always`` compares the two).
        engine_kwargs: any other ``ServerArgs`` field, passed to ``sglang.Engine`` as is.

    Raises:
        pydantic.ValidationError: on a value out of range, naming the key and the allowed range; on an
            ``engine_kwargs`` key that is not a ``ServerArgs`` field (the message lists the valid
            ones) or that this config already owns (the message names the key to use).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    name: Literal["sglang"] = "sglang"
    model_path: str
    dtype: str = "bfloat16"
    tensor_model_parallel_size: int = Field(1, ge=1, le=1024)
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    free_cache_engine: bool = True
    sleep_level: Literal[1, 2] = 2
    enable_weights_cpu_backup: bool = False
    update_weights_bucket_megabytes: int = Field(2048, ge=1, le=65536)
    enforce_eager: bool = False
    max_num_seqs: Optional[int] = Field(None, ge=1)
    load_format: str = "auto"
    piecewise_cuda_graph: bool = False
    fast_sync: bool = True
    layered_summon: bool = False
    validate_sync: bool = True
    lora_rank: int = Field(0, ge=0, le=4096)
    lora_alpha: float = Field(16.0, gt=0)
    lora_target_modules: Union[str, List[str]] = "all-linear"
    max_loras: int = Field(1, ge=1, le=256)
    freeze_gc: bool = True
    empty_cache: Literal["auto", "always"] = "auto"
    engine_kwargs: Dict[str, Any] = Field(default_factory=dict)

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, v: str) -> str:
        allowed = ("auto", "half", "float16", "bfloat16", "float", "float32")
        if v not in allowed:
            raise ValueError(f"dtype must be one of {allowed}, got {v!r}")
        return v

    @field_validator("lora_target_modules")
    @classmethod
    def _check_lora_target_modules(cls, v):
        if isinstance(v, str):
            if v not in ("all-linear", "all"):
                raise ValueError(f"lora_target_modules must be 'all-linear', 'all' or a list of module names, got {v!r}")
            return v
        if not v:
            raise ValueError("lora_target_modules is empty: list module names, or 'all-linear'")
        bad = sorted({m for m in v if m.split(".")[-1] not in SGLANG_LORA_TARGET_MODULES})
        if bad:
            raise ValueError(f"lora_target_modules {bad} are not served by SGLang; it serves "
                             f"{list(SGLANG_LORA_TARGET_MODULES)}")
        return sorted({m.split(".")[-1] for m in v})

    @model_validator(mode="after")
    def _check_lora_engine(self):
        if self.lora_rank == 0:
            return self
        kw = self.engine_kwargs
        problems = []
        if int(kw.get("dp_size", 1) or 1) > 1:
            problems.append("engine_kwargs dp_size > 1 (SGLang 0.5.10 asserts dp_size == 1 on every adapter load)")
        loaded = kw.get("max_loaded_loras")
        if loaded is not None and int(loaded) < 2:
            problems.append(f"engine_kwargs max_loaded_loras={loaded} (an adapter update loads the new version "
                            "before unloading the old one: it needs 2)")
        spec = kw.get("speculative_algorithm")
        if spec not in (None, "NGRAM"):
            problems.append(f"engine_kwargs speculative_algorithm={spec!r} (SGLang serves LoRA with NGRAM only)")
        if kw.get("enable_lora_overlap_loading"):
            problems.append("engine_kwargs enable_lora_overlap_loading (pins adapters in CPU memory and needs "
                            "max_loaded_loras <= 2 * max_loras; not supported with adapter updates)")
        if problems:
            raise ValueError(f"lora_rank={self.lora_rank} (LoRA on) does not go with: " + "; ".join(problems))
        return self

    @property
    def lora_enabled(self) -> bool:
        """True when the engine serves LoRA adapters (``lora_rank > 0``)."""
        return self.lora_rank > 0

    def server_lora_target_modules(self) -> List[str]:
        """``lora_target_modules`` as SGLang's server argument: ``"all-linear"`` -> the linear projections
        (:data:`ALL_LINEAR_MODULES`), ``"all"`` -> ``["all"]``, a list as it is."""
        t = self.lora_target_modules
        if t == "all-linear":
            return list(ALL_LINEAR_MODULES)
        if t == "all":
            return ["all"]
        return list(t)

    @field_validator("engine_kwargs")
    @classmethod
    def _check_engine_kwargs(cls, v: Dict[str, Any]) -> Dict[str, Any]:
        owned = sorted(k for k in v if k in MANAGED_SERVER_ARGS)
        if owned:
            hints = ", ".join(f"{k} -> {MANAGED_SERVER_ARGS[k]}" for k in owned)
            raise ValueError(f"engine_kwargs keys set through the rollout config instead: {hints}")
        valid = server_args_fields()
        unknown = sorted(k for k in v if k not in valid)
        if unknown:
            raise ValueError(
                f"unknown engine_kwargs keys {unknown}; valid SGLang ServerArgs keys: "
                f"{sorted(valid - MANAGED_SERVER_ARGS.keys())}"
            )
        return v

    @property
    def bucket_bytes(self) -> int:
        """Largest bucket in bytes (``update_weights_bucket_megabytes`` * 2**20)."""
        return self.update_weights_bucket_megabytes << 20

    def to_server_args(self) -> Dict[str, Any]:
        """Keyword arguments for ``sglang.Engine(**kwargs)``.

        The memory saver is always on: without it release/resume silently free nothing (SGLang 0.5.10).
        Piecewise CUDA graphs are off unless ``piecewise_cuda_graph`` is set: they are never released.
        ``engine_kwargs`` is checked again here, so a dict mutated after validation cannot undo them.

        Raises:
            ValueError: ``engine_kwargs`` now holds a key this config owns or SGLang does not know.
        """
        self._check_engine_kwargs(dict(self.engine_kwargs))
        kwargs: Dict[str, Any] = dict(self.engine_kwargs)
        kwargs.update(
            model_path=self.model_path,
            dtype=self.dtype,
            tp_size=self.tensor_model_parallel_size,
            mem_fraction_static=self.gpu_memory_utilization,
            enable_memory_saver=True,
            enable_weights_cpu_backup=self.enable_weights_cpu_backup,
            disable_cuda_graph=self.enforce_eager,
            disable_piecewise_cuda_graph=not self.piecewise_cuda_graph,
            load_format=self.load_format,
        )
        if self.max_num_seqs is not None:
            kwargs["max_running_requests"] = self.max_num_seqs
        if self.lora_enabled:
            kwargs.update(enable_lora=True, max_lora_rank=self.lora_rank,
                          lora_target_modules=self.server_lora_target_modules(), max_loras_per_batch=self.max_loras)
        if self.fast_sync:
            loaders = list(kwargs.get("custom_weight_loader") or [])
            if FAST_SYNC_LOADER not in loaders:
                loaders.append(FAST_SYNC_LOADER)
            kwargs["custom_weight_loader"] = loaders
        return kwargs


# ------------------------------------------------------------------------------------ TP layout
class TPLayoutError(ValueError):
    """A tensor-parallel size SGLang cannot run with this model or these GPUs; refused before any engine
    starts. The message is one line naming the numbers."""


def model_heads(hf_config) -> Optional[tuple]:
    """``(attention heads, KV heads)`` of a Hugging Face config (its ``text_config`` for multimodal
    models; KV heads default to the attention heads, as in multi-head attention); None when the
    config has no ``num_attention_heads``."""
    text = hf_config.get("text_config") if isinstance(hf_config, Mapping) else getattr(hf_config, "text_config", None)
    cfg = text or hf_config  # a config.json read as a dict holds its text_config as a dict too
    get = cfg.get if isinstance(cfg, Mapping) else (lambda k, d=None: getattr(cfg, k, d))
    heads = get("num_attention_heads", None)
    if not heads:
        return None
    kv = get("num_key_value_heads", None) or heads
    return int(heads), int(kv)


def tp_layout_problem(tp_size: int, heads: Optional[tuple] = None, gpus: Optional[int] = None,
                      key: str = "tensor_model_parallel_size") -> Optional[str]:
    """Why SGLang cannot shard a model over ``tp_size`` GPUs, in one line; None when it can.

    SGLang 0.5.10's rule (``sglang/srt/models/llama.py``: ``total_num_heads % tp_size == 0``;
    ``sglang/srt/layers/linear.py`` ``QKVParallelLinear``: KV heads split evenly when there are at least
    ``tp_size`` of them, else replicated, which needs ``tp_size % kv_heads == 0``). Broken, the scheduler
    dies on an assertion after the engine's start-up, which verl reports as a lost server actor.

    Args:
        tp_size: the engine's TP size (SGLang's ``tp_size``).
        heads: ``(attention heads, KV heads)`` (:func:`model_heads`), or None to skip that check.
        gpus: GPUs available to the replica, or None to skip that check.
        key: the setting named in the message (e.g. verl's ``actor_rollout_ref.rollout.tensor_model_parallel_size``).
    """
    if tp_size < 1:
        return f"{key}={tp_size}: must be at least 1"
    if gpus is not None and tp_size > gpus:
        return f"{key}={tp_size} exceeds the {gpus} GPU(s) available"
    if heads is None:
        return None
    n_heads, n_kv = heads
    divisors = [d for d in range(1, n_heads + 1) if n_heads % d == 0 and (n_kv % d == 0 if n_kv >= d else d % n_kv == 0)]
    if n_heads % tp_size:
        return (f"{key}={tp_size} does not divide the model's {n_heads} attention heads "
                f"(SGLang shards heads evenly over TP ranks); TP sizes that fit: {divisors}")
    if (n_kv % tp_size) if n_kv >= tp_size else (tp_size % n_kv):
        return (f"{key}={tp_size} does not fit the model's {n_kv} KV heads (SGLang splits them evenly, or "
                f"replicates them when TP is a multiple of their number); TP sizes that fit: {divisors}")
    return None


def check_tp_layout(tp_size: int, heads: Optional[tuple] = None, gpus: Optional[int] = None,
                    key: str = "tensor_model_parallel_size") -> None:
    """Raise :class:`TPLayoutError` with :func:`tp_layout_problem`'s line, if any."""
    problem = tp_layout_problem(tp_size, heads, gpus, key)
    if problem is not None:
        raise TPLayoutError(problem)


def config_json_of_model_path(model_path: str) -> Optional[dict]:
    """``model_path/config.json`` read as JSON (no download, no transformers); None when there is no readable
    JSON object there (a hub id, a test double)."""
    import json
    import os

    try:
        with open(os.path.join(str(model_path), "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def heads_of_model_path(model_path: str) -> Optional[tuple]:
    """:func:`model_heads` of ``model_path/config.json`` (read as JSON, no download); None when there is
    no readable config there (a hub id, a test double)."""
    cfg = config_json_of_model_path(model_path)
    try:
        return None if cfg is None else model_heads(cfg)
    except ValueError:  # a head count that is not a number
        return None


def vocab_size_of_model_path(model_path: str) -> Optional[int]:
    """The model's vocabulary size from ``model_path/config.json`` (``vocab_size``, or its
    ``text_config``'s for a multimodal model), read as JSON with no download; None when there is no
    readable config or no such field (a hub id, a test double).

    SGLang computes its top-k logprobs over exactly that many logits (the logits processor slices them
    to ``config.vocab_size``, ``sglang/srt/layers/logits_processor.py``), so a ``top_logprobs_num``
    above it fails ``topk`` inside the scheduler, which then dies and takes its host process with it.
    """
    cfg = config_json_of_model_path(model_path)
    if cfg is None:
        return None
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return int(vocab) if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None

