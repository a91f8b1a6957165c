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
    """An invalid release/resume call, refused before it reached the engine."""


class MemoryState:
    """Which tags are resident, and how many requests are running; refuses invalid transitions.

    Args:
        tags: the tags the engine has; ``cuda_graph`` is absent when CUDA graphs are off.

    Thread-safe: generation threads call :meth:`request` while another thread may release.
    """

    def __init__(self, tags: Sequence[str] = ALL_TAGS):
        unknown = set(tags) - set(ALL_TAGS)
        if unknown:
            raise ValueError(f"unknown tags {sorted(unknown)}; SGLang's tags are {ALL_TAGS}")
        self._released: Dict[str, bool] = {t: False for t in tags}
        self._in_flight = 0
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
        """Number of requests running now."""
        with self._lock:
            return self._in_flight

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

    def begin_release(self, tags: Optional[Iterable[str]] = None) -> List[str]:
        """Check that ``tags`` (None: all) may be released now; return them as a list.

        Raises:
            MemoryStateError: a tag is already released, unknown or repeated, or requests are running.
        """
        with self._lock:
            tags = self._normalise(tags)
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
            return tags

    def begin_resume(self, tags: Optional[Iterable[str]] = None) -> List[str]:
        """Check that ``tags`` (None: all) may be resumed now; return them as a list.

        Raises:
            MemoryStateError: a tag is resident, unknown or repeated.
        """
        with self._lock:
            tags = self._normalise(tags)
            resident = [t for t in tags if not self._released[t]]
            if resident:
                raise MemoryStateError(
                    f"tags {resident} are resident; resuming them would raise KeyError in SGLang's scheduler"
                )
            return tags

    def commit(self, tags: Iterable[str], released: bool) -> None:
        """Record that the engine released (``released=True``) or resumed ``tags``."""
        with self._lock:
            for t in tags:
                self._released[t] = released

    def request(self) -> "_InFlight":
        """Context manager counting one running request; refuses to start if any tag is released.

        Raises:
            MemoryStateError: on entry, when a tag is released (the engine would read freed memory).
        """
        return _InFlight(self)


class _InFlight:
    def __init__(self, state: MemoryState):
        self._state = state

    def __enter__(self) -> None:
        s = self._state
        with s._lock:
            released = [t for t, r in s._released.items() if r]
            if released:
                raise MemoryStateError(f"engine is asleep (released: {released}); wake it up before generating")
            s._in_flight += 1

    def __exit__(self, *exc) -> None:
        with self._state._lock:
            self._state._in_flight -= 1


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
