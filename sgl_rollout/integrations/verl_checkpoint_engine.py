"""verl checkpoint-engine backend ``sgl_rollout``: each trainer rank sends each rollout TP rank only its
shard, straight into the engine's fast-path buffer (:mod:`sgl_rollout.weight_sync.p2p`).

For rollout replicas on GPUs of their own (verl's standalone mode, its one-step-off and fully-async
trainers): ``actor_rollout_ref.rollout.checkpoint_engine.backend=sgl_rollout``. verl's
``CheckpointEngineManager.update_weights`` (``verl/checkpoint_engine/base.py``) then drives it as any
backend: ``prepare`` and ``init_process_group`` on every trainer and rollout worker, the trainers'
``send_weights(get_per_tensor_param())``, the rollout workers' ``receive_weights`` handed to this
package's rollout (``SglRollout.update_weights(wire_format=WIRE_FORMAT)``), ``finalize``.

What differs from verl's ``nccl`` backend (``verl/checkpoint_engine/nccl_checkpoint_engine.py``),
which broadcasts every full tensor from trainer rank 0 to every rollout GPU through two buckets on each:

* rollout worker ``k`` is served by trainer rank ``k % trainer world size``, so trainer ranks send at
  the same time, and each sends only the bytes of its rollout ranks' copy plans (their TP shards,
  already in the engine's fused layout), validated against the weight manifest on the way;
* the bytes land in the fast path's persistent buffer, which the engine scatters into its parameters:
  no second bucket and no copy out of a broadcast buffer on the rollout side;
* the group and its store live across syncs (``prepare`` allocates nothing, ``finalize`` frees nothing
  but the fast path's buffer, which the rollout frees after each sync).

Only this package's rollout (``rollout.name=sglang`` answered by sgl-rollout, fast path on) can take
its ``receive_weights``; :func:`~.verl_config.check_served_features` refuses it otherwise.

verl imports this module through this package's plugin (:mod:`.verl`), in the driver and every worker;
``checkpoint_engine.custom_backend_module=sgl_rollout.integrations.verl_checkpoint_engine`` does the same
where plugins are off.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from .. import trace
from ..memory import release_cached_blocks, reserved_bytes
from ..weight_sync.p2p import PeerGroup, PlanReceipt, send_plan_buckets

logger = logging.getLogger(__name__)

#: ``checkpoint_engine.backend`` value of this backend.
BACKEND = "sgl_rollout"
#: ``wire_format`` this backend's ``receive_weights`` hands the rollout (verl's ``CheckpointEngineWorker``
#: reads the backend's ``wire_format`` attribute).
WIRE_FORMAT = "sgl_rollout_plan"


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address().strip("[]")


def _free_port() -> int:
    from torch.distributed.elastic.utils.distributed import get_free_port

    return get_free_port()


def _gpu_uuid() -> Optional[str]:
    """This process's GPU's UUID (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def topology(actor_world: int, rollout_world: int, master: Tuple[str, int]) -> Tuple[Dict[str, list], Dict[str, list]]:
    """``init_process_group`` arguments of every trainer and rollout worker (verl's ``build_topology``
    contract: one list per argument, as long as each worker group).

    Group ranks: trainer ranks ``0..A-1``, rollout worker ``k`` at ``A + k``. ``peers``: a trainer's
    ``(group rank, rollout index)`` of each rollout worker it serves (``k % A == j``); a rollout
    worker's one ``(group rank, rollout index)`` of the trainer rank that serves it and itself.
    """
    a, r = int(actor_world), int(rollout_world)
    world = a + r
    actor = {"rank": list(range(a)), "world_size": [world] * a, "master": [list(master)] * a,
             "peers": [[(a + k, k) for k in range(r) if k % a == j] for j in range(a)]}
    rollout = {"rank": [a + k for k in range(r)], "world_size": [world] * r, "master": [list(master)] * r,
               "peers": [[(k % a, k)] for k in range(r)]}
    return actor, rollout


class SglRolloutCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine ``sgl_rollout`` (see the module docstring).

    Args:
        bucket_size: verl's ``update_weights_bucket_megabytes`` in bytes; unused: the buckets are the
            rollout engine's copy plan, made with this package's bucket size.
        is_master: given by verl's trainer workers only (``verl/workers/engine_workers.py``: trainer
            rank 0 is True); its absence marks a rollout worker (``CheckpointEngineWorker``).
        timeout_s: seconds a store read or a transfer may wait before it raises.
    """

    wire_format = WIRE_FORMAT

    def __init__(self, bucket_size: int = 0, is_master: Optional[bool] = None, timeout_s: float = 600.0, **_):
        self.trainer = is_master is not None
        if self.trainer:  # the trainer worker's FSDP engine feeds send_weights; inert unless SGLROLLOUT_LAYERED_GATHER=1
            from . import verl_gather

            verl_gather.install()
        self.is_master = bool(is_master)
        self.timeout_s = float(timeout_s)
        self._master: Optional[Tuple[str, int]] = None
        self._group: Optional[PeerGroup] = None
        self._key: Optional[tuple] = None
        self.peers: List[Tuple[int, int]] = []
        self._reserved_at_prepare: Optional[int] = None  # torch's reserved bytes as the sync began

    @trace.traced("ckpt.prepare")
    def prepare(self) -> Dict[str, Any]:
        """This worker's metadata; trainer rank 0 names the group's store (the same address while
        the group lives), and ``broken`` says this worker's last sync failed part-way (its group must
        not carry another: :meth:`build_topology` then numbers a new one for every side). Allocates
        nothing; notes torch's reserved bytes, which :meth:`finalize` compares against."""
        self._reserved_at_prepare = reserved_bytes()
        if self.is_master and self._master is None:
            self._master = (_node_ip(), _free_port())
        broken = self._group is not None and self._group.broken
        return {"role": "trainer" if self.trainer else "rollout", "master": self._master, "gpu": _gpu_uuid(),
                "broken": broken}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        """:func:`topology`, with trainer rank 0's store address (``metadata[0]``) and the number of the
        group every side joins: a new one for a new layout or after a failed sync (any ``broken``).

        Raises:
            RuntimeError: trainer rank 0 named no store.
            ValueError: a rollout worker shares its GPU with the trainer rank that would serve it
                (colocated replicas: NCCL cannot send between two ranks of one GPU; use ``naive``).
        """
        master = metadata[0]["master"]
        if master is None:
            raise RuntimeError("trainer rank 0 gave no store address: was it made with is_master=True?")
        a = int(actor_wg_world_size)
        shared = [k for k in range(int(rollout_world_size))
                  if metadata[a + k].get("gpu") and metadata[a + k].get("gpu") == metadata[k % a].get("gpu")]
        if shared:
            raise ValueError(f"checkpoint_engine.backend={BACKEND} sends between GPUs, but rollout workers {shared} "
                             "share a GPU with the trainer rank that would serve them (colocated replicas); "
                             "use checkpoint_engine.backend=naive there")
        layout = (a, int(rollout_world_size), tuple(master), tuple(m.get("gpu") for m in metadata))
        # a new layout (replicas added or removed), or a group a failed sync left part-way (issue 46: a
        # timed-out transfer made every later sync fail at once): a new group, new keys, on every side
        if layout != cls._layout or any(m.get("broken") for m in metadata):
            cls._layout, cls._generation = layout, cls._generation + 1
        actor, rollout = topology(a, rollout_world_size, tuple(master))
        actor["generation"] = [cls._generation] * a
        rollout["generation"] = [cls._generation] * int(rollout_world_size)
        return actor, rollout

    #: the driver's last layout and its number (``build_topology`` runs in verl's driver)
    _layout: Optional[tuple] = None
    _generation = 0

    @trace.traced("ckpt.init_group")
    def init_process_group(self, rank: int, world_size: int, master, peers, generation: int = 0):
        """Join the group of this layout (``generation``: the driver's number of it); the group of
        the last sync is kept while the layout is the same, else shut down and a new one made."""
        key = (tuple(master), int(rank), int(world_size), int(generation))
        if self._group is None or self._key != key:
            if self._group is not None:  # another layout (replicas added or removed): a new group
                self._group.close()
                self._group = None
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
            self._group = PeerGroup(master[0], master[1], rank, world_size, device, timeout_s=self.timeout_s,
                                    prefix=f"g{int(generation)}")
            self._key = key
        self.peers = [tuple(p) for p in peers]

    @trace.traced("ckpt.finalize")
    def finalize(self):
        """Hand the blocks this sync added to torch's cache back to the driver (``torch.cuda.empty_cache``,
        only when the reserved memory grew since :meth:`prepare`); the group and its store stay for the
        next sync.

        The send buffer (one bucket) and the trainer's gathered tensors held for a bucket are freed when
        :meth:`send_weights` returns, but torch's caching allocator keeps their blocks: on 4xH200 (one-step-off,
        1.1B shape, 2 GiB buckets) the trainer's reserved memory then stayed 6.4 GB higher after the first
        sync and its peak grew step by step (94.5 GB against the built-in's 84.0 GB,
        ``examples/verl/compare/one-step-off-1b-random-h200x4-sgl_rollout``). verl's own ``nccl`` backend
        empties the cache here every time (``verl/checkpoint_engine/nccl_checkpoint_engine.py``), which after a
        training step costs the trainer 210-250 ms (the whole activation cache goes back, and is allocated
        again by the next step); a sync that grew nothing skips it
        (:func:`~sgl_rollout.memory.release_cached_blocks`, ``grown_since``)."""
        release_cached_blocks(grown_since=self._reserved_at_prepare)
        self._reserved_at_prepare = None

    @trace.traced("ckpt.send")
    async def send_weights(self, weights, global_steps: Optional[int] = None):
        """Send this trainer rank's rollout workers their plans' bytes (every rank reads ``weights``
        to the end: verl's generator gathers collectively); returns verl's sync metrics (seconds, bytes).

        Raises:
            RuntimeError: called before :meth:`init_process_group` (``weights`` read to the end first).
            SyncValidationError, TrainerRefused: see :func:`~sgl_rollout.weight_sync.p2p.send_plan_buckets`.
        """
        stats = send_plan_buckets(self._group, self.peers, weights, renamer=_renamer, on_plan=_tell_gather)
        return {"sgl_rollout/send_s": stats.seconds, "sgl_rollout/send_bytes": float(stats.bytes)}

    def receive_weights(self, global_steps: Optional[int] = None) -> PlanReceipt:
        """The receipt the rollout receives with (not a generator: verl hands it on unread).

        Raises:
            RuntimeError: called before :meth:`init_process_group`, or on a trainer rank.
        """
        if self._group is None or self.trainer:
            raise RuntimeError("receive_weights before init_process_group" if self._group is None else
                               "receive_weights on a trainer rank: trainer ranks send_weights")
        (source, index), = self.peers
        return PlanReceipt(self._group, source, index)


