"""verl classes that answer ``rollout.name=sglang``: the in-worker adapter, the replica, the server actor.

Interfaces implemented (verl 0.9.1, read from its source):

* :class:`SglRolloutAdapter` is verl's ``BaseRollout`` (``verl/workers/rollout/base.py``), built in each
  trainer worker as ``cls(config=..., model_config=..., device_mesh=...)``. verl's
  ``ActorRolloutRefWorker.update_weights`` (``verl/workers/engine_workers.py``) calls
  ``resume(["weights"])`` (skipped when ``sleep_level == 1``), ``update_weights(gen, peft_config=,
  base_sync_done=, global_steps=)``, offloads the actor, then ``resume(["kv_cache"])``: the staged wake.
* :class:`SglRolloutReplica` is verl's ``RolloutReplica`` (``verl/workers/rollout/replica.py``): its
  ``launch_servers`` starts one :class:`VerlRolloutServer` actor per replica on the node of its
  trainer workers, with :mod:`sgl_rollout.ray`'s ``runtime_env``.
* :class:`VerlRolloutServer` adds to :class:`sgl_rollout.ray.RolloutServer` the methods verl's
  replica and ``LLMServerClient`` (``verl/workers/rollout/llm_server.py``) call: ``generate`` returning
  ``TokenOutput``, ``abort_all_requests``, ``resume_generation``, ``clear_kv_cache``,
  ``release_kv_cache``, ``resume_kv_cache``, ``start_profile``, ``stop_profile``,
  ``get_server_address``, ``set_global_steps``.

Not supported yet (raise NotImplementedError with this message): multi-node replicas, LoRA adapter
sync (``peft_config`` with ``base_sync_done``), ``wire_format="delta_flush"``, image and video inputs.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, List, Optional

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from ..config import RolloutConfig
from ..engine import _req
from ..memory import CUDA_GRAPH, KV_CACHE, WEIGHTS, aggressive_empty_cache
from ..ray import RolloutServer, launch_rollout_server, merge_visible_devices
from ..weight_sync import BucketStream

logger = logging.getLogger(__name__)


def server_name(replica_rank: int, node_rank: int = 0) -> str:
    """Ray actor name of a replica's engine server."""
    return f"sgl_rollout_server_{replica_rank}_{node_rank}"


def _get(cfg, key, default=None):
    try:
        return cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    except Exception:  # noqa: BLE001 - verl's BaseConfig raises on some missing keys
        return default


def rollout_config_from_verl(cfg, model_path: str) -> RolloutConfig:
    """Map verl's rollout config (``verl/workers/config/rollout.py``) to :class:`RolloutConfig`.

    TP size is verl's ``tensor_model_parallel_size * data_parallel_size`` (verl's own SGLang server
    does the same); the bucket size comes from ``checkpoint_engine.update_weights_bucket_megabytes``;
    ``engine_kwargs.sglang`` passes through.

    Raises:
        pydantic.ValidationError: a value out of range or an unknown SGLang key.
    """
    engine_kwargs = dict(_get(_get(cfg, "engine_kwargs", {}) or {}, "sglang", {}) or {})
    engine_kwargs.setdefault("skip_tokenizer_init", bool(_get(cfg, "skip_tokenizer_init", True)))
    ce = _get(cfg, "checkpoint_engine", None)
    bucket_mb = _get(ce, "update_weights_bucket_megabytes", None) if ce is not None else None
    kwargs = dict(
        model_path=model_path,
        dtype=_get(cfg, "dtype", "bfloat16"),
        tensor_model_parallel_size=int(_get(cfg, "tensor_model_parallel_size", 1)) * int(_get(cfg, "data_parallel_size", 1) or 1),
        gpu_memory_utilization=float(_get(cfg, "gpu_memory_utilization", 0.5)),
        free_cache_engine=bool(_get(cfg, "free_cache_engine", True)),
        enforce_eager=bool(_get(cfg, "enforce_eager", False)),
        max_num_seqs=_get(cfg, "max_num_seqs", None),
        load_format=_get(cfg, "load_format", "dummy") or "auto",
        engine_kwargs=engine_kwargs,
    )
    if bucket_mb:
        kwargs["update_weights_bucket_megabytes"] = int(bucket_mb)
    return RolloutConfig(**kwargs)


def _model_path(model_config) -> str:
    return _get(model_config, "local_path", None) or _get(model_config, "path")


