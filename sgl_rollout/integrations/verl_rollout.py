"""The trainer side of ``rollout.name=sglang`` under verl: the rollout in each trainer worker that
wakes, sleeps and sends the weights to its replica's engine actor (:mod:`.verl_server`).

:class:`SglRollout` is verl's ``BaseRollout`` (``verl/workers/rollout/base.py``). verl 0.9.1
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
trainer worker writing its own TP rank's shard (:meth:`SglRollout._send_fast`,
:class:`~sgl_rollout.weight_sync.driver.GroupLoader`), or as SGLang's flattened buckets, pipelined
(:meth:`SglRollout._send_buckets`).

LoRA served as an adapter: verl's trainer calls ``update_weights(base, peft_config=,
base_sync_done=False)`` while its own ``base_sync_done`` is False (a dummy load's first step) and
``update_weights(adapter, peft_config=, base_sync_done=True)`` every step. The base is sent only when
:func:`~sgl_rollout.weight_sync.lora.needs_base_sync` says the engine lacks it (asked of the engine
actor, which records its syncs, releases and restarts); otherwise every rank drains verl's generator
and nothing is sent. The adapter goes to SGLang's ``load_lora_adapter_from_tensors`` as one checked,
by-value ``flattened_bucket`` payload from the TP leader, replacing the previous version.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Mapping
from typing import Any, List, Optional

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from .. import trace
from ..switch import sleep_stages, stages_of
from ..weight_sync import lora as lora_sync
from ..weight_sync.fast_path import FastPathSender
from ..weight_sync.path import SyncPath
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
from .verl_checkpoint_engine import WIRE_FORMAT as P2P_WIRE_FORMAT
from . import verl_gather, verl_trainer_cache
from .verl_server import server_name
from .verl_weight_sync import VerlWeightSync, _drain

logger = logging.getLogger(__name__)

__all__ = ["SglRollout"]



async def _renamed_async(weights, path):
    async for name, tensor in weights:
        for item in path.renamed([(name.replace(".base_layer.", "."), tensor)]):
            yield item


async def _checked_fp8(helper, quantized):
    """verl's FP8 quantizer yields a weight unquantized when quantizing it fails (logged only): that
    bf16 tensor would be loaded into an FP8 layer. Refuse it instead."""
    async for name, tensor in quantized:
        if helper.should_quantize_param(name) and tensor.element_size() != 1:
            raise RuntimeError(f"FP8 quantization of {name} failed (verl's quantizer returned it as {tensor.dtype}); "
                               "see the error verl logged just before (torch.distributed must be initialised)")
        yield name, tensor


def _renamed_sync(weights, path):
    return path.renamed((name.replace(".base_layer.", "."), tensor) for name, tensor in weights)


class SglRollout(VerlWeightSync, BaseRollout):
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
        # inert unless SGLROLLOUT_LAYERED_GATHER=1: this trainer worker's FSDP engine gathers by unit
        verl_gather.install(rollout_dtype=self.rollout_config.dtype)
        # inert unless SGLROLLOUT_TRAINER_EMPTY_CACHE=auto: verl's update_weights skips empty_cache where room is
        verl_trainer_cache.install(SglRollout)
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
        self._sync_path = SyncPath(self.rollout_config, model_path_of(self.model_config),
                                   trust_remote_code=bool(_get(self.model_config, "trust_remote_code", False)),
                                   no_manifest="FP8-quantized on the way" if self._fp8 else None)
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._server = None
        self._fast: Optional[FastPathSender] = None
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

    def _all_gather(self, item) -> List[Any]:
        """Every TP rank's ``item``, in TP rank order, on every rank."""
        if self._tp_group is None or self.tp_size == 1:
            return [item]
        out = [None] * self.tp_size
        torch.distributed.all_gather_object(out, item, group=self._tp_group)
        return out

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
        if not self.is_leader_rank:
            return
        released = sleep_stages(self.rollout_config)  # the switch's rule: what a sleep released
        for stage in stages_of(tags):  # which stages these tags are, in wake order
            if stage in released:
                await self.server.resume_stage.remote(stage)

    @trace.traced("rollout.release")
    async def release(self):
        """Release per ``sleep_level`` (weights and KV cache at level 2)."""
        if self.is_leader_rank and sleep_stages(self.rollout_config):
            await self.server.sleep.remote()

    # -------------------------------------------------------------- weight sync
    def _named_tensors(self, weights):
        """``weights`` with LoRA ``.base_layer.`` names folded and transformers >= 5 names renamed to the
        checkpoint's, fused experts split into per-expert views (:meth:`SyncPath.renamed`), FP8-quantized
        when configured; a sync or an async iterator as ``weights`` (and the quantizer) make it."""
        path = self._sync_path
        weights = _renamed_async(weights, path) if hasattr(weights, "__aiter__") else _renamed_sync(weights, path)
        if self._fp8:
            from verl.utils.sglang.sglang_fp8_utils import SGLangFP8QuantizerHelper

            hf_config = _get(self.model_config, "hf_config", None)
            dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.bfloat16
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype)
            helper = SGLangFP8QuantizerHelper(fp8_quant_config(hf_config))
            weights = _checked_fp8(helper, helper.quant_weights_by_name(weights, dtype=dtype))
        return weights

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
            wire_format: ``"named_tensors"``, or :data:`~.verl_checkpoint_engine.WIRE_FORMAT` when ``weights``
                is the ``sgl_rollout`` checkpoint engine's receipt (:meth:`_receive_plan`: the trainer
                sends this rank's copy plan's bytes itself).
            peft_config: verl's LoRA adapter config (dict or ``peft.LoraConfig``) when it serves LoRA as
                an adapter, else None (full or merged weights).
            base_sync_done: with ``peft_config``: True: ``weights`` is the adapter (PEFT names), loaded
                as this replica's adapter (:data:`VERL_ADAPTER_NAME`), replacing the previous version;
                False: ``weights`` is the base model, sent only when the engine lacks it
                (:func:`~sgl_rollout.weight_sync.lora.needs_base_sync`, asked of the engine actor),
                else drained on every rank and dropped. Ignored without ``peft_config``.
            global_steps: the trainer step of these weights, reported in ``TokenOutput.extra_fields``.

        Raises:
            NotImplementedError: another ``wire_format``, or ``peft_config`` for an
                engine started without LoRA (``model.lora.merge=True``).
            BaseWeightsMissing: an adapter for an engine that lacks its base weights (it restarted, say);
                nothing was sent.
            SyncValidationError: the weights do not match the model's manifest (names, shapes, dtypes).
            RuntimeError: another TP rank failed, or the ranks disagree on the number of buckets.
            MemoryStateError, EngineDeadError, EngineClosedError: from the engine actor, unchanged.
        """
        if wire_format == P2P_WIRE_FORMAT and peft_config is None:
            self._ensure_tp_group()
            await self._receive_plan(weights, global_steps)
            return
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

    async def _base_needed(self) -> bool:
        """The engine actor's answer to the base-resend rule, the same on every TP rank (the leader asks;
        its failure raises on every rank, :meth:`TPGroup.agree <sgl_rollout.weight_sync.driver.TPGroup.agree>`)."""
        need, error = None, None
        if self.is_leader_rank:
            try:
                need = bool(await self.server.base_sync_needed.remote())
            except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it
                error = exc
        return self._sync_group().agree(need, error)[0]

    async def _update_adapter(self, weights, peft_config, global_steps: Optional[int]) -> None:
        """Every rank reads verl's adapter tensors; the leader checks them (against the model's manifest and
        the engine's LoRA settings) and hands the engine actor one by-value payload; a failure on any rank
        or in the engine raises on every rank (:meth:`TPGroup.agree
        <sgl_rollout.weight_sync.driver.TPGroup.agree>`)."""
        leader, group = self.is_leader_rank, self._sync_group()
        error, payload = None, None
        try:
            items = await _collect(weights)
            if leader:
                payload = lora_sync.build_adapter_payload(items, peft_config, manifest=self._sync_manifest(),
                                                          engine_config=self.rollout_config)
            del items
        except Exception as exc:  # noqa: BLE001 - reported to every TP rank, re-raised by agree
            error = exc
        group.agree(None, error)
        if leader:
            try:
                await self.server.load_lora_adapter.remote(VERL_ADAPTER_NAME, payload.data, payload.config)
            except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it
                error = exc
        group.agree(None, error)
        self.adapter_syncs += 1
        if leader and global_steps is not None:
            await self.server.set_global_steps.remote(global_steps)


async def _collect(weights) -> list:
    """All ``(name, tensor)`` pairs of a sync or async iterable."""
    if hasattr(weights, "__aiter__"):
        return [item async for item in weights]
    return list(weights)
