"""The weight sync of verl's trainer workers to their replica's engine actor: both transports, as bucket rounds.

Each trainer worker's :class:`~.verl_rollout.SglRollout` sends through :class:`VerlWeightSync`:

* the copy-plan fast path (SGLang's ``update_weights_from_tensor`` with this package's loader,
  :mod:`sgl_rollout.weight_sync.fast_path`): each worker writes its own TP rank's shard
  (:meth:`VerlWeightSync._send_fast`, :class:`~sgl_rollout.weight_sync.driver.GroupLoader`);
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
from typing import Any, Optional, Tuple

import torch

from ..weight_sync import BucketStream
from ..weight_sync.driver import GroupLoader, ServerFence, TPGroup, async_sync_fenced
from ..weight_sync.fast_path import FastPathSender
from ..weight_sync.protocol import async_bucket_rounds

logger = logging.getLogger(__name__)


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



async def _drain(weights) -> None:
    """Read a sync or async iterable to its end, keeping nothing; then close it."""
    if hasattr(weights, "__aiter__"):
        async for _ in weights:
            pass
        await _aclose(weights)
    else:
        for _ in weights:
            pass


async def _end_reading(named, ok: bool) -> None:
    """After a sync, close verl's weights generator; after a failed one, read it to its end first.

    verl's generators gather each tensor over every trainer rank (FSDP's ``full_tensor`` in
    ``get_per_tensor_param``, ``verl/workers/engine_workers.py``): a rank that stopped reading early would
    leave the others (its TP peers, and the other replicas' ranks, which sync normally) waiting in that
    collective. Every rank reads every item, so the gathers pair up whatever failed where. A read that
    fails ends the draining (logged); never raises."""
    if named is None:
        return
    if not ok:
        try:
            await _drain(named)
        except Exception:  # noqa: BLE001 - the sync's own error is the one to raise
            logger.warning("reading the rest of verl's weights after a failed sync failed", exc_info=True)
    await _aclose(named)


async def _aclose(named) -> None:
    """Close a (possibly half-consumed) async generator; never raises."""
    if hasattr(named, "aclose"):
        try:
            await named.aclose()
        except Exception:  # noqa: BLE001 - closing must not mask the sync's own outcome
            logger.debug("closing the weights generator failed", exc_info=True)



def _fast_send(sender: FastPathSender, items, validator) -> None:
    """One fast-path sync of ``items`` by ``sender``, then the buffers freed: the engine closes its handles
    with the last bucket (plan path), or in op ``release`` (load path; a no-op where they are freed)."""
    sender.send(items, validator=validator, release=True)
    sender.release()




class VerlWeightSync:
    """The weight-sync part of :class:`~.verl_rollout.SglRollout` (a mixin: it uses the rollout's
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
        group = self._sync_group()
        loader = GroupLoader(group, (lambda: self.server) if self.is_leader_rank else None, self.rollout_config)
        self._fast = FastPathSender(loader, self._sync_manifest(), self.rollout_config.bucket_bytes,
                                    devices=[torch.device("cuda", torch.cuda.current_device())],
                                    tp_size=self.tp_size, tp_ranks=[self.tp_rank],
                                    share=group.round if self.tp_size > 1 else None)
        return self._fast

    def _sync_group(self) -> TPGroup:
        """The replica's TP ranks as the weight-sync driver sees them (:class:`~sgl_rollout.weight_sync.driver.TPGroup`)."""
        return TPGroup(self._all_gather, self.tp_size)

    def _fence(self, global_steps: Optional[int]) -> Optional[ServerFence]:
        """The engine actor's sync fence on the TP leader (which calls the engine); None on the other ranks."""
        return ServerFence(lambda: self.server, global_steps) if self.is_leader_rank else None

    async def _send_fast(self, sender: FastPathSender, named, global_steps: Optional[int]) -> None:
        """One weight sync on the fast path (``engine_kwargs.sgl_rollout.fast_sync``).

        Each TP rank's worker writes its own rank's shard of each bucket of the copy plan
        (:mod:`sgl_rollout.weight_sync.receiver`) into its buffer on its GPU, and the engine scatters
        every rank's buffer into its parameters in one call per bucket
        (:class:`~sgl_rollout.weight_sync.driver.GroupLoader`). After
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
        info = dict(model_path=self._sync_path.model_path, trust_remote_code=self._sync_path.trust_remote_code,
                    dtype=self.rollout_config.dtype)  # the trainer's gather by unit may all-gather in it

        started = False

        async def work():
            nonlocal started
            started = True
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._bucket_executor(), receive_plan_buckets, sender, receipt, info)

        try:
            await self._fast_sync(sender, work, None, global_steps)
        except BaseException as exc:
            if not started:  # the leader's fence refused: the trainer rank must not wait for this one
                receipt.refuse(f"{type(exc).__name__}: {exc}")
            raise

    async def _fast_sync(self, sender: FastPathSender, work, named, global_steps: Optional[int]) -> None:
        """A fast-path sync whose body is ``await work()``, run by the weight-sync driver
        (:func:`~sgl_rollout.weight_sync.driver.async_sync_fenced`: the leader's fence, the closing round
        over the TP ranks). A failed sync resets the sender's plan (the engine may have restarted) but
        keeps its key; verl's weights generator is read to its end after a failure and closed on every
        exit (:func:`_end_reading`)."""

        async def on_end(ok: bool) -> None:
            if ok:
                self.base_syncs += 1
            else:
                sender.reset(new_key=False)
            await _end_reading(named, ok)

        await async_sync_fenced(self._fence(global_steps), work, group=self._sync_group(), on_end=on_end)

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
        bucket k; the protocol's bucket rounds (:func:`~sgl_rollout.weight_sync.protocol.async_bucket_rounds`)
        inside the driver's fence (:func:`~sgl_rollout.weight_sync.driver.async_sync_fenced`).

        Each round, every rank flattens its next bucket (or finds none), the leader waits for the engine's
        step in flight (the fence's begin, sent before bucket 0 was read; bucket k-1's load), and one round of the TP group gives every rank every rank's payload.
        Every rank then drops all but its newest buffer (the engine is done with them), and all decide the
        same: end when no rank has a bucket, else the leader starts the load of the round's payloads. A
        rank that fails (its bucket, or on the leader the engine's load) leaves with its reason, after the
        leader's load in flight has answered, so no buffer is freed before the load that reads it has
        answered; a rank holds at most two buckets.
        """
        leader = self.is_leader_rank
        group = self._sync_group()
        fence = ServerFence(lambda: self.server, global_steps, overlap=True) if leader else None
        stream, next_payload = self._payload_source(named)
        pending, step = None, ""

        async def settle() -> None:  # the leader's load in flight, answered (or its error raised)
            nonlocal pending
            if pending is not None:
                waiting, pending = pending, None
                await waiting

        async def next_round(bucket: int) -> list:
            error, payload = None, None
            try:
                payload = await next_payload()
            except Exception as exc:  # noqa: BLE001 - raised once the load in flight has answered
                error = exc
            try:
                if fence is not None:
                    await fence.confirm()  # the fence's begin, sent before the first bucket was read
                await settle()
            except Exception as exc:  # noqa: BLE001 - the engine refused: this rank leaves with its own error
                error = error or exc
            if error is not None:
                raise error
            payloads = group.round(payload)
            stream.release(keep_newest=True)  # the engine has answered the load that read the older ones
            return payloads

        def load(payloads, bucket: int) -> None:  # started, not awaited: the next round overlaps it
            nonlocal pending, step
            if leader:
                pending, step = self._submit("update_weights_from_payloads", list(payloads)), f"load bucket {bucket}"

        async def on_end(ok: bool) -> None:
            try:
                await settle()  # left with a load in flight (an interrupted caller): its buffers stay until then
            except Exception:  # noqa: BLE001 - the sync has failed already; this is its cleanup
                logger.exception("the engine failed to %s while the weight sync was failing", step)
            stream.release()
            if ok:
                self.base_syncs += 1
            await _end_reading(named, ok)

        await async_sync_fenced(fence, lambda: async_bucket_rounds(next_round, load), group=group, on_end=on_end)
