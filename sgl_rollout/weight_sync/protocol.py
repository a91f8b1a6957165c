"""The bucket rounds of one weight sync, and the figures it reports.

A round: every TP rank's sender makes its next bucket's payload (None when it has no more), the round is
checked (:func:`check_round`), the engine loads the payloads (one per TP rank), and the senders drop the
buffers the engine has read. Every rank must run out of buckets in the same round; ranks that disagree
fail the sync. The fence around the rounds, the closing round and the rule by which TP ranks in several
processes agree on errors are :mod:`.driver`'s (:func:`~.driver.sync_fenced`), which every way in calls.
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
    """The TP ranks disagree on whether buckets are left; the message names the bucket."""


def check_round(payloads: Sequence[Any], bucket: int) -> bool:
    """The rule every driver applies to a round, the same on every rank.

    Args:
        payloads: each TP rank's payload of bucket ``bucket``, in rank order; None: that rank has no
            more buckets.
        bucket: the round's index (0-based), for the message.

    Returns:
        True when every rank is done (the sync ends); False when every rank has a bucket to load.

    Raises:
        RoundError: some ranks are done and others are not.
    """
    done = [p is None for p in payloads]
    if all(done):
        return True
    if any(done):
        raise RoundError(f"TP ranks ran out of buckets at different times (bucket {bucket}: done={done})")
    return False


def _bucket_rounds(next_round: Callable[[int], Any], load: Callable[[Sequence[Any], int], Any],
                   release: Optional[Callable[[int], Any]] = None):
    """The body of :func:`bucket_rounds` (:mod:`sgl_rollout.twin`)."""
    n = 0
    while True:
        payloads = yield Step.call(next_round, n)
        try:
            if check_round(payloads, n):
                break
            yield Step.call(load, payloads, n)
        finally:
            if release is not None:
                yield Step.call(release, n)
        n += 1
    return n


def bucket_rounds(next_round: Callable[[int], Sequence[Any]], load: Callable[[Sequence[Any], int], Any],
                  release: Optional[Callable[[int], Any]] = None) -> int:
    """Run the bucket rounds of one weight sync, inside the fence of :func:`~.driver.sync_fenced`.

    Args:
        next_round: ``(bucket) -> payloads``, one per TP rank in rank order, None for a rank with no
            more buckets (:func:`check_round`'s input).
        load: ``(payloads, bucket)``: the engine loads them; returns when it has answered.
        release: ``(bucket)``: drop the buffers of the round's payloads; runs after the load answered
            (or failed), also in the round that ends the sync.

    Returns:
        the number of buckets loaded.

    Raises:
        RoundError: the ranks disagree on the bucket count.
        whatever a callable raises.
    """
    return run_sync(_bucket_rounds(next_round, load, release))


async def async_bucket_rounds(next_round, load, release=None) -> int:
    """:func:`bucket_rounds` from inside an event loop; each callable may be a coroutine function."""
    return await run_async(_bucket_rounds(next_round, load, release))
