"""verl's two ``empty_cache`` calls in a colocated weight update, skipped where the device has room for the
engine's wake anyway (issue 47, goal 2: keep ``empty_cache`` out of the timed path where that is safe).

verl 0.9.1's ``ActorRolloutRefWorker.update_weights`` (``verl/workers/engine_workers.py``, the ``naive``
backend of the colocated trainer) empties the trainer's torch cache twice: before it resumes the rollout's
weights and again before the KV cache. The first returns what training cached (tens of GB on a 1.1B model at
TP=2) to the driver, which took 290-310 ms of a 0.67-0.95 s update on 2×H200 (2026-11-29,
``examples/verl/compare/colocated-1b-random-tp2-h200x2/``), on verl's built-in rollout as on this package's.
It is needed only where the engine's memory would not fit beside the trainer's cache.

With :data:`ENV` = ``auto`` in the trainer workers' environment (``bench verl --ours-trainer-empty-cache
auto``), :func:`install` wraps that method so that each of its ``empty_cache`` calls is skipped when this
process's reserved memory plus a headroom fits in the *room* measured at the end of the previous update:
this process's reserved memory plus the device's free memory once every engine on the device was awake
(after a barrier of the trainer ranks, so that each replica's leader has resumed its engine). The engine's
memory is static while it is awake (SGLang's weights, KV pool and CUDA graphs), so whatever the trainer holds
within that room leaves the engine what it had then, and :data:`HEADROOM` (a share of the device) keeps
room for the engine's activations during generation and for variation. The first update of a run (no
room measured yet), any other backend and any other rollout keep verl's behaviour. So does the default
(:data:`ENV` unset or ``always``).

What it costs: the trainer's cache stays reserved through generation, so the device's peak memory grows by
about what verl would have emptied. Measured on one H200 (1.1B, TP=1, 2026-11-29,
``examples/verl/compare/colocated-1b-random-h200/``), it cost more than it saved: at SGLang's
``gpu_memory_utilization`` 0.5 the room never fitted training's 86 GB cache, so nothing was skipped; at 0.25
the first call was skipped and ``timing_s/update_weights`` fell from about 0.40 to 0.093 s, but the
trainer's process grew to the whole device (140 GB) and ``timing_s/step`` rose from 19.8 to 23.5 s
(``update_actor`` 8.4 to 10.9 s). Not recommended; kept opt-in for that measurement's sake.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

#: The environment switch the wrapper reads in each trainer worker at every update: ``auto`` skips verl's
#: ``empty_cache`` calls where the room allows; anything else (default) keeps verl's.
ENV = "SGLROLLOUT_TRAINER_EMPTY_CACHE"
#: Share of the device's memory kept free beyond the trainer's reserved memory before a call is skipped.
HEADROOM = 0.10

__all__ = ["ENV", "HEADROOM", "TrainerCacheWindow", "install"]


@dataclass
class TrainerCacheWindow:
    """What one trainer process knows between its weight updates (one per process, :func:`install`).

    Attributes:
        room_bytes: this process's reserved memory plus the device's free memory at the end of the last
            update, every engine awake (bytes); None before the first update ended.
        total_bytes: the device's memory (bytes; ``torch.cuda.mem_get_info``'s total).
        skipped: ``empty_cache`` calls skipped so far; ``kept``: those run.
    """

    room_bytes: Optional[int] = None
    total_bytes: int = 0
    skipped: int = 0
    kept: int = 0

    def fits(self, reserved_bytes: int) -> bool:
        """Whether ``reserved_bytes`` (this process's torch reservation now) plus :data:`HEADROOM` of the
        device fits in :attr:`room_bytes`; False while no room is known."""
        return self.room_bytes is not None and reserved_bytes + HEADROOM * self.total_bytes <= self.room_bytes


class _GuardedDevice:
    """``torch.cuda`` (what verl's ``get_torch_device()`` returns) with ``empty_cache`` skipped when the
    window :meth:`~TrainerCacheWindow.fits`; every other attribute is the module's."""

    def __init__(self, device, window: TrainerCacheWindow):
        self._device, self._window = device, window

    def __getattr__(self, name: str) -> Any:
        return getattr(self._device, name)

    def empty_cache(self) -> None:
        reserved = self._device.memory_reserved()
        if self._window.fits(reserved):
            self._window.skipped += 1
            logger.debug("verl's empty_cache skipped: %d bytes reserved fit in a room of %d",
                         reserved, self._window.room_bytes)
            return
        self._window.kept += 1
        self._device.empty_cache()


#: The window of the update running in this task (None outside one): verl's ``update_weights`` awaits its
#: calls in the task the wrapper runs in, so only its own ``get_torch_device()`` calls see it.
_ACTIVE: contextvars.ContextVar[Optional[TrainerCacheWindow]] = contextvars.ContextVar(
    "sgl_rollout_trainer_cache", default=None)
_WINDOW = TrainerCacheWindow()


def _naive(worker, mode: str, rollout_class: type) -> bool:
    """Whether this ``update_weights(mode=...)`` call takes verl's colocated (``naive``) path, the one
    that empties the cache, with a rollout of ``rollout_class`` (this package's)."""
    if not isinstance(getattr(worker, "rollout", None), rollout_class):
        return False
    if mode != "auto":
        return mode == "naive"
    ckpt = getattr(getattr(getattr(worker, "config", None), "rollout", None), "checkpoint_engine", None)
    return getattr(ckpt, "backend", "naive") == "naive"


async def _measure_room(device, window: TrainerCacheWindow) -> None:
    """After a barrier of the trainer ranks (each replica's leader has resumed its engine by then), record
    the room: this process's reserved memory plus the device's free memory."""
    import torch

    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        await asyncio.to_thread(dist.barrier)
    free, total = device.mem_get_info()
    window.room_bytes, window.total_bytes = int(device.memory_reserved()) + int(free), int(total)


def install(rollout_class: type, worker_class=None, module=None, window: Optional[TrainerCacheWindow] = None) -> bool:
    """Wrap verl's ``ActorRolloutRefWorker.update_weights`` (or ``worker_class``'s) and the
    ``get_torch_device`` that ``module`` (default ``verl.workers.engine_workers``) calls, as the module
    docstring says. Idempotent; inert unless :data:`ENV` is ``auto`` at the call.

    Args:
        rollout_class: this package's rollout class (:class:`~.verl_rollout.SglRollout`, which installs
            this in its ``__init__``); a worker whose ``rollout`` is not one keeps verl's behaviour.
        window: the process's :class:`TrainerCacheWindow` (tests; default the module's).

    Returns:
        True when installed (now or before); False when verl's worker cannot be imported (nothing changed).
    """
    window = _WINDOW if window is None else window
    if worker_class is None or module is None:
        try:
            from verl.workers import engine_workers
        except Exception as e:  # noqa: BLE001 - verl absent or broken here: its own update stays
            logger.debug("trainer-cache guard not installed: %r", e)
            return False
        module = engine_workers if module is None else module
        worker_class = engine_workers.ActorRolloutRefWorker if worker_class is None else worker_class
    if getattr(worker_class.__dict__.get("update_weights"), "_sgl_rollout_cache_guard", False):
        return True  # this class's own method is the guard already (a subclass's inherited one is not)
    original, real_device = worker_class.update_weights, module.get_torch_device

    @functools.wraps(real_device)
    def get_torch_device():
        device, active = real_device(), _ACTIVE.get()
        return device if active is None else _GuardedDevice(device, active)

    @functools.wraps(original)
    async def update_weights(self, global_steps: Optional[int] = None, mode: str = "auto", **kwargs):
        if os.environ.get(ENV, "").strip() != "auto" or not _naive(self, mode, rollout_class):
            return await original(self, global_steps=global_steps, mode=mode, **kwargs)
        token = _ACTIVE.set(window)
        try:
            result = await original(self, global_steps=global_steps, mode=mode, **kwargs)
        finally:
            _ACTIVE.reset(token)
        await _measure_room(real_device(), window)
        return result

    update_weights._sgl_rollout_cache_guard = True
    module.get_torch_device = get_torch_device
    worker_class.update_weights = update_weights
    return True