class VerlRolloutServer(RolloutServer):
    """The engine actor, with the methods verl's replica and server client call.

    Args:
        config: rollout settings (dict or :class:`RolloutConfig`).
        max_model_len: context length; a request's default ``max_new_tokens`` is bounded by it.
        response_length: default ``max_new_tokens`` (verl's ``rollout.response_length``).
    """

    def __init__(self, config, max_model_len: Optional[int] = None, response_length: int = 512):
        super().__init__(config)
        self.max_model_len = max_model_len
        self.response_length = response_length

    async def generate(self, prompt_ids, sampling_params: dict, request_id: str, image_data=None,
                       video_data=None, **kwargs) -> TokenOutput:
        """One request, as ``LLMServerClient.generate`` sends it; returns verl's ``TokenOutput``.

        ``sampling_params`` may hold ``max_new_tokens`` or vLLM-style ``max_tokens`` and ``logprobs``
        (bool); other keys go to SGLang as they are.

        Raises:
            NotImplementedError: image or video input.
            ValueError: the prompt does not fit the context.
        """
        if image_data or video_data:
            raise NotImplementedError("sgl-rollout does not take image or video inputs yet")
        params = dict(sampling_params)
        return_logprob = bool(params.pop("logprobs", False))
        max_new_tokens, max_tokens = params.pop("max_new_tokens", None), params.pop("max_tokens", None)
        max_new = max_new_tokens or max_tokens or self.response_length
        if self.max_model_len:
            room = self.max_model_len - len(prompt_ids) - 1
            if room < 0:
                raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds max_model_len={self.max_model_len}")
            max_new = min(max_new, room)
        params["max_new_tokens"] = max_new
        ids = prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
        gen = (await self._engine.async_generate([ids], params, n=1, return_logprob=return_logprob))[0][0]
        return TokenOutput(token_ids=gen.output_ids, log_probs=gen.logprobs if return_logprob else None,
                           stop_reason=gen.finish_reason, extra_fields={"global_steps": self.global_steps})

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """Abort running requests (SGLang ``pause_generation(mode="abort")``)."""
        await self._engine._engine.tokenizer_manager.pause_generation(_req("PauseGenerationReqInput", mode="abort"))

    async def resume_generation(self) -> None:
        """Let requests run again after :meth:`abort_all_requests`."""
        await self._engine._engine.tokenizer_manager.continue_generation(_req("ContinueGenerationReqInput"))

    async def clear_kv_cache(self) -> None:
        """Drop the prefix cache."""
        await self.flush_cache()

    async def release_kv_cache(self) -> List[str]:
        """Release the KV cache (and CUDA-graph memory) if resident, keeping the weights."""
        released = set(self._engine.state.released)
        tags = [t for t in (KV_CACHE, CUDA_GRAPH) if t in self._engine.tags and t not in released]
        return await self._engine.async_release(tags) if tags else []

    async def resume_kv_cache(self) -> List[str]:
        """Resume the KV cache (and CUDA-graph memory) if released."""
        return await self.resume_stage(KV_CACHE)

    async def start_profile(self, **kwargs) -> None:
        """Profiling is not wired yet; logged and ignored."""
        logger.warning("sgl-rollout: start_profile is not supported; ignored")

    async def stop_profile(self) -> None:
        """See :meth:`start_profile`."""

    async def get_server_address(self):
        """(ip, port) of this actor; there is no HTTP server, so the port is 0."""
        return ray.util.get_node_ip_address(), 0


class SglRolloutReplica(RolloutReplica):
    """verl ``RolloutReplica`` whose server is a :class:`VerlRolloutServer` actor (one node).

    Attributes:
        server_class: the actor body; a subclass may swap it (tests use an engine double).
    """

    server_class = VerlRolloutServer

    async def launch_servers(self):
        """Start the engine actor on the node of this replica's workers, on the GPUs they use.

        Raises:
            NotImplementedError: the replica spans several nodes.
        """
        if self.nnodes > 1:
            raise NotImplementedError("sgl-rollout runs one replica on one node; lower TP or use verl's built-in")
        infos = await asyncio.gather(*[
            w.__ray_call__.remote(lambda self: (ray.get_runtime_context().get_node_id(),
                                                os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                                                [str(g) for g in ray.get_gpu_ids()]))
            for w in self.workers
        ])
        devices = merge_visible_devices([cvd or ",".join(gpus) for _node, cvd, gpus in infos])
        cfg = rollout_config_from_verl(self.config, _model_path(self.model_config))
        server = launch_rollout_server(cfg, devices, node_id=infos[0][0], name=server_name(self.replica_rank),
                                       max_concurrency=self.max_concurrency,
                                       actor_cls=_bind_server(self.server_class, self.config))
        await server.start.remote()
        ip, port = await server.get_server_address.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{ip}:{port}"
        logger.info("sgl-rollout replica %d: engine on GPUs %s of node %s", self.replica_rank, devices, infos[0][0])


