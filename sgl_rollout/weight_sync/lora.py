"""LoRA adapters on top of base weights the engine keeps: when the base must travel, and the adapter sync.

The base-resend rule lives here and only here (:func:`needs_base_sync`): base weights are sent when the
engine does not have them, never otherwise. verl's merged change "avoid redundant base weight sync when
the engine doesn't sleep" measured up to 26 % faster training from this alone; verl 0.9.1 serves a LoRA
policy as an adapter over base weights the engine keeps (sleep level 1), sends the base once and the
adapter every step (``verl/workers/engine_workers.py``, ``update_weights``).

The adapter travels through SGLang's ``load_lora_adapter_from_tensors`` (SGLang 0.5.10:
``TokenizerManager.load_lora_adapter_from_tensors`` -> ``TpModelWorker.load_lora_adapter_from_tensors``
-> ``LoRAManager.load_lora_adapter_from_tensors``) in its ``flattened_bucket`` format: one serialized
``{"flattened_tensor", "metadata"}`` dict that every TP rank reads whole (each rank slices its shard
itself). What would fail inside SGLang's scheduler, and so kill it (and the trainer through its
SIGQUIT), is refused here before anything is sent:

* a payload the scheduler cannot unpickle (``TpModelWorker`` deserializes outside any ``try``);
* an adapter whose tensors do not fit the LoRA memory pool: ``load_lora_weight_to_buffer``
  (``sglang/srt/lora/mem_pool.py``) asserts ``buffer_view.shape == weight.shape`` when a batch first
  uses the adapter, i.e. inside the scheduler's forward; a rank above ``max_lora_rank``, a module the
  engine does not target, a ``v_proj`` or ``up_proj`` without its ``q_proj`` / ``gate_proj`` (SGLang
  stacks q/k/v and gate/up and looks the rest up by name: ``get_target_module_name`` raises);
* PEFT options SGLang would silently serve wrong (``use_rslora``: SGLang scales by ``alpha / r``;
  ``use_dora``; per-module ``rank_pattern`` / ``alpha_pattern``; ``modules_to_save``; LoRA biases).

The payload is serialized by value (the flattened buffer's bytes), not as CUDA IPC handles or shared
memory: every TP rank's scheduler can read it (a shared-memory file descriptor opens once only), and
without SGLang's device-UUID patch, which the scheduler installs only on its first base-weight sync.
Adapters are small (rank r on every target module: about ``2 * r / hidden`` of the base).
"""

from __future__ import annotations

import functools
import io
import logging
import pickle
import re
import time
from collections.abc import ItemsView, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from ..config import ALL_LINEAR_MODULES
from ..lora_adapter import AdapterPayload, adapter_config_dict, check_adapter_config, stacked_modules as _stacked
from ..memory import WEIGHTS
from ..switch import sleep_releases
from .bucket import NamedTensor, _checked_item, flatten_bucket, tensor_nbytes
from .manifest import SyncValidationError, WeightManifest

logger = logging.getLogger(__name__)

#: Prefix of a PEFT adapter's weight names (``get_peft_model_state_dict``), which SGLang expects.
PEFT_PREFIX = "base_model.model."
#: Adapter name the verl integration and :class:`AdapterSync` use unless told otherwise.
DEFAULT_ADAPTER_NAME = "policy"

_LORA_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: Decoder-layer modules an adapter may target here, as Hugging Face checkpoints name them.
ADAPTER_MODULES = ALL_LINEAR_MODULES + ("qkv_proj", "gate_up_proj")


# ======================================================================= the rule
def is_dummy_load(load_format: Optional[str]) -> bool:
    """True for a load format that gives random weights (``"dummy"``; verl tests ``"dummy" in``)."""
    return "dummy" in str(load_format or "").lower()


