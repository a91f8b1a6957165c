"""The train-to-rollout switch of one replica: release by sleep level, stage -> tags, the staged wake, phase timing.

Every caller that moves a replica's memory goes through :class:`Switch` (the in-process worker, the Ray
server, verl's server and trainer-side rollout, the LoRA path); none of them lists tags or orders the
stages itself.

Stages and their tags (torch-memory-saver regions SGLang tags, ``sglang/srt/constants.py``):

* ``weights``: ``("weights",)``;
* ``kv_cache``: ``("kv_cache", "cuda_graph")`` (CUDA-graph memory is tagged only with
  ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1``, which the engine sets; an engine without CUDA graphs has no
  ``cuda_graph`` tag).

Sleep levels (verl's ``free_cache_engine`` and ``sleep_level``, as verl's SGLang rollout maps them):
level 1 releases the ``kv_cache`` stage, level 2 also ``weights``; ``free_cache_engine=False`` releases
nothing.

The staged wake, in this order (SGLang's RL team's multi-stage wake-up; verl's ``ServerAdapter.resume``
with ``tags=["weights"]`` then ``tags=["kv_cache"]``):

1. resume ``weights`` (if released), the caller's ``while_resuming`` work running meanwhile in this process
   (the fast path gathers its first bucket there, overlapping SGLang's resume);
2. the caller's hooks, each timed as a phase: the weight sync (``sync``), the trainer's offload
   (``offload_trainer``), anything else the caller names;
3. ``aggressive_empty_cache()``, so the trainer's freed blocks go back to the driver, unless the device
   already has room for what step 4 takes back (below);
4. resume the ``kv_cache`` stage.

The empty-cache step skipped: ``torch.cuda.empty_cache`` hands every cached block of this process back,
the trainer's activations included, which its next step then allocates again (3.6-11.9 ms of a 16 ms sync
of SmolLM2 under TRL on one H200, ``examples/trl/``). Where this process has a CUDA context (a trainer
in the same process: TRL, the in-process worker) a sleep measures the device memory its release freed,
and the wake the part its ``weights`` stage took back; when the device's free memory before step 4
covers the rest (the KV cache and CUDA graphs) with :data:`EMPTY_CACHE_MARGIN_BYTES` to spare, step 3
is skipped (``last_empty_cache["skipped"]``). Elsewhere (no context, a release not measured, or
``RolloutConfig(empty_cache="always")``) it runs.

At no point do the trainer's parameters and the engine's KV cache sit on the GPU together, which is what
lets the KV cache take a large memory fraction without an OOM at the switch.

Each call is written once (:mod:`sgl_rollout.twin`): ``wake`` blocks, ``async_wake`` is awaited (a Ray
actor's loop); hooks may be plain functions or coroutines.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .memory import (CUDA_GRAPH, KV_CACHE, WEIGHTS, GiB, MemoryTimeline, aggressive_empty_cache, device_memory,
                     has_cuda_context)
from .twin import Step, twin

#: Stage -> the tags it moves, in SGLang's order. The only place these lists are written.
STAGES: Dict[str, Tuple[str, ...]] = {WEIGHTS: (WEIGHTS,), KV_CACHE: (KV_CACHE, CUDA_GRAPH)}
#: The order a wake resumes the stages in.
WAKE_ORDER: Tuple[str, ...] = (WEIGHTS, KV_CACHE)

Hook = Tuple[str, Callable[[], Any]]

#: Free device memory (bytes) a wake must have beyond what its ``kv_cache`` stage takes back to skip the
#: empty-cache step: room for measurement noise and for what SGLang's first requests allocate outside its
#: tagged regions.
EMPTY_CACHE_MARGIN_BYTES = 2 * GiB


def free_bytes_here() -> Optional[int]:
    """Free memory of this process's current device (bytes, the driver's view: every process), or None
    where this process has no CUDA context (:func:`~sgl_rollout.memory.has_cuda_context`; none is made):
    then nothing of its own is cached, and the empty-cache step costs next to nothing."""
    return int(device_memory()[0]) if has_cuda_context() else None


def stage_tags(stage: str, engine_tags: Optional[Iterable[str]] = None) -> List[str]:
    """The tags of ``stage`` (``"weights"`` or ``"kv_cache"``), kept to those the engine has.

    Raises:
        ValueError: unknown stage.
    """
    tags = STAGES.get(stage)
    if tags is None:
        raise ValueError(f"unknown stage {stage!r}; use one of {list(STAGES)}")
    have = None if engine_tags is None else set(engine_tags)
    return [t for t in tags if have is None or t in have]


def stages_of(tags: Optional[Iterable[str]]) -> List[str]:
    """The stages, in wake order, that ``tags`` touch (None: every stage); verl's adapter passes tags
    (``["weights"]``, ``["kv_cache"]``, ``["kv_cache", "cuda_graph"]``).

    Raises:
        ValueError: a tag no stage has.
    """
    if tags is None:
        return list(WAKE_ORDER)
    tags = list(tags)
    unknown = [t for t in tags if not any(t in STAGES[s] for s in STAGES)]
    if unknown:
        raise ValueError(f"unknown tags {unknown}; SGLang's tags are {[t for s in WAKE_ORDER for t in STAGES[s]]}")
    return [s for s in WAKE_ORDER if any(t in STAGES[s] for t in tags)]


def sleep_tags(engine_tags: Iterable[str], sleep_level: int) -> List[str]:
    """The tags a sleep at ``sleep_level`` releases, of those the engine has: level 1 the ``kv_cache``
    stage, level 2 the ``weights`` too (weights first).

    Raises:
        ValueError: a level other than 1 or 2.
    """
    if sleep_level not in (1, 2):
        raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level!r}")
    stages = WAKE_ORDER if sleep_level == 2 else (KV_CACHE,)
    return [t for s in stages for t in stage_tags(s, engine_tags)]


def sleep_releases(stage: str, free_cache_engine: bool, sleep_level: int) -> bool:
    """Whether a sleep with verl's ``free_cache_engine`` and ``sleep_level`` releases ``stage``: never
    without ``free_cache_engine``; ``kv_cache`` at levels 1 and 2, ``weights`` at level 2 (:func:`sleep_tags`).

    Raises:
        ValueError: a level other than 1 or 2, or an unknown stage.
    """
    return bool(sleep_tags(stage_tags(stage), sleep_level)) and bool(free_cache_engine)


def sleep_stages(config) -> List[str]:
    """The stages a sleep releases under ``config`` (its ``free_cache_engine`` and ``sleep_level``), in wake
    order: ``[]`` without ``free_cache_engine``, ``["kv_cache"]`` at level 1, ``["weights", "kv_cache"]``
    at level 2 (:func:`sleep_releases`). Every caller that decides whether to sleep or wake asks this.

    Raises:
        ValueError: a level other than 1 or 2.
    """
    return [s for s in WAKE_ORDER if sleep_releases(s, config.free_cache_engine, config.sleep_level)]


class Switch:
    """The memory states of one replica's engine, moved in stages and timed.

    Args:
        engine: the :class:`~sgl_rollout.engine.RolloutEngine` (its ``release`` / ``resume`` twins,
            ``settle`` and memory state are used).
        config: the rollout settings (``free_cache_engine``, ``sleep_level``).
        timeline: where each phase's device memory is recorded; None: nothing recorded (a host with
            no CUDA context of its own, such as the Ray server, has only NVML's figure to pay for).
        free_bytes: ``() -> bytes or None``, the device's free memory where the empty-cache step could
            be skipped (:func:`free_bytes_here`, the default); None, or a reader answering None: never skipped.
        empty_cache_margin_bytes: :data:`EMPTY_CACHE_MARGIN_BYTES` unless given.

    Attributes:
        last_phase_seconds: seconds of each phase of the last sleep or wake (``sleep``,
            ``resume_weights``, each hook's name, ``empty_cache`` and its parts ``empty_cache.*``,
            ``resume_kv_cache``, ``switch_total``); callers add their own sub-phases.
        last_empty_cache: the last wake's :class:`~sgl_rollout.memory.EmptyCacheResult` as a dict, or where
            the step was skipped ``{"skipped": True, "free_bytes", "needed_bytes", "margin_bytes"}``.
        last_resumed: the tags the last wake resumed, in order.
    """

    def __init__(self, engine, config, timeline: Optional[MemoryTimeline] = None,
                 free_bytes: Optional[Callable[[], Optional[int]]] = free_bytes_here,
                 empty_cache_margin_bytes: int = EMPTY_CACHE_MARGIN_BYTES):
        self.engine = engine
        self.config = config
        self.timeline = timeline
        self._free = free_bytes or (lambda: None)
        self.empty_cache_margin_bytes = int(empty_cache_margin_bytes)
        self._released_bytes: Optional[int] = None  # device memory the last sleep's release freed, if measured
        self.last_phase_seconds: Dict[str, float] = {}
        self.last_empty_cache: Dict = {}
        self.last_resumed: List[str] = []

    def phase(self, name: str, t0: float) -> float:
        """Record phase ``name`` as having run since ``t0`` (``time.perf_counter()`` seconds) and its
        device memory in the timeline; returns now (the next phase's ``t0``)."""
        now = time.perf_counter()
        self.last_phase_seconds[name] = now - t0
        if self.timeline is not None:
            self.timeline.record(name)
        return now

    def released_stages(self) -> List[str]:
        """The stages with any tag released now, in wake order."""
        released = set(self.engine.state.released)
        return [s for s in WAKE_ORDER if released & set(STAGES[s])]

    def _engine_step(self, call: str, *args) -> Step:
        """The step calling the engine's ``call`` (blocking face) or ``async_<call>`` (awaiting face)."""
        engine = self.engine
        return Step(lambda *a: getattr(engine, call)(*a), lambda *a: getattr(engine, "async_" + call)(*a), args)

    # ----------------------------------------------------------------- release
    def _sleep(self, before_release: Optional[Callable[[List[str]], Optional[str]]] = None):
        """Release per ``sleep_level``; nothing when ``free_cache_engine`` is False (phase ``sleep``).

        Args:
            before_release: ``(tags) -> phase name or None``, called with the tags about to go, before
                they go (the fast path frees its sync buffers there when the weights go); a name
                records it as a phase.

        Returns:
            the tags released.

        Raises:
            MemoryStateError: already asleep, or requests are running; nothing was released.
            whatever ``before_release`` raises; nothing was released.
        """
        self.last_phase_seconds = {}
        if not sleep_stages(self.config):
            return []
        yield self._engine_step("settle")
        t0 = time.perf_counter()
        tags = sleep_tags(self.engine.tags, self.config.sleep_level)
        if before_release is not None:
            name = yield Step.call(before_release, tags)
            if name:
                t0 = self.phase(name, t0)
        self._released_bytes, before = None, self._free()
        tags = yield self._engine_step("release", tags)
        after = self._free() if before is not None else None
        self._released_bytes = None if after is None else after - before
        self.phase("sleep", t0)
        return tags

    sleep, async_sleep = twin(_sleep)

    def _release_stage(self, stage: str):
        """Release one stage, only what of it is resident (a stage with nothing resident is a no-op).

        Returns:
            the tags released.

        Raises:
            ValueError: unknown stage. MemoryStateError: as the engine's ``release``.
        """
        released = set(self.engine.state.released)
        tags = [t for t in stage_tags(stage, self.engine.tags) if t not in released]
        if not tags:
            return []
        self._released_bytes = None  # not measured: the next wake empties the cache
        return (yield self._engine_step("release", tags))

    release_stage, async_release_stage = twin(_release_stage)

    # ----------------------------------------------------------------- wake
    def _resume_stage(self, stage: str, meanwhile: Optional[Callable[[], Any]] = None):
        """Resume one stage of the staged wake, only what of it is released (phase ``resume_<stage>``;
        a stage with nothing released is a no-op and records nothing).

        Args:
            stage: ``"weights"`` or ``"kv_cache"``.
            meanwhile: run while SGLang resumes (the engine's ``resume``'s ``meanwhile``; the phase then spans
                both), or on its own when nothing of the stage is released.

        Returns:
            the tags resumed.

        Raises:
            ValueError: unknown stage. MemoryStateError: as the engine's ``resume``. Whatever ``meanwhile`` raised.
        """
        released = set(self.engine.state.released)
        tags = [t for t in stage_tags(stage, self.engine.tags) if t in released]
        if not tags:
            if meanwhile is not None:
                yield Step.call(meanwhile)
            return []
        t0 = time.perf_counter()
        tags = yield self._engine_step("resume", tags, *([meanwhile] if meanwhile is not None else []))
        self.phase(f"resume_{stage}", t0)
        return tags

    resume_stage, async_resume_stage = twin(_resume_stage)

    def _wake(self, hooks: Sequence[Hook] = (), empty_cache: bool = True, weights_undefined: bool = False,
              after_stage: Optional[Callable[[str, List[str]], Any]] = None,
              while_resuming: Optional[Callable[[], Optional[int]]] = None):
        """The staged wake: resume ``weights`` -> each hook -> empty cache -> resume ``kv_cache``.

        Works asleep or awake: stages with nothing released are skipped, so with
        ``free_cache_engine=False`` only the hooks run.

        Args:
            hooks: ``(phase name, fn)`` pairs run in order after the weights are back and before the
                cache is emptied (the weight sync, then the trainer's offload); ``fn()`` may return an
                awaitable (awaited by ``async_wake``). Each is timed as its phase.
            empty_cache: run :func:`~sgl_rollout.memory.aggressive_empty_cache` before the KV cache
                returns (phase ``empty_cache`` and its parts).
            weights_undefined: a sync follows, and released weights without a CPU backup come back
                undefined: mark them so (no generate admitted until a complete sync) *before* their
                resume, so a caller interrupted right after it cannot leave them looking whole.
            after_stage: ``(stage, tags resumed) -> None`` (or an awaitable), called after each stage
                that resumed anything (the Ray server records every node's device memory there).
            while_resuming: ``() -> bytes or None``, a plain function run while SGLang resumes the ``weights``
                stage (before the hooks when it is resident), so that work needing neither the engine nor
                its weights overlaps the resume: the fast path's first bucket gathered (:class:`RolloutWorker
                <sgl_rollout.worker.RolloutWorker>`). It returns the device memory (bytes) it took on this
                process's device, so the empty-cache step's reading of what the weights took back stays
                true; None counts as 0. Phase ``resume_weights`` spans both. It must not call the engine.

        Returns:
            ``{phase name: hook's return value}`` of the hooks; :attr:`last_resumed` holds the tags
            resumed, in order.

        Raises:
            MemoryStateError: requests run, or another operation is in progress.
            whatever a hook raises: the later stages do not run (the KV cache stays released).
        """
        results: Dict[str, Any] = {}
        self.last_phase_seconds = {}
        yield self._engine_step("settle")
        t_start = time.perf_counter()
        if weights_undefined and WEIGHTS in self.released_stages() and not self.config.enable_weights_cpu_backup:
            self.engine.state.sync_sent()
        released_bytes, self._released_bytes = self._released_bytes, None
        before = self._free() if released_bytes is not None else None
        took = [0]  # device memory while_resuming took (it is not the weights')

        def overlap() -> None:
            took[0] = while_resuming() or 0

        self.last_resumed = yield from self._resume_stage(WEIGHTS, None if while_resuming is None else overlap)
        # what the KV-cache stage takes back: the sleep's release less what the weights took back
        still_released = (None if before is None else
                          released_bytes - (before - self._free() - took[0] if self.last_resumed else 0))
        if after_stage is not None and self.last_resumed:
            yield Step.call(after_stage, WEIGHTS, list(self.last_resumed))
        t0 = time.perf_counter()
        for name, fn in hooks:
            results[name] = yield Step.call(fn)
            t0 = self.phase(name, t0)
        if empty_cache:
            free = None if still_released is None else self._free()
            if (self.config.empty_cache == "auto" and free is not None
                    and free >= still_released + self.empty_cache_margin_bytes):
                self.last_empty_cache = {"skipped": True, "free_bytes": free, "needed_bytes": still_released,
                                         "margin_bytes": self.empty_cache_margin_bytes}
                self.phase("empty_cache", t0)
            else:
                ec = aggressive_empty_cache()
                self.phase("empty_cache", t0)
                self.last_phase_seconds.update(ec.phase_seconds())  # empty_cache.gc / .empty_cache / ...
                self.last_empty_cache = ec.to_dict()
        kv = yield from self._resume_stage(KV_CACHE)
        self.last_resumed = self.last_resumed + kv
        if after_stage is not None and kv:
            yield Step.call(after_stage, KV_CACHE, list(kv))
        self.last_phase_seconds["switch_total"] = time.perf_counter() - t_start
        return results

    wake, async_wake = twin(_wake)
