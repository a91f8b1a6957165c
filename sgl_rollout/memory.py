"""Memory state of the rollout engine: which tagged regions are resident, and a timeline.

SGLang (0.5.10) keeps weights, KV cache and CUDA-graph memory in separately tagged regions of
torch-memory-saver's allocator. It trusts its caller completely:

* releasing a tag that is already released makes torch-memory-saver call ``exit(1)`` in the
  scheduler;
* resuming a tag that is not released raises ``KeyError`` in the scheduler
  (``Scheduler.resume_memory_occupation``, ``offload_tags.remove``);
* releasing while requests run fails the scheduler's ``is_fully_idle()`` assertion
  (``sglang/srt/managers/scheduler_update_weights_mixin.py``).

Each of these kills the scheduler, whose SIGQUIT then kills the host process. :class:`MemoryState`
tracks the tags itself and refuses such a call in Python, before it reaches the engine.
"""

from __future__ import annotations

import gc
import json
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
CUDA_GRAPH = "cuda_graph"
#: SGLang's tag names (``sglang/srt/constants.py``: GPU_MEMORY_TYPE_*).
ALL_TAGS: Tuple[str, ...] = (WEIGHTS, KV_CACHE, CUDA_GRAPH)

GiB = 1 << 30


class MemoryStateError(RuntimeError):
    """An invalid release/resume/sync/generate call, refused before it reached the engine."""


class MemoryState:
    """Which tags are resident, what runs in the engine now, and which calls may start.

    One lock covers every check-and-act: a release, resume or weight sync is admitted only when no
    other one is in progress (:attr:`busy`), and a generate only while nothing is released, no
    release/resume/sync is in progress and the last weight sync completed. The state changes when
    the engine *answers* (:meth:`commit`, :meth:`end_sync`, :meth:`request_done`), not when the
    caller returns: a caller interrupted after its request was sent (KeyboardInterrupt,
    ``asyncio.wait_for`` timeout, ``ray.cancel``) leaves no lie behind, because
    :class:`sgl_rollout.engine.RolloutEngine` calls these from the engine call's completion.

    Args:
        tags: the tags the engine has; ``cuda_graph`` is absent when CUDA graphs are off.

    Thread-safe: generation threads, a release in another thread and the engine's event-loop
    thread may all call it.
    """

    def __init__(self, tags: Sequence[str] = ALL_TAGS):
        unknown = set(tags) - set(ALL_TAGS)
        if unknown:
            raise ValueError(f"unknown tags {sorted(unknown)}; SGLang's tags are {ALL_TAGS}")
        self._released: Dict[str, bool] = {t: False for t in tags}
        self._in_flight = 0
        self._busy: Optional[str] = None
        self._weights_incomplete = False
        self._lock = threading.Lock()

    @property
    def tags(self) -> Tuple[str, ...]:
        """All tags this engine has, in SGLang's order."""
        return tuple(self._released)

    @property
    def released(self) -> Tuple[str, ...]:
        """Tags whose memory is released now."""
        with self._lock:
            return tuple(t for t, r in self._released.items() if r)

    @property
    def in_flight(self) -> int:
        """Number of requests running in the engine now (cancelled callers included until SGLang ends them)."""
        with self._lock:
            return self._in_flight

    @property
    def busy(self) -> Optional[str]:
        """``"release"``, ``"resume"`` or ``"sync"`` while one is in progress in the engine, else None."""
        with self._lock:
            return self._busy

    @property
    def weights_incomplete(self) -> bool:
        """True after a weight sync that sent bytes and did not complete: the engine's weights are mixed."""
        with self._lock:
            return self._weights_incomplete

    def is_released(self, tag: str) -> bool:
        """True when ``tag`` is released. Raises KeyError for a tag the engine does not have."""
        with self._lock:
            return self._released[tag]

    def _normalise(self, tags: Optional[Iterable[str]]) -> List[str]:
        tags = list(self._released) if tags is None else list(tags)
        if not tags:
            raise MemoryStateError("empty tag list: SGLang would treat it as 'all tags'; pass None for that")
        if len(set(tags)) != len(tags):
            raise MemoryStateError(f"duplicate tags in {tags}")
        unknown = [t for t in tags if t not in self._released]
        if unknown:
            raise MemoryStateError(f"unknown tags {unknown}; this engine has {list(self._released)}")
        return tags

    def _check_not_busy(self, what: str) -> None:
        if self._busy is not None:
            raise MemoryStateError(f"cannot {what}: a {self._busy} is in progress in the engine")

    def begin_release(self, tags: Optional[Iterable[str]] = None) -> List[str]:
        """Admit a release of ``tags`` (None: all) and mark a release in progress; return the tags.

        Raises:
            MemoryStateError: a tag is already released, unknown or repeated, requests are running
                (SGLang asserts ``is_fully_idle()``), or another release/resume/sync is in progress.
        """
        with self._lock:
            tags = self._normalise(tags)
            self._check_not_busy(f"release {tags}")
            if self._in_flight:
                raise MemoryStateError(
                    f"cannot release {tags} while {self._in_flight} request(s) run; SGLang asserts the "
                    "scheduler is idle and dies otherwise"
                )
            already = [t for t in tags if self._released[t]]
            if already:
                raise MemoryStateError(
                    f"tags {already} are already released; releasing again would make torch-memory-saver exit(1)"
                )
            self._busy = "release"
            return tags

    def begin_resume(self, tags: Optional[Iterable[str]] = None) -> List[str]:
        """Admit a resume of ``tags`` (None: all) and mark a resume in progress; return the tags.

        Raises:
            MemoryStateError: a tag is resident, unknown or repeated, or another
                release/resume/sync is in progress.
        """
        with self._lock:
            tags = self._normalise(tags)
            self._check_not_busy(f"resume {tags}")
            resident = [t for t in tags if not self._released[t]]
            if resident:
                raise MemoryStateError(
                    f"tags {resident} are resident; resuming them would raise KeyError in SGLang's scheduler"
                )
            self._busy = "resume"
            return tags

    def commit(self, tags: Iterable[str], released: bool) -> None:
        """Record that the engine released (``released=True``) or resumed ``tags``; ends the operation."""
        with self._lock:
            for t in tags:
                self._released[t] = released
            self._busy = None

    def cancel(self) -> None:
        """End an admitted release/resume/sync that never reached the engine (state unchanged)."""
        with self._lock:
            self._busy = None

    def begin_sync(self) -> None:
        """Admit a weight sync: weights resident, no request running, nothing else in progress.

        From here until :meth:`end_sync` no generate is admitted, so none sees half-new weights.

        Raises:
            MemoryStateError: the weights are released, requests run, or another operation is in progress.
        """
        with self._lock:
            self._check_not_busy("start a weight sync")
            if self._released.get("weights"):
                raise MemoryStateError("weights are released: resume 'weights' before loading new weights")
            if self._in_flight:
                raise MemoryStateError(
                    f"cannot start a weight sync while {self._in_flight} request(s) run: they would see half-new "
                    "weights; wait for them or abort them first"
                )
            self._busy = "sync"

    def sync_sent(self) -> None:
        """Record that a sync's first bytes reached the engine: its weights are mixed until :meth:`end_sync`."""
        with self._lock:
            self._weights_incomplete = True

    def end_sync(self, complete: bool) -> None:
        """End the weight sync; ``complete`` True when every bucket loaded (the weights are whole again)."""
        with self._lock:
            if complete:
                self._weights_incomplete = False
            self._busy = None

    def admit_request(self) -> None:
        """Count one request as running; refuse it when the engine cannot serve it now.

        Raises:
            MemoryStateError: a tag is released (the engine would read freed memory), a
                release/resume/sync is in progress, or the last weight sync did not complete.
        """
        with self._lock:
            released = [t for t, r in self._released.items() if r]
            if released:
                raise MemoryStateError(f"engine is asleep (released: {released}); wake it up before generating")
            if self._busy is not None:
                raise MemoryStateError(f"cannot generate while a {self._busy} is in progress")
            if self._weights_incomplete:
                raise MemoryStateError(
                    "the last weight sync did not complete and the engine's weights are mixed; sync again before generating"
                )
            self._in_flight += 1

    def request_done(self) -> None:
        """Count one request as ended (called when SGLang has finished or aborted it)."""
        with self._lock:
            self._in_flight -= 1


