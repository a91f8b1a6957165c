"""Where each part of a rollout replica runs: its nodes, TP ranks, GPUs and ports.

A replica is one SGLang engine with TP size ``tp``. When ``tp`` is larger than a node's GPUs, SGLang
0.5.10 runs it as one engine process per node, each started with ``Engine(tp_size=tp, nnodes=N,
node_rank=n, dist_init_addr="<node 0 ip>:<port>")``:

* node ``n`` hosts TP ranks ``[n * tp / N, (n + 1) * tp / N)`` on its GPUs ``base_gpu_id + k *
  gpu_id_step`` (``_compute_node_rank_ranges`` and ``_launch_scheduler_processes``,
  ``sglang/srt/entrypoints/engine.py``);
* only node 0 runs the tokenizer manager and detokenizer; the others return from ``Engine(...)`` only
  with ``SGLANG_BLOCK_NONZERO_RANK_CHILDREN=0`` (same file) and host schedulers;
* the TP group's TCP store listens on ``dist_init_addr`` on node 0 (``ModelRunner.init_torch_distributed``,
  ``sglang/srt/model_executor/model_runner.py``). With DP attention, ``PortArgs.init_new``
  (``sglang/srt/server_args.py``) also binds ``port + 1`` to ``port + 4`` on that host; ``nccl_port`` is
  a random free port unless given, so two engines starting at once on one node can draw the same one.

Several replicas share a node when ``tp`` is smaller than its GPUs. :func:`plan_replicas` gives every
replica its own block of :data:`PORTS_PER_REPLICA` ports (the store, the DP-attention ports, ``nccl_port``),
disjoint from every other replica's, so replicas never collide whichever nodes they share; the node-0
process of a replica checks its block is free before starting (:meth:`ReplicaLayout.first_free_block`),
and moves it by whole strides of all replicas' blocks if not, which keeps the blocks disjoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

#: Ports of one replica's block: +0 the TP group's store (``dist_init_addr``), +1..+4 the ports
#: ``PortArgs.init_new`` derives from it under DP attention, +5 ``nccl_port``, +6 SGLang's ``port``
#: (bound only by SGLang's HTTP server, which this package does not start), +7 spare.
PORTS_PER_REPLICA = 8
#: First port of replica 0's block by default: below Linux's ephemeral range (32768-60999), where
#: random free ports (Ray's, torch's, SGLang's ``get_free_port``) come from.
DEFAULT_BASE_PORT = 20000
#: Highest port a block may reach.
MAX_PORT = 32767


class LayoutError(ValueError):
    """A replica layout that cannot be built; the message names the numbers."""


@dataclass(frozen=True)
class NodeSlot:
    """One node's part of a replica.

    Attributes:
        node_rank: SGLang's ``node_rank`` (0 hosts the tokenizer manager and answers every call).
        node_index: index of the node among all nodes of the run (0-based; the n-th Ray node the
            trainer's workers were placed on).
        tp_ranks: the TP ranks whose schedulers run on this node, ascending.
        gpu_ids: the node's GPU ids they run on (``CUDA_VISIBLE_DEVICES`` of the node's engine
            process, in TP-rank order).
    """

    node_rank: int
    node_index: int
    tp_ranks: Tuple[int, ...]
    gpu_ids: Tuple[int, ...]

    @property
    def cuda_visible_devices(self) -> str:
        """``CUDA_VISIBLE_DEVICES`` for this node's engine process, e.g. ``"4,5,6,7"``."""
        return ",".join(str(g) for g in self.gpu_ids)