@functools.lru_cache(maxsize=4)
def _renamer_of(model_path: str, trust_remote_code: bool):
    from ..checkpoint_names import checkpoint_mappings

    return checkpoint_mappings(model_path, trust_remote_code=trust_remote_code)[1]


def _renamer(plan: dict):
    """``(trainer name, tensor) -> [(checkpoint name, tensor), ...]`` for the model a rollout's plan names
    (read once per model; fused experts split into views, :func:`~sgl_rollout.checkpoint_names.tensor_renamer`),
    or None."""
    path = plan.get("model_path")
    return _renamer_of(path, bool(plan.get("trust_remote_code"))) if path else None


def _tell_gather(plan: dict) -> None:
    """Give the trainer's gather by FSDP unit (:mod:`.verl_gather`, ``SGLROLLOUT_LAYERED_GATHER=1``) the rollout's
    weight dtype from its plan (``dtype``, :meth:`~.verl_weight_sync.VerlWeightSync._receive_plan`): units whose
    compute dtype is that one all-gather in it, as the colocated rollout lets them. Inert without that switch."""
    from . import verl_gather

    verl_gather.set_rollout_dtype(plan.get("dtype"))


def register() -> bool:
    """Register :data:`BACKEND` in verl's ``CheckpointEngineRegistry`` (idempotent).

    Returns:
        True when registered; False when verl's checkpoint engines cannot be imported (logged).
    """
    try:
        if BACKEND not in CheckpointEngineRegistry._registry:
            CheckpointEngineRegistry.register(BACKEND)(SglRolloutCheckpointEngine)
    except Exception as exc:  # noqa: BLE001 - verl would only say "not registered" much later
        logger.warning("sgl-rollout could not register checkpoint_engine.backend=%s with verl: %r", BACKEND, exc)
        return False
    return True


register()
