"""The weight sync of verl's trainer workers to their replica's engine actor: both transports, as bucket rounds.

Each trainer worker's :class:`~.verl_adapter.SglRolloutAdapter` sends through :class:`VerlWeightSync`:

* the copy-plan fast path (SGLang's ``update_weights_from_tensor`` with this package's loader,
  :mod:`sgl_rollout.weight_sync.fast_path`): each worker writes its own TP rank's shard
  (:meth:`VerlWeightSync._send_fast`, :class:`_FastPathRound`);
* SGLang's flattened buckets (``load_format="flattened_bucket"``,
  :mod:`sgl_rollout.weight_sync.flattened_bucket`), pipelined over the protocol's bucket rounds
  (:meth:`VerlWeightSync._send_buckets`, :mod:`sgl_rollout.weight_sync.protocol`).

Which one, and the manifest both read, is :class:`~sgl_rollout.weight_sync.path.SyncPath`'s choice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, List, Optional, Tuple

import ray
import torch

from ..weight_sync import BucketStream
from ..weight_sync.fast_path import FastPathSender
from ..weight_sync.protocol import Round, async_bucket_rounds

logger = logging.getLogger(__name__)

#: First element of a TP rank's item in a round when that rank failed (then its message).
_ERR = "__sgl_rollout_error__"
#: First element of a TP rank's item in a fast-path round when that rank has ended the sync.
_LEFT = "__sgl_rollout_left__"


class _PeerLeft(RuntimeError):
    """Another TP rank ended the fast-path weight sync (it failed); raised from the round that heard it."""


class _FastPathRound:
    """The engine as one trainer worker's :class:`~sgl_rollout.weight_sync.fast_path.FastPathSender` sees
    it under verl, where each TP rank's worker owns its own rank's buffer: one round over the replica's
    TP group per call.

    :meth:`update_weights_from_tensor` all-gathers every worker's payloads; the leader hands them to
    the engine actor's ``update_weights_from_payloads(fast_path=True)`` and broadcasts the outcome, so
    every worker returns (or raises) once the engine has answered for every rank. :meth:`share` is the
    sender's all-gather. :meth:`close` is the round every worker ends a sync with. A worker that fails
    between rounds (its generator, the manifest check) goes straight to it, with its error; workers
    still in a sync round meet that closing item there, raise :class:`_PeerLeft` and end without a
    closing round of their own, so no worker waits for a round the others never enter. With TP size 1
    every round is local.

    Args:
        adapter: the worker's :class:`SglRolloutAdapter` (its TP group and engine actor).
    """

    def __init__(self, adapter):
        self.adapter = adapter
        self.config = adapter.rollout_config  # the sender checks the engine registers its loader

    def _round(self, item) -> List[Any]:
        got = self.adapter._all_gather((None, item))
        left = [f"TP rank {r}: {why}" for r, (mark, why) in enumerate(got) if mark == _LEFT]
        if left:
            raise _PeerLeft("the weight sync ended on another TP rank: " + "; ".join(left))
        return [x for _, x in got]

    def share(self, obj) -> List[Any]:
        """Every worker's ``obj``, in TP rank order.

        Raises:
            _PeerLeft: another worker has ended the sync.
        """
        return self._round(obj)

    def update_weights_from_tensor(self, payloads: list, load_format: Optional[str] = None, flush_cache: bool = False):
        """Load this round's payloads of every TP rank (``payloads``: this worker's); ``(True, "Success")``.

        Raises:
            _PeerLeft: another worker has ended the sync (nothing was loaded).
            RuntimeError: the engine actor refused or failed the call (every worker raises it).
        """
        everyone = [p for part in self._round(list(payloads)) for p in part]
        error = None
        if self.adapter.is_leader_rank:
            try:
                ray.get(self.adapter.server.update_weights_from_payloads.remote(everyone, fast_path=True))
            except Exception as exc:  # noqa: BLE001 - every TP rank must hear of it
                error = f"{type(exc).__name__}: {exc}"
        error = self.adapter._broadcast(error)
        if error:
            raise RuntimeError(f"the engine failed a fast-path weight sync call: {error}")
        return True, "Success"

    def flush_cache(self) -> None:
        """Nothing: ``finish_weight_sync`` flushes the prefix cache."""

    def close(self, error: Optional[BaseException]) -> List[str]:
        """The closing round of a sync: every worker's error (``"TP rank r: ..."``), empty when all succeeded."""
        why = f"{type(error).__name__}: {error}" if error is not None else ""
        got = self.adapter._all_gather((_LEFT, why))
        return [f"TP rank {r}: {w}" for r, (_, w) in enumerate(got) if w]