def device_memory(device: Optional[int] = None) -> Tuple[int, int]:
    """(free, total) bytes of the whole device, as the driver reports them (all processes).

    Returns (0, 0) when CUDA is not available.
    """
    if not torch.cuda.is_available():
        return 0, 0
    return torch.cuda.mem_get_info(device)


def aggressive_empty_cache(
    max_rounds: int = 3, min_freed_bytes: int = GiB, device: Optional[int] = None
) -> List[int]:
    """Return cached memory to the driver: up to ``max_rounds`` rounds of gc, empty_cache, synchronize.

    Stops after the first round that frees less than ``min_freed_bytes`` (default 1 GiB) of device
    memory, as read from the driver. Also collects CUDA IPC blocks that receivers have closed
    (``torch.cuda.ipc_collect``). Without CUDA it only runs ``gc.collect()`` once.

    Returns:
        bytes freed by each round that ran (device-wide free memory after minus before).
    """
    freed: List[int] = []
    if not torch.cuda.is_available():
        gc.collect()
        return freed
    for _ in range(max_rounds):
        before, _total = device_memory(device)
        gc.collect()
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        after, _total = device_memory(device)
        freed.append(after - before)
        if after - before < min_freed_bytes:
            break
    return freed


@dataclass
class MemoryRecord:
    """One point of the memory timeline.

    Attributes:
        phase: what just happened, e.g. ``"sleep"``, ``"resume_weights"``.
        wall_s: seconds since the timeline began (``time.perf_counter``).
        free_bytes: free device memory, all processes (driver's view).
        used_bytes: total minus free device memory.
        peak_allocated_bytes: this process's torch peak allocation since the previous record.
    """

    phase: str
    wall_s: float
    free_bytes: int
    used_bytes: int
    peak_allocated_bytes: int


class MemoryTimeline:
    """Device memory after each phase of the rollout worker.

    Args:
        device: CUDA device index; None for the current one.
        clock: time source in seconds (``time.perf_counter``); tests pass their own.
        meminfo: ``() -> (free, total)`` in bytes; defaults to :func:`device_memory`.
    """

    def __init__(
        self,
        device: Optional[int] = None,
        clock: Callable[[], float] = time.perf_counter,
        meminfo: Optional[Callable[[], Tuple[int, int]]] = None,
    ):
        self._device = device
        self._clock = clock
        self._meminfo = meminfo or (lambda: device_memory(device))
        self._t0 = clock()
        self.records: List[MemoryRecord] = []

    def record(self, phase: str) -> MemoryRecord:
        """Append and return a record for ``phase``."""
        free, total = self._meminfo()
        peak = 0
        if torch.cuda.is_available():
            peak = torch.cuda.max_memory_allocated(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
        rec = MemoryRecord(phase, self._clock() - self._t0, free, total - free, peak)
        self.records.append(rec)
        return rec

    def to_dicts(self) -> List[dict]:
        """The records as plain dicts (JSON-ready)."""
        return [asdict(r) for r in self.records]

    def save(self, path: str) -> None:
        """Write the records to ``path`` as a JSON list."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dicts(), f, indent=1)