def needs_base_sync(*, free_cache_engine: bool, sleep_level: int, base_sync_done: bool, load_format: str,
                    weights_cpu_backup: bool = False, weights_released: Optional[bool] = None) -> bool:
    """Whether the base weights must be sent before an adapter: True exactly when the engine lacks them.

    The engine lacks its base weights when

    1. it never had them: ``load_format`` is a dummy format (random weights) and no base sync reached
       it since it started (``base_sync_done`` False): the first sync after a dummy load; or
    2. it lost them: its ``weights`` tag was released since the last base sync (or since the start)
       and no CPU backup restores them. ``weights_released`` says whether that happened, when it is
       known (an engine's own record); None predicts it from the settings: the weights tag is released
       on every sleep when ``free_cache_engine`` is True and ``sleep_level`` is 2, never otherwise.

    So the base is never resent when ``free_cache_engine`` is False (nothing is ever released) or the
    weights tag stayed resident (sleep level 1, verl's adapter mode); with a non-dummy load it is never
    sent at all unless released. The table, for ``weights_cpu_backup=False`` and
    ``weights_released=None`` (D: dummy load format, "-": either):

    ===================  ===========  ==============  ======  ======
    free_cache_engine    sleep_level  base_sync_done  format  result
    ===================  ===========  ==============  ======  ======
    -                    -            False           D       True
    True                 2            -               -       True
    any other row                                             False
    ===================  ===========  ==============  ======  ======

    Args:
        free_cache_engine: sleep releases memory at all (verl's ``rollout.free_cache_engine``).
        sleep_level: 1 releases the KV cache only, 2 also the weights.
        base_sync_done: a complete base-weight sync reached the engine since it started.
        load_format: the engine's load format (``"dummy"``, ``"auto"``, ``"safetensors"``, ...).
        weights_cpu_backup: SGLang's ``enable_weights_cpu_backup``: released weights come back as they were.
        weights_released: observed: the weights tag was released since the last base sync (or the
            start). None: predicted from ``free_cache_engine`` and ``sleep_level``.

    Returns:
        True when base weights must be sent.

    Raises:
        ValueError: ``sleep_level`` not 1 or 2.
    """
    predicted = sleep_releases(WEIGHTS, free_cache_engine, sleep_level)  # the switch's rule (validates the level)
    if is_dummy_load(load_format) and not base_sync_done:
        return True
    released = predicted if weights_released is None else bool(weights_released)
    return released and not weights_cpu_backup


def engine_needs_base_sync(engine) -> bool:
    """:func:`needs_base_sync` for a :class:`~sgl_rollout.engine.RolloutEngine` from what it observed:
    whether a complete weight sync reached it since it (re)started, and whether its weights tag was
    released since then."""
    cfg = engine.config
    return needs_base_sync(free_cache_engine=cfg.free_cache_engine, sleep_level=cfg.sleep_level,
                           base_sync_done=engine.weights_synced, load_format=cfg.load_format,
                           weights_cpu_backup=cfg.enable_weights_cpu_backup,
                           weights_released=engine.weights_released_since_sync)


class BaseWeightsMissing(RuntimeError):
    """The engine lacks its base weights (dummy load, level-2 release, restart) and no base weights were
    given: loading an adapter now would serve it over garbage. Nothing was sent."""


# ======================================================================= names
def parse_adapter_name(name: str) -> Tuple[str, str, str]:
    """``(peft name, module path, "A" or "B")`` of one adapter weight.

    Accepts PEFT's saved names (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``),
    ``named_parameters()`` names with the adapter's name (``...lora_A.default.weight``) and names
    without the ``base_model.model.`` prefix; returns the saved form SGLang expects and the module's
    path in the base model (``model.layers.0.self_attn.q_proj``).

    Raises:
        ValueError: not a LoRA A/B weight name (a DoRA magnitude, an embedding LoRA, a bias, ...).
    """
    m = _LORA_NAME.match(name)
    if m is None:
        raise ValueError(f"{name}: not a LoRA weight name ('<module>.lora_A.weight' / '<module>.lora_B.weight')")
    module = m.group("module")
    if module.startswith(PEFT_PREFIX):
        module = module[len(PEFT_PREFIX):]
    return f"{PEFT_PREFIX}{module}.lora_{m.group('ab')}.weight", module, m.group("ab")


