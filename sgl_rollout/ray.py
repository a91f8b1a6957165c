"""Run the rollout engine in a Ray actor, colocated with trainer workers that started in any order.

* :func:`rollout_env_vars` gives the ``runtime_env`` variables the engine's actor needs: the TP
  memory-imbalance switch (``patches/tp_memory_imbalance.py``; out-of-order workers leave GPUs with
  unequal free memory), ``NCCL_CUMEM_ENABLE=0``, ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``
  (Ray must not overwrite the devices we give) and ``CUDA_VISIBLE_DEVICES`` = the GPUs the actor
  shares with its trainer workers. They are set on this actor only: ``runtime_env`` does not leak
  into other actors. The legacy ``SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK`` (which would turn the check
  back ON) cannot be unset through ``runtime_env``; :class:`sgl_rollout.engine.RolloutEngine` removes
  it from the environment its scheduler processes are spawned with.
* :class:`RolloutServer` is the actor body (an async actor: generation requests run concurrently).
* :func:`launch_rollout_server` starts one, with zero GPUs reserved in Ray's accounting (the GPUs
  belong to the colocated trainer workers).
* :func:`sync_weights_from_workers` drives a weight sync where every TP rank's payload comes from a
  different trainer worker (each on its own GPU), bucket by bucket.

CUDA IPC handles carry the device UUID (:mod:`sgl_rollout.weight_sync.ipc`), so a trainer worker that
sees its GPU as ``cuda:0`` and a scheduler that sees the same GPU as ``cuda:1`` agree.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence

from .config import RolloutConfig
from .engine import Generation
from .memory import CUDA_GRAPH, KV_CACHE, WEIGHTS

#: Variables the engine actor reads back in :meth:`RolloutServer.env` (tests, ``doctor``).
WATCHED_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "NCCL_CUMEM_ENABLE",
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
    "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK",
    "SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK",
)


def rollout_env_vars(cuda_visible_devices: str, sglang_version: Optional[str] = None) -> Dict[str, str]:
    """``runtime_env["env_vars"]`` for the engine actor.

    Args:
        cuda_visible_devices: physical GPU ids the engine shares with its trainer workers, e.g. ``"0,1"``.
        sglang_version: for the version-gated imbalance switch; None reads the installed SGLang.

    Returns:
        dict of variable -> value (Ray's runtime_env cannot unset variables; see module docstring).
    """
    from .patches import tp_memory_imbalance

    env = {k: v for k, v in tp_memory_imbalance.env_updates(sglang_version).items() if v is not None}
    env.update(
        NCCL_CUMEM_ENABLE="0",
        RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES="1",
        CUDA_VISIBLE_DEVICES=cuda_visible_devices,
    )
    return env


def merge_visible_devices(per_worker: Sequence[str]) -> str:
    """Sorted union of the workers' ``CUDA_VISIBLE_DEVICES`` strings: ``["1", "0"] -> "0,1"``."""
    ids = {int(d) for s in per_worker for d in str(s).split(",") if d.strip()}
    return ",".join(str(i) for i in sorted(ids))


class RolloutServer:
    """Ray actor body hosting one :class:`~sgl_rollout.worker.RolloutWorker` (the engine starts in :meth:`start`).

    All methods are coroutines so that Ray runs the actor as an async actor: generation requests
    from many clients overlap and SGLang batches them. Memory transitions go through the same
    guards as the in-process worker (:class:`~sgl_rollout.memory.MemoryStateError` on a bad call).

    Args:
        config: rollout settings, or a dict of them.

    Attributes:
        engine_factory: passed to :class:`~sgl_rollout.engine.RolloutEngine` (None: ``sglang.Engine``);
            a subclass may set an engine double.
    """

    engine_factory = None

    def __init__(self, config):
        from .engine import install_sigquit_handler

        self.config = config if isinstance(config, RolloutConfig) else RolloutConfig(**config)
        self.worker = None
        self.global_steps: Optional[int] = None
        # Without this, a dying scheduler's SIGQUIT would end the actor (and everything verl awaits
        # on it) instead of raising EngineDeadError. An async actor runs outside the main thread, so
        # SIGQUIT is ignored here and deaths are found by the engine's watchdog.
        self.sigquit_handled = install_sigquit_handler()

    async def start(self) -> List[str]:
        """Start the engine in this actor (blocks the actor for the engine's start-up); returns its tags.

        Idempotent: a second call returns the running engine's tags and starts nothing.

        Raises:
            EngineClosedError: the engine was shut down.
        """
        from .engine import RolloutEngine
        from .worker import RolloutWorker

        if self.worker is not None:
            self.worker.engine.check_alive()
            return list(self.worker.engine.tags)
        engine = RolloutEngine(self.config, engine_factory=self.engine_factory)
        self.worker = RolloutWorker(self.config, engine=engine)
        return list(self.worker.engine.tags)

    async def restart(self) -> List[str]:
        """Start a fresh engine after :class:`~sgl_rollout.engine.EngineDeadError` (blocks the actor
        for the start-up); sync weights before generating. Returns the tags."""
        if self.worker is None:
            return await self.start()
        self.worker.restart()
        return list(self.worker.engine.tags)

    @property
    def _engine(self):
        if self.worker is None:
            raise RuntimeError("engine not started: call start() first")
        return self.worker.engine

    async def env(self) -> Dict[str, Optional[str]]:
        """The watched environment variables as this actor sees them (None: unset)."""
        return {k: os.environ.get(k) for k in WATCHED_ENV}

    async def memory_state(self) -> Dict[str, Any]:
        """``{"released": [...], "in_flight": int, "busy": str | None, "weights_incomplete": bool, "alive": bool}``."""
        s = self._engine.state
        return {"released": list(s.released), "in_flight": s.in_flight, "busy": s.busy,
                "weights_incomplete": s.weights_incomplete, "alive": self._engine.alive}

    # -------------------------------------------------------------- generation
    async def generate_batch(self, input_ids: List[List[int]], sampling_params: Optional[dict] = None, n: int = 1,
                             return_logprob: bool = True) -> List[List[Generation]]:
        """Sample ``n`` completions for each prompt (see :meth:`RolloutEngine.generate`)."""
        return await self._engine.async_generate(input_ids, sampling_params, n=n, return_logprob=return_logprob)

    # -------------------------------------------------------------- memory
    async def sleep(self) -> List[str]:
        """Release per ``sleep_level`` (nothing when ``free_cache_engine`` is False)."""
        if not self.config.free_cache_engine:
            return []
        return await self._engine.async_release(self.worker.release_tags())

    async def release(self, tags: Optional[List[str]] = None) -> List[str]:
        """Release exactly ``tags`` (None: all); refuses invalid transitions."""
        return await self._engine.async_release(tags)

    async def resume(self, tags: Optional[List[str]] = None) -> List[str]:
        """Resume exactly ``tags`` (None: all); refuses invalid transitions."""
        return await self._engine.async_resume(tags)

    async def resume_stage(self, stage: str) -> List[str]:
        """Resume one stage of the staged wake, only what is released: ``"weights"``, or ``"kv_cache"``
        (KV cache and CUDA-graph memory). A stage with nothing released is a no-op.

        Raises:
            ValueError: unknown stage.
        """
        tags = {WEIGHTS: [WEIGHTS], KV_CACHE: [KV_CACHE, CUDA_GRAPH]}.get(stage)
        if tags is None:
            raise ValueError(f"unknown stage {stage!r}; use 'weights' or 'kv_cache'")
        released = set(self._engine.state.released)
        tags = [t for t in tags if t in released]
        return await self._engine.async_resume(tags) if tags else []

    async def wake_up(self) -> List[str]:
        """Resume everything released, weights first."""
        return await self.resume_stage(WEIGHTS) + await self.resume_stage(KV_CACHE)

    # -------------------------------------------------------------- weights
    async def begin_weight_sync(self) -> None:
        """Start a bucketed weight sync: from here until :meth:`finish_weight_sync` no generate is
        admitted, so none sees half-new weights.

        Raises:
            MemoryStateError: weights released, requests running, or another operation in progress.
        """
        await self._engine.async_begin_sync()

    async def finish_weight_sync(self, ok: bool = True) -> None:
        """End the sync begun by :meth:`begin_weight_sync`; with ``ok`` the prefix cache is flushed.

        ``ok=False`` (a failed sync) leaves the engine refusing generates until a complete sync, if
        any bucket had reached it.
        """
        self._engine.end_sync(ok)
        if ok:
            await self._engine.async_flush_cache()

    async def update_weights_from_payloads(self, payloads: List[bytes]) -> None:
        """Load one flattened bucket (inside :meth:`begin_weight_sync` / :meth:`finish_weight_sync`):
        ``payloads[r]`` is TP rank ``r``'s serialized payload.

        Raises:
            RuntimeError: SGLang reports a failed load.
            MemoryStateError: the weights are released, or no sync was begun.
            ValueError: not one payload per TP rank.
        """
        if len(payloads) != self.config.tensor_model_parallel_size:
            raise ValueError(f"{len(payloads)} payloads for TP size {self.config.tensor_model_parallel_size}")
        ok, msg = await self._engine.async_update_weights_from_tensor(list(payloads), load_format="flattened_bucket")
        if not ok:
            raise RuntimeError(f"SGLang failed to load a weight bucket: {msg}")

    async def flush_cache(self) -> None:
        """Drop the prefix cache (after new weights)."""
        await self._engine.async_flush_cache()

    async def set_global_steps(self, global_steps: int) -> None:
        """Remember the trainer step whose weights the engine holds."""
        self.global_steps = global_steps

    async def shutdown(self) -> None:
        """Stop the engine's processes."""
        if self.worker is not None:
            self.worker.shutdown()


def launch_rollout_server(config: RolloutConfig, cuda_visible_devices: str, node_id: Optional[str] = None,
                          name: Optional[str] = None, max_concurrency: int = 1000, actor_cls=RolloutServer):
    """Create the engine actor (not yet started: call ``start.remote()``).

    Args:
        config: rollout settings.
        cuda_visible_devices: GPUs shared with the colocated trainer workers (see :func:`merge_visible_devices`).
        node_id: Ray node to pin the actor to (hard affinity); None lets Ray choose.
        name: Ray actor name (for ``ray.get_actor``).
        max_concurrency: concurrent calls the async actor accepts.
        actor_cls: the actor body, :class:`RolloutServer` or a subclass.

    Returns:
        the Ray ActorHandle.
    """
    import ray

    opts: Dict[str, Any] = dict(
        num_gpus=0,
        runtime_env={"env_vars": rollout_env_vars(cuda_visible_devices)},
        max_concurrency=max_concurrency,
    )
    if name:
        opts["name"] = name
    if node_id:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    return ray.remote(actor_cls).options(**opts).remote(config.model_dump())


def sync_weights_from_workers(server, workers: Sequence, prepare: str = "next_weight_payload",
                              release: str = "release_weight_payload") -> int:
    """Drive a bucketed weight sync where TP rank ``r``'s payload comes from ``workers[r]``.

    Each worker actor must offer ``prepare()`` returning the next bucket's serialized payload (bytes)
    or None when done, keeping that bucket's GPU buffer alive, and ``release()`` dropping it (see
    :class:`sgl_rollout.weight_sync.BucketStream`). Every worker must yield the same number of buckets.

    Returns:
        number of buckets loaded.

    Raises:
        RuntimeError: workers disagree on the number of buckets, or the engine fails to load one.
        Whatever a worker's ``prepare()`` raises (a ``SyncValidationError``, say). In every case each
        worker's held bucket is released before this returns, and the engine is told the sync failed.
    """
    import ray

    n = 0
    ray.get(server.begin_weight_sync.remote())
    ok = False
    try:
        while True:
            refs = [getattr(w, prepare).remote() for w in workers]
            try:
                payloads = ray.get(refs)
                done = [p is None for p in payloads]
                if all(done):
                    break
                if any(done):
                    raise RuntimeError(f"workers ran out of buckets at different times (bucket {n}: {done})")
                ray.get(server.update_weights_from_payloads.remote(payloads))
            finally:
                ray.wait(refs, num_returns=len(refs))  # a failed worker must not leave the others holding
                ray.get([getattr(w, release).remote() for w in workers])
            n += 1
        ok = True
    finally:
        ray.get(server.finish_weight_sync.remote(ok))
    return n
