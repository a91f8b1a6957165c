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
* :func:`launch_replica` lays a replica over several nodes
  (:class:`~sgl_rollout.engine.layout.ReplicaLayout`): the leader :class:`RolloutServer` (node rank 0,
  SGLang's tokenizer manager, every call) and a :class:`NodeEngineHost` on each other node (SGLang's
  schedulers of that node's TP ranks). The leader starts, watches, restarts and stops them; why per-node
  engine processes and not SGLang's ``RayEngine``: :class:`NodeEngineHost`.

CUDA IPC handles carry the device UUID (:mod:`sgl_rollout.weight_sync.ipc`), so a trainer worker that
sees its GPU as ``cuda:0`` and a scheduler that sees the same GPU as ``cuda:1`` agree.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence

from . import trace
from .config import FAST_SYNC_LOADER, RolloutConfig
from .engine import Generation
from .switch import sleep_stages
from .weight_sync.driver import EngineFence

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


#: ``SGLROLLOUT_ENGINE_LOOP=thread`` in the server actor's environment runs SGLang's coroutines on the
#: engine's own thread instead of the actor's event loop (to compare the two; see
#: :meth:`RolloutServer.engine_loop`).
ENGINE_LOOP_ENV = "SGLROLLOUT_ENGINE_LOOP"


class RolloutServer:
    """Ray actor body hosting one :class:`~sgl_rollout.engine.RolloutEngine` and its
    :class:`~sgl_rollout.switch.Switch` (the engine starts in :meth:`start`).

    All methods are coroutines so that Ray runs the actor as an async actor: generation requests
    from many clients overlap and SGLang batches them. SGLang's tokenizer manager runs on the actor's
    own event loop (:meth:`engine_loop`), so a request goes from Ray to SGLang without crossing a
    thread. Memory transitions go through the same guards as the in-process worker
    (:class:`~sgl_rollout.memory.MemoryStateError` on a bad call).

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
        self.engine = None
        self.switch = None
        self.global_steps: Optional[int] = None
        # Without this, a dying scheduler's SIGQUIT would end the actor (and everything verl awaits
        # on it) instead of raising EngineDeadError. An async actor runs outside the main thread, so
        # SIGQUIT is ignored here and deaths are found by the engine's watchdog.
        self.sigquit_handled = install_sigquit_handler()
        # a replica over several nodes (start(layout, node_hosts)): the layout, the other nodes' hosts, their watch
        self.layout = None
        self.node_hosts: list = []
        self.node_timeline: List[dict] = []
        self._node_watch = None

    @staticmethod
    def engine_loop():
        """The event loop the engine runs SGLang's coroutines on, or None for the engine's own thread.

        The actor's running loop, as verl's ``SGLangHttpServer`` runs SGLang
        (``verl/workers/rollout/sglang_rollout/async_sglang_server.py``): a request then reaches
        SGLang's tokenizer manager on the thread Ray delivered it on, and its answer goes back the
        same way, with no hand-over to a second thread that must win the GIL from the first (what
        that costs per request on the CPU: ``python -m sgl_rollout.bench requests``; in verl's run on two
        H100, one run per way did not separate them: ``examples/verl/compare/``). None (the engine's own
        thread) when called outside a running loop, on the main thread (SGLang's tokenizer manager
        would install its SIGQUIT handler there, which ends the process when a scheduler dies;
        Ray runs an async actor's loop in another thread), or with ``SGLROLLOUT_ENGINE_LOOP=thread``.
        """
        import asyncio
        import threading

        if os.environ.get(ENGINE_LOOP_ENV, "").strip().lower() == "thread":
            return None
        if threading.current_thread() is threading.main_thread():
            return None
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            return None

    def _leader_config(self) -> RolloutConfig:
        """The config with this node's part of :attr:`layout` (SGLang's ``nnodes``, ``node_rank``,
        ``dist_init_addr``, ports) in ``engine_kwargs``; the port block is moved off ports in use here."""
        import ray

        from .engine.layout import port_is_free

        self.layout = self.layout.first_free_block(port_is_free)
        self._leader_host = ray.util.get_node_ip_address()
        kwargs = {**self.config.engine_kwargs, **self.layout.engine_kwargs(0, self._leader_host)}
        kwargs.pop("tp_size")  # the config's tensor_model_parallel_size
        return self.config.model_copy(update={"engine_kwargs": kwargs})

    def _start_nodes(self) -> list:
        """Start the other nodes' engine processes (they wait for the leader's); their refs."""
        return [h.start.remote(self.layout, self._leader_host) for h in self.node_hosts]

    async def _await_nodes(self, refs: list) -> None:
        """Wait for the other nodes' starts; on a failure stop them all and re-raise it."""
        import asyncio

        results = await asyncio.gather(*refs, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self._stop_nodes()
            raise RuntimeError(f"a node of this replica failed to start its engine: {failed[0]!r}") from failed[0]

    async def _stop_nodes(self) -> None:
        import asyncio

        if self._node_watch is not None:
            self._node_watch.cancel()
            self._node_watch = None
        await asyncio.gather(*[h.stop.remote() for h in self.node_hosts], return_exceptions=True)

    async def start(self, layout=None, node_hosts: Sequence = ()) -> List[str]:
        """Start the engine in this actor (blocks the actor for the engine's start-up); returns its tags.

        Args:
            layout: for a replica over several nodes, its
                :class:`~sgl_rollout.engine.layout.ReplicaLayout`: this actor is its leader (node rank 0)
                and uses the layout's ports (a single-node layout only gives the ports).
            node_hosts: the :class:`NodeEngineHost` actors of node ranks 1, 2, ...; their engine
                processes are started at the same time as this one's (SGLang forms the TP group across
                them), then watched: a dead node makes this engine raise
                :class:`~sgl_rollout.engine.EngineDeadError` (see :meth:`_watch_nodes`).

        Idempotent: a second call returns the running engine's tags and starts nothing.

        Raises:
            EngineClosedError: the engine was shut down.
            ValueError: not one host per node other than the leader.
            RuntimeError: a node failed to start (every node's processes are stopped).
        """
        from .engine import RolloutEngine
        from .switch import Switch

        if self.engine is not None:
            self.engine.check_alive()
            return list(self.engine.tags)
        if layout is not None:
            if len(node_hosts) != layout.nnodes - 1:
                raise ValueError(f"{len(node_hosts)} node hosts for a replica over {layout.nnodes} nodes")
            self.layout, self.node_hosts = layout, list(node_hosts)
        config, refs = self.config, []
        if self.layout is not None:
            config = self._leader_config()
            refs = self._start_nodes()
        try:
            engine = RolloutEngine(config, engine_factory=self.engine_factory, loop=self.engine_loop())
        except BaseException:
            await self._stop_nodes()
            raise
        self.engine, self.switch = engine, Switch(engine, config)
        await self._await_nodes(refs)
        self._watch_nodes()
        return list(self.engine.tags)

    async def restart(self) -> List[str]:
        """Start a fresh engine after :class:`~sgl_rollout.engine.EngineDeadError` (blocks the actor
        for the start-up); sync weights before generating. Returns the tags. A replica over several
        nodes restarts on every node (the other nodes' processes are stopped first)."""
        if self.engine is None:
            return await self.start()
        refs = []
        if self.node_hosts:
            self.engine.fail("restart of the whole replica")
            await self._stop_nodes()
            refs = self._start_nodes()
        self.engine.restart()
        await self._await_nodes(refs)
        self._watch_nodes()
        return list(self.engine.tags)

    def _watch_nodes(self, interval_s: float = 1.0) -> None:
        """Ask every other node's host every ``interval_s`` seconds whether its engine processes live; when
        one does not (or its actor is gone) fail this engine (:meth:`RolloutEngine.fail`): its calls in
        flight and after raise EngineDeadError within about ``interval_s`` instead of hanging in a
        collective that waits for the dead node."""
        import asyncio

        if not self.node_hosts:
            return
        engine = self.engine

        async def watch():
            while engine.alive:
                for rank, host in enumerate(self.node_hosts, start=1):
                    try:
                        problem = await asyncio.wait_for(host.status.remote(), timeout=max(5.0, 5 * interval_s))
                    except Exception as exc:  # noqa: BLE001 - an unreachable node is a dead one
                        problem = f"its host actor is unreachable: {type(exc).__name__}: {exc}"
                    if problem is not None:
                        engine.fail(f"node {rank} of the replica: {problem}")
                        return
                await asyncio.sleep(interval_s)

        self._node_watch = asyncio.get_running_loop().create_task(watch())

    async def memory_by_node(self, phase: Optional[str] = None) -> Dict[int, Dict[int, int]]:
        """Device memory in use (bytes, NVML, all processes) on every GPU of every node of the replica:
        ``{node_rank: {gpu_id: used_bytes}}``; with ``phase``, also appended to :attr:`node_timeline`
        as ``{"phase", "nodes"}``. A node whose host cannot answer reports ``{}``."""
        import asyncio

        from .memory import gpu_used_bytes

        gpus = self.layout.leader.gpu_ids if self.layout is not None else [
            int(d) for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        out = {0: gpu_used_bytes(gpus)}
        others = await asyncio.gather(*[h.memory.remote() for h in self.node_hosts], return_exceptions=True)
        for rank, mem in enumerate(others, start=1):
            out[rank] = {} if isinstance(mem, BaseException) else mem
        if phase is not None:
            self.node_timeline.append({"phase": phase, "nodes": out})
        return out

    @property
    def _engine(self):
        if self.engine is None:
            raise RuntimeError("engine not started: call start() first")
        return self.engine

    @property
    def _switch(self):
        """The engine's :class:`~sgl_rollout.switch.Switch`.

        Raises:
            RuntimeError: the engine has not started.
        """
        if self.switch is None:
            raise RuntimeError("engine not started: call start() first")
        return self.switch

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
    @trace.traced("server.sleep")
    async def sleep(self) -> List[str]:
        """Release per ``sleep_level`` (nothing when ``free_cache_engine`` is False;
        :meth:`Switch.sleep <sgl_rollout.switch.Switch.sleep>`)."""
        if not sleep_stages(self.config):  # nothing to release (the switch's rule), started or not
            return []
        tags = await self._switch.async_sleep()
        if tags and self.layout is not None:  # a replica over nodes: every node's GPUs (one node: no NVML cost here)
            await self.memory_by_node("sleep")
        return tags

    async def release(self, tags: Optional[List[str]] = None) -> List[str]:
        """Release exactly ``tags`` (None: all); refuses invalid transitions."""
        return await self._engine.async_release(tags)

    async def resume(self, tags: Optional[List[str]] = None) -> List[str]:
        """Resume exactly ``tags`` (None: all); refuses invalid transitions."""
        return await self._engine.async_resume(tags)

    @trace.traced("server.resume", fields=("stage",))
    async def resume_stage(self, stage: str) -> List[str]:
        """Resume one stage of the staged wake, only what is released: ``"weights"``, or ``"kv_cache"``
        (KV cache and CUDA-graph memory; :data:`sgl_rollout.switch.STAGES`). A stage with nothing
        released is a no-op.

        Raises:
            ValueError: unknown stage.
        """
        tags = await self._switch.async_resume_stage(stage)
        if tags:
            await self._after_stage(stage, tags)
        return tags

    @trace.traced("server.wake_up")
    async def wake_up(self) -> List[str]:
        """Resume everything released: the switch's staged wake with nothing between the stages
        (:meth:`Switch.wake <sgl_rollout.switch.Switch.wake>`; no cache to empty in this process). Returns
        the tags resumed, weights first."""
        await self._switch.async_wake(empty_cache=False, after_stage=self._after_stage)
        return list(self._switch.last_resumed)

    async def _after_stage(self, stage: str, tags: List[str]) -> None:
        """A replica over nodes records every node's device memory after each resumed stage."""
        if self.layout is not None:
            await self.memory_by_node(f"resume_{stage}")

    # -------------------------------------------------------------- weights
    @trace.traced("server.begin_weight_sync")
    async def begin_weight_sync(self) -> None:
        """Start a bucketed weight sync: from here until :meth:`finish_weight_sync` no generate is
        admitted, so none sees half-new weights.

        Raises:
            MemoryStateError: weights released, requests running, or another operation in progress.
        """
        await EngineFence(self._engine).async_open()

    @trace.traced("server.finish_weight_sync")
    async def finish_weight_sync(self, ok: bool = True, global_steps: Optional[int] = None) -> None:
        """End the sync begun by :meth:`begin_weight_sync`; with ``ok`` the prefix cache is flushed and
        ``global_steps`` (when given) remembered as :meth:`set_global_steps` does, in the same call.

        ``ok=False`` (a failed sync) leaves the engine refusing generates until a complete sync, if
        any bucket had reached it.

        The flush runs before the fence lifts: a generate admitted between the two would otherwise find
        prefixes computed with the old weights (issue 39; no request runs inside the fence, so SGLang's
        flush, which it refuses while requests are pending, is not refused).
        """
        try:
            if ok:
                await self._engine.async_flush_cache()
        finally:
            EngineFence(self._engine).close(ok)
        if ok and global_steps is not None:
            await self.set_global_steps(global_steps)

    @trace.traced("server.update_weights_from_payloads")
    async def update_weights_from_payloads(self, payloads: List[bytes], fast_path: bool = False) -> None:
        """Load one flattened bucket (inside :meth:`begin_weight_sync` / :meth:`finish_weight_sync`):
        ``payloads[r]`` is TP rank ``r``'s serialized payload.

        Args:
            payloads: one per TP rank, in rank order.
            fast_path: the payloads are requests of the fast-path loader
                (:data:`~sgl_rollout.config.FAST_SYNC_LOADER`, :mod:`sgl_rollout.weight_sync.receiver`),
                which answers in each rank's status block; else SGLang's ``flattened_bucket`` format.

        Raises:
            RuntimeError: SGLang reports a failed load.
            MemoryStateError: the weights are released, or no sync was begun.
            ValueError: not one payload per TP rank; ``fast_path`` for an engine launched without
                ``fast_sync`` (SGLang would raise inside its scheduler for an unregistered loader,
                killing it, so nothing is sent).
        """
        if len(payloads) != self.config.tensor_model_parallel_size:
            raise ValueError(f"{len(payloads)} payloads for TP size {self.config.tensor_model_parallel_size}")
        if fast_path and not self.config.fast_sync:
            raise ValueError("a fast-path weight sync call for an engine launched without fast_sync; nothing was sent")
        load_format = FAST_SYNC_LOADER if fast_path else "flattened_bucket"
        ok, msg = await self._engine.async_update_weights_from_tensor(list(payloads), load_format=load_format)
        if not ok:
            raise RuntimeError(f"SGLang failed to load a weight bucket: {msg}")

    async def flush_cache(self) -> None:
        """Drop the prefix cache (after new weights)."""
        await self._engine.async_flush_cache()

    async def set_global_steps(self, global_steps: int) -> None:
        """Remember the trainer step whose weights the engine holds."""
        self.global_steps = global_steps

    async def shutdown(self) -> None:
        """Stop the engine's processes; for a replica over several nodes this node's first, then the
        others' (stopped the other way round, the leader's scheduler sees its peers' connections reset
        and logs an error)."""
        if self.engine is not None:
            self.engine.shutdown()
        await self._stop_nodes()


class NodeEngineHost:
    """Ray actor body hosting the engine process of one node other than the leader (node rank >= 1) of a
    replica that spans nodes: SGLang's schedulers of that node's TP ranks, no tokenizer manager.

    Why per-node engine processes under one Ray actor per node, and not SGLang's ``RayEngine``
    (``sglang/srt/ray/engine.py``, schedulers as Ray actors): the processes of every node are then started,
    watched and ended by the same code as a single-node engine's (:class:`~sgl_rollout.engine.lifecycle.EngineProcesses`:
    the environment for torch-memory-saver and the TP imbalance switch, SIGQUIT containment, only the
    engine's own children killed), the staged wake and the guards stay in the leader's
    :class:`~sgl_rollout.engine.RolloutEngine` unchanged, and a node's death is seen as a process exit
    there rather than as a Ray actor error inside SGLang's own launcher.

    Every call into SGLang (generate, release, resume, weight sync) goes to the leader
    (:class:`RolloutServer`); SGLang's scheduler on node 0 passes it to every TP rank. This actor starts,
    reports and stops. Created by :func:`launch_replica`.

    Args:
        config: rollout settings (as the leader's), or a dict of them.
        node_rank: SGLang's ``node_rank`` of this node (>= 1).

    Attributes:
        engine_factory: as :attr:`RolloutServer.engine_factory`.
    """

    engine_factory = None

    def __init__(self, config, node_rank: int):
        from .engine import install_sigquit_handler

        if node_rank < 1:
            raise ValueError(f"node_rank {node_rank}: node 0 is the leader's RolloutServer")
        self.config = config if isinstance(config, RolloutConfig) else RolloutConfig(**config)
        self.node_rank = node_rank
        self.layout = None
        self._procs = None
        self._dead: Optional[str] = "not started"
        self.sigquit_handled = install_sigquit_handler()

    async def start(self, layout, leader_host: str) -> List[int]:
        """Start this node's engine process with SGLang's ``node_rank``; returns when SGLang's schedulers on
        this node are up, which needs the leader's engine to start at the same time. Returns their pids.

        Raises:
            RuntimeError: already running; or SGLang's own error (its processes are killed).
        """
        from .engine.lifecycle import EngineProcesses, engine_env_updates

        if self._procs is not None and self._dead is None:
            raise RuntimeError(f"node {self.node_rank}'s engine is already running")
        factory = self.engine_factory
        if factory is None:
            from sglang.srt.entrypoints.engine import Engine as factory  # noqa: N813
        server_args = self.config.to_server_args()
        server_args.update(layout.engine_kwargs(self.node_rank, leader_host))
        env = engine_env_updates(disable_tp_imbalance_check=True)
        env.update(layout.node_env(self.node_rank))
        self.layout = layout
        self._dead = None
        self._procs = EngineProcesses(factory, server_args, env, on_death=self._on_death)
        return self._procs.child_pids

    def _on_death(self, reason: str) -> None:
        self._dead = reason
        self._procs.stop()

    async def status(self) -> Optional[str]:
        """None while this node's engine processes live; else why not (``"not started"``, ``"stopped"``,
        or which processes exited)."""
        return self._dead

    async def memory(self) -> Dict[int, int]:
        """``{gpu_id: used_bytes}`` of this node's GPUs of the replica (NVML; ``{}`` without it)."""
        from .memory import gpu_used_bytes

        return gpu_used_bytes(self.layout.nodes[self.node_rank].gpu_ids) if self.layout is not None else {}

    async def child_pids(self) -> List[int]:
        """Pids of this node's engine processes (its schedulers)."""
        return self._procs.child_pids if self._procs is not None else []

    async def stop(self) -> None:
        """End this node's engine processes (idempotent)."""
        if self._procs is not None:
            self._procs.stop()
        if self._dead is None:
            self._dead = "stopped"

    async def shutdown(self) -> None:
        """Same as :meth:`stop` (the name verl's replica calls)."""
        await self.stop()


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


def launch_replica(config: RolloutConfig, layout, node_ids: Sequence[str], name: Optional[str] = None,
                   max_concurrency: int = 1000, actor_cls=RolloutServer, host_cls=None):
    """Create the actors of one replica laid out as ``layout`` (not yet started).

    Start it with ``leader.start.remote(layout, hosts)``: the leader starts the other nodes' engines
    with its own. Every call then goes to the leader.

    Args:
        config: rollout settings.
        layout: the replica's :class:`~sgl_rollout.engine.layout.ReplicaLayout`.
        node_ids: Ray node id of each node rank of the replica (``len == layout.nnodes``).
        name: Ray actor name of the leader; the host of node rank ``k`` is named ``f"{name}_node{k}"``.
        max_concurrency: concurrent calls the leader accepts.
        actor_cls: the leader's body (:class:`RolloutServer` or a subclass).
        host_cls: the other nodes' body (:class:`NodeEngineHost` by default, or a subclass).

    Returns:
        ``(leader, hosts)``: Ray ActorHandles; ``hosts[k - 1]`` runs on node rank ``k``.

    Raises:
        ValueError: not one node id per node of the layout.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if len(node_ids) != layout.nnodes:
        raise ValueError(f"{len(node_ids)} node ids for a replica over {layout.nnodes} nodes")
    leader = launch_rollout_server(config, layout.leader.cuda_visible_devices, node_id=node_ids[0], name=name,
                                   max_concurrency=max_concurrency, actor_cls=actor_cls)
    hosts = []
    for slot in layout.nodes[1:]:
        opts: Dict[str, Any] = dict(
            num_gpus=0, runtime_env={"env_vars": rollout_env_vars(slot.cuda_visible_devices)},
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_ids[slot.node_rank], soft=False))
        if name:
            opts["name"] = f"{name}_node{slot.node_rank}"
        hosts.append(ray.remote(host_cls or NodeEngineHost).options(**opts).remote(config.model_dump(), slot.node_rank))
    return leader, hosts


def sync_weights_from_workers(server, workers: Sequence, prepare: str = "next_weight_payload",
                              release: str = "release_weight_payload") -> int:
    """Drive a bucketed weight sync where TP rank ``r``'s payload comes from ``workers[r]``: the bucket
    rounds of :func:`sgl_rollout.weight_sync.protocol.bucket_rounds` over Ray, inside the driver's fence
    (:func:`sgl_rollout.weight_sync.driver.sync_fenced` with the actor's ``begin_weight_sync`` /
    ``finish_weight_sync``).

    Each worker actor must offer ``prepare()`` returning the next bucket's serialized payload (bytes)
    or None when done, keeping that bucket's GPU buffer alive, and ``release()`` dropping it (see
    :class:`sgl_rollout.weight_sync.BucketStream`). Every worker must yield the same number of buckets.

    Returns:
        number of buckets loaded.

    Raises:
        RoundError: workers disagree on the number of buckets (a RuntimeError).
        RuntimeError: the engine fails to load a bucket.
        Whatever a worker's ``prepare()`` raises (a ``SyncValidationError``, say). In every case each
        worker's held bucket is released before this returns, and the engine is told the sync failed.
    """
    import ray

    from .weight_sync.driver import ServerFence, sync_fenced
    from .weight_sync.protocol import bucket_rounds

    def release_all(_bucket=None) -> None:
        ray.get([getattr(w, release).remote() for w in workers])

    def next_round(_bucket: int) -> list:
        refs = [getattr(w, prepare).remote() for w in workers]
        try:
            return ray.get(refs)
        except BaseException:
            ray.wait(refs, num_returns=len(refs))  # a failed worker must not leave the others holding
            release_all()
            raise

    def rounds() -> int:
        return bucket_rounds(
            next_round=next_round,
            load=lambda payloads, _bucket: ray.get(server.update_weights_from_payloads.remote(payloads)),
            release=release_all,
        )

    return sync_fenced(ServerFence(server), rounds)
