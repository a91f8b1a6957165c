"""The trainer's full weights from verl's FSDP2 actor, gathered one FSDP unit (a decoder layer) at a time
(issue 47, goal 2: own the gather).

verl 0.9.1 hands a weight sync ``FSDPEngine.get_per_tensor_param``'s stream
(``verl/workers/engine/fsdp/transformer_impl.py``): for an FSDP2 module, ``param.full_tensor()`` of each
``state_dict()`` entry, one all-gather per tensor (a 1.4B Qwen2: ~340 collectives, 200-220 ms of a 734 ms
update on 2 H200s, issue 47). :func:`layered_full_tensors` gives the same names in the same order with the
same values, but all-gathers each FSDP unit's parameters at once with FSDP2's own ``FSDPModule.unshard()``
(one collective per unit), copies them out, and ``reshard()``s the unit before the next one: at most one
unit's unsharded parameters are held besides what the consumer keeps. Under mixed precision FSDP2 gathers in
the compute dtype (bf16 for fp32 parameters): that stands for the parameters only where the rollout holds that
dtype (the colocated rollout says which at start, :func:`install`; the checkpoint engine ``sgl_rollout``'s
trainer side learns it from the rollout's copy plan, :func:`set_rollout_dtype`), else the unit is read per
tensor as verl does.

:func:`install` puts it behind verl's method for the runs that ask for it (``SGLROLLOUT_LAYERED_GATHER=1`` in
the trainer workers' environment; ``bench verl --ours-layered-gather``) and can use it: FSDP2, no LoRA, no
QAT, parameters on the GPU. Everything else keeps verl's own stream. Off by default: on 4×H200 (colocated,
1.1B at TP=2, 2026-11-28) it gave no gain (``timing_s/update_weights`` 0.746 against 0.730 s,
``examples/verl/compare/colocated-1b-random-tp2-h200x4-layered/``); it has not run behind the checkpoint
engine ``sgl_rollout``. CPU tests: ``tests/test_verl_gather.py`` (FSDP2 over gloo).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Iterator, Optional, Tuple

from .. import trace

logger = logging.getLogger(__name__)

#: The environment switch :func:`install`'s wrapper reads in each trainer worker at every call.
ENV = "SGLROLLOUT_LAYERED_GATHER"

__all__ = ["ENV", "install", "layered_full_tensors", "set_rollout_dtype", "unit_of"]


def unit_of(module, keys=None) -> Dict[str, Any]:
    """``state_dict()`` key (of ``keys``, default all of ``module``'s) -> the FSDP2 unit (``FSDPModule``) that
    shards it: the deepest ``FSDPModule`` whose module path is a prefix of the key; keys of no unit are left
    out."""
    from torch.distributed.fsdp import FSDPModule

    units = [(name, m) for name, m in module.named_modules() if isinstance(m, FSDPModule)]
    units.sort(key=lambda u: -len(u[0]))  # deepest first
    owners = {}
    for key in module.state_dict().keys() if keys is None else keys:
        for name, unit in units:
            if not name or key.startswith(name + "."):
                owners[key] = unit
                break
    return owners


def layered_full_tensors(module, device=None, narrow_ok=None, state=None) -> Iterator[Tuple[str, Any]]:
    """``(state_dict key, full tensor)`` for every entry of an FSDP2 ``module``'s ``state_dict()``, in its order,
    each a new tensor of the full shape (a copy: the consumer may keep it), in the unit's compute dtype
    (FSDP2's ``MixedPrecisionPolicy.param_dtype``, else the parameter's). A unit is unsharded when the first
    of a run of its keys comes and resharded when the run ends (a unit whose keys come in two runs, such as
    the root's embedding and its final norm and head, is gathered twice), and on any exit of the
    generator. Tensors that no unit shards (a plain tensor) come as they are, moved to ``device``.

    Args:
        narrow_ok: ``(dtype) -> bool``: whether a unit's compute dtype, where it differs from its parameters'
            (mixed precision, e.g. bf16 for fp32 parameters), may stand for them (True when the receiver
            holds that dtype: the cast is the same either side). A unit it refuses is read per tensor with
            ``full_tensor()`` in the parameters' dtype, as verl does. None: always.
        state: ``module.state_dict()`` when the caller has it already.

    Raises:
        whatever FSDP2's ``unshard`` raises (a collective: every rank must read the stream to its end).
    """
    from torch.distributed.tensor import DTensor

    state = module.state_dict() if state is None else state
    owners = unit_of(module, state.keys())
    current, per_tensor = None, set()
    try:
        for key, value in state.items():
            unit = owners.get(key) if isinstance(value, DTensor) else None
            if unit is not current and current is not None:
                current.reshard()
                current = None
            if unit is None or id(unit) in per_tensor:
                yield key, (value.full_tensor() if unit is not None else
                            value if device is None else value.to(device, non_blocking=True))
                continue
            if current is None:
                unit.unshard()
                current = unit
            full = module.get_parameter(key)
            if full.dtype != value.dtype and narrow_ok is not None and not narrow_ok(full.dtype):
                current.reshard()
                current = None
                per_tensor.add(id(unit))
                yield key, value.full_tensor()
                continue
            yield key, full.detach().clone()
    finally:
        if current is not None:
            current.reshard()


def _can_use(engine) -> Optional[str]:
    """Why ``engine`` (verl's ``FSDPEngine``) cannot take :func:`layered_full_tensors`, or None."""
    from verl.utils.fsdp_utils import fsdp_version

    module = engine.module
    if fsdp_version(module) != 2:
        return "not FSDP2"
    if hasattr(getattr(module, "_fsdp_wrapped_module", module), "peft_config"):
        return "LoRA"
    if getattr(engine, "_qat_enabled", False):
        return "QAT"
    if getattr(engine, "_uses_fsdp2_cpu_offload_policy", False) or getattr(engine, "_is_offload_param", False):
        return "parameters offloaded to the CPU"
    return None


def _stream(engine) -> Iterator[Tuple[str, Any]]:
    """verl's names for :func:`layered_full_tensors` of ``engine.module``: its ``convert_weight_keys`` renaming
    (``verl/utils/model.py``), then its ``unfuse_moe_params`` (``verl/workers/engine/fsdp/utils.py``), as
    ``get_per_tensor_param`` applies them."""
    from verl.utils.model import convert_weight_keys
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    module = engine.module
    # spans: verl.get_per_tensor_param took 137 ms around these two on 2 H200s (seventh session), 2.8 ms on the CPU
    with trace.span("gather.state_dict"):
        state = module.state_dict()
    with trace.span("gather.rename"):
        renamed: Dict[str, str] = {key: new for new, key in
                                   convert_weight_keys({k: k for k in state},
                                                       getattr(module, "_fsdp_wrapped_module", module)).items()}
    # plain (non-DTensor) entries stay where they are: _can_use admits only modules whose parameters are on the GPU
    full = layered_full_tensors(module, narrow_ok=lambda dtype: _ROLLOUT_DTYPE is not None and dtype == _ROLLOUT_DTYPE,
                                state=state)
    named = ((renamed.get(k, k), t) for k, t in full)
    return unfuse_moe_params(named, engine.model_config.hf_config.model_type)


#: The rollout engine's dtype in this process (:func:`install`'s ``rollout_dtype``, or :func:`set_rollout_dtype`):
#: units whose compute dtype is it may send it; None (unknown): every unit sends its parameters' dtype.
_ROLLOUT_DTYPE = None


def set_rollout_dtype(name: Optional[str]) -> None:
    """Tell this process's gather the rollout's weight dtype (``"bfloat16"``, ...; torch's name), read at each
    unit as the stream goes: the colocated rollout knows it at start (:func:`install`), a checkpoint engine's
    trainer side learns it from the rollout's copy plan before it reads the stream
    (:mod:`.verl_checkpoint_engine`). None or a name torch does not know: unknown (no unit narrows)."""
    global _ROLLOUT_DTYPE
    import torch

    dtype = getattr(torch, str(name), None) if name is not None else None
    _ROLLOUT_DTYPE = dtype if isinstance(dtype, torch.dtype) else None


def install(engine_class=None, rollout_dtype: Optional[str] = None) -> bool:
    """Wrap verl's ``FSDPEngine.get_per_tensor_param`` (or ``engine_class``'s) so that, with :data:`ENV` = ``1``
    in the process, an engine :func:`_can_use` returns :func:`_stream` instead; otherwise verl's own
    method runs. Idempotent. ``rollout_dtype`` (``"bfloat16"``, ...: the rollout's weights, the colocated
    rollout knows it) lets units in that compute dtype send it (:func:`layered_full_tensors`' ``narrow_ok``).

    Returns:
        True when installed (now or before); False when verl's FSDP engine cannot be imported.
    """
    if rollout_dtype is not None:
        set_rollout_dtype(rollout_dtype)
    if engine_class is None:
        try:
            from verl.workers.engine.fsdp.transformer_impl import FSDPEngine as engine_class
        except Exception as e:  # noqa: BLE001 - verl absent or broken here: its own stream stays
            logger.debug("layered gather not installed: %r", e)
            return False
    if getattr(engine_class.get_per_tensor_param, "_sgl_rollout_layered", False):
        return True
    original = engine_class.get_per_tensor_param

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        if os.environ.get(ENV, "").strip() == "1":
            why = _can_use(self)
            if why is None:
                return _stream(self), None
            logger.info("layered gather not used (%s): verl's own per-tensor gather", why)
        return original(self, layered_summon=layered_summon, base_sync_done=base_sync_done, **kwargs)

    get_per_tensor_param._sgl_rollout_layered = True
    get_per_tensor_param.__doc__ = original.__doc__
    engine_class.get_per_tensor_param = get_per_tensor_param
    return True