# ======================================================================= validation
def _adapter_scope(config: Mapping[str, Any], engine_config) -> Tuple[Optional[set], Optional[set]]:
    """``(declared, served)``: the module kinds the config's ``target_modules`` list (None when it is a
    string or empty) and the stacked module kinds the engine serves adapters on (None when any)."""
    targets = config.get("target_modules")
    declared = None if isinstance(targets, str) or not targets else {t.split(".")[-1] for t in targets}
    served = None
    if engine_config is not None and engine_config.lora_enabled and engine_config.server_lora_target_modules() != ["all"]:
        served = set(_stacked(engine_config.server_lora_target_modules()))
    return declared, served


def _tensor_problems(name: str, module: str, tensor: torch.Tensor, declared: Optional[set],
                     served: Optional[set], engine_config) -> Tuple[List[str], bool]:
    """Problems of one adapter weight on its own (module served, declared and served by the engine;
    floating dtype; 2-D), and whether it goes on to the per-module checks."""
    problems: List[str] = []
    kind = module.split(".")[-1]
    if _LAYER.search(module + ".") is None or kind not in ADAPTER_MODULES:
        problems.append(f"{name}: adapters on {kind!r} are not served (decoder-layer modules {list(ADAPTER_MODULES)})")
        return problems, False
    if declared is not None and kind not in declared:
        problems.append(f"{name}: {kind!r} is not in the config's target_modules {sorted(declared)}")
    if served is not None and _stacked([kind])[0] not in served:
        problems.append(f"{name}: the engine serves no adapter on {kind!r} (its lora_target_modules: "
                        f"{engine_config.lora_target_modules!r}; SGLang's scheduler would fail on it)")
    if not tensor.is_floating_point():
        problems.append(f"{name}: dtype {tensor.dtype} is not floating point")
    if tensor.dim() != 2:
        problems.append(f"{name}: shape {tuple(tensor.shape)} is not 2-D")
        return problems, False
    return problems, True


def _collect_adapter_tensors(items: Iterable[NamedTensor], declared: Optional[set], served: Optional[set],
                             engine_config, problems: List[str]
                             ) -> Tuple[List[NamedTensor], Dict[str, str], Dict[str, Dict[str, torch.Tensor]]]:
    """Read ``items`` to the end, appending each item's problems to ``problems``; return
    ``(out, seen, modules)``: the usable ``(peft name, tensor)`` pairs, every peft name seen (-> the name
    given) and each module's ``{"A"/"B": tensor}``."""
    out: List[NamedTensor] = []
    seen: Dict[str, str] = {}
    modules: Dict[str, Dict[str, torch.Tensor]] = {}
    for item in items:
        try:
            name, tensor = _checked_item(item)
            peft_name, module, ab = parse_adapter_name(name)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if peft_name in seen:
            problems.append(f"{name}: the same weight as {seen[peft_name]}")
            continue
        seen[peft_name] = name
        found, usable = _tensor_problems(name, module, tensor, declared, served, engine_config)
        problems.extend(found)
        if usable:
            modules.setdefault(module, {})[ab] = tensor
            out.append((peft_name, tensor))
    return out, seen, modules


def _base_shape_problems(module: str, a: Optional[torch.Tensor], b: Optional[torch.Tensor], r: Optional[int],
                         manifest: WeightManifest) -> List[str]:
    """Problems of a module's ``A``/``B`` shapes against its base weight's ``(out, in)`` in ``manifest``."""
    base = f"{module}.weight"
    if base not in manifest:
        return [f"{module}: the base model has no weight {base}"]
    shape = manifest[base].shape
    if len(shape) != 2:
        return [f"{module}: base weight {base} has shape {shape}, not a linear layer's"]
    problems: List[str] = []
    out_dim, in_dim = shape
    if a is not None and a.shape[1] != in_dim:
        problems.append(f"{module}.lora_A: shape {tuple(a.shape)}, expected ({r or a.shape[0]}, {in_dim}) "
                        f"(base {base} is {shape})")
    if b is not None and b.shape[0] != out_dim:
        problems.append(f"{module}.lora_B: shape {tuple(b.shape)}, expected ({out_dim}, {r or b.shape[1]}) "
                        f"(base {base} is {shape})")
    return problems


