"""The trainer side of ``rollout.name=sglang`` under verl: the adapter in each trainer worker that
wakes, sleeps and sends the weights to its replica's engine actor (:mod:`.verl_server`).

:class:`SglRolloutAdapter` is verl's ``BaseRollout`` (``verl/workers/rollout/base.py``). verl 0.9.1
builds it in two places:

- in each hybrid trainer worker (``verl/workers/engine_workers.py``) as
  ``cls(config=..., model_config=..., device_mesh=...)`` with an ``infer_tp`` mesh dimension; its
  ``update_weights`` calls ``resume(["weights"])`` (skipped when ``sleep_level == 1``),
  ``update_weights(gen, peft_config=, base_sync_done=, global_steps=)``, offloads the actor, then
  ``resume(["kv_cache"])``: the staged wake;
- in each ``CheckpointEngineWorker`` (``verl/checkpoint_engine/base.py``; standalone and colocated
  replicas, ``checkpoint_engine.backend`` other than ``naive``) as
  ``cls(config=, model_config=, device_mesh=None, replica_rank=)`` *before* torch.distributed is
  initialised, with ``update_weights(async generator, global_steps=, wire_format=)`` and reads of
  ``is_leader_rank`` and ``replica_rank``. Without a mesh the TP group is made on the first weight
  sync: consecutive global ranks, as verl lays replicas out.

Weight syncs go on the copy-plan fast path by default (``engine_kwargs.sgl_rollout.fast_sync``), each
trainer worker writing its own TP rank's shard (:meth:`SglRolloutAdapter._send_fast`,
:class:`_FastPathRound`), or as SGLang's flattened buckets, pipelined
(:meth:`SglRolloutAdapter._send_buckets`).

LoRA served as an adapter: verl's trainer calls ``update_weights(base, peft_config=,
base_sync_done=False)`` while its own ``base_sync_done`` is False (a dummy load's first step) and
``update_weights(adapter, peft_config=, base_sync_done=True)`` every step. The base is sent only when
:func:`~sgl_rollout.weight_sync.lora.needs_base_sync` says the engine lacks it (asked of the engine
actor, which records its syncs, releases and restarts); otherwise every rank drains verl's generator
and nothing is sent. The adapter goes to SGLang's ``load_lora_adapter_from_tensors`` as one checked,
by-value ``flattened_bucket`` payload from the TP leader, replacing the previous version.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any, List, Optional, Sequence, Tuple

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from .. import trace
from ..memory import KV_CACHE, WEIGHTS
from ..weight_sync import BucketStream
from ..weight_sync import lora as lora_sync
from ..weight_sync.sender import FastPathSender
from .verl_config import (
    MODEL_PREFIX,
    ROLLOUT_PREFIX,
    VERL_ADAPTER_NAME,
    _get,
    check_verl_tp,
    fp8_quant_config,
    model_path_of,
    rollout_config_for_verl,
)
from .verl_server import server_name

logger = logging.getLogger(__name__)

__all__ = ["SglRolloutAdapter"]

_UNSET = object()
_ERR = "__sgl_rollout_error__"
_DONE, _LOAD = "done", "load"
#: First element of a TP rank's item in a fast-path round when that rank has ended the sync.
_LEFT = "__sgl_rollout_left__"


class _PeerLeft(RuntimeError):
    """Another TP rank ended the fast-path weight sync (it failed); raised from the round that heard it."""


class _FastPathRound:
    """The engine as one trainer worker's :class:`~sgl_rollout.weight_sync.sender.FastPathSender` sees
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

    def __init__(self, adapter: "SglRolloutAdapter"):
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


async def _renamed_async(weights):
    async for name, tensor in weights:
        yield name.replace(".base_layer.", "."), tensor


