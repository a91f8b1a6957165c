"""One weight sync, whoever drives it: begin -> bucket rounds -> finish.

* **begin**: the engine fences off generates (``begin_sync`` / the server's ``begin_weight_sync``);
* **a round**: every TP rank's sender makes its next bucket's payload (None when it has no more), the
  round is checked (:func:`check_round`), the engine loads the payloads (one per TP rank), and the
  senders drop the buffers the engine has read;
* **finish**: the engine ends the fence, complete or not (``end_sync`` / ``finish_weight_sync(ok)``).

The same rules hold in-process (:class:`~sgl_rollout.worker.RolloutWorker`), across Ray actors
(:func:`sgl_rollout.server.sync_weights_from_workers`) and in verl's trainer workers
(:mod:`sgl_rollout.integrations.verl_weight_sync`, which pipelines the rounds: the engine loads bucket k while
the ranks make bucket k+1):

* every rank must run out of buckets in the same round; ranks that disagree fail the sync;
* a failure on any rank, or in the engine, fails the sync on every rank;
* finish runs on every exit, and a buffer is dropped only after the load that reads it has answered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ..twin import Step, run_async, run_sync


@dataclass
class SyncStats:
    """Figures of one weight sync.

    Attributes:
        n_tensors: tensors sent.
        n_buckets: buckets sent.
        bytes: bytes of tensor data sent (no padding).
        seconds: wall time of the whole sync, flush included.
        max_bucket_bytes: largest flat buffer allocated, padding included (the sender's extra peak).
    """

    n_tensors: int = 0
    n_buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0
    max_bucket_bytes: int = 0

    def add(self, flat) -> int:
        """Count one sent :class:`~.bucket.FlatBucket`; returns its tensor bytes (no padding)."""
        nbytes = sum(m.end_idx - m.start_idx for m in flat.metadata)
        self.n_buckets += 1
        self.n_tensors += len(flat.metadata)
        self.bytes += nbytes
        self.max_bucket_bytes = max(self.max_bucket_bytes, flat.nbytes)
        return nbytes

    @property
    def gb_per_s(self) -> float:
        """Throughput in GB/s (1e9 bytes), 0 when nothing was timed."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class RoundError(RuntimeError):
    """A bucket round failed: a rank or the engine reported an error, or the ranks disagree on whether
    buckets are left. The message names the bucket and the ranks."""


def check_round(payloads: Sequence[Any], bucket: int, errors: Sequence[str] = ()) -> bool:
    """The rule every driver applies to a round, the same on every rank.

    Args:
        payloads: each TP rank's payload of bucket ``bucket``, in rank order; None: that rank has no
            more buckets.
        bucket: the round's index (0-based), for the message.
        errors: what failed in this round (a rank's ``"TP rank r: ..."``, the engine's refusal).

    Returns:
        True when every rank is done (the sync ends); False when every rank has a bucket to load.

    Raises:
        RoundError: ``errors`` is not empty, or some ranks are done and others are not.
    """
    if errors:
        raise RoundError(f"bucket {bucket} failed: " + "; ".join(errors))
    done = [p is None for p in payloads]
    if all(done):
        return True
    if any(done):
        raise RoundError(f"TP ranks ran out of buckets at different times (bucket {bucket}: done={done})")
    return False


@dataclass
class Round:
    """What a round gathered, for drivers whose ranks report failures in the round itself (each rank
    must take part in every collective, so a failing rank sends its error instead of a payload).

    Attributes:
        payloads: each TP rank's payload (None: done), in rank order.
        errors: what failed in this round, one line each (``"TP rank 1: ..."``, the engine's refusal).
        error: this process's own exception behind one of ``errors``, raised in place of the
            :class:`RoundError` so the caller sees the original.
    """

    payloads: Sequence[Any]
    errors: Sequence[str] = ()
    error: Optional[BaseException] = None


def _bucket_rounds(begin: Callable[[], Any], next_round: Callable[[int], Any],
                   load: Callable[[Sequence[Any], int], Any], finish: Callable[[bool], Any],
                   release: Optional[Callable[[int], Any]] = None):
    """The body of :func:`bucket_rounds` (:mod:`sgl_rollout.twin`)."""
    yield Step.call(begin)
    ok, n = False, 0
    try:
        while True:
            got = yield Step.call(next_round, n)
            rnd = got if isinstance(got, Round) else Round(got)
            try:
                try:
                    if check_round(rnd.payloads, n, rnd.errors):
                        break
                except RoundError as exc:
                    raise rnd.error or exc
                yield Step.call(load, rnd.payloads, n)
            finally:
                if release is not None:
                    yield Step.call(release, n)
            n += 1
        ok = True
    finally:
        yield Step.call(finish, ok)
    return n


def bucket_rounds(begin: Callable[[], Any], next_round: Callable[[int], Sequence[Any]],
                  load: Callable[[Sequence[Any], int], Any], finish: Callable[[bool], Any],
                  release: Optional[Callable[[int], Any]] = None) -> int:
    """Run one weight sync: ``begin()``, then rounds until every rank is done, then ``finish(ok)``.

    Args:
        begin: fence the engine off for the sync.
        next_round: ``(bucket) -> payloads``, one per TP rank in rank order, None for a rank with no
            more buckets (:func:`check_round`'s input); or a :class:`Round` with the round's failures.
        load: ``(payloads, bucket)``: the engine loads them; returns when it has answered.
        finish: ``(ok)``: end the engine's fence; runs on every exit, after the last release.
        release: ``(bucket)``: drop the buffers of the round's payloads; runs after the load answered
            (or failed), also in the round that ends the sync.

    Returns:
        the number of buckets loaded.

    Raises:
        RoundError: the ranks disagree on the bucket count.
        whatever a callable raises; ``finish(False)`` has run.
    """
    return run_sync(_bucket_rounds(begin, next_round, load, finish, release))


async def async_bucket_rounds(begin, next_round, load, finish, release=None) -> int:
    """:func:`bucket_rounds` from inside an event loop; each callable may be a coroutine function."""
    return await run_async(_bucket_rounds(begin, next_round, load, finish, release))
