"""verl's rollout and model config (verl 0.9.1) mapped onto :class:`~sgl_rollout.config.RolloutConfig`.

Every key verl's own SGLang server (``verl/workers/rollout/sglang_rollout/async_sglang_server.py``,
``SGLangHttpServer.launch_server``) turns into an SGLang argument is either mapped here or refused at
start-up by :func:`check_verl_features` with :class:`UnsupportedVerlFeature`, whose message names the
verl config key and what to use instead. Keys that verl's SGLang server ignores too (``seed``,
``max_num_batched_tokens``, ``cudagraph_capture_sizes``, ...) are ignored here as well.

Mapped (verl's semantics):

* ``tensor_model_parallel_size * data_parallel_size`` is SGLang's ``tp_size``, and
  ``data_parallel_size`` its ``dp_size``; SGLang runs ``dp_size`` TP groups of ``tp_size`` GPUs each
  unless ``enable_dp_attention`` is on, so ``data_parallel_size > 1`` needs
  ``engine_kwargs.sglang.enable_dp_attention=True`` (otherwise the replica's GPUs would not suffice);
* ``expert_parallel_size`` is ``ep_size``;
* ``engine_kwargs.sglang`` passes through; a key verl lets override its own choice
  (``mem_fraction_static``, ``dtype``, ``disable_cuda_graph``, ``max_running_requests``,
  ``load_format``, ``enable_weights_cpu_backup``) overrides the matching rollout key here too;
* piecewise CUDA graphs stay on where SGLang allows them (SGLang's default, which verl's built-in server
  keeps; without them our TP=2 replica served each step slower than the built-in in four runs out of four,
  with them as fast: README), so their memory, about 1.15 GB per GPU for a 1.1B model at TP=2, stays held
  while the trainer runs, as in verl's built-in; ``engine_kwargs.sglang.disable_piecewise_cuda_graph=true``
  turns them off and frees it; ``enforce_eager=true`` does not (it is SGLang's ``disable_cuda_graph``, as in
  verl's built-in, which keeps capturing them then);
* ``quantization=fp8``: SGLang gets ``quantization="fp8"`` and the block-wise FP8
  ``quantization_config`` in ``json_model_override_args`` (verl's
  ``verl/utils/sglang/sglang_fp8_utils.py`` builds it), and the adapter quantizes the trainer's bf16
  weights to FP8 blocks before each weight sync, as verl's SGLang adapter does;
* ``layered_summon`` is ``RolloutConfig.layered_summon``: the trainer's weights are gathered one
  decoder layer at a time for a sync (:mod:`sgl_rollout.weight_sync.layered`). verl's vLLM rollout
  forces ``sleep_level=1`` with it (``verl/workers/rollout/vllm_rollout/vllm_rollout.py``); here the
  sleep level stays what it would be without it (2 for hybrid replicas), as the staged wake resumes
  the weights before the sync and the KV cache only after the trainer has offloaded;
* the model's ``trust_remote_code``; the model's local path is resolved on the engine's node by
  :func:`resolve_local_model` (hdfs copy, ``use_shm``), as verl's server does.

This package's own settings sit under ``engine_kwargs.sgl_rollout`` (:data:`SGL_ROLLOUT_KWARGS`):
``fast_sync`` (``RolloutConfig.fast_sync``, on by default: weight syncs on the copy-plan fast path,
each trainer worker sending its own TP rank's shard; ``SglRollout._send_fast``) and ``freeze_gc``
(``RolloutConfig.freeze_gc``, on by default). Any other key there is refused.

What the replica and the adapter build from it: :func:`rollout_config_for_verl` (the mapping above
plus LoRA served as an adapter, :func:`verl_lora_settings`: level-1 sleep, as verl's own SGLang
rollout serves it), :func:`check_served_features` (the refusals, with that LoRA mode accepted) and
:func:`check_verl_tp` (a TP size the model's heads or the GPUs cannot take, refused before any engine
starts).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, List, Optional, Tuple

from pydantic import TypeAdapter, ValidationError

from ..config import MANAGED_SERVER_ARGS, RolloutConfig, check_tp_layout, model_heads

logger = logging.getLogger("sgl_rollout")

#: Where verl's trainer config keeps the rollout section and the model section.
ROLLOUT_PREFIX = "actor_rollout_ref.rollout"
MODEL_PREFIX = "actor_rollout_ref.model"
#: What a user can switch to for a feature this package refuses.
VERL_BUILTIN = "VERL_USE_EXTERNAL_PLUGINS=none (verl's built-in SGLang server)"
#: Name of the policy adapter the verl integration loads and every request carries.
VERL_ADAPTER_NAME = "verl_policy"

#: ``engine_kwargs.sgl_rollout`` keys (this package's own settings in verl's config) -> what they do.
SGL_ROLLOUT_KWARGS = {
    "fast_sync": "bool, default true: weight syncs through the copy-plan fast path (false: SGLang's flattened buckets) "
                 "(RolloutConfig.fast_sync, README 'Fast-path weight sync')",
    "freeze_gc": "bool, default true: after the engine's first generate, SGLang's freeze_gc in the server actor and "
                 "the engine's processes, so full garbage collections skip the warm heap (RolloutConfig.freeze_gc)",
}

#: ``engine_kwargs.sglang`` keys that verl lets override its own choice -> RolloutConfig field.
ENGINE_KWARG_OVERRIDES = {
    "mem_fraction_static": "gpu_memory_utilization",
    "dtype": "dtype",
    "disable_cuda_graph": "enforce_eager",
    "max_running_requests": "max_num_seqs",
    "load_format": "load_format",
    "enable_weights_cpu_backup": "enable_weights_cpu_backup",
}
#: ``engine_kwargs.sglang`` keys whose value decides the replica's layout: set the verl key instead.
ENGINE_KWARG_LAYOUT_KEYS = {
    "tp_size": f"{ROLLOUT_PREFIX}.tensor_model_parallel_size",
    "dp_size": f"{ROLLOUT_PREFIX}.data_parallel_size",
    "ep_size": f"{ROLLOUT_PREFIX}.expert_parallel_size",
    "model_path": f"{MODEL_PREFIX}.path",
    "nnodes": f"{ROLLOUT_PREFIX}.nnodes",
}
#: ``engine_kwargs.sglang`` flags whose negation is a RolloutConfig field (``disable_piecewise_cuda_graph=true``
#: turns ``piecewise_cuda_graph`` off; through verl it is on, as in verl's built-in server).
ENGINE_KWARG_NEGATED = {"disable_piecewise_cuda_graph": "piecewise_cuda_graph"}
#: ``engine_kwargs.sglang`` flags this package always sets: accepted only with the value it sets.
ENGINE_KWARG_FIXED = {"enable_memory_saver": True}


class UnsupportedVerlFeature(NotImplementedError):
    """A verl feature sgl-rollout does not serve, refused at start-up.

    The message has one line per problem: the verl config key with its value, why, and what to use
    instead.
    """


def _get(cfg, key, default=None):
    """``cfg[key]`` for a dict, DictConfig, dataclass or plain object; ``default`` when absent."""
    if cfg is None:
        return default
    try:
        return cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    except Exception:  # noqa: BLE001 - verl's BaseConfig / struct DictConfigs raise on some missing keys
        return default


def lora_as_adapter(model_config) -> bool:
    """True when verl would serve LoRA as a hot-swapped adapter (``lora_rank`` or ``lora.rank`` > 0
    without ``lora.merge``); the rule of verl's ``lora_served_as_adapter``
    (``verl/workers/rollout/sglang_rollout/utils.py``)."""
    lora = _get(model_config, "lora", None) or {}
    rank = int(_get(model_config, "lora_rank", 0) or 0) or int(_get(lora, "rank", 0) or 0)
    return rank > 0 and not bool(_get(lora, "merge", False))


def _profiler_discrete(profiler) -> bool:
    """True when verl's SGLang server would profile the engine (``start_profile``): enabled, tool
    ``torch`` or ``npu``, discrete mode (``verl/utils/profiler``)."""
    if profiler is None or not _get(profiler, "enable", False):
        return False
    tool = _get(profiler, "tool", None)
    if tool not in ("torch", "npu"):
        return False
    tool_cfg = _get(_get(profiler, "tool_config", None) or {}, tool, None)
    return bool(_get(tool_cfg, "discrete", False))


def check_verl_features(cfg, model_config=None, prefix: str = ROLLOUT_PREFIX) -> None:
    """Refuse the verl features sgl-rollout does not serve, all at once.

    Args:
        cfg: verl's rollout config (``verl/workers/config/rollout.py`` ``RolloutConfig``, a DictConfig
            or a dict).
        model_config: verl's model config (``HFModelConfig``, DictConfig, dict) or None.
        prefix: where ``cfg`` sits in verl's config, for the messages.

    Raises:
        UnsupportedVerlFeature: one line per refused feature, each naming the config key and what to
            use instead.
    """
    problems: List[str] = []

    def refuse(key: str, value, why: str, instead: str) -> None:
        problems.append(f"{key}={value!r}: {why}; use {instead}")

    sglang_kwargs = _get(_get(cfg, "engine_kwargs", None) or {}, "sglang", None) or {}
    dp = int(_get(cfg, "data_parallel_size", 1) or 1)
    if dp > 1 and not _get(sglang_kwargs, "enable_dp_attention", False):
        refuse(f"{prefix}.data_parallel_size", dp,
               "SGLang runs data_parallel_size TP groups of tensor_model_parallel_size*data_parallel_size GPUs "
               "each (more GPUs than the replica has) unless DP attention is on",
               f"{prefix}.engine_kwargs.sglang.enable_dp_attention=True (DP attention, MoE models), or "
               f"data_parallel_size=1 (verl then starts more replicas on the same GPUs)")
    pp = int(_get(cfg, "pipeline_model_parallel_size", 1) or 1)
    if pp > 1:
        refuse(f"{prefix}.pipeline_model_parallel_size", pp, "pipeline parallel rollout is not supported",
               "pipeline_model_parallel_size=1")
    quant = _get(cfg, "quantization", None)
    if quant not in (None, "fp8"):
        refuse(f"{prefix}.quantization", quant, "only fp8 is supported (as in verl's SGLang server)",
               "quantization=fp8 or null")
    if _get(cfg, "quantization_config_file", None):
        refuse(f"{prefix}.quantization_config_file", _get(cfg, "quantization_config_file"),
               "read by verl's vLLM server only; SGLang would not apply it", "quantization=fp8 (block-wise) or null")
    qat = _get(cfg, "qat", None)
    if qat and _get(qat, "enable", False):
        refuse(f"{prefix}.qat", "enabled", "QAT weight loading is implemented for vLLM only", "qat disabled")
    if _get(_get(cfg, "prometheus", None), "enable", False):
        refuse(f"{prefix}.prometheus.enable", True,
               "Prometheus scrapes an HTTP /metrics endpoint per replica and sgl-rollout serves no HTTP",
               f"prometheus.enable=False, or {VERL_BUILTIN}")
    if _get(cfg, "enable_rollout_routing_replay", False):
        refuse(f"{prefix}.enable_rollout_routing_replay", True,
               "routed experts are not returned by sgl-rollout's generate", f"False, or {VERL_BUILTIN}")
    mtp = _get(cfg, "mtp", None)
    if mtp is not None and _get(mtp, "enable", False) and _get(mtp, "enable_rollout", False):
        refuse(f"{prefix}.mtp.enable_rollout", True,
               "speculative (MTP) rollout needs the draft weights synced too, which sgl-rollout does not do",
               f"mtp.enable_rollout=False, or {VERL_BUILTIN}")
    if _get(_get(cfg, "disaggregation", None), "enabled", False):
        refuse(f"{prefix}.disaggregation.enabled", True, "prefill/decode disaggregation is not supported",
               f"False, or {VERL_BUILTIN}")
    backend = _get(_get(cfg, "checkpoint_engine", None), "backend", "naive")
    if backend == "delta_sharded":
        refuse(f"{prefix}.checkpoint_engine.backend", backend,
               "delta weight syncs (wire_format='delta_flush') need verl's custom SGLang weight loader",
               f"backend=naive or nccl/nixl (full weights), or {VERL_BUILTIN}")
    ours = dict(_get(_get(cfg, "engine_kwargs", None) or {}, "sgl_rollout", None) or {})
    if backend == "sgl_rollout" and (_sgl_rollout_setting(ours, "fast_sync") is False or _get(cfg, "quantization", None) == "fp8"):
        refuse(f"{prefix}.checkpoint_engine.backend", backend,
               "it sends the fast path's copy-plan buckets, so it needs engine_kwargs.sgl_rollout.fast_sync=True "
               "and unquantized weights", "backend=nccl, or fast_sync=True without quantization")
    if _profiler_discrete(_get(cfg, "profiler", None)):
        refuse(f"{prefix}.profiler.tool_config.<tool>.discrete", True,
               "profiling the rollout engine is not wired in sgl-rollout", f"discrete=False, or {VERL_BUILTIN}")
    for key in sorted(set(ours) - set(SGL_ROLLOUT_KWARGS)):
        refuse(f"{prefix}.engine_kwargs.sgl_rollout.{key}", ours[key], "not a key of sgl-rollout's verl settings",
               "one of " + ", ".join(f"{k} ({why})" for k, why in SGL_ROLLOUT_KWARGS.items()))
    if model_config is not None and lora_as_adapter(model_config):
        model_prefix = MODEL_PREFIX if prefix == ROLLOUT_PREFIX else f"{prefix}.model"
        refuse(f"{model_prefix}.lora.merge", False,
               "a LoRA adapter served as an adapter (hot-swapped) is not supported by sgl-rollout",
               f"{model_prefix}.lora.merge=True (the trainer syncs merged weights), or {VERL_BUILTIN}")
    if problems:
        raise UnsupportedVerlFeature("sgl-rollout (rollout.name=sglang) does not serve:\n  " + "\n  ".join(problems))


def fp8_quant_config(hf_config) -> dict:
    """The block-wise FP8 ``quantization_config`` verl gives SGLang for ``quantization=fp8``.

    Built by verl's ``build_sglang_fp8_quant_config`` (``verl/utils/sglang/sglang_fp8_utils.py``):
    ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
    "weight_block_size": [128, 128], ...}`` plus the layers the model's own quantization config or
    ``SGLANG_FP8_IGNORED_LAYERS`` leave out.
    """
    from verl.utils.sglang.sglang_fp8_utils import build_sglang_fp8_quant_config

    return build_sglang_fp8_quant_config(hf_config)


def with_fp8_override(engine_kwargs: dict, hf_config) -> dict:
    """``engine_kwargs`` with ``json_model_override_args`` carrying the FP8 ``quantization_config``
    (a user's own overrides in that JSON are kept; their ``quantization_config`` wins)."""
    out = dict(engine_kwargs)
    overrides = json.loads(out.get("json_model_override_args") or "{}")
    overrides.setdefault("quantization_config", fp8_quant_config(hf_config))
    out["json_model_override_args"] = json.dumps(overrides)
    return out


def _base_rollout_kwargs(cfg, model_path: str) -> dict:
    """The :class:`RolloutConfig` keywords read straight from verl's rollout config (before
    ``engine_kwargs`` override them)."""
    return dict(
        model_path=model_path,
        dtype=_get(cfg, "dtype", "bfloat16"),
        gpu_memory_utilization=float(_get(cfg, "gpu_memory_utilization", 0.5)),
        free_cache_engine=bool(_get(cfg, "free_cache_engine", True)),
        enforce_eager=bool(_get(cfg, "enforce_eager", False)),
        max_num_seqs=_get(cfg, "max_num_seqs", None),
        load_format=_get(cfg, "load_format", "dummy") or "auto",
        layered_summon=bool(_get(cfg, "layered_summon", False)),
        piecewise_cuda_graph=True,
    )


def _map_sglang_kwargs(engine_kwargs: dict, kwargs: dict, prefix: str) -> List[str]:
    """Move the ``engine_kwargs.sglang`` keys that map onto rollout fields from ``engine_kwargs`` into
    ``kwargs`` (both changed in place); return one line per key refused (layout, fixed, managed, or a
    non-boolean negated flag)."""
    bad: List[str] = []
    for key in list(engine_kwargs):
        if key in ENGINE_KWARG_OVERRIDES:
            kwargs[ENGINE_KWARG_OVERRIDES[key]] = engine_kwargs.pop(key)  # verl: engine_kwargs win
        elif key in ENGINE_KWARG_NEGATED:
            try:
                kwargs[ENGINE_KWARG_NEGATED[key]] = not TypeAdapter(bool).validate_python(engine_kwargs.pop(key))
            except ValidationError:
                bad.append(f"{prefix}.engine_kwargs.sglang.{key}: not a boolean")
        elif key in ENGINE_KWARG_LAYOUT_KEYS:
            bad.append(f"{prefix}.engine_kwargs.sglang.{key}={engine_kwargs[key]!r}: decides the replica's GPU "
                       f"layout; set {ENGINE_KWARG_LAYOUT_KEYS[key]} instead")
        elif key in ENGINE_KWARG_FIXED:
            if engine_kwargs.pop(key) != ENGINE_KWARG_FIXED[key]:
                bad.append(f"{prefix}.engine_kwargs.sglang.{key}: sgl-rollout always sets it to "
                           f"{ENGINE_KWARG_FIXED[key]} ({MANAGED_SERVER_ARGS.get(key, '')}); remove the key")
        elif key in MANAGED_SERVER_ARGS:
            bad.append(f"{prefix}.engine_kwargs.sglang.{key}: {MANAGED_SERVER_ARGS[key]}; remove the key")
    return bad


def _sgl_rollout_setting(ours, key: str) -> Optional[bool]:
    """``engine_kwargs.sgl_rollout.<key>`` read as the engine reads it (pydantic's ``bool``: ``"no"``,
    ``"false"``, ``"off"``, ``0`` are False, as a truth test would not have them); None when absent or not a
    boolean (:func:`_map_sgl_rollout_kwargs` refuses the latter)."""
    if key not in ours:
        return None
    try:
        return TypeAdapter(bool).validate_python(ours[key])
    except ValidationError:
        return None


def _map_sgl_rollout_kwargs(cfg, kwargs: dict, prefix: str) -> List[str]:
    """Set ``kwargs[key]`` from ``engine_kwargs.sgl_rollout.<key>`` for each key of :data:`SGL_ROLLOUT_KWARGS`
    given (each a RolloutConfig boolean, :func:`_sgl_rollout_setting`); return the refusal line of each
    non-boolean value (empty list otherwise)."""
    bad: List[str] = []
    ours = _get(_get(cfg, "engine_kwargs", None) or {}, "sgl_rollout", None) or {}
    for key in SGL_ROLLOUT_KWARGS:
        if key in ours:
            value = _sgl_rollout_setting(ours, key)
            if value is None:
                bad.append(f"{prefix}.engine_kwargs.sgl_rollout.{key}={ours[key]!r}: not a boolean")
            else:
                kwargs[key] = value
    return bad


def _layout_engine_kwargs(cfg, engine_kwargs: dict, kwargs: dict, model_config, hf_config) -> dict:
    """Set the TP size in ``kwargs`` (``tensor_model_parallel_size * data_parallel_size``) and return
    ``engine_kwargs`` with SGLang's ``dp_size``/``ep_size``, FP8 quantization, ``trust_remote_code`` and
    ``skip_tokenizer_init`` as verl's server sets them."""
    tp = int(_get(cfg, "tensor_model_parallel_size", 1) or 1)
    dp = int(_get(cfg, "data_parallel_size", 1) or 1)
    ep = int(_get(cfg, "expert_parallel_size", 1) or 1)
    kwargs["tensor_model_parallel_size"] = tp * dp
    if dp > 1:
        engine_kwargs["dp_size"] = dp
    if ep > 1:
        engine_kwargs["ep_size"] = ep
    if _get(cfg, "quantization", None) == "fp8":
        engine_kwargs["quantization"] = "fp8"
        if hf_config is not None:
            engine_kwargs = with_fp8_override(engine_kwargs, hf_config)
    if model_config is not None and _get(model_config, "trust_remote_code", False):
        engine_kwargs.setdefault("trust_remote_code", True)
    engine_kwargs.setdefault("skip_tokenizer_init", bool(_get(cfg, "skip_tokenizer_init", True)))
    return engine_kwargs


def _apply_replica_mode(cfg, kwargs: dict, rollout_mode: Optional[str]) -> None:
    """Set in ``kwargs`` what the replica's mode implies (standalone: ``sleep_level=1``; colocated: a CPU
    copy of the weights) and the bucket size of ``checkpoint_engine.update_weights_bucket_megabytes``."""
    if rollout_mode == "standalone":
        kwargs["sleep_level"] = 1
    elif rollout_mode == "colocated":
        kwargs.setdefault("enable_weights_cpu_backup", True)
    ce = _get(cfg, "checkpoint_engine", None)
    bucket_mb = _get(ce, "update_weights_bucket_megabytes", None)
    if bucket_mb:
        kwargs["update_weights_bucket_megabytes"] = int(bucket_mb)


def rollout_config_from_verl(cfg, model_path: str, model_config=None, hf_config=None,
                             rollout_mode: Optional[str] = None, prefix: str = ROLLOUT_PREFIX) -> RolloutConfig:
    """Map verl's rollout config (``verl/workers/config/rollout.py``) to :class:`RolloutConfig`.

    Args:
        cfg: verl's rollout config (dataclass, DictConfig or dict).
        model_path: the model folder the engine loads (see :func:`resolve_local_model`).
        model_config: verl's model config, for ``trust_remote_code`` and the LoRA check; may be None.
        hf_config: the model's Hugging Face config, needed for ``quantization=fp8``'s
            ``json_model_override_args``; None leaves that to the engine actor, which knows it.
        rollout_mode: verl's ``RolloutMode`` value of the replica (``"hybrid"``, ``"colocated"``,
            ``"standalone"``; None: hybrid). As in verl's server: standalone replicas release only the
            KV cache on sleep (``sleep_level=1``: weight syncs go into resident weights); colocated
            ones (no weight sync ever) keep a CPU copy of the weights so a wake-up restores them.
        prefix: where ``cfg`` sits in verl's config, for error messages.

    Returns:
        RolloutConfig with TP size ``tensor_model_parallel_size * data_parallel_size`` (verl's
        ``infer_tp``), the bucket size of ``checkpoint_engine.update_weights_bucket_megabytes`` and
        ``engine_kwargs.sglang`` (minus the keys mapped onto rollout fields).

    Raises:
        UnsupportedVerlFeature: a feature :func:`check_verl_features` refuses, or an
            ``engine_kwargs.sglang`` key that would change the replica's layout.
        pydantic.ValidationError: a value out of range or an unknown SGLang key.
    """
    check_verl_features(cfg, model_config, prefix)
    engine_kwargs = dict(_get(_get(cfg, "engine_kwargs", None) or {}, "sglang", None) or {})
    kwargs = _base_rollout_kwargs(cfg, model_path)
    bad = _map_sglang_kwargs(engine_kwargs, kwargs, prefix)
    bad += _map_sgl_rollout_kwargs(cfg, kwargs, prefix)
    if bad:
        raise UnsupportedVerlFeature("sgl-rollout (rollout.name=sglang) does not take:\n  " + "\n  ".join(bad))
    engine_kwargs = _layout_engine_kwargs(cfg, engine_kwargs, kwargs, model_config, hf_config)
    _apply_replica_mode(cfg, kwargs, rollout_mode)
    kwargs["engine_kwargs"] = engine_kwargs
    return RolloutConfig(**kwargs)


def model_path_of(model_config) -> Optional[str]:
    """The model path as the caller's process sees it: ``local_path`` if set, else ``path``."""
    return _get(model_config, "local_path", None) or _get(model_config, "path", None)


def resolve_local_model(model_config) -> Tuple[Optional[str], Any]:
    """The model's local folder on *this* node, and its Hugging Face config, as verl's server gets them.

    verl's SGLang server converts the model config to ``HFModelConfig`` in its own actor
    (``omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)``), whose ``__post_init__``
    copies an hdfs path to the node's local cache and, with ``use_shm``, into ``/dev/shm``
    (``verl/utils/fs.py`` ``copy_to_local``). This does the same; an ``HFModelConfig`` object built on
    another node (its ``local_path`` absent here) is copied again with ``copy_to_local``.

    Args:
        model_config: dict / DictConfig (converted here), ``HFModelConfig`` or any object with
            ``path`` / ``local_path`` / ``use_shm``.

    Returns:
        (local path or None, hf_config or None).

    Raises:
        whatever verl's ``HFModelConfig`` raises for a path it cannot read.
    """
    from omegaconf import DictConfig

    if isinstance(model_config, (dict, DictConfig)):
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
    local = _get(model_config, "local_path", None)
    path = _get(model_config, "path", None)
    if path and (not local or not os.path.exists(local)):
        from verl.utils.fs import copy_to_local

        local = copy_to_local(path, use_shm=bool(_get(model_config, "use_shm", False)))
    return local or path, _get(model_config, "hf_config", None)


def max_position_embeddings(hf_config) -> Optional[int]:
    """The model's context length from its Hugging Face config (``text_config`` for VL models)."""
    if hf_config is None:
        return None
    try:
        from verl.workers.rollout.utils import get_max_position_embeddings

        return int(get_max_position_embeddings(hf_config))
    except Exception:  # noqa: BLE001 - an unusual config: fall back to the common attribute
        value = getattr(hf_config, "max_position_embeddings", None)
        return int(value) if value else None


class _WithoutLora:
    """A view of verl's model config without its LoRA keys, for :func:`check_verl_features` and
    :func:`rollout_config_from_verl`, which refuse LoRA served as an adapter; :func:`rollout_config_for_verl`
    serves it."""

    _HIDDEN = ("lora_rank", "lora")

    def __init__(self, model_config):
        self._cfg = model_config

    def get(self, key, default=None):
        return default if key in self._HIDDEN else _get(self._cfg, key, default)

    def __getattr__(self, key):
        if key.startswith("_"):
            raise AttributeError(key)
        return self.get(key)


def verl_lora_settings(model_config, rollout_cfg=None) -> Optional[dict]:
    """The LoRA settings of :class:`~sgl_rollout.config.RolloutConfig` for verl's model config, or None
    when verl does not serve LoRA as an adapter (no rank, or ``lora.merge=True``).

    Read as verl 0.9.1's SGLang server reads them (``lora_rank_of``, ``sglang_lora_target_modules``):
    the rank from ``model.lora_rank`` (FSDP) or ``model.lora.rank`` (Megatron), ``lora_alpha`` (or
    ``lora.alpha``), ``target_modules`` (``"all-linear"`` or a list).

    Raises:
        UnsupportedVerlFeature: a regex ``target_modules`` (SGLang takes names), FP8 rollout with an
            adapter, or a checkpoint-engine backend other than ``naive`` (verl's checkpoint engines send
            the base weights only, never the adapter); the message names the key.
    """
    if model_config is None or not lora_as_adapter(model_config):
        return None
    lora = _get(model_config, "lora", None) or {}
    rank = max(int(_get(model_config, "lora_rank", 0) or 0), int(_get(lora, "rank", 0) or 0))
    alpha = _get(model_config, "lora_alpha", None) or _get(lora, "alpha", None) or 16
    targets = _get(model_config, "target_modules", None) or _get(lora, "target_modules", None) or "all-linear"
    problems = []
    if isinstance(targets, str) and targets not in ("all-linear", "all"):
        problems.append(f"{MODEL_PREFIX}.target_modules={targets!r}: SGLang serves adapters on named modules, "
                        "not a regex; use all-linear or list the module names")
    elif not isinstance(targets, str):
        targets = [str(t) for t in targets]
    backend = _get(_get(rollout_cfg, "checkpoint_engine", None), "backend", "naive") if rollout_cfg is not None else "naive"
    if backend != "naive":
        problems.append(f"{ROLLOUT_PREFIX}.checkpoint_engine.backend={backend!r} with a LoRA adapter: verl's checkpoint "
                        "engines send get_per_tensor_param()'s base weights only (no peft_config), so the adapter "
                        f"would never reach the engine; use backend=naive (hybrid), or {MODEL_PREFIX}.lora.merge=True")
    if rollout_cfg is not None and _get(rollout_cfg, "quantization", None) == "fp8":
        problems.append(f"{ROLLOUT_PREFIX}.quantization='fp8' with a LoRA adapter: not served by sgl-rollout; use "
                        f"{MODEL_PREFIX}.lora.merge=True, quantization=null, or {VERL_BUILTIN}")
    if problems:
        raise UnsupportedVerlFeature("sgl-rollout (rollout.name=sglang) does not serve:\n  " + "\n  ".join(problems))
    return {"lora_rank": rank, "lora_alpha": float(alpha), "lora_target_modules": targets}


def check_served_features(cfg, model_config) -> None:
    """:func:`check_verl_features`, with LoRA served as an adapter accepted (and its keys checked by
    :func:`verl_lora_settings`): what a replica of this package refuses at construction.

    Raises:
        UnsupportedVerlFeature: naming every verl key to change.
    """
    verl_lora_settings(model_config, cfg)
    view = _WithoutLora(model_config) if model_config is not None and lora_as_adapter(model_config) else model_config
    check_verl_features(cfg, view)


def rollout_config_for_verl(cfg, model_path: str, model_config=None, hf_config=None,
                            rollout_mode: Optional[str] = None, prefix: str = ROLLOUT_PREFIX) -> RolloutConfig:
    """:func:`rollout_config_from_verl`, plus LoRA served as an adapter: the LoRA settings
    of :func:`verl_lora_settings` and ``sleep_level=1`` (verl's adapter mode: the base weights stay in
    the engine, only the KV cache is released, so the base is sent at most once)."""
    settings = verl_lora_settings(model_config, cfg)
    if settings is None:
        return rollout_config_from_verl(cfg, model_path, model_config=model_config, hf_config=hf_config,
                                        rollout_mode=rollout_mode, prefix=prefix)
    rc = rollout_config_from_verl(cfg, model_path, model_config=_WithoutLora(model_config), hf_config=hf_config,
                                  rollout_mode=rollout_mode, prefix=prefix)
    return RolloutConfig(**{**rc.model_dump(), **settings, "sleep_level": 1})


def check_verl_tp(cfg, model_config, gpus: Optional[int] = None) -> None:
    """Refuse a rollout TP size SGLang cannot run with this model (attention or KV heads not split
    evenly) or that needs more GPUs than ``gpus``, before any engine starts (:func:`~sgl_rollout.config.
    tp_layout_problem`; verl's own server would lose its actor to an assertion in SGLang's scheduler).

    Args:
        cfg: verl's rollout config (``tensor_model_parallel_size``, ``data_parallel_size``).
        model_config: verl's model config (its ``hf_config`` gives the heads), or None.
        gpus: GPUs of the trainer world (verl colocates a replica's ranks on them), or None.

    Raises:
        TPLayoutError: one line naming the numbers and the verl key.
    """
    tp = int(_get(cfg, "tensor_model_parallel_size", 1) or 1)
    dp = int(_get(cfg, "data_parallel_size", 1) or 1)
    key = f"{ROLLOUT_PREFIX}.tensor_model_parallel_size"
    hf_config = _get(model_config, "hf_config", None) if model_config is not None else None
    check_tp_layout(tp, model_heads(hf_config) if hf_config is not None else None, key=key)
    if gpus is not None:
        check_tp_layout(tp * dp, gpus=gpus, key=f"{key} x data_parallel_size")