async def _checked_fp8(helper, quantized):
    """verl's FP8 quantizer yields a weight unquantized when quantizing it fails (logged only): that
    bf16 tensor would be loaded into an FP8 layer. Refuse it instead."""
    async for name, tensor in quantized:
        if helper.should_quantize_param(name) and tensor.element_size() != 1:
            raise RuntimeError(f"FP8 quantization of {name} failed (verl's quantizer returned it as {tensor.dtype}); "
                               "see the error verl logged just before (torch.distributed must be initialised)")
        yield name, tensor


async def _aclose(named) -> None:
    """Close a (possibly half-consumed) async generator; never raises."""
    if hasattr(named, "aclose"):
        try:
            await named.aclose()
        except Exception:  # noqa: BLE001 - closing must not mask the sync's own outcome
            logger.debug("closing the weights generator failed", exc_info=True)


def _renamed_sync(weights):
    for name, tensor in weights:
        yield name.replace(".base_layer.", "."), tensor


class SglRolloutAdapter(BaseRollout):
    """verl ``BaseRollout`` living in each trainer (or checkpoint-engine) worker; talks to the replica's
    engine actor.

    The TP leader (TP rank 0) makes the calls; every TP rank flattens its buckets on its own GPU and
    the leader gathers one payload per TP rank for each bucket. TP ranks come from the ``infer_tp``
    dimension of ``device_mesh``, or without one from the global rank: ranks ``[k*T, (k+1)*T)`` form
    replica ``k``'s TP group of size ``T = tensor_model_parallel_size * data_parallel_size`` (verl's
    layout), created with ``torch.distributed.new_group`` on the first weight sync.

    Args:
        config: verl's rollout config.
        model_config: verl's model config (``HFModelConfig``, or a config verl converts to one).
        device_mesh: verl's rollout mesh with an ``infer_tp`` dimension, or None.
        replica_rank: the replica this worker belongs to; -1: ``RANK // T``.

    Attributes:
        sleep_level: read by verl's trainer (2: weights and KV cache are released).
        replica_rank: read by verl's ``CheckpointEngineWorker.get_replica_rank``.
        tp_rank: this worker's TP rank in its replica.

    Raises:
        UnsupportedVerlFeature: a verl feature sgl-rollout refuses (see :mod:`.verl_config`).
        TPLayoutError: a TP size the model's heads do not split over, or larger than the trainer world
            (:func:`check_verl_tp`).
    """

    def __init__(self, config, model_config, device_mesh=None, *args, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        world = os.environ.get("WORLD_SIZE", "")
        check_verl_tp(self.config, self.model_config, int(world) if world.isdigit() else None)
        self.rollout_config = rollout_config_for_verl(self.config, model_path_of(self.model_config),
                                                      model_config=self.model_config)
        self.sleep_level = self.rollout_config.sleep_level
        self.tp_size = self.rollout_config.tensor_model_parallel_size
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = replica_rank if replica_rank is not None and replica_rank >= 0 else rank // self.tp_size
        self._tp_group = None
        if device_mesh is not None and "infer_tp" in (device_mesh.mesh_dim_names or ()):
            self.tp_rank = device_mesh["infer_tp"].get_local_rank()
            self._tp_group = device_mesh["infer_tp"].get_group()
        else:
            self.tp_rank = rank % self.tp_size
        self._fp8 = _get(self.config, "quantization", None) == "fp8"
        self._manifest = _UNSET
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._server = None
        self._fast: Optional[FastPathSender] = None
        self._fast_off_logged = False
        #: weight syncs of this rank: full (base) syncs sent, base syncs verl offered and the rule
        #: skipped, adapter syncs
        self.base_syncs = self.base_syncs_skipped = self.adapter_syncs = 0
        logger.info("rollout.name=sglang answered by sgl-rollout (replica %d, TP rank %d of %d)",
                    self.replica_rank, self.tp_rank, self.tp_size)

    @property
    def is_leader_rank(self) -> bool:
        """True on TP rank 0 of the replica: the rank that calls the engine actor (read by verl's
        ``CheckpointEngineWorker.is_leader_rank``)."""
        return self.tp_rank == 0

    @property
    def server(self):
        """The replica's engine actor (looked up by name on first use)."""
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    # -------------------------------------------------------------- TP group
    def _ensure_tp_group(self) -> None:
        """Make the TP group from global ranks when verl gave no mesh (collective over all ranks).

        Raises:
            RuntimeError: TP size > 1 and torch.distributed is not initialised.
            ValueError: the world size is not a multiple of the TP size.
        """
        if self._tp_group is not None or self.tp_size == 1:
            return
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"TP size {self.tp_size} without a device mesh needs torch.distributed initialised "
                               "(verl's CheckpointEngineWorker does it) to gather one payload per TP rank")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % self.tp_size:
            raise ValueError(f"world size {world} is not a multiple of the rollout TP size {self.tp_size}")
        mine = None
        for start in range(0, world, self.tp_size):  # every rank makes every group, in the same order
            group = dist.new_group(ranks=list(range(start, start + self.tp_size)))
            if start <= rank < start + self.tp_size:
                mine = group
        if rank % self.tp_size != self.tp_rank:
            logger.warning("TP rank from RANK (%d) differs from torch.distributed's (%d); using the latter",
                           self.tp_rank, rank % self.tp_size)
        self.tp_rank, self._tp_group = rank % self.tp_size, mine

    def _leader_global_rank(self) -> int:
        return torch.distributed.get_global_rank(self._tp_group, 0)

    def _gather(self, payload) -> Optional[List[Any]]:
        """Every TP rank's object at the leader (None elsewhere)."""
        if self._tp_group is None or self.tp_size == 1:
            return [payload]
        out = [None] * self.tp_size if self.is_leader_rank else None
        torch.distributed.gather_object(payload, out, dst=self._leader_global_rank(), group=self._tp_group)
        return out

    def _all_gather(self, item) -> List[Any]:
        """Every TP rank's ``item``, in TP rank order, on every rank."""
        if self._tp_group is None or self.tp_size == 1:
            return [item]
        out = [None] * self.tp_size
        torch.distributed.all_gather_object(out, item, group=self._tp_group)
        return out

    def _broadcast(self, status):
        """The leader's ``status`` on every TP rank."""
        if self._tp_group is None or self.tp_size == 1:
            return status
        box = [status]
        torch.distributed.broadcast_object_list(box, src=self._leader_global_rank(), group=self._tp_group)
        return box[0]

    # -------------------------------------------------------------- memory
    @trace.traced("rollout.resume", fields=("tags",))
    async def resume(self, tags: List[str]):
        """Resume a stage of the staged wake: ``["weights"]`` or ``["kv_cache"]`` (the TP leader asks the
        engine actor; the other ranks return at once).

        Nothing is collected or emptied here: verl's ``update_weights`` (``verl/workers/engine_workers.py``)
        has already synchronized, emptied torch's cache and passed a barrier of every trainer rank
        before it resumes the KV cache, so a collection here would only add its cost (a full
        ``gc.collect()`` over the trainer process's objects).
        """
        if not self.rollout_config.free_cache_engine or not self.is_leader_rank:
            return
        for stage in (WEIGHTS, KV_CACHE):
            if stage in tags:
                await self.server.resume_stage.remote(stage)

    @trace.traced("rollout.release")
    async def release(self):
        """Release per ``sleep_level`` (weights and KV cache at level 2)."""
        if self.rollout_config.free_cache_engine and self.is_leader_rank:
            await self.server.sleep.remote()

    # -------------------------------------------------------------- weight sync
    def _sync_manifest(self):
        """The model's :class:`~sgl_rollout.weight_sync.manifest.WeightManifest`, built once; None when
        validation is off, the weights are FP8-quantized on the way (their names and dtypes differ from
        the checkpoint's), or it cannot be built (logged once)."""
        if self._manifest is _UNSET:
            self._manifest = None
            if self._fp8 or not self.rollout_config.validate_sync:
                return None
            path = model_path_of(self.model_config)
            try:
                from ..weight_sync.manifest import WeightManifest

                self._manifest = WeightManifest.from_pretrained(
                    path, trust_remote_code=bool(_get(self.model_config, "trust_remote_code", False)))
            except Exception as exc:  # noqa: BLE001 - a sync without validation beats no sync
                logger.warning("no weight manifest for %s (%r): weight syncs are not validated", path, exc)
        return self._manifest

    def _named_tensors(self, weights):
        """``weights`` with LoRA ``.base_layer.`` names folded, FP8-quantized when configured; a sync
        or an async iterator as ``weights`` (and the quantizer) make it."""
        weights = _renamed_async(weights) if hasattr(weights, "__aiter__") else _renamed_sync(weights)
        if self._fp8:
            from verl.utils.sglang.sglang_fp8_utils import SGLangFP8QuantizerHelper

            hf_config = _get(self.model_config, "hf_config", None)
            dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.bfloat16
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype)
            helper = SGLangFP8QuantizerHelper(fp8_quant_config(hf_config))
            weights = _checked_fp8(helper, helper.quant_weights_by_name(weights, dtype=dtype))
        return weights

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

    def _decide(self, payloads: List[Any], bucket: int, engine_errors: Sequence[str] = ()) -> str:
        """What every TP rank does after a round: stop (``_ERR: why``), end (``_DONE``) or load."""
        if engine_errors:
            return f"{_ERR}: " + "; ".join(engine_errors)
        errors = [f"TP rank {r}: {p[1]}" for r, p in enumerate(payloads) if isinstance(p, tuple) and p[:1] == (_ERR,)]
        if errors:
            return f"{_ERR}: bucket {bucket} failed on " + "; ".join(errors)
        done = [p is None for p in payloads]
        if all(done):
            return _DONE
        if any(done):
            return f"{_ERR}: TP ranks ran out of buckets at different times (bucket {bucket}: done={done})"
        return _LOAD

    @trace.traced("rollout.update_weights")
    async def update_weights(self, weights, wire_format: str = "named_tensors", peft_config=None,
                             base_sync_done: bool = True, global_steps: Optional[int] = None, **kwargs):
        """Stream ``weights`` to the engine in flattened buckets (or on the fast path, :meth:`_send_fast`,
        with ``engine_kwargs.sgl_rollout.fast_sync``), one weight sync.

        Every TP rank must call this and consume its generator (verl's full-tensor gathers are
        collective). The leader brackets the sync with the engine actor's ``begin_weight_sync`` /
        ``finish_weight_sync`` (no generate runs between buckets; the prefix cache is flushed at the
        end); a failure anywhere (a rank's generator, the manifest check, the engine) ends it with
        ``finish_weight_sync(ok=False)`` and raises on every TP rank. The buckets are pipelined: the
        engine loads bucket k while every rank flattens bucket k+1 (:meth:`_send_buckets`), so each
        rank holds up to two buckets (``rollout.update_weights_bucket_megabytes`` each) of extra GPU
        memory during the sync.

        Args:
            weights: ``(name, tensor)`` pairs in Hugging Face naming: a sync iterable or an async
                iterable (verl's checkpoint engines' ``receive_weights``); tensors of any dtype on this
                worker's GPU (or CPU).
            wire_format: only ``"named_tensors"``.
            peft_config: verl's LoRA adapter config (dict or ``peft.LoraConfig``) when it serves LoRA as
                an adapter, else None (full or merged weights).
            base_sync_done: with ``peft_config``: True: ``weights`` is the adapter (PEFT names), loaded
                as this replica's adapter (:data:`VERL_ADAPTER_NAME`), replacing the previous version;
                False: ``weights`` is the base model, sent only when the engine lacks it
                (:func:`~sgl_rollout.weight_sync.lora.needs_base_sync`, asked of the engine actor),
                else drained on every rank and dropped. Ignored without ``peft_config``.
            global_steps: the trainer step of these weights, reported in ``TokenOutput.extra_fields``.

        Raises:
            NotImplementedError: ``wire_format`` other than ``"named_tensors"``, or ``peft_config`` for an
                engine started without LoRA (``model.lora.merge=True``).
            BaseWeightsMissing: an adapter for an engine that lacks its base weights (it restarted, say);
                nothing was sent.
            SyncValidationError: the weights do not match the model's manifest (names, shapes, dtypes).
            RuntimeError: another TP rank failed, or the ranks disagree on the number of buckets.
            MemoryStateError, EngineDeadError, EngineClosedError: from the engine actor, unchanged.
        """
        if wire_format != "named_tensors":
            raise NotImplementedError(f"wire_format={wire_format!r} is not supported by sgl-rollout; set "
                                      f"{ROLLOUT_PREFIX}.checkpoint_engine.backend to a full-weight backend")
        if isinstance(weights, Mapping):
            raise TypeError("weights is a dict: pass dict.items() (verl passes a generator of (name, tensor))")
        if peft_config is not None:
            if not self.rollout_config.lora_enabled:
                raise NotImplementedError(
                    "verl passed a LoRA adapter (peft_config) but this engine serves no adapters: it was started "
                    f"without LoRA; set {MODEL_PREFIX}.lora_rank > 0 without lora.merge, or lora.merge=True")
            self._ensure_tp_group()
            if base_sync_done:
                await self._update_adapter(weights, peft_config, global_steps)
                return
            if not await self._base_needed():
                await _drain(weights)  # verl's generator may run collectives: every rank reads it
                self.base_syncs_skipped += 1
                logger.info("base weights not resent: the engine kept them (sleep level %d, free_cache_engine=%s)",
                            self.sleep_level, self.rollout_config.free_cache_engine)
                return
        self._ensure_tp_group()
        fast = self._fast_sender()
        if fast is not None:
            await self._send_fast(fast, self._named_tensors(weights), global_steps)
        else:
            await self._send_buckets(self._named_tensors(weights), global_steps)

    def _fast_sender(self) -> Optional[FastPathSender]:
        """This worker's fast-path sender (made on the first weight sync), or None: the flattened buckets.

        None when ``engine_kwargs.sgl_rollout.fast_sync`` is off, and (logged once) without CUDA or
        without the model's weight manifest (``validate_sync`` off, FP8, or unreadable), or when another
        TP rank of the replica lacks one of those (all TP ranks take the same path).
        """
        if self._fast is not None or not self.rollout_config.fast_sync:
            return self._fast
        reason = ""
        if not torch.cuda.is_available():
            reason = "no CUDA device in this trainer worker"
        elif self._sync_manifest() is None:
            reason = "no weight manifest (validate_sync off, FP8, or unreadable): the copy plan is made from it"
        reasons = [r for r in self._all_gather(reason) if r]
        if reasons:
            if not self._fast_off_logged:
                self._fast_off_logged = True
                logger.warning("fast_sync is on but weight syncs go through flattened buckets: %s", reasons[0])
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

        began = False
        error: Optional[BaseException] = None
        try:
            if self.is_leader_rank:
                await self.server.begin_weight_sync.remote()
                began = True
            validator = SyncValidator(self._sync_manifest())
            if hasattr(named, "__aiter__"):  # items are pulled from this loop by a helper thread
                loop = asyncio.get_running_loop()
                items = _AsyncToSyncIterator(named, loop, threading.current_thread())
                await loop.run_in_executor(self._bucket_executor(), _fast_send, sender, items, validator)
            else:  # verl's sync generators may run collectives that must stay on this thread
                _fast_send(sender, named, validator)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the closing round
            error = exc
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
        bucket k.

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
        pending, step = (self._submit("begin_weight_sync"), "begin a weight sync") if leader else (None, "")
        began = ok = False
        try:
            bucket = 0
            while True:
                local_exc: Optional[BaseException] = None
                try:
                    payload = await next_payload()
                except Exception as exc:  # noqa: BLE001 - reported to every TP rank, re-raised below
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
                stream.release(keep_newest=True)
                payloads = [p for p, _ in rounds]
                status = self._decide(payloads, bucket, [e for _, e in rounds if e])
                if status.startswith(_ERR):
                    raise local_exc or engine_exc or RuntimeError(status[len(_ERR) + 2:])
                if status == _DONE:
                    break
                if leader:
                    pending, step = self._submit("update_weights_from_payloads", payloads), f"load bucket {bucket}"
                bucket += 1
            ok = True
            self.base_syncs += 1
        finally:
            if pending is not None:  # left with a load in flight: its buffers stay until it answered
                try:
                    await pending
                    began = True
                except Exception:  # noqa: BLE001 - the sync has failed already; this is its cleanup
                    logger.exception("the engine failed to %s while the weight sync was failing", step)
            stream.release()
            await self._end_sync(named, began, ok, global_steps)

    async def _base_needed(self) -> bool:
        """The engine actor's answer to the base-resend rule, the same on every TP rank."""
        need, exc = None, None
        if self.is_leader_rank:
            try:
                need = bool(await self.server.base_sync_needed.remote())
            except Exception as e:  # noqa: BLE001 - the other ranks must hear of it
                exc, need = e, f"{_ERR}: the engine could not tell whether it holds its base weights: {e}"
        need = self._broadcast(need)
        if isinstance(need, str):
            if exc is not None:
                raise exc
            raise RuntimeError(need[len(_ERR) + 2:])
        return need

    async def _update_adapter(self, weights, peft_config, global_steps: Optional[int]) -> None:
        """Every rank reads verl's adapter tensors; the leader checks them (against the model's manifest and
        the engine's LoRA settings) and hands the engine actor one by-value payload; a failure on any rank
        or in the engine raises on every rank."""
        leader = self.is_leader_rank
        status, local_exc, payload = None, None, None
        try:
            items = await _collect(weights)
            if leader:
                payload = lora_sync.build_adapter_payload(items, peft_config, manifest=self._sync_manifest(),
                                                          engine_config=self.rollout_config)
            del items
        except Exception as exc:  # noqa: BLE001 - reported to every TP rank, re-raised below
            local_exc, status = exc, (_ERR, f"{type(exc).__name__}: {exc}")
        statuses = self._gather(status)
        engine_exc = None
        if leader:
            errors = [f"TP rank {r}: {p[1]}" for r, p in enumerate(statuses) if isinstance(p, tuple) and p[:1] == (_ERR,)]
            if errors:
                status = f"{_ERR}: the adapter sync failed on " + "; ".join(errors)
            else:
                try:
                    await self.server.load_lora_adapter.remote(VERL_ADAPTER_NAME, payload.data, payload.config)
                    status = _DONE
                except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it
                    engine_exc, status = exc, f"{_ERR}: the engine refused the adapter: {exc}"
        status = self._broadcast(status)
        if status != _DONE:
            if local_exc is not None:
                raise local_exc
            if engine_exc is not None:
                raise engine_exc
            raise RuntimeError(status[len(_ERR) + 2:])
        self.adapter_syncs += 1
        if leader and global_steps is not None:
            await self.server.set_global_steps.remote(global_steps)


def _fast_send(sender: FastPathSender, items, validator) -> None:
    """One fast-path sync of ``items`` by ``sender``, then the buffers freed (the engine closes its handles)."""
    sender.send(items, validator=validator)
    sender.release()


async def _collect(weights) -> list:
    """All ``(name, tensor)`` pairs of a sync or async iterable."""
    if hasattr(weights, "__aiter__"):
        return [item async for item in weights]
    return list(weights)


async def _drain(weights) -> None:
    """Read a sync or async iterable to its end, keeping nothing; then close it."""
    if hasattr(weights, "__aiter__"):
        async for _ in weights:
            pass
        await _aclose(weights)
    else:
        for _ in weights:
            pass