def _module_problems(module: str, ab: Dict[str, torch.Tensor], r: Optional[int],
                     manifest: Optional[WeightManifest]) -> List[str]:
    """Problems of one module's A/B pair: one missing, a rank other than the config's ``r``, shapes
    that do not fit the base weight (when ``manifest`` is given)."""
    problems: List[str] = []
    missing = sorted({"A", "B"} - set(ab))
    if missing:
        problems.append(f"{module}: lora_{missing[0]} is missing (each module needs lora_A and lora_B)")
    a, b = ab.get("A"), ab.get("B")
    if r is not None:
        if a is not None and a.dim() == 2 and a.shape[0] != r:
            problems.append(f"{module}.lora_A: shape {tuple(a.shape)} has rank {a.shape[0]}, the config's r is {r}")
        if b is not None and b.dim() == 2 and b.shape[1] != r:
            problems.append(f"{module}.lora_B: shape {tuple(b.shape)} has rank {b.shape[1]}, the config's r is {r}")
    if manifest is not None:
        problems.extend(_base_shape_problems(module, a, b, r, manifest))
    return problems


def _pairing_problems(modules: Iterable[str]) -> List[str]:
    """Problems of the modules SGLang stacks, per layer in sorted order: ``k_proj``/``v_proj`` without
    ``q_proj``, ``q_proj`` without ``v_proj``, ``up_proj`` without ``gate_proj``."""
    layers: Dict[str, set] = {}
    for module in modules:
        parent, _, kind = module.rpartition(".")
        layers.setdefault(parent, set()).add(kind)
    problems: List[str] = []
    for parent, kinds in sorted(layers.items()):
        if kinds & {"k_proj", "v_proj"} and "q_proj" not in kinds:
            problems.append(f"{parent}: {sorted(kinds & {'k_proj', 'v_proj'})} without q_proj (SGLang stacks q/k/v "
                            "on q_proj and would fail on the rest inside its scheduler)")
        if "q_proj" in kinds and "v_proj" not in kinds:
            problems.append(f"{parent}: q_proj without v_proj (SGLang stacks q/k/v and needs v_proj)")
        if "up_proj" in kinds and "gate_proj" not in kinds:
            problems.append(f"{parent}: up_proj without gate_proj (SGLang stacks gate/up on gate_proj)")
    return problems


def validate_adapter(items: Iterable[NamedTensor], config: Mapping[str, Any], manifest: Optional[WeightManifest] = None,
                     engine_config=None, context: str = "LoRA adapter") -> List[NamedTensor]:
    """Check an adapter whole before any of it is sent; return its tensors under PEFT's saved names.

    Checked: every item is a ``(str, Tensor)`` pair named as a LoRA A/B weight of a decoder-layer
    module SGLang serves (:data:`ADAPTER_MODULES`), listed in the config's ``target_modules`` (when a
    list) and served by the engine; no name twice; floating dtypes; 2-D; each module
    has both A and B; ``A`` is ``[r, in]`` and ``B`` is ``[out, r]`` with ``r`` the config's rank and
    ``(out, in)`` the base weight's shape from ``manifest``; per layer, ``q_proj`` with any of
    ``k_proj``/``v_proj`` and ``v_proj`` with ``q_proj`` (SGLang stacks them), ``gate_proj`` with
    ``up_proj``; the config (:func:`check_adapter_config`, with ``engine_config``'s limits).

    Args:
        items: ``(name, tensor)`` pairs (a generator is read to the end).
        config: the adapter's normalized PEFT config (:func:`adapter_config_dict`).
        manifest: the base model's :class:`~.manifest.WeightManifest`; None skips the base-shape check.
        engine_config: the engine's rollout config; None skips the engine's limits.
        context: prefix of the error message.

    Returns:
        ``[(peft name, tensor)]`` in the given order.

    Raises:
        SyncValidationError: every problem at once.
    """
    problems = list(check_adapter_config(config, engine_config))
    r = config.get("r") if isinstance(config.get("r"), int) else None
    declared, served = _adapter_scope(config, engine_config)
    out, seen, modules = _collect_adapter_tensors(items, declared, served, engine_config, problems)
    if not seen and not problems:
        problems.append("empty adapter: no tensors")
    for module, ab in modules.items():
        problems.extend(_module_problems(module, ab, r, manifest))
    problems.extend(_pairing_problems(modules))
    if problems:
        raise SyncValidationError(problems, context)
    return out