class _AsyncToSyncIterator:
    """A sync iterator over an async iterator that runs on ``loop``; used from another thread only."""

    def __init__(self, aiterator, loop: asyncio.AbstractEventLoop, loop_thread: threading.Thread):
        self._it, self._loop, self._loop_thread = aiterator, loop, loop_thread

    def __iter__(self):
        return self

    def __next__(self):
        if threading.current_thread() is self._loop_thread:
            raise RuntimeError("_AsyncToSyncIterator used on its own event loop's thread (would deadlock)")

        async def step():
            return await self._it.__anext__()

        try:
            return asyncio.run_coroutine_threadsafe(step(), self._loop).result()
        except StopAsyncIteration:
            raise StopIteration from None



async def _aclose(named) -> None:
    """Close a (possibly half-consumed) async generator; never raises."""
    if hasattr(named, "aclose"):
        try:
            await named.aclose()
        except Exception:  # noqa: BLE001 - closing must not mask the sync's own outcome
            logger.debug("closing the weights generator failed", exc_info=True)



def _is_error(payload) -> bool:
    """A rank's failure report in a round (``(_ERR, message)``), not a payload."""
    return isinstance(payload, tuple) and payload[:1] == (_ERR,)


def _fast_send(sender: FastPathSender, items, validator) -> None:
    """One fast-path sync of ``items`` by ``sender``, then the buffers freed (the engine closes its handles)."""
    sender.send(items, validator=validator)
    sender.release()