@dataclass(frozen=True)
class ReplicaLayout:
    """One replica: its nodes and its port block.

    Attributes:
        replica_rank: 0-based index of the replica.
        tp_size: TP size of the replica's engine (GPUs it uses).
        nodes: one :class:`NodeSlot` per node, ``node_rank`` order.
        port_base: first port of the replica's block (:data:`PORTS_PER_REPLICA` ports).
        port_stride: what :meth:`first_free_block` moves the block by (all replicas' blocks), ports.
    """

    replica_rank: int
    tp_size: int
    nodes: Tuple[NodeSlot, ...]
    port_base: int
    port_stride: int

    @property
    def nnodes(self) -> int:
        """Nodes the replica spans (SGLang's ``nnodes``)."""
        return len(self.nodes)

    @property
    def leader(self) -> NodeSlot:
        """The node-rank-0 slot (tokenizer manager, every call)."""
        return self.nodes[0]

    @property
    def dist_init_port(self) -> int:
        """Port of the TP group's store on the leader's host."""
        return self.port_base

    @property
    def nccl_port(self) -> int:
        """SGLang's ``nccl_port`` for this replica (given, so that engines starting together differ)."""
        return self.port_base + 5

    @property
    def sglang_port(self) -> int:
        """SGLang's ``port`` for this replica."""
        return self.port_base + 6

    def ports(self) -> range:
        """Every port of the block."""
        return range(self.port_base, self.port_base + PORTS_PER_REPLICA)

    def engine_kwargs(self, node_rank: int, leader_host: Optional[str] = None) -> Dict[str, object]:
        """SGLang ``ServerArgs`` fields for the engine process of ``node_rank``.

        Args:
            node_rank: which node's engine.
            leader_host: the leader's IP address (needed when the replica spans nodes).

        Returns:
            ``tp_size``, ``nnodes``, ``node_rank``, ``nccl_port``, ``port``, ``base_gpu_id`` 0 and
            ``gpu_id_step`` 1 (the process sees only its node's GPUs, :attr:`NodeSlot.cuda_visible_devices`),
            and ``dist_init_addr`` when ``nnodes > 1``.

        Raises:
            LayoutError: ``node_rank`` out of range, or no ``leader_host`` for a multi-node replica.
        """
        if not 0 <= node_rank < self.nnodes:
            raise LayoutError(f"node_rank {node_rank} is not one of replica {self.replica_rank}'s "
                              f"{self.nnodes} node(s)")
        kwargs: Dict[str, object] = dict(tp_size=self.tp_size, nnodes=self.nnodes, node_rank=node_rank,
                                         nccl_port=self.nccl_port, port=self.sglang_port,
                                         base_gpu_id=0, gpu_id_step=1)
        if self.nnodes > 1:
            if not leader_host:
                raise LayoutError(f"replica {self.replica_rank} spans {self.nnodes} nodes: its engines need "
                                  "the leader's IP address for dist_init_addr")
            host = f"[{leader_host}]" if ":" in leader_host else leader_host
            kwargs["dist_init_addr"] = f"{host}:{self.dist_init_port}"
        return kwargs

    def node_env(self, node_rank: int) -> Dict[str, str]:
        """Environment of ``node_rank``'s engine process beyond the single-node one: its GPUs, and for
        a node other than the leader ``SGLANG_BLOCK_NONZERO_RANK_CHILDREN=0`` (so ``Engine(...)`` returns)."""
        env = {"CUDA_VISIBLE_DEVICES": self.nodes[node_rank].cuda_visible_devices}
        if node_rank > 0:
            env["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"
        return env

    def first_free_block(self, is_free: Callable[[int], bool], max_port: int = MAX_PORT) -> "ReplicaLayout":
        """This layout with its block moved, by whole :attr:`port_stride` steps, to the first place where
        ``is_free(port)`` holds for every port; run on the leader's host.

        Raises:
            LayoutError: no free block below ``max_port``.
        """
        base = self.port_base
        while base + PORTS_PER_REPLICA - 1 <= max_port:
            if all(is_free(p) for p in range(base, base + PORTS_PER_REPLICA)):
                return ReplicaLayout(self.replica_rank, self.tp_size, self.nodes, base, self.port_stride)
            base += self.port_stride
        raise LayoutError(f"replica {self.replica_rank}: no block of {PORTS_PER_REPLICA} free ports from "
                          f"{self.port_base} in steps of {self.port_stride} up to {max_port}")


def port_is_free(port: int, host: str = "") -> bool:
    """True when a TCP socket can bind ``port`` on ``host`` (all addresses by default) here, now."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def plan_replicas(n_gpus: int, tp_size: int, gpus_per_node: int,
                  base_port: int = DEFAULT_BASE_PORT) -> List[ReplicaLayout]:
    """Lay ``n_gpus // tp_size`` replicas of TP size ``tp_size`` over nodes of ``gpus_per_node`` GPUs, in
    the order verl places its workers (replica ``r`` takes global GPUs ``[r * tp, (r + 1) * tp)``; node
    ``i`` holds global GPUs ``[i * gpus_per_node, (i + 1) * gpus_per_node)``).

    Args:
        n_gpus: GPUs of the run (all nodes).
        tp_size: GPUs per replica.
        gpus_per_node: GPUs of every node.
        base_port: first port of replica 0's block.

    Returns:
        one :class:`ReplicaLayout` per replica; blocks ``base_port + r * PORTS_PER_REPLICA``, stride all
        replicas' blocks.

    Raises:
        LayoutError: a size is not positive, ``tp_size`` neither divides ``gpus_per_node`` nor is a
            multiple of it, ``n_gpus`` is not a multiple of ``tp_size`` or of the GPUs a replica's nodes
            hold, or the blocks would pass :data:`MAX_PORT`.
    """
    if min(n_gpus, tp_size, gpus_per_node) < 1:
        raise LayoutError(f"n_gpus={n_gpus}, tp_size={tp_size}, gpus_per_node={gpus_per_node} must all be >= 1")
    if tp_size <= gpus_per_node:
        if gpus_per_node % tp_size:
            raise LayoutError(f"tp_size={tp_size} does not divide gpus_per_node={gpus_per_node}: a replica "
                              "would straddle two nodes with part of each")
    elif tp_size % gpus_per_node:
        raise LayoutError(f"tp_size={tp_size} > gpus_per_node={gpus_per_node} is not a multiple of it: "
                          "SGLang splits a TP group evenly over whole nodes")
    if n_gpus % tp_size:
        raise LayoutError(f"n_gpus={n_gpus} is not a multiple of tp_size={tp_size}")
    n_replicas = n_gpus // tp_size
    stride = n_replicas * PORTS_PER_REPLICA
    if base_port + stride - 1 > MAX_PORT:
        raise LayoutError(f"{n_replicas} replicas x {PORTS_PER_REPLICA} ports from {base_port} pass port "
                          f"{MAX_PORT}; lower base_port")
    nnodes = max(1, tp_size // gpus_per_node)
    per_node = tp_size // nnodes
    out = []
    for r in range(n_replicas):
        firsts = [r * tp_size + n * per_node for n in range(nnodes)]  # global GPU of each node's first rank
        places = [divmod(first, gpus_per_node) for first in firsts]
        out.append(replica_layout(r, tp_size, [range(local, local + per_node) for _node, local in places],
                                  node_indices=[node for node, _local in places], n_replicas=n_replicas,
                                  base_port=base_port))
    return out


def replica_layout(replica_rank: int, tp_size: int, gpu_ids_per_node: Sequence[Sequence[int]],
                   node_indices: Optional[Sequence[int]] = None, n_replicas: Optional[int] = None,
                   base_port: int = DEFAULT_BASE_PORT) -> ReplicaLayout:
    """The layout of one replica whose nodes are known: node rank ``n`` runs on the GPUs
    ``gpu_ids_per_node[n]`` of its node (e.g. where verl placed the replica's trainer workers).

    Args:
        replica_rank: the replica's index; its port block is ``base_port + replica_rank * PORTS_PER_REPLICA``.
        tp_size: the replica's TP size.
        gpu_ids_per_node: per node rank, the GPU ids there, in TP-rank order.
        node_indices: each node's index in the run (default ``0, 1, ...``).
        n_replicas: replicas of the run (the stride :meth:`ReplicaLayout.first_free_block` moves by
            is all their blocks); None: as many as fit below :data:`MAX_PORT`.
        base_port: first port of replica 0's block.

    Raises:
        LayoutError: the nodes do not hold ``tp_size / nnodes`` GPUs each.
    """
    nnodes = len(gpu_ids_per_node)
    if nnodes < 1 or tp_size % nnodes or any(len(g) != tp_size // nnodes for g in gpu_ids_per_node):
        raise LayoutError(f"replica {replica_rank}: tp_size={tp_size} over GPUs {[list(g) for g in gpu_ids_per_node]} "
                          "per node: SGLang needs the same number of GPUs on each node")
    per_node = tp_size // nnodes
    indices = list(node_indices) if node_indices is not None else list(range(nnodes))
    slots = tuple(NodeSlot(node_rank=n, node_index=indices[n], tp_ranks=tuple(range(n * per_node, (n + 1) * per_node)),
                           gpu_ids=tuple(int(g) for g in gpu_ids_per_node[n])) for n in range(nnodes))
    if n_replicas is None:
        n_replicas = (MAX_PORT + 1 - base_port) // PORTS_PER_REPLICA
    return ReplicaLayout(replica_rank, tp_size, slots, base_port + replica_rank * PORTS_PER_REPLICA,
                         n_replicas * PORTS_PER_REPLICA)

__all__ = ["DEFAULT_BASE_PORT", "LayoutError", "MAX_PORT", "NodeSlot", "PORTS_PER_REPLICA", "ReplicaLayout",
           "plan_replicas", "port_is_free", "replica_layout"]
