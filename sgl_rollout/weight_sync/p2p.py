"""The copy plan's buckets packed on a trainer GPU and sent point to point into a rollout TP rank's
fast-path buffer, for SGLang's ``update_weights_from_tensor`` with this package's loader.

Rollout replicas on GPUs of their own (verl's standalone mode, its asynchronous trainers) get their
weights from the trainer's ranks over a process group. verl's ``nccl`` checkpoint engine broadcasts
every full tensor to every rollout GPU, where the rollout worker copies its TP rank's shard out again.
Here each rollout TP rank publishes its engine's copy plan (:mod:`.plan`: which bytes of which trainer
tensor go where in each bucket of that rank), a trainer rank packs exactly those bytes on its own GPU
(the fast path's gather, :mod:`.fast_path`) and sends each bucket straight into that rank's persistent
IPC buffer, which the engine then scatters into its parameters. So a rollout TP rank receives only its
own shard; trainer ranks send to different rollout ranks at the same time; and the extra GPU memory
is one bucket on each sending trainer rank and the fast path's one buffer on each rollout rank.

The pieces, each usable without verl (the backend that verl drives is
:mod:`sgl_rollout.integrations.verl_checkpoint_engine`):

* :class:`PeerGroup`: a process group of its own (a ``TCPStore`` and NCCL on CUDA, gloo on the CPU),
  kept across syncs; its store carries each sync's plans.
* the wire, per link (one trainer rank to one rollout TP rank): per bucket a header
  ``int64[3] = (OK, bucket, bytes)`` and the bucket's bytes; at the end ``(END, n, 0)``; on a failure
  ``(ERROR, bucket, message bytes)`` and the message instead of the rest.
* :func:`send_plan_buckets` (trainer side) and :func:`receive_plan_buckets` (rollout side).

The weights are checked against the rollout's weight manifest on the trainer, tensor by tensor, before
the bucket that needs them is sent (the same :class:`~.manifest.SyncValidator` as every other path);
a refused tensor ends the sync on both sides with the validator's message, and every trainer rank
still reads its weights generator to the end (verl's are collective over the trainer's ranks).
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .. import trace
from .fast_path import FastPathError, FastPathSender, SendProgram, SourceFeed, load_written
from .manifest import ParamSpec, SyncValidator, WeightManifest
from .plan import Chunk, dtype_of, layout
from .protocol import SyncStats

logger = logging.getLogger(__name__)

#: Header codes of the wire (first element of the ``int64[3]`` header).
OK, END, ERROR = 0, 1, 2


def plan_key(index: int) -> str:
    """The store key under which rollout worker ``index`` publishes its plan for the next sync."""
    return f"sgl_rollout/plan/{index}"


_STORES: Dict[Tuple[str, int, bool], "torch.distributed.TCPStore"] = {}
_STORES_LOCK = threading.Lock()


def _store(host: str, port: int, is_master: bool, timeout: datetime.timedelta):
    """A ``TCPStore`` for ``host:port``: the server this process hosts there (one for the process's life,
    made on first use), or a new client (a client's blocking reads hold its connection, so two groups
    must not share one)."""
    if not is_master:
        return torch.distributed.TCPStore(host, port, None, is_master=False, timeout=timeout)
    key = (host, port, True)
    with _STORES_LOCK:
        if key not in _STORES:
            _STORES[key] = torch.distributed.TCPStore(host, port, None, is_master=True, timeout=timeout,
                                                      wait_for_workers=False)
        return _STORES[key]


class PeerGroup:
    """A process group of its own over a ``TCPStore``: ranks ``0..world_size-1`` of a trainer and its
    rollout workers, apart from any ``torch.distributed`` default group the processes already have.

    On CUDA it is ``torch.distributed.ProcessGroupNCCL`` (send/recv make a two-rank communicator per
    pair on first use; the group is meant to live across syncs), on the CPU ``ProcessGroupGloo``
    (tests). Rank 0 hosts the store, one server per address for the process's life (:func:`_store`),
    so a later group on the same address (another ``prefix``) never meets a store server that is going
    away. Each group's keys, its plans' too, live under its ``prefix``.

    Args:
        host, port: the store's address (rank 0 listens there).
        rank, world_size: this process's rank and the group's size.
        device: where the wire's tensors live (a CUDA device: NCCL; the CPU: gloo).
        timeout_s: seconds a store read or a transfer may wait (a peer that never comes raises then).
        prefix: the group's namespace in the store; every member must give the same one, and a new
            group on the same store a new one.
        plan_wait_s: seconds a trainer rank waits for its rollout ranks' plans (at most ``timeout_s``);
            the ranks whose plans came are then told which did not, instead of waiting ``timeout_s``.

    Raises:
        RuntimeError / DistNetworkError: the store could not be reached within ``timeout_s``.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, device, timeout_s: float = 600.0,
                 prefix: str = "g0", plan_wait_s: float = 120.0):
        self.rank, self.world_size, self.device = int(rank), int(world_size), torch.device(device)
        self.plan_wait_s = min(float(plan_wait_s), float(timeout_s))
        #: set when a sync over this group failed part-way: a timed-out or refused transfer can leave a
        #: link mid-message, so the next sync must get a new group (the verl backend reports it in
        #: ``prepare`` and verl's driver then numbers a new one for every side)
        self.broken = False
        timeout = datetime.timedelta(seconds=timeout_s)
        base = _store(host, int(port), self.rank == 0, timeout)
        self.store = torch.distributed.PrefixStore(f"sgl_rollout/{prefix}/", base)
        if self.device.type == "cuda":
            opts = torch.distributed.ProcessGroupNCCL.Options()
            if hasattr(opts, "_timeout"):
                opts._timeout = timeout
            self.pg = torch.distributed.ProcessGroupNCCL(self.store, self.rank, self.world_size, opts)
        else:
            self.pg = torch.distributed.ProcessGroupGloo(self.store, self.rank, self.world_size, timeout)

    def close(self) -> None:
        """Shut the group down (rank 0's store server stays, for the next group on it)."""
        pg, self.pg = self.pg, None
        shutdown = getattr(pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - a group that cannot shut down is dropped all the same
                logger.debug("process group shutdown failed", exc_info=True)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` (contiguous, on :attr:`device`) to rank ``dst``; on CUDA the caller's stream
        then waits for it, so a later write into ``tensor`` on that stream is safe."""
        self.pg.send([tensor], dst, 0).wait()

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Receive into ``tensor`` (contiguous, on :attr:`device`) from rank ``src``."""
        self.pg.recv([tensor], src, 0).wait()

    def publish(self, key: str, obj) -> None:
        """Put JSON-able ``obj`` under ``key`` in the store."""
        self.store.set(key, json.dumps(obj))

    def take(self, key: str):
        """The object under ``key``, waiting for it (up to the timeout), then delete it from the store."""
        obj = json.loads(self.store.get(key))
        self.store.delete_key(key)
        return obj

    def take_all(self, keys: Sequence[str], wait_s: float) -> list:
        """The objects under ``keys`` (each deleted from the store), waiting up to ``wait_s`` seconds for all
        of them; None for each key that did not come by then."""
        try:
            self.store.wait(list(keys), datetime.timedelta(seconds=wait_s))
        except Exception:  # noqa: BLE001 - torch raises DistStoreError or RuntimeError on the timeout
            logger.warning("not every rollout plan came within %.0f s", wait_s)
        return [self.take(k) if self.store.check([k]) else None for k in keys]


class _Wire:
    """Headers and messages of one process's links, on the group's device."""

    def __init__(self, group: PeerGroup):
        self.group = group
        self.head = torch.zeros(3, dtype=torch.int64, device=group.device)

    def send_head(self, peer: int, code: int, b: int, n: int) -> None:
        self.head.copy_(torch.tensor([code, b, n], dtype=torch.int64))
        self.group.send(self.head, peer)

    def recv_head(self, peer: int) -> Tuple[int, int, int]:
        self.group.recv(self.head, peer)
        code, b, n = (int(x) for x in self.head.tolist())
        return code, b, n

    def send_error(self, peer: int, b: int, message: str) -> None:
        raw = message.encode()[:65536] or b"?"
        self.send_head(peer, ERROR, b, len(raw))
        self.group.send(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.group.device), peer)

    def recv_error(self, peer: int, n: int) -> str:
        raw = torch.empty(n, dtype=torch.uint8, device=self.group.device)
        self.group.recv(raw, peer)
        return bytes(raw.cpu().numpy()).decode(errors="replace")


class TrainerRefused(RuntimeError):
    """The trainer side ended the sync (its weights failed the manifest check, its generator raised);
    the message is the trainer's. The engine is alive; its weights are partly new if buckets came."""


# ====================================================================== trainer side
class PlanPacker:
    """Trainer side: the buckets of some rollout TP ranks' copy plans, packed into a buffer per rank on this GPU.

    Args:
        plans: one published plan per destination (:meth:`CopyPlan.message <.fast_path.CopyPlan.message>`, in the order the
            destinations are served): ``chunks``, ``bucket_bytes``, ``manifest``, ``optional``.
        device: this trainer rank's GPU (the CPU: tests).
        rename: ``(trainer name, tensor) -> [(checkpoint name, tensor), ...]`` (a fused expert parameter
            split into per-expert views; :func:`sgl_rollout.checkpoint_names.tensor_renamer`), or None.

    Each destination has a buffer of its plan's largest bucket, reused for every bucket; a bucket is gathered
    in steps (:class:`~.fast_path.GatherSteps`), so besides the buffers this rank holds about one step of the
    trainer's tensors (:data:`~.fast_path.GATHER_STEP_BYTES`) and those a later step still reads.
    """

    def __init__(self, plans: Sequence[dict], device, rename: Optional[Callable[[str, torch.Tensor], list]] = None):
        self.layouts = [layout([Chunk.from_list(c) for c in p["chunks"]], int(p["bucket_bytes"])) for p in plans]
        self.program = SendProgram(self.layouts)
        self.device, self.rename = torch.device(device), rename
        first = plans[0]
        specs = {n: ParamSpec(tuple(shape), dtype_of(dt)) for n, dt, shape in first["manifest"]}
        self.manifest = WeightManifest(specs, optional=first.get("optional", ()))
        self.buffers: List[Optional[torch.Tensor]] = [None] * len(plans)
        self._feed: Optional[SourceFeed] = None

    @property
    def seen(self) -> int:
        """Tensors read from the stream by the last :meth:`buckets`."""
        return self._feed.seen if self._feed is not None else 0

    def buckets(self, named_tensors: Iterable) -> Iterable[Tuple[int, int, torch.Tensor]]:
        """``(destination, bucket, bytes)`` in send order; each view is valid until the next bucket is made.

        Raises:
            SyncValidationError: a tensor does not match the manifest, or the stream ended without some
                weights of a plan (before the bucket that needed them).
        """
        prog = self.program
        named = (p for n, t in named_tensors for p in self.rename(n, t)) if self.rename else named_tensors
        feed = self._feed = SourceFeed(named, SyncValidator(self.manifest), prog.steps.last_use)
        for d, size in enumerate(prog.buffer_bytes):
            if self.buffers[d] is None or self.buffers[d].numel() < size:
                self.buffers[d] = torch.empty(size, dtype=torch.uint8, device=self.device)
        with torch.no_grad():
            for b in range(prog.n_buckets):
                bufs = {d: self.buffers[d] for d in range(len(prog.ops)) if b < len(prog.ops[d])}
                prog.steps.gather(b, feed, bufs, lambda _s, d, step, _srcs: [op.dst_view(bufs[d]) for op in step.ops])
                for d in bufs:
                    yield d, b, bufs[d][: prog.sizes[d][b]]
            feed.finish()


def _drain(named_tensors) -> None:
    """Read ``named_tensors`` to the end (verl's generators gather collectively: every trainer rank reads
    to the end); nothing for an object that is not iterable (the caller reports that)."""
    try:
        items = iter(named_tensors)
    except TypeError:
        return
    for _ in items:
        pass


def send_plan_buckets(group: PeerGroup, peers: Sequence[Tuple[int, int]], named_tensors: Iterable,
                      renamer: Optional[Callable[[dict], Optional[Callable[[str, torch.Tensor], list]]]] = None,
                      on_plan: Optional[Callable[[dict], None]] = None) -> SyncStats:
    """One sync from this trainer rank to its rollout TP ranks ``peers`` (``(group rank, rollout index)``):
    read each one's plan from the store (:func:`plan_key`), pack and send its buckets, end each link.
    ``renamer(plan)`` gives the trainer-to-checkpoint tensor renamer (:class:`PlanPacker`'s ``rename``) for the
    model the first plan names (its ``model_path``; None: names unchanged). ``on_plan(plan)`` is called with the
    first plan before ``named_tensors`` is read (what the stream's producer may want to know of the rollout,
    such as its ``dtype``).

    A rank without peers reads ``named_tensors`` to the end and sends nothing.

    Returns:
        SyncStats: ``bytes`` sent (all links), ``n_buckets``, ``n_tensors`` read, ``max_bucket_bytes``
        (the largest destination's buffer), ``seconds``.

    Raises:
        SyncValidationError: the weights failed the manifest check (every link got the message).
        TrainerRefused: a rollout rank published an error instead of its plan, or none within
            ``group.plan_wait_s`` (the others got the message).
        RuntimeError: ``group`` is None (no ``init_process_group`` yet).
        TypeError: ``named_tensors`` is not iterable; whatever it raises. In each case every link still
        open was ended with ERROR, ``named_tensors`` was read to the end, and ``group.broken`` is set.
    """
    t0, stats = time.perf_counter(), SyncStats()
    if group is None:
        _drain(named_tensors)
        raise RuntimeError("send_weights before init_process_group: this trainer rank has no group to send on")
    if not peers:
        _drain(named_tensors)
        return stats
    wire, open_links, b, items = _Wire(group), [], 0, None
    try:
        plans = group.take_all([plan_key(index) for _, index in peers], group.plan_wait_s)
        # every rank that did not refuse waits for a header: those whose plans came first, then those whose
        # plans did not (a slow one still gets the reason; a dead one holds this rank until the timeout)
        open_links = ([rank for (rank, _), p in zip(peers, plans) if p is not None and "error" not in p]
                      + [rank for (rank, _), p in zip(peers, plans) if p is None])
        refused = [f"rollout worker {index}: {p['error']}" for (_, index), p in zip(peers, plans)
                   if p is not None and "error" in p]
        refused += [f"rollout worker {index}: no copy plan came within {group.plan_wait_s:.0f} s"
                    for (_, index), p in zip(peers, plans) if p is None]
        if refused:
            raise TrainerRefused("; ".join(refused))
        if on_plan is not None:
            on_plan(plans[0])
        items = iter(named_tensors)  # inside the try: weights that are not iterable end every link too
        packer = PlanPacker(plans, group.device, renamer(plans[0]) if renamer is not None else None)
        for d, b, view in packer.buckets(items):
            wire.send_head(peers[d][0], OK, b, view.numel())
            group.send(view, peers[d][0])
            stats.n_buckets += 1
            stats.bytes += view.numel()
        for rank in open_links:
            wire.send_head(rank, END, b, 0)
        open_links = []
        stats.n_tensors, stats.max_bucket_bytes = packer.seen, max(b.numel() for b in packer.buffers if b is not None)
    except BaseException as exc:
        group.broken = True
        for rank in open_links:
            try:
                wire.send_error(rank, b, f"{type(exc).__name__}: {exc}")
            except Exception:  # noqa: BLE001 - the sync's own error is the one to raise
                logger.exception("could not tell rollout rank %d that the sync failed", rank)
        _drain(named_tensors if items is None else items)  # the iterator begun, not a second one
        raise
    stats.seconds = time.perf_counter() - t0
    return stats


# ====================================================================== rollout side
class PlanReceipt:
    """What a rollout worker needs for one sync from its trainer rank: the group, the trainer's group
    rank (``source``) and this worker's rollout index (the plan's store key).

    Handed by the checkpoint engine's ``receive_weights`` to the rollout adapter, which runs
    :func:`receive_plan_buckets` with it inside the engine's sync fence.
    """

    def __init__(self, group: PeerGroup, source: int, index: int):
        self.group, self.source, self.index = group, int(source), int(index)

    def publish(self, plan: dict) -> None:
        """Offer this worker's plan for this sync."""
        self.group.publish(plan_key(self.index), plan)

    def refuse(self, why: str) -> None:
        """Tell the trainer rank this worker will not take this sync (it raises :class:`TrainerRefused`)."""
        self.group.publish(plan_key(self.index), {"error": why})


class _Link:
    """The rollout end of one link: receives bucket after bucket into the fast path's buffer views.

    Every header is followed by the message it announces, so a link is read by the trainer's sizes, not
    this rank's: a bucket this rank did not expect (the two sides' plans differ) is read into scratch
    before the sync fails, so no later read takes the trainer's bytes for a header (gloo aborts the
    process on a message of the wrong size).
    """

    #: Largest message (bytes) a header may announce; more means the stream is not this protocol's.
    MAX_MESSAGE = 1 << 34

    def __init__(self, receipt: PlanReceipt, n_buckets: int):
        self.wire, self.src, self.n_buckets = _Wire(receipt.group), receipt.source, n_buckets
        self.next, self.ended, self.error = 0, False, ""
        self.pending = 0  # bytes the trainer sent after the last header that were not read yet

    def _head(self, expect_b: int, expect_n: int) -> bool:
        """Read a header; True for the expected bucket. Records the trainer's error or END.

        Raises:
            FastPathError: a bucket other than the expected one (the plans differ): its bytes are left
                in :attr:`pending` for :meth:`finish`.
        """
        code, b, n = self.wire.recv_head(self.src)
        if code == ERROR:
            self.ended, self.error = True, self.wire.recv_error(self.src, n)
            return False
        if code == END:
            self.ended = True
            if expect_n:
                self.error = f"the trainer ended the sync at bucket {self.next} of {self.n_buckets}"
            return False
        if code != OK or not 0 <= n <= self.MAX_MESSAGE:
            self.ended = True  # not this protocol's header: nothing more can be read safely
            raise FastPathError(f"the trainer sent a header ({code}, {b}, {n}) that is not this protocol's")
        if (b, n) != (expect_b, expect_n):
            self.pending = n
            raise FastPathError(f"the trainer's bucket {b} of {n} bytes is not bucket {expect_b} of {expect_n} bytes "
                                "of this rank's copy plan: the two sides' plans differ")
        return True

    def fill(self, i: int, b: int, view: torch.Tensor) -> None:
        """Receive bucket ``b`` into ``view`` (served rank ``i``: the adapter serves one)."""
        if self.ended or not self._head(b, view.numel()):
            raise TrainerRefused(f"the trainer ended the sync: {self.error}")
        self.wire.group.recv(view, self.src)
        self.next = b + 1

    def finish(self, scratch: Callable[[int], torch.Tensor]) -> None:
        """Read the link to its end: every message the trainer sends after a failure here, each by the size
        its header announces, into ``scratch(n)``; then END or the trainer's ERROR.

        Raises:
            TrainerRefused: the trainer ended the sync with an error (after every bucket, its last checks).
            FastPathError: the trainer sent buckets this rank's plan does not have.
        """
        extra = 0
        if self.pending:
            self.wire.group.recv(scratch(self.pending)[: self.pending], self.src)
            self.pending, extra = 0, 1
        while not self.ended:
            code, b, n = self.wire.recv_head(self.src)
            if code == ERROR:
                self.ended, self.error = True, self.wire.recv_error(self.src, n)
            elif code == END:
                self.ended = True
            elif code == OK and 0 <= n <= self.MAX_MESSAGE:
                self.wire.group.recv(scratch(n)[:n], self.src)
                extra += b >= self.n_buckets
                self.next = b + 1
            else:
                self.ended = True
                raise FastPathError(f"the trainer sent a header ({code}, {b}, {n}) that is not this protocol's")
        if self.error:
            raise TrainerRefused(f"the trainer ended the sync: {self.error}")
        if extra:
            raise FastPathError("the trainer sent buckets this rank's copy plan does not have: the plans differ")


@trace.traced("ckpt.receive")
def receive_plan_buckets(sender: FastPathSender, receipt: PlanReceipt, info: Optional[dict] = None) -> SyncStats:
    """One sync into ``sender``'s engine (one served TP rank) from the trainer rank of ``receipt``.

    Call inside the engine's sync fence. Asks for the copy plan (once per engine), publishes it with
    ``info`` (``model_path``, ``trust_remote_code``: how the trainer renames its names), receives each
    bucket into the fast path's buffer and has the engine scatter it (:meth:`FastPathSender._plan_rounds`),
    then frees the buffer (the engine closes its handle). On any failure it reads the link to its end
    (by the trainer's sizes: :class:`_Link`), so the trainer rank never waits on this one, and marks the
    group broken (``receipt.group.broken``) so that the next sync gets a new one.

    Returns:
        SyncStats of the engine's rounds (``n_tensors`` 0: no tensor passes here).

    Raises:
        FastPathError: no copy plan covers the model (the trainer was told), the plans differ, or the
            loader failed inside SGLang.
        TrainerRefused: the trainer ended the sync (its weights failed the manifest check, say).
    """
    try:
        if not sender.ensure_plan():
            raise FastPathError(f"the copy plan does not cover this model ({sender.reason}); use "
                                "checkpoint_engine.backend=nccl")
        receipt.publish(dict(sender.plan.message(sender.tp_ranks[0]), **(info or {})))
    except BaseException as exc:
        receipt.group.broken = True
        receipt.refuse(f"{type(exc).__name__}: {exc}")
        raise
    link = _Link(receipt, len(sender.plan.bucket_sizes(sender.tp_ranks[0])))
    try:
        stats = load_written(sender, lambda b, buf: link.fill(0, b, buf))
        link.finish(sender.scratch)
    except BaseException:
        receipt.group.broken = True
        if not link.ended:
            try:
                link.finish(sender.scratch)
            except Exception:  # noqa: BLE001 - this sync's own error is the one to raise
                logger.debug("the link ended with the trainer's error too", exc_info=True)
        raise
    sender.release()
    return stats


