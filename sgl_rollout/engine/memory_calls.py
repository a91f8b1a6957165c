"""The engine's memory calls: release and resume of tagged regions, and the prefix-cache flush.

Each is checked against :class:`~sgl_rollout.memory.MemoryState` before SGLang sees it (a release of a
released tag, a resume of a resident one or a release while requests run is refused: in SGLang 0.5.10 each
of them kills the scheduler), and the state changes when SGLang *answers*, whatever became of the caller.
Which tags a sleep level releases and in which order a wake resumes them is :mod:`sgl_rollout.switch`'s.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, List, Optional, Sequence

from ..memory import KV_CACHE, WEIGHTS
from ..twin import Step, twin
from . import io_struct
from .core import EngineCore, sigint_deferred


class MemoryCalls:
    """``release`` / ``resume`` (and their ``async_`` faces) and ``flush_cache`` on :class:`~.core.EngineCore`."""

    def _op_done(self: EngineCore, op: str, tags: Optional[List[str]] = None, released: Optional[bool] = None):
        generation, state = self._generation, self.state

        def on_done(exc: Optional[BaseException]) -> None:
            if exc is None:
                state.commit(tags or [], released=bool(released))
                if released and WEIGHTS in (tags or []) and generation == self._generation:
                    self._weights_released_since_sync = True
            else:  # the outcome is unknown: never guess; the engine is unusable until restart()
                self._mark_dead(f"{op} {tags} failed in SGLang: {exc!r}", generation)
        return on_done

    def _start_op(self: EngineCore, op: str, tags: List[str], released: bool) -> concurrent.futures.Future:
        cls = "ReleaseMemoryOccupationReqInput" if released else "ResumeMemoryOccupationReqInput"
        with sigint_deferred():  # sent and recorded, or neither
            try:
                call = getattr(self._tm(), "release_memory_occupation" if released else "resume_memory_occupation")
                req = io_struct.make(cls, tags=tags)
                fut = self._submit(lambda: call(req, None), self._op_done(op, tags, released))
            except BaseException:
                self.state.cancel()
                raise
            self._last_op = fut
        return fut

    def _memory_op(self, op: str, tags: Optional[Sequence[str]], meanwhile: Optional[Callable[[], Any]] = None):
        """The body of a release (``op="release"``) or a resume: settle, check and claim the transition,
        send it, run ``meanwhile()`` (if given) while SGLang works, wait for SGLang's answer (which commits it)."""
        yield from self._settle()
        released = op == "release"
        tags = self.state.begin_release(tags) if released else self.state.begin_resume(tags)
        fut = self._start_op(op, tags, released=released)
        error: Optional[Exception] = None
        if meanwhile is not None:
            try:
                yield Step.call(meanwhile)
            except Exception as exc:  # noqa: BLE001 - raised once SGLang has answered (the state is then known)
                error = exc
        yield self.waiting(fut)
        if error is not None:
            raise error
        return tags

    def _release(self, tags: Optional[Sequence[str]] = None):
        """Release the memory of ``tags`` (None: all of this engine's tags).

        Returns:
            the tags released.

        Raises:
            MemoryStateError: a tag is already released or unknown, requests run, or another
                operation is in progress. Nothing reaches the engine then, so it keeps serving.
            EngineDeadError, EngineClosedError: as every call.
        """
        return (yield from self._memory_op("release", tags))

    release, async_release = twin(_release, before_sync=EngineCore._check_not_on_loop)

    def _resume(self, tags: Optional[Sequence[str]] = None, meanwhile: Optional[Callable[[], Any]] = None):
        """Resume the memory of ``tags`` (None: all of this engine's tags).

        Args:
            tags: the tags to resume.
            meanwhile: ``() -> None`` (or an awaitable, in the awaiting face), run in this process after the
                resume is sent and before its answer is awaited, so its time overlaps SGLang's (the weight
                sync gathers its first bucket there: :meth:`sgl_rollout.switch.Switch.wake`'s
                ``while_resuming``). It must not call this engine (the resume is in progress). Its error is
                raised after SGLang has answered, so the state is known whatever it raised.

        Returns:
            the tags resumed.

        Raises:
            MemoryStateError: a tag is resident or unknown, or another operation is in progress.
                Nothing reaches the engine then.
            EngineDeadError, EngineClosedError: as every call.
            whatever ``meanwhile`` raised (an ``Exception``), the resume done.
        """
        return (yield from self._memory_op("resume", tags, meanwhile))

    resume, async_resume = twin(_resume, before_sync=EngineCore._check_not_on_loop)

    def _flush_cache(self):
        """Drop SGLang's prefix (radix) cache, stale after new weights.

        Skipped while the KV cache is released: SGLang flushed it when it released the KV cache.
        """
        if not self.state.is_released(KV_CACHE):
            yield self.waiting(self._submit(lambda: self._tm().flush_cache()))

    flush_cache, async_flush_cache = twin(_flush_cache, before_sync=EngineCore._check_not_on_loop)