class VerlWeightSync:
    """The weight-sync part of :class:`~.verl_adapter.SglRolloutAdapter` (a mixin: it uses the adapter's
    TP group, engine actor, rollout config, ``_sync_path`` and ``base_syncs``)."""

    def _sync_manifest(self):
        """The model's :class:`~sgl_rollout.weight_sync.manifest.WeightManifest`, read once
        (:class:`~sgl_rollout.weight_sync.path.SyncPath`); None when validation is off, the weights are
        FP8-quantized on the way (their names and dtypes differ from the checkpoint's), or it cannot be
        read (logged once)."""
        return self._sync_path.manifest


    def _bucket_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else None

            def init():
                if device is not None:
                    torch.cuda.set_device(device)

            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="sgl-rollout-buckets", initializer=init)
        return self._executor

    def _payload_source(self, named) -> Tuple[BucketStream, Any]:
        """A BucketStream over ``named`` and an async ``next_payload()`` for it.

        A sync iterator is bucketed on this thread (verl's generators may run collectives that must stay
        on it). An async one is bucketed on a helper thread that pulls each item from this event loop,
        so the stream may read ahead as far as it needs (the manifest check reads to the end on a bad
        tensor) while the loop keeps running the generator.
        """
        from ..weight_sync.layered import layer_index

        kwargs = dict(manifest=self._sync_manifest(), partial=False, max_held=2,
                      group_of=layer_index if self.rollout_config.layered_summon else None)
        if not hasattr(named, "__aiter__"):
            stream = BucketStream(named, self.rollout_config.bucket_bytes, **kwargs)

            async def next_sync():
                return stream.next_payload()

            return stream, next_sync
        loop = asyncio.get_running_loop()
        stream = BucketStream(_AsyncToSyncIterator(named, loop, threading.current_thread()),
                              self.rollout_config.bucket_bytes, **kwargs)
        executor = self._bucket_executor()

        async def next_async():
            return await loop.run_in_executor(executor, stream.next_payload)

        return stream, next_async


    def _fast_sender(self) -> Optional[FastPathSender]:
        """This worker's fast-path sender (made on the first weight sync), or None: the flattened buckets.

        :class:`~sgl_rollout.weight_sync.path.SyncPath` decides, once, for every TP rank of the replica
        together (an all-gather of each rank's reason): None when ``engine_kwargs.sgl_rollout.fast_sync``
        is off, and (logged once) when any rank lacks CUDA or the model's weight manifest
        (``validate_sync`` off, FP8, or unreadable).
        """
        if self._fast is not None:
            return self._fast
        if not self._sync_path.fast(agree=self._all_gather):
            return None
        rnd = _FastPathRound(self)
        self._fast = FastPathSender(rnd, self._sync_manifest(), self.rollout_config.bucket_bytes,
                                    devices=[torch.device("cuda", torch.cuda.current_device())],
                                    tp_size=self.tp_size, tp_ranks=[self.tp_rank],
                                    share=rnd.share if self.tp_size > 1 else None)
        return self._fast

    async def _send_fast(self, sender: FastPathSender, named, global_steps: Optional[int]) -> None:
        """One weight sync on the fast path (``engine_kwargs.sgl_rollout.fast_sync``).

        Each TP rank's worker writes its own rank's shard of each bucket of the copy plan
        (:mod:`sgl_rollout.weight_sync.receiver`) into its buffer on its GPU, and the engine scatters
        every rank's buffer into its parameters in one call per bucket (:class:`_FastPathRound`). After
        the last bucket the engine closes the buffers' IPC handles and the workers free them, so no
        trainer memory is held while the trainer runs. A failure anywhere raises on every TP rank and
        ends the sync with ``finish_weight_sync(ok=False)``; the sender then asks for the copy plan
        again at the next sync (the engine may have restarted).
        """
        from ..weight_sync.manifest import SyncValidator

        async def work():
            validator = SyncValidator(self._sync_manifest())
            if hasattr(named, "__aiter__"):  # items are pulled from this loop by a helper thread
                loop = asyncio.get_running_loop()
                items = _AsyncToSyncIterator(named, loop, threading.current_thread())
                await loop.run_in_executor(self._bucket_executor(), _fast_send, sender, items, validator)
            else:  # verl's sync generators may run collectives that must stay on this thread
                _fast_send(sender, named, validator)

        await self._fast_sync(sender, work, named, global_steps)

    async def _receive_plan(self, receipt, global_steps: Optional[int]) -> None:
        """One weight sync from verl's checkpoint engine ``sgl_rollout``
        (:mod:`~sgl_rollout.integrations.verl_checkpoint_engine`): this TP rank's trainer rank sends its
        copy plan's buckets straight into its fast-path buffer (:func:`~sgl_rollout.weight_sync.p2p.receive_plan_buckets`,
        on the bucket thread: it blocks on the transfers), inside the engine's sync fence, with
        :meth:`_send_fast`'s failure rules. A rank that cannot take the sync tells its trainer rank first,
        so no side waits for the other.

        Raises:
            FastPathError: the fast path is off for this replica (the trainer was told).
        """
        from ..weight_sync.fast_path import FastPathError
        from ..weight_sync.p2p import receive_plan_buckets

        sender = self._fast_sender()
        if sender is None:
            why = ("checkpoint_engine.backend=sgl_rollout needs the fast path (engine_kwargs.sgl_rollout.fast_sync, "
                   "a weight manifest, CUDA on every TP rank)")
            receipt.refuse(why)
            raise FastPathError(why)
        info = dict(model_path=self._sync_path.model_path, trust_remote_code=self._sync_path.trust_remote_code)

        async def work():
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._bucket_executor(), receive_plan_buckets, sender, receipt, info)

        def not_started(exc: BaseException) -> None:
            receipt.refuse(f"{type(exc).__name__}: {exc}")

        await self._fast_sync(sender, work, None, global_steps, not_started=not_started)

    async def _fast_sync(self, sender: FastPathSender, work, named, global_steps: Optional[int],
                         not_started=None) -> None:
        """The fence, closing round and outcome of a fast-path sync whose body is ``await work()``;
        ``not_started(exc)`` runs when the sync failed before the body began (the leader's fence refused)."""
        began, started = False, False
        error: Optional[BaseException] = None
        try:
            if self.is_leader_rank:
                await self.server.begin_weight_sync.remote()
                began = True
            started = True
            await work()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the closing round
            error = exc
            if not started and not_started is not None:
                not_started(exc)
        peers = [] if isinstance(error, _PeerLeft) else sender.engine.close(error)
        if error is None and peers:
            error = RuntimeError("the weight sync failed on " + "; ".join(peers))
        ok = error is None
        if not ok:
            sender.reset(new_key=False)
        else:
            self.base_syncs += 1
        await self._end_sync(named, began, ok, global_steps)
        if error is not None:
            raise error

    async def _end_sync(self, named, began: bool, ok: bool, global_steps: Optional[int]) -> None:
        """Close verl's weights generator; the leader then ends the engine's sync (``finish_weight_sync``)
        if it began one. A failing ``finish_weight_sync`` is raised after a good sync and logged after a
        failed one (whose own error is the one to raise)."""
        if named is not None:
            await _aclose(named)
        if self.is_leader_rank and began:
            try:
                await self.server.finish_weight_sync.remote(ok=ok, global_steps=global_steps if ok else None)
            except Exception:
                if ok:
                    raise
                logger.exception("finish_weight_sync(ok=False) failed after a failed weight sync")

    def _submit(self, method: str, *args):
        """Start a call of the engine actor's ``method`` now; an awaitable of its answer, which raises
        what the call raised, or what starting it raised (the actor not found, say), so the leader
        still takes part in the round that reports it."""
        try:
            return getattr(self.server, method).remote(*args)
        except Exception as exc:  # noqa: BLE001 - raised where the answer is awaited
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            return failed

    async def _send_buckets(self, named, global_steps: Optional[int]) -> None:
        """One bucketed weight sync, pipelined: every TP rank flattens bucket k+1 while the engine loads
        bucket k; the protocol's bucket rounds (:func:`~sgl_rollout.weight_sync.protocol.async_bucket_rounds`).

        Each round, every rank flattens its next bucket (or finds none, or fails), the leader then waits
        for the engine's step in flight (``begin_weight_sync`` in the first round, bucket k-1's load
        after), and one all-gather gives every rank every rank's payload and the leader's answer. Every
        rank then drops all but its newest buffer (the engine is done with them), and all decide the
        same: stop on any failure, end when no rank has a bucket, else the leader starts the load of the
        round's payloads. So a rank holds at most two buckets, and no buffer is freed before the engine
        load that reads it has answered; on any exit the leader waits for a load in flight before the
        buffers go.
        """
        leader = self.is_leader_rank
        stream, next_payload = self._payload_source(named)
        pending, step, began = None, "", False

        def begin() -> None:
            nonlocal pending, step
            if leader:
                pending, step = self._submit("begin_weight_sync"), "begin a weight sync"

        async def next_round(bucket: int) -> Round:
            nonlocal pending, began
            local_exc: Optional[BaseException] = None
            try:
                payload = await next_payload()
            except Exception as exc:  # noqa: BLE001 - reported to every TP rank, re-raised by the protocol
                local_exc, payload = exc, (_ERR, f"{type(exc).__name__}: {exc}")
            engine_exc, engine_error = None, None
            if pending is not None:
                try:
                    await pending
                    began = True
                except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it
                    engine_exc, engine_error = exc, f"the engine refused to {step}: {exc}"
                pending = None
            rounds = self._all_gather((payload, engine_error))
            stream.release(keep_newest=True)  # the engine has answered the load that read the older ones
            payloads = [p for p, _ in rounds]
            errors = [e for _, e in rounds if e] + [f"TP rank {r}: {p[1]}" for r, p in enumerate(payloads)
                                                    if _is_error(p)]
            return Round([None if _is_error(p) else p for p in payloads], errors, local_exc or engine_exc)

        def load(payloads, bucket: int) -> None:  # started, not awaited: the next round overlaps it
            nonlocal pending, step
            if leader:
                pending, step = self._submit("update_weights_from_payloads", list(payloads)), f"load bucket {bucket}"

        async def finish(ok: bool) -> None:
            nonlocal began
            if pending is not None:  # left with a load in flight: its buffers stay until it answered
                try:
                    await pending
                    began = True
                except Exception:  # noqa: BLE001 - the sync has failed already; this is its cleanup
                    logger.exception("the engine failed to %s while the weight sync was failing", step)
            stream.release()
            if ok:
                self.base_syncs += 1
            await self._end_sync(named, began, ok, global_steps)

        await async_bucket_rounds(begin, next_round, load, finish)