# ======================================================================= payload
class _ByValuePickler(pickle.Pickler):
    """Pickles a 1-D uint8 CPU tensor as its bytes (a protocol-5 ``PickleBuffer``, written straight from the
    tensor's memory, read back as a ``bytearray``) plus ``functools.partial(torch.frombuffer,
    dtype=torch.uint8)``: names SGLang's ``SafeUnpickler`` allows (``functools.``, ``builtins.``,
    ``torch.``), one copy of the bytes on each side (torch's own by-value pickling goes through
    ``torch.save``; measured about 1.5 times slower here)."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.dtype == torch.uint8 and obj.dim() == 1:
            return functools.partial(torch.frombuffer, dtype=torch.uint8), (pickle.PickleBuffer(obj.contiguous().numpy()),)
        return NotImplemented


def serialize_by_value(obj) -> bytes:
    """Pickle ``obj`` with its tensors' bytes inside (no shared memory, no IPC handles), for SGLang's
    ``MultiprocessingSerializer.deserialize`` in any process."""
    buf = io.BytesIO()
    _ByValuePickler(buf, protocol=5).dump(obj)
    return buf.getvalue()


def build_adapter_payload(items, peft_config, manifest: Optional[WeightManifest] = None, engine_config=None,
                          dtype: Optional[torch.dtype] = None) -> AdapterPayload:
    """Check an adapter (:func:`validate_adapter`) and serialize it in SGLang's ``flattened_bucket`` format.

    Args:
        items: the adapter's ``(name, tensor)`` pairs, or a dict of them (PEFT's state dict); CPU or CUDA.
        peft_config: its PEFT config (dict or ``peft.LoraConfig``).
        manifest: the base model's manifest, for the shape check (recommended).
        engine_config: the engine's rollout config, for its LoRA limits.
        dtype: cast the tensors to this dtype first (e.g. the engine's); None keeps them (SGLang casts
            into its LoRA memory pool's dtype).

    Returns:
        AdapterPayload.

    Raises:
        SyncValidationError: every problem of the adapter at once; nothing is built.
    """
    t0 = time.perf_counter()
    if isinstance(items, Mapping):
        items = items.items()
    items = list(items)
    kinds = set()
    for item in items:  # the modules sent replace a string target_modules ("all-linear") for SGLang
        try:
            kinds.add(parse_adapter_name(item[0])[1].split(".")[-1])
        except Exception:  # noqa: BLE001 - validate_adapter reports it
            pass
    config = adapter_config_dict(peft_config, modules=sorted(kinds) if kinds else None)
    named = validate_adapter(items, config, manifest=manifest, engine_config=engine_config)
    kinds = sorted({parse_adapter_name(n)[1].split(".")[-1] for n, _ in named})
    t1 = time.perf_counter()
    named = [(n, t.detach().to(dtype) if dtype is not None else t.detach()) for n, t in named]
    # one flat buffer where the tensors are (on the GPU: device copies), then one copy to the host; with a
    # device-to-host copy per tensor the build took 0.58 s for a 1.1B Llama's 308 adapter tensors (H100)
    flat = flatten_bucket(named)
    if flat.flattened_tensor.device.type != "cpu":
        pinned = torch.empty(flat.nbytes, dtype=torch.uint8, pin_memory=True)
        flat.flattened_tensor = pinned.copy_(flat.flattened_tensor)
    t2 = time.perf_counter()
    data = serialize_by_value(flat.payload())
    t3 = time.perf_counter()
    return AdapterPayload(data=data, config=config, n_tensors=len(named),
                          tensor_bytes=sum(tensor_nbytes(t) for _, t in named), modules=kinds,
                          build_parts={"check": t1 - t0, "flatten": t2 - t1, "serialize": t3 - t2})


# ======================================================================= driver
@dataclass
class AdapterSyncStats:
    """Figures of one adapter sync.

    Attributes:
        name: the adapter's name; version: its version after the sync.
        base_sent: whether base weights were sent (the rule said the engine lacked them).
        base_tensors, base_bytes: base weights sent (0 when not).
        adapter_tensors, adapter_bytes: adapter tensors sent and their data bytes; payload_bytes: the
            serialized payload's size.
        base_seconds: the base sync; build_parts: checking, flattening and serializing the adapter
            (see :class:`AdapterPayload`; :attr:`build_seconds` is their sum); load_seconds: SGLang's
            load (and the previous version's unload).
        seconds: all of it.
    """

    name: str = DEFAULT_ADAPTER_NAME
    version: int = 0
    base_sent: bool = False
    base_tensors: int = 0
    base_bytes: int = 0
    adapter_tensors: int = 0
    adapter_bytes: int = 0
    payload_bytes: int = 0
    base_seconds: float = 0.0
    build_parts: Dict[str, float] = field(default_factory=dict)
    load_seconds: float = 0.0
    seconds: float = 0.0

    @property
    def build_seconds(self) -> float:
        """Seconds to check, flatten and serialize the adapter (the sum of :attr:`build_parts`)."""
        return sum(self.build_parts.values())


class AdapterSync:
    """Send LoRA adapters to a :class:`~sgl_rollout.engine.RolloutEngine`, with base weights only when
    the engine lacks them (:func:`engine_needs_base_sync`).

    Args:
        engine: a started RolloutEngine with ``lora_rank > 0``.
        name: the adapter's name (``generate(..., lora_path=name)``).
        manifest: the base model's weight manifest: adapter shapes and base syncs are checked against
            it; None skips those checks.

    Attributes:
        history: the :class:`AdapterSyncStats` of every sync, in order.
    """

    def __init__(self, engine, name: str = DEFAULT_ADAPTER_NAME, manifest: Optional[WeightManifest] = None):
        self.engine = engine
        self.name = name
        self.manifest = manifest
        self.history: List[AdapterSyncStats] = []

    def needs_base(self) -> bool:
        """The rule for this engine now (:func:`engine_needs_base_sync`)."""
        return engine_needs_base_sync(self.engine)

    def payload(self, adapter, peft_config) -> AdapterPayload:
        """:func:`build_adapter_payload` against this engine's settings and the manifest."""
        return build_adapter_payload(adapter, peft_config, manifest=self.manifest, engine_config=self.engine.config)

    def sync(self, adapter, peft_config, base_weights=None, bucket_bytes: Optional[int] = None) -> AdapterSyncStats:
        """One adapter sync into a resident engine, inside one sync fence: base weights first when the rule
        says the engine lacks them, then the adapter (replacing the previous version).

        Everything is checked before anything is sent: the adapter whole; the base, when it is a list
        or ``dict.items()``, whole too (a generator bucket by bucket).

        Args:
            adapter: the adapter's ``(name, tensor)`` pairs or a dict (PEFT names), or an :class:`AdapterPayload`.
            peft_config: its PEFT config (dict or ``peft.LoraConfig``); unused with an AdapterPayload.
            base_weights: the base model's ``(name, tensor)`` pairs (Hugging Face names), or a callable
                returning them (called only when needed); may be None when the engine has its base.
            bucket_bytes: bucket size of the base sync; None: the engine's config.

        Returns:
            AdapterSyncStats (also appended to :attr:`history`).

        Raises:
            BaseWeightsMissing: the engine lacks its base weights and ``base_weights`` is None. Nothing was sent.
            SyncValidationError: the adapter (or the base) does not fit the model. Nothing was sent
                when the adapter or a materialised base was refused.
            MemoryStateError: the weights are released, requests run, or another operation is in progress.
            RuntimeError: SGLang refused the adapter or a bucket.
        """
        from .driver import EngineFence, sync_fenced
        from .flattened_bucket import send_flattened_buckets
        from .manifest import SyncValidator

        t0 = time.perf_counter()
        stats = AdapterSyncStats(name=self.name)
        payload = adapter if isinstance(adapter, AdapterPayload) else self.payload(adapter, peft_config)
        stats.build_parts = dict(payload.build_parts)
        self.engine.settle()
        base = None
        if self.needs_base():
            base = _base_to_send(self.engine, base_weights, "sent")
            if isinstance(base, Mapping):
                raise TypeError("base_weights is a dict: pass dict.items() (or model.named_parameters())")
            if isinstance(base, (list, tuple, ItemsView)) and self.manifest is not None:
                base = list(base)
                SyncValidator(self.manifest).validate_all(base)
        def body():
            if base is not None:
                tb = time.perf_counter()
                validator = None
                if self.manifest is not None and not isinstance(base, list):
                    validator = SyncValidator(self.manifest)
                cfg = self.engine.config
                s = send_flattened_buckets(_NoFlush(self.engine), base, bucket_bytes or cfg.bucket_bytes,
                                           tp_size=cfg.tensor_model_parallel_size, validator=validator)
                stats.base_sent, stats.base_tensors, stats.base_bytes = True, s.n_tensors, s.bytes
                stats.base_seconds = time.perf_counter() - tb
            tl = time.perf_counter()
            loaded = self.engine.load_lora_adapter_from_tensors(self.name, payload)
            stats.load_seconds = time.perf_counter() - tl
            return loaded

        record = sync_fenced(EngineFence(self.engine), body)
        self.engine.flush_cache()
        stats.version = record.version
        stats.adapter_tensors, stats.adapter_bytes, stats.payload_bytes = (payload.n_tensors, payload.tensor_bytes,
                                                                           payload.nbytes)
        stats.seconds = time.perf_counter() - t0
        self.history.append(stats)
        logger.info("adapter sync %s v%d: %d tensors, %.2f MB%s in %.1f ms", self.name, stats.version,
                    stats.adapter_tensors, stats.adapter_bytes / 1e6,
                    f" + base {stats.base_bytes / 1e6:.1f} MB" if stats.base_sent else " (base kept)",
                    stats.seconds * 1e3)
        return stats


def _base_to_send(engine, base_weights, nothing_was: str):
    """The base weights the rule asked for: ``base_weights`` called if callable.

    Raises:
        BaseWeightsMissing: ``base_weights`` is None (the message ends "nothing was <nothing_was>").
    """
    if base_weights is None:
        raise BaseWeightsMissing(
            f"the engine lacks its base weights (load_format={engine.config.load_format!r}, synced="
            f"{engine.weights_synced}, weights released since={engine.weights_released_since_sync}): "
            f"pass base_weights; nothing was {nothing_was}")
    return base_weights() if callable(base_weights) else base_weights


class _NoFlush:
    """The engine for :func:`~.flattened_bucket.send_flattened_buckets` without its flush (the adapter sync
    flushes once at its end)."""

    def __init__(self, engine):
        self._engine = engine

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=False):
        return self._engine.update_weights_from_tensor(named_tensors, load_format=load_format, flush_cache=flush_cache)

    def flush_cache(self):
        pass


def update_adapter(worker, adapter, peft_config, base_weights=None, offload_trainer: Optional[Callable[[], None]] = None,
                   name: str = DEFAULT_ADAPTER_NAME) -> AdapterSyncStats:
    """The staged wake of a :class:`~sgl_rollout.worker.RolloutWorker` with an adapter sync (the body of
    ``RolloutWorker.update_adapter``).

    Order: check and serialize the adapter (nothing sent on a refusal); then the worker's staged wake
    (:meth:`sgl_rollout.switch.Switch.wake`) with the adapter load as a hook (phase ``adapter``) before
    ``offload_trainer``: when the engine lacks its base weights (:func:`engine_needs_base_sync`) through
    ``worker.update_weights(base_weights)``, which syncs the base first; otherwise without a sync (released
    weights come back from their CPU backup). The phases land in ``worker.last_phase_seconds`` and
    ``worker.timeline``.

    Args:
        worker: the RolloutWorker (its engine started with ``lora_rank > 0``).
        adapter: the adapter's ``(name, tensor)`` pairs or dict (PEFT names), or an AdapterPayload.
        peft_config: its PEFT config (dict or ``peft.LoraConfig``).
        base_weights: the base model's ``(name, tensor)`` pairs or a callable returning them (called only
            when the base must be sent); None when the engine keeps its base.
        offload_trainer: called once the engine holds the new adapter, before the KV cache returns.
        name: the adapter's name.

    Returns:
        AdapterSyncStats.

    Raises:
        BaseWeightsMissing: the base is needed and ``base_weights`` is None; the engine stays as it was.
        SyncValidationError: the adapter does not fit the model; nothing was resumed or sent.
        MemoryStateError, RuntimeError: as :meth:`RolloutWorker.update_weights`.
    """
    from ..memory import KV_CACHE
    from .driver import EngineFence, sync_fenced

    engine = worker.engine
    sync = AdapterSync(engine, name=name, manifest=worker.manifest)
    t_start = time.perf_counter()
    payload = adapter if isinstance(adapter, AdapterPayload) else sync.payload(adapter, peft_config)
    engine.settle()
    stats = AdapterSyncStats(name=name, build_parts=dict(payload.build_parts))

    def load_adapter():
        t = time.perf_counter()
        record = sync_fenced(EngineFence(engine), lambda: engine.load_lora_adapter_from_tensors(name, payload))
        if not engine.state.is_released(KV_CACHE):
            engine.flush_cache()
        stats.version, stats.load_seconds = record.version, time.perf_counter() - t

    hooks = [("adapter", load_adapter)]
    if sync.needs_base():
        base = _base_to_send(engine, base_weights, "resumed or sent")
        base_stats = worker.update_weights(base, offload_trainer=offload_trainer, after_sync=hooks)
        stats.base_sent, stats.base_tensors, stats.base_bytes = True, base_stats.n_tensors, base_stats.bytes
        stats.base_seconds = base_stats.seconds
    else:  # released weights come back from their CPU backup: no sync before the adapter
        if offload_trainer is not None:
            hooks.append(("offload_trainer", offload_trainer))
        worker.switch.wake(hooks)
    stats.adapter_tensors, stats.adapter_bytes, stats.payload_bytes = (payload.n_tensors, payload.tensor_bytes,
                                                                       payload.nbytes)
    stats.seconds = worker.last_phase_seconds["switch_total"] = time.perf_counter() - t_start
    sync.history.append(stats)
    return stats


__all__ = [
    "ADAPTER_MODULES",
    "AdapterPayload",
    "AdapterSync",
    "AdapterSyncStats",
    "BaseWeightsMissing",
    "DEFAULT_ADAPTER_NAME",
    "PEFT_PREFIX",
    "SyncValidationError",
    "adapter_config_dict",
    "build_adapter_payload",
    "check_adapter_config",
    "engine_needs_base_sync",
    "is_dummy_load",
    "needs_base_sync",
    "parse_adapter_name",
    "serialize_by_value",
    "update_adapter",
    "validate_adapter",
]
