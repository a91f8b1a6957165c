"""The engine's weight calls: the sync fence and SGLang's ``update_weights_from_tensor`` inside it.

From :meth:`WeightCalls.begin_sync` until :meth:`WeightCalls.end_sync` no generate is admitted, so none
sees half-new weights; a bucket a caller stopped waiting for keeps the fence up until SGLang has answered
it (its buffer must outlive SGLang's read). Which path carries the buckets (SGLang's flattened buckets, or
the copy-plan fast path) is :mod:`sgl_rollout.weight_sync`'s, and only its driver
(:mod:`sgl_rollout.weight_sync.driver`) raises and lowers the fence.
"""

from __future__ import annotations

import threading
from typing import Optional

from ..memory import WEIGHTS, MemoryStateError
from ..twin import twin
from . import io_struct
from .core import EngineCore, sigint_deferred


class WeightCalls:
    """The sync fence and bucket loads on :class:`~.core.EngineCore`; records what
    :func:`sgl_rollout.weight_sync.lora.needs_base_sync` needs to know: whether a complete weight sync
    reached the engine since it started (:attr:`weights_synced`) and whether its weights were released
    since (:attr:`weights_released_since_sync`)."""

    def _on_start(self) -> None:
        super()._on_start()
        if not hasattr(self, "_sync_lock"):
            self._sync_lock = threading.Lock()
        self._bucket_loading = self._sync_abandoned = False
        self._weights_synced = False
        self._weights_released_since_sync = False
        self._sync_bytes_sent = False

    def _begin_sync(self):
        """Fence off generates for a weight sync (waits for the last release/resume to be answered).

        Raises:
            MemoryStateError: weights released, requests running, or another operation in progress.
        """
        yield from self._settle()
        self.state.begin_sync()
        self._sync_bytes_sent = False

    begin_sync, async_begin_sync = twin(_begin_sync, before_sync=EngineCore._check_not_on_loop)

    def end_sync(self, complete: bool) -> None:
        """End the fence of :meth:`begin_sync` once the last bucket was answered.

        ``complete`` False (a failed or interrupted sync) leaves the engine refusing generates until a
        complete sync, if any byte had reached it.
        """
        with self._sync_lock:
            if self.state.busy != "sync":
                return
            if self._bucket_loading:  # an interrupted caller's bucket is still loading: end when it is answered
                self._sync_abandoned = True
            else:
                self.state.end_sync(complete)
                if complete and self._sync_bytes_sent:
                    self._weights_synced, self._weights_released_since_sync = True, False

    def _bucket_answered(self, _exc: Optional[BaseException]) -> None:
        with self._sync_lock:
            self._bucket_loading = False
            if self._sync_abandoned:
                self._sync_abandoned = False
                self.state.end_sync(False)

    def _submit_sync_op(self: EngineCore, fn):
        """Submit ``fn`` (a coroutine function) as the sync fence's in-flight load: an interrupted caller's
        :meth:`end_sync` waits for its answer (:meth:`_bucket_answered`). Returns its future."""
        with sigint_deferred():  # sent and recorded, or neither
            with self._sync_lock:
                self._bucket_loading = True
            try:
                fut = self._submit(fn, self._bucket_answered)
            except BaseException:
                self._bucket_answered(None)
                raise
            self._last_op = fut
        return fut

    def _update_weights_from_tensor(self, named_tensors: list, load_format: Optional[str] = None,
                                    flush_cache: bool = False):
        """SGLang's ``update_weights_from_tensor`` for one bucket, inside :meth:`begin_sync` / :meth:`end_sync`.

        Args:
            named_tensors: for ``load_format="flattened_bucket"``, one serialized payload (bytes) per TP
                rank; see :mod:`sgl_rollout.weight_sync`.
            load_format: SGLang's ``load_format`` (``"flattened_bucket"``, or the path of a custom
                weight loader).
            flush_cache: SGLang flushes its prefix cache after loading.

        Returns:
            SGLang's ``(success, message)``.

        Raises:
            MemoryStateError: no sync was begun, or the ``weights`` tag is released.
            EngineDeadError, EngineClosedError: as every call.
        """
        if self.state.is_released(WEIGHTS):
            raise MemoryStateError("weights are released: resume 'weights' before loading new weights")
        if self.state.busy != "sync":
            raise MemoryStateError("call begin_sync() before loading weights (no generate may see half-new weights)")
        req = io_struct.make("UpdateWeightsFromTensorReqInput", serialized_named_tensors=named_tensors,
                             load_format=load_format, flush_cache=flush_cache)
        self.state.sync_sent()
        self._sync_bytes_sent = True
        return (yield self.waiting(self._submit_sync_op(lambda: self._tm().update_weights_from_tensor(req, None))))

    update_weights_from_tensor, async_update_weights_from_tensor = twin(
        _update_weights_from_tensor, before_sync=EngineCore._check_not_on_loop)

    @property
    def weights_synced(self) -> bool:
        """True once a complete weight sync (:meth:`update_weights_from_tensor` buckets inside
        :meth:`begin_sync` / :meth:`end_sync` ``(True)``) reached this engine since it started.

        A sync of only some weights counts too: the engine cannot tell (the worker's ``partial=True``)."""
        return self._weights_synced

    @property
    def weights_released_since_sync(self) -> bool:
        """True when SGLang released the ``weights`` tag since the last complete weight sync (or since
        the start, if none): without ``enable_weights_cpu_backup`` their contents are then undefined."""
        return self._weights_released_since_sync
