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
import os
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
            if any(self._released.values()):
                released = [t for t, r in self._released.items() if r]
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


def has_cuda_context(device: Optional[int] = None) -> bool:
    """True when this process has a CUDA context on ``device`` (None: the current device) already.

    ``torch.cuda.is_initialized()`` is not enough: importing SGLang initializes torch's CUDA state in
    every process that imports it (``sgl_kernel`` asks for the current device, which creates no context),
    while the first ``torch.cuda.mem_get_info`` creates a context. Asks torch's
    ``_cuda_hasPrimaryContext``, which creates nothing; a torch build without it answers True.
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    probe = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if probe is None:
        return True
    return bool(probe(torch.cuda.current_device() if device is None else int(device)))


def reserved_bytes(device: Optional[int] = None) -> int:
    """torch's reserved CUDA memory on ``device`` (``torch.cuda.memory_reserved``), in bytes; 0 where this
    process has no CUDA context (:func:`has_cuda_context`: none is made by asking)."""
    return int(torch.cuda.memory_reserved(device)) if has_cuda_context(device) else 0


def release_cached_blocks(device: Optional[int] = None, grown_since: Optional[int] = None) -> bool:
    """``torch.cuda.empty_cache()`` where this process has a CUDA context (:func:`has_cuda_context`; none: a
    CPU test, or a worker that never touched the GPU, is not made to create one). The light form of
    :func:`aggressive_empty_cache`: no garbage collection, one call, what verl's checkpoint engines do after a
    sync (``verl/checkpoint_engine/nccl_checkpoint_engine.py``, ``finalize``).

    Args:
        device: CUDA device index (None: the current one).
        grown_since: torch's reserved bytes (:func:`reserved_bytes`) at the start of the work whose blocks
            are to go back; the cache is emptied only when it is above that now. None: always.

    Returns:
        True when the cache was emptied.

    Why ``grown_since``: ``empty_cache`` frees every unused block, the trainer's cached activations
    included, and after a training step that is most of the GPU. On 4xH200 (one-step-off, 1.1B shape) the
    trainer's ``finalize`` took 210-250 ms in every sync after the first (verl's built-in and ours, the
    same), 14.9 ms in the first, and the step's training then allocated its blocks anew. A sync served from
    the cache training left (it grew nothing) has nothing of its own to give back.
    """
    if not has_cuda_context(device):
        return False
    if grown_since is not None and torch.cuda.memory_reserved(device) <= int(grown_since):
        return False
    torch.cuda.empty_cache()
    return True


def nvml_device_memory(device: Optional[int] = None, nvml=None) -> Tuple[int, int]:
    """(free, total) bytes of this process's CUDA device ``device`` (None: 0) from NVML, without
    initializing CUDA in this process.

    A process that only hosts the engine (SGLang's schedulers run elsewhere; the Ray server actor) would
    otherwise get a CUDA context of its own on that GPU from its first ``torch.cuda.mem_get_info``, held
    for the rest of the run, training included (``tests/gpu/test_host_cuda_gpu.py`` prints its size).
    The device is mapped to NVML through ``CUDA_VISIBLE_DEVICES`` (an index or a ``GPU-``/``MIG-`` UUID); NVML's free and total are the
    driver's, as ``mem_get_info``'s.

    Args:
        device: CUDA device index in this process (an index into ``CUDA_VISIBLE_DEVICES``).
        nvml: the ``pynvml`` module or a double; None imports ``pynvml``.

    Returns:
        ``(free, total)`` in bytes; ``(0, 0)`` where NVML cannot answer (no driver, no ``pynvml``, a
        device that is not visible).
    """
    index = 0 if device is None else int(device)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
        if visible is None:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        else:
            name = [v.strip() for v in visible.split(",") if v.strip()][index]
            handle = (nvml.nvmlDeviceGetHandleByIndex(int(name)) if name.isdigit()
                      else nvml.nvmlDeviceGetHandleByUUID(name))
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.free), int(info.total)
    except Exception:  # noqa: BLE001 - a timeline without figures beats a failed phase
        return 0, 0


def gpu_used_bytes(gpu_ids: Sequence[int], nvml=None) -> Dict[int, int]:
    """Device memory in use on each of ``gpu_ids`` (physical ids of this host), all processes, from NVML.

    A replica's report per node (:meth:`sgl_rollout.server.RolloutServer.memory_by_node`) is made of these:
    ``torch.cuda.mem_get_info`` sees only this process's current device, NVML every GPU of the host.

    Args:
        gpu_ids: NVML device indices (the physical ids ``CUDA_VISIBLE_DEVICES`` names).
        nvml: the ``pynvml`` module or a double; None imports ``pynvml``.

    Returns:
        ``{gpu_id: used_bytes}``; empty where NVML cannot be used (no driver, no ``pynvml``).
    """
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
        return {int(g): int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(int(g))).used)
                for g in gpu_ids}
    except Exception:  # noqa: BLE001 - a report without figures beats a failed sleep
        return {}


def freeze_long_lived(collect: bool = True) -> int:
    """Move every object alive now out of the garbage collector's reach (``gc.freeze()``), so later
    full collections traverse only what was created afterwards.

    When to call it: once start-up is done, i.e. after the engine started and the trainer's model
    (and ideally its optimizer) is built; the bulk of a trainer process's ~450k tracked objects are
    modules, classes and functions of torch, transformers, Ray, SGLang and verl, which live until
    the process ends. :func:`aggressive_empty_cache` runs a full ``gc.collect()``; with ~450k live
    objects that costs about 250 ms each time, after this call well under a millisecond when the
    training step frees its tensors by reference counting (``python tests/test_switch.py``
    measures it on CPU). Automatic collections during training get cheaper the same way.

    Cost: with ``collect`` (default) one full ``gc.collect()`` first, so that garbage alive now is
    freed rather than frozen (about 250 ms with ~450k unfrozen objects, once), and one pass over
    the unfrozen objects to count them; the freeze itself is a constant-time list splice. Called
    again with nothing new to freeze it takes well under a millisecond.

    Objects created later are still tracked and collected as usual, also those referenced from
    frozen objects. Calling it again is cheap and safe: it freezes what was created since (after
    collecting the unfrozen objects only), e.g. call it after the engine start and again after the
    first weight sync.

    Caveat: a frozen object that later becomes part of unreachable reference-cycle garbage is
    never collected (until ``gc.unfreeze()``); objects freed by reference counting, which is how
    tensors are normally freed, are not affected. So freeze long-lived state, not per-step data.

    Args:
        collect: run a full ``gc.collect()`` before freezing (default True).

    Returns:
        the number of objects this call froze.
    """
    if collect:
        gc.collect()
    n = len(gc.get_objects())  # the unfrozen tracked objects (gc.get_freeze_count() walks all frozen ones)
    gc.freeze()
    return n


@dataclass
class CacheRound:
    """One round of :func:`aggressive_empty_cache`.

    Attributes:
        freed_bytes: device-wide free memory after the round minus before (driver's view, bytes;
            may be negative when other processes allocated meanwhile).
        gc_generation: the generation ``gc.collect`` ran on (2: full collection), None when skipped.
        gc_unreachable: unreachable objects that collection found (``gc.collect``'s return).
        gc_freed_bytes: bytes of this process's caching allocator that collection freed (allocated
            before minus after, all devices; they go to the driver with ``empty_cache``).
        cached_bytes: bytes the caching allocator held unused before ``empty_cache``
            (reserved minus allocated, all devices).
        empty_cache_skipped: True when ``torch.cuda.empty_cache`` was not called (nothing cached,
            or the allocator unchanged since the previous round's call).
        gc_s: seconds in ``gc.collect``.
        ipc_collect_s: seconds in ``torch.cuda.ipc_collect``.
        empty_cache_s: seconds in ``torch.cuda.empty_cache``.
        synchronize_s: seconds in ``torch.cuda.synchronize``.
        meminfo_s: seconds reading memory figures (``mem_get_info``, allocator statistics).
    """

    freed_bytes: int = 0
    gc_generation: Optional[int] = None
    gc_unreachable: int = 0
    gc_freed_bytes: int = 0
    cached_bytes: int = 0
    empty_cache_skipped: bool = False
    gc_s: float = 0.0
    ipc_collect_s: float = 0.0
    empty_cache_s: float = 0.0
    synchronize_s: float = 0.0
    meminfo_s: float = 0.0


#: the timed parts of a round, in the order they run (attribute names of :class:`CacheRound`).
CACHE_PARTS: Tuple[str, ...] = ("gc_s", "ipc_collect_s", "empty_cache_s", "synchronize_s", "meminfo_s")


class EmptyCacheResult(List[int]):
    """What :func:`aggressive_empty_cache` did: a list of the bytes freed by each round that ran
    (what it returned before, so ``result == [3 * GiB, 0]`` and ``json.dumps(result)`` still work),
    plus per-round detail and timings.

    Attributes:
        rounds: one :class:`CacheRound` per round that ran.
        seconds: wall seconds of the whole call.
    """

    def __init__(self, rounds: Sequence[CacheRound] = (), seconds: float = 0.0, gc_s: float = 0.0):
        super().__init__(r.freed_bytes for r in rounds)
        self.rounds: List[CacheRound] = list(rounds)
        self.seconds = seconds
        self._extra_gc_s = gc_s  # the collection of the no-CUDA path, which has no rounds

    def part_seconds(self, part: str) -> float:
        """Seconds spent in ``part`` (one of :data:`CACHE_PARTS`) summed over the rounds."""
        extra = self._extra_gc_s if part == "gc_s" else 0.0
        return extra + sum(getattr(r, part) for r in self.rounds)

    def phase_seconds(self, prefix: str = "empty_cache.") -> Dict[str, float]:
        """Seconds per part summed over the rounds, keyed ``prefix + part`` without ``_s``
        (``empty_cache.gc``, ``empty_cache.ipc_collect``, ``empty_cache.empty_cache``,
        ``empty_cache.synchronize``, ``empty_cache.meminfo``), for a worker's phase table."""
        return {prefix + p[:-2]: self.part_seconds(p) for p in CACHE_PARTS}

    def to_dict(self) -> dict:
        """JSON-ready detail: total seconds, freed bytes and every round's fields."""
        return {"seconds": self.seconds, "freed_bytes": list(self), "rounds": [asdict(r) for r in self.rounds]}

    def __reduce__(self):  # pickles (Ray) as this class, with its detail
        return (_rebuild_result, (self.rounds, self.seconds, self._extra_gc_s))

    def __repr__(self) -> str:
        return f"EmptyCacheResult({list.__repr__(self)}, seconds={self.seconds:.6f})"


def _rebuild_result(rounds, seconds, gc_s):
    return EmptyCacheResult(rounds, seconds, gc_s)


def _allocator_bytes() -> Tuple[int, int]:
    """(allocated, reserved) bytes of this process's CUDA caching allocator, summed over devices.

    (0, 0) while CUDA is not initialised in this process (then no CUDA tensor exists).
    """
    allocated = reserved = 0
    for d in range(torch.cuda.device_count()):
        s = torch.cuda.memory_stats(d)
        allocated += s.get("allocated_bytes.all.current", 0)
        reserved += s.get("reserved_bytes.all.current", 0)
    return allocated, reserved


def aggressive_empty_cache(
    max_rounds: int = 3,
    min_freed_bytes: int = GiB,
    device: Optional[int] = None,
    collect: str = "auto",
) -> EmptyCacheResult:
    """Return cached memory to the driver: up to ``max_rounds`` rounds of gc, ipc_collect,
    empty_cache, synchronize.

    Stops after the first round that frees less than ``min_freed_bytes`` (default 1 GiB) of device
    memory, as read from the driver for ``device`` (None: the current one). Each round also collects
    CUDA IPC blocks that receivers have closed (``torch.cuda.ipc_collect``). Without CUDA it only
    runs ``gc.collect()`` once and returns no rounds.

    What a round skips (``collect="auto"``, the default), each only where it cannot free anything:

    * ``gc.collect()`` (a full collection, because dropped trainer tensors held in reference cycles
      have usually been promoted to the oldest generation during the step, where a young collection
      would not see them) is skipped when this process's caching allocator holds no live bytes on
      any device: then no Python object, garbage or not, holds CUDA memory it could give back. In
      rounds after the first it runs only when the previous round's collection freed CUDA memory
      (the finalisers it ran may have dropped more); otherwise collecting again could at most free
      CPU objects created since, which ``gc``'s own thresholds take care of.
    * ``torch.cuda.empty_cache()`` is skipped when the allocator caches nothing (reserved equals
      allocated, all devices) or is unchanged since the previous round's call.

    ``collect="always"`` runs the full collection in every round, as before. A full collection costs
    about 225-290 ms with ~430-450k live objects (torch, transformers, Ray, verl, a 135M model); after
    :func:`freeze_long_lived` it costs what the objects created since cost, typically well under a
    millisecond. Memory that is not this process's caching allocator's (e.g. a pluggable
    allocator outside torch's statistics) is not seen by the skip test: use ``collect="always"``
    there.

    Returns:
        :class:`EmptyCacheResult`: a list of the bytes freed by each round that ran (device-wide free
        memory after minus before), with ``.rounds`` (per-round seconds in gc, ipc_collect,
        empty_cache, synchronize and memory reads, and what was skipped) and ``.seconds``.
    """
    if collect not in ("auto", "always"):
        raise ValueError(f"collect must be 'auto' or 'always', not {collect!r}")
    clock = time.perf_counter
    t_start = clock()
    if not torch.cuda.is_available():
        gc.collect()
        seconds = clock() - t_start
        return EmptyCacheResult((), seconds, gc_s=seconds)
    rounds: List[CacheRound] = []
    repeat_gc = True  # round 1, or the last collection freed CUDA memory
    after_empty: Optional[Tuple[int, int]] = None  # allocator (allocated, reserved) after the last empty_cache
    r = CacheRound()

    def timed(part: str, fn: Callable, *args):  # fn(*args), its seconds added to the round's ``part``
        t = clock()
        out = fn(*args)
        setattr(r, part, getattr(r, part) + clock() - t)
        return out

    for _ in range(max_rounds):
        r = CacheRound()
        before, _total = timed("meminfo_s", device_memory, device)
        allocated, _reserved = timed("meminfo_s", _allocator_bytes)
        if collect == "always" or (allocated > 0 and repeat_gc):
            r.gc_generation = 2
            r.gc_unreachable = timed("gc_s", gc.collect, 2)
            r.gc_freed_bytes = allocated - timed("meminfo_s", _allocator_bytes)[0]
            repeat_gc = r.gc_freed_bytes > 0
        timed("ipc_collect_s", torch.cuda.ipc_collect)
        state = timed("meminfo_s", _allocator_bytes)
        r.cached_bytes = state[1] - state[0]
        r.empty_cache_skipped = r.cached_bytes <= 0 or state == after_empty
        if not r.empty_cache_skipped:
            timed("empty_cache_s", torch.cuda.empty_cache)
            after_empty = timed("meminfo_s", _allocator_bytes)
        timed("synchronize_s", torch.cuda.synchronize, device)
        after, _total = timed("meminfo_s", device_memory, device)
        r.freed_bytes = after - before
        rounds.append(r)
        if r.freed_bytes < min_freed_bytes:
            break
    return EmptyCacheResult(rounds, clock() - t_start)


@dataclass
class MemoryRecord:
    """One point of the memory timeline.

    Attributes:
        phase: what just happened, e.g. ``"sleep"``, ``"resume_weights"``.
        wall_s: seconds since the timeline began (``time.perf_counter``).
        free_bytes: free device memory, all processes (driver's view).
        used_bytes: total minus free device memory.
        peak_allocated_bytes: this process's torch peak allocation since the previous record; 0 in a
            process without a CUDA context (see :class:`MemoryTimeline`).
    """

    phase: str
    wall_s: float
    free_bytes: int
    used_bytes: int
    peak_allocated_bytes: int


class MemoryTimeline:
    """Device memory after each phase of the rollout worker.

    A record does not create a CUDA context in this process (:func:`has_cuda_context`): until something
    else has (a trainer in the same process), the figures come from NVML (:func:`nvml_device_memory`;
    torch's only where NVML cannot answer) and the torch peak is 0. The engine's memory lives in
    SGLang's scheduler processes, so a host without a context, such as the Ray server actor, has no
    torch peak to report and would only pay a context for one.

    Args:
        device: CUDA device index; None for the current one (NVML: device 0 of ``CUDA_VISIBLE_DEVICES``).
        clock: time source in seconds (``time.perf_counter``); tests pass their own.
        meminfo: ``() -> (free, total)`` in bytes; defaults to :func:`device_memory` once this process
            has a CUDA context, :func:`nvml_device_memory` before (and where NVML cannot answer,
            :func:`device_memory`).
    """

    def __init__(
        self,
        device: Optional[int] = None,
        clock: Callable[[], float] = time.perf_counter,
        meminfo: Optional[Callable[[], Tuple[int, int]]] = None,
    ):
        self._device = device
        self._clock = clock
        self._meminfo = meminfo or self._device_memory
        self._t0 = clock()
        self.records: List[MemoryRecord] = []

    def _device_memory(self) -> Tuple[int, int]:
        if not has_cuda_context(self._device):
            free, total = nvml_device_memory(self._device)
            if total:
                return free, total
        # a context here already, or no NVML (pynvml is one of SGLang's dependencies)
        return device_memory(self._device)

    def record(self, phase: str) -> MemoryRecord:
        """Append and return a record for ``phase``."""
        free, total = self._meminfo()
        peak = 0
        if has_cuda_context(self._device):
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