def _bind_server(cls, verl_cfg):
    """Subclass of ``cls`` whose constructor also gets verl's length limits."""
    max_model_len = _get(verl_cfg, "max_model_len", None)
    response_length = int(_get(verl_cfg, "response_length", 512) or 512)

    class _Bound(cls):
        def __init__(self, config):
            super().__init__(config, max_model_len=max_model_len, response_length=response_length)

    _Bound.__name__ = cls.__name__
    return _Bound


class SglRolloutAdapter(BaseRollout):
    """verl ``BaseRollout`` living in each trainer worker; talks to the replica's engine actor.

    The TP leader (rank 0 of the ``infer_tp`` mesh dimension) makes the calls; every rank flattens its
    buckets on its own GPU and the leader gathers one payload per TP rank.

    Attributes:
        sleep_level: read by verl's trainer (2: weights and KV cache are released).
    """

    def __init__(self, config, model_config, device_mesh=None, *args, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        self.rollout_config = rollout_config_from_verl(self.config, _model_path(self.model_config))
        self.sleep_level = self.rollout_config.sleep_level
        tp = self.rollout_config.tensor_model_parallel_size
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = replica_rank if replica_rank >= 0 else rank // tp
        if device_mesh is not None and "infer_tp" in (device_mesh.mesh_dim_names or ()):
            self.tp_rank = device_mesh["infer_tp"].get_local_rank()
            self._tp_group = device_mesh["infer_tp"].get_group()
        else:
            self.tp_rank, self._tp_group = rank % tp, None
        self._server = None
        logger.info("rollout.name=sglang answered by sgl-rollout (replica %d, TP rank %d)", self.replica_rank, self.tp_rank)

    @property
    def server(self):
        """The replica's engine actor (looked up by name on first use)."""
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    def _barrier(self):
        if self._tp_group is not None:
            torch.distributed.barrier(group=self._tp_group)

    async def resume(self, tags: List[str]):
        """Resume a stage of the staged wake: ``["weights"]`` or ``["kv_cache"]``.

        Before the KV cache comes back, every rank returns its freed trainer memory to the driver
        (:func:`aggressive_empty_cache`).
        """
        if not self.rollout_config.free_cache_engine:
            return
        if KV_CACHE in tags:
            aggressive_empty_cache()
            self._barrier()
        if self.tp_rank == 0:
            for stage in (WEIGHTS, KV_CACHE):
                if stage in tags:
                    await self.server.resume_stage.remote(stage)

    async def release(self):
        """Release per ``sleep_level`` (weights and KV cache at level 2)."""
        if self.rollout_config.free_cache_engine and self.tp_rank == 0:
            await self.server.sleep.remote()

    async def update_weights(self, weights, wire_format: str = "named_tensors", peft_config=None,
                             base_sync_done: bool = True, global_steps: Optional[int] = None, **kwargs):
        """Stream ``weights`` ((name, tensor) generator) to the engine in flattened buckets.

        Every TP rank must consume the generator (verl's full-tensor gathers are collective).

        Raises:
            NotImplementedError: ``wire_format`` other than ``"named_tensors"``, or a LoRA adapter sync.
        """
        if wire_format != "named_tensors":
            raise NotImplementedError(f"wire_format={wire_format!r} is not supported by sgl-rollout yet")
        if peft_config is not None and base_sync_done:
            raise NotImplementedError("LoRA adapter sync is not supported by sgl-rollout yet")
        stream = BucketStream(((n.replace(".base_layer.", "."), t) for n, t in weights),
                              self.rollout_config.bucket_bytes)
        tp = self.rollout_config.tensor_model_parallel_size
        while True:
            payload = stream.next_payload()
            payloads = self._gather(payload, tp)
            done = payload is None
            if self.tp_rank == 0 and not done:
                await self.server.update_weights_from_payloads.remote(payloads)
            self._barrier()  # every rank keeps its buffer until the engine has copied the bucket
            if done:
                break
            stream.release()
        if self.tp_rank == 0:
            await self.server.flush_cache.remote()
            if global_steps is not None:
                await self.server.set_global_steps.remote(global_steps)

    def _gather(self, payload: Optional[bytes], tp: int) -> List[Any]:
        if self._tp_group is None or tp == 1:
            return [payload]
        out = [None] * tp if self.tp_rank == 0 else None
        dst = torch.distributed.get_global_rank(self._tp_group, 0)
        torch.distributed.gather_object(payload, out, dst=dst, group=self._tp_group)
        return out
