"""The adapter sync: a LoRA adapter into a resident engine, the base weights first when the engine lacks them.

Three modules, one job each: the base-resend rule (:mod:`.base_sync`), the adapter's checks and payload
(:mod:`.lora_payload`), and here the sync itself, in process (:class:`AdapterSync`, and
:func:`update_adapter`, the body of ``RolloutWorker.update_adapter``: the worker's staged wake with the
adapter load as a hook). Each load runs inside the driver's sync fence (:mod:`.driver`). The names of the
other two modules are re-exported here, so ``sgl_rollout.weight_sync.lora`` stays the one import of LoRA
serving.
"""

from __future__ import annotations

import logging
import time
from collections.abc import ItemsView, Mapping
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from .base_sync import BaseWeightsMissing, engine_needs_base_sync, is_dummy_load, needs_base_sync
from .lora_payload import (
    ADAPTER_MODULES,
    DEFAULT_ADAPTER_NAME,
    PEFT_PREFIX,
    AdapterPayload,
    SyncValidationError,
    adapter_config_dict,
    build_adapter_payload,
    check_adapter_config,
    parse_adapter_name,
    serialize_by_value,
    validate_adapter,
)
from .manifest import WeightManifest

logger = logging.getLogger(__name__)


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
