"""SGLang's ``update_weights_from_tensor`` with this package's loader as ``load_format``: the copy-plan fast path.

The engine is launched with :data:`sgl_rollout.config.FAST_SYNC_LOADER` in SGLang's
``custom_weight_loader``; ``update_weights_from_tensor(load_format=<that path>)`` then calls
:mod:`.receiver` inside the scheduler, which scatters each bucket of the copy plan (:mod:`.plan`) from a
persistent IPC buffer straight into the model's parameters and answers in a status block. The sender side,
:class:`FastPathSender`, writes the buckets.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .. import trace
from .bucket import ALIGN, NamedTensor, _checked_item, bucket_layout, flatten_bucket, iter_buckets
from .ipc import serialize
from .manifest import SyncValidationError
from .plan import (OK, STATUS_BYTES, STATUS_NAME, Chunk, bucket_size, decode_header, dtype_name, dtype_of, header_name,
                   layout, manifest_entries, plan_id, unpack_chunks)
from .flattened_bucket import raise_on_failure
from .protocol import SyncStats, bucket_rounds

logger = logging.getLogger(__name__)


#: Bytes of a status block read in one device-to-host copy: the header and a short body.
_STATUS_READ = 512


def _read_status(st: torch.Tensor) -> Tuple[int, int, bytes]:
    """(seq, code, body JSON bytes) of a status block (:func:`.plan.encode_status`); one
    device-to-host copy when the body is short."""
    head = bytes(st[:_STATUS_READ].cpu().numpy())
    got, code, n, _v = decode_header(head)
    n = min(max(n, 0), st.numel() - 32)
    raw = head[32 : 32 + n] if 32 + n <= len(head) else bytes(st[32 : 32 + n].cpu().numpy())
    return got, code, raw


class FastPathError(RuntimeError):
    """The fast-path loader inside SGLang reported a failure, or did not answer.

    The engine is alive (the loader never raises into the scheduler). If bytes of a bucket were
    copied, its weights are partly new: sync again (the engine refuses generates until then).
    """


class FastPathSender:
    """Sender side of the fast path (:mod:`.receiver` inside SGLang, :mod:`.plan`), for one engine.

    It owns, per TP rank, one persistent bucket buffer (``torch.uint8``, at most ``bucket_bytes``,
    on that rank's GPU) and one status block (``STATUS_BYTES``), shared with the engine over CUDA
    IPC in every call; the engine keeps the handles open, so only the first call of a buffer pays
    the open and only :meth:`release` pays the close. The copy plan is asked of the engine once
    (op ``plan``, from ``manifest``); a sync then writes each bucket in plan order (one
    ``torch._foreach_copy_`` into views of the buffer made once per buffer, casting as needed; a
    memcpy per piece for big pieces: :func:`gather_bucket`), synchronizes the stream, and has SGLang scatter it.

    Extra GPU memory on the sending side: the buffers (one bucket per TP rank, each on its rank's
    GPU), the status blocks (1 MiB each), and trainer tensors that arrive before the bucket that
    needs them (none when they come in the model's order, as ``named_parameters()`` gives them).

    Models whose layout the plan does not cover, and partial syncs, go through op ``load``: the
    bucket is flattened into the same buffer and SGLang's own ``load_weights`` runs on views of it
    (today's flattened path, caught inside the scheduler); the reason is logged once.

    One process may serve only some of the engine's TP ranks (``tp_ranks``): under verl each trainer
    worker owns its own TP rank's buffer on its own GPU. Then every such process runs a sender in
    lockstep, ``engine`` is a round over them all (each process hands it the payloads of its ranks; it
    returns once the engine has loaded every rank's), and ``share`` exchanges the copy plan's layouts
    once (so every process runs the same buckets and reads the trainer's tensors at the same points) and
    each call's answers (so a failure on any rank raises on every process).

    Args:
        engine: :class:`sgl_rollout.engine.RolloutEngine` (or anything with its
            ``update_weights_from_tensor(payloads, load_format, flush_cache)`` and ``flush_cache()``),
            launched with :data:`sgl_rollout.config.FAST_SYNC_LOADER` in ``custom_weight_loader``.
            With ``tp_ranks``, the round over the processes (``payloads``: this process's, in
            ``tp_ranks`` order).
        manifest: the model's :class:`~.manifest.WeightManifest`.
        bucket_bytes: most bytes per bucket (and per buffer).
        devices: one device per TP rank served, for that rank's buffer (the rank's GPU); None: the
            current CUDA device for every rank (the CPU without CUDA: tests).
        tp_size: the engine's TP size; with ``devices`` and no ``tp_ranks``, ``len(devices)``.
        tp_ranks: the engine TP ranks of ``devices`` (one each); None: ``range(len(devices))``, all of them.
        share: with ``tp_ranks`` short of every rank: ``share(obj)`` returns every process's ``obj`` in
            TP rank order (an all-gather over the replica's TP group; it may raise to end the sync).
        gather: how a bucket is written into the buffer (:data:`GATHER_METHODS`, see :func:`gather_bucket`):
            ``"auto"`` (default: per-piece memcpy for big pieces, one ``torch._foreach_copy_`` for many small ones),
            ``"copy"``, ``"foreach"`` or ``"cat"``. The destinations are views of the persistent buffer
            made once. All write the same bytes; ``python -m sgl_rollout.bench sync`` times each.

    Raises:
        ValueError: ``gather`` is not one of :data:`GATHER_METHODS`; ``tp_ranks`` does not match
            ``devices`` or ``tp_size``; ``tp_ranks`` leaves ranks out and no ``share`` is given.
    """

    def __init__(self, engine, manifest, bucket_bytes: int, devices: Optional[Sequence] = None, tp_size: int = 1,
                 gather: str = "auto", tp_ranks: Optional[Sequence[int]] = None,
                 share: Optional[Callable[[Any], List[Any]]] = None):
        from ..config import FAST_SYNC_LOADER

        self.engine, self.manifest, self.bucket_bytes = engine, manifest, int(bucket_bytes)
        if devices is None:
            dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            devices = [dev] * tp_size
        self.devices = [torch.device(d) for d in devices]
        self.tp_ranks, self._tp_size = _served_ranks(len(self.devices), tp_ranks, tp_size, share is not None)
        self.share = share
        if gather not in GATHER_METHODS:
            raise ValueError(f"gather must be one of {GATHER_METHODS}, got {gather!r}")
        self.gather = gather
        self.load_format = FAST_SYNC_LOADER
        self.key = uuid.uuid4().hex
        self._seq = 0
        self._t_mark = time.perf_counter()
        self._mem = _RankBuffers(self.devices)  # per rank: the buffer and status block shared with the engine
        self.plan: Optional[CopyPlan] = None  # the engine's copy plan, once asked for (ensure_plan)
        self._registered = False  # the engine's config was checked to list the loader
        self.covered: Optional[bool] = None
        self.reason = ""
        self.fault: Optional[str] = None  # tests: "raise" makes the next call's loader raise inside SGLang
        #: seconds of the last :meth:`send`: ``gather`` (sender's copies into the buffers, until the
        #: stream is synchronized), ``call`` (SGLang's round trip, the receiver's scatter included),
        #: ``check`` (reading the status blocks); within ``gather``, ``gather.alloc`` (getting the
        #: buffer: a new one after a release), ``gather.copy`` (launching the copies into it),
        #: ``gather.read`` (on the plan path, reading the stream between a bucket's gather steps),
        #: ``gather.serialize`` (pickling the payloads: sharing the CUDA buffers) and ``gather.wait``
        #: (the stream synchronize: the copies still running on the GPU); the rest of ``gather`` is
        #: the caller's stream of tensors and their checks; ``call`` split by rank 0's loader into
        #: ``call.request`` (sender's call to the loader's entry: SGLang's tokenizer manager, ZMQ, the
        #: scheduler's dequeue and unpickling), ``call.loader`` (the loader's own work and its
        #: synchronize) and ``call.reply`` (its answer back to the sender)
        self.timings: Dict[str, float] = {}

    @property
    def tp_size(self) -> int:
        """The engine's TP size (``len(tp_ranks)`` when this sender serves every rank)."""
        return self._tp_size

    def _agree(self, mine: List[Any]) -> List[Any]:
        """Every served rank's item of every process (``mine``: this process's, in ``tp_ranks`` order)."""
        if self.share is None:
            return list(mine)
        return [x for part in self.share(list(mine)) for x in part]

    @property
    def buffer_bytes(self) -> int:
        """Bytes of GPU memory the buffers and status blocks hold now (all ranks)."""
        return self._mem.nbytes

    @property
    def holds_buffers(self) -> bool:
        """True while a buffer or status block is allocated (and shared with the engine)."""
        return self._mem.holds

    @property
    def _buffers(self) -> List[Optional[torch.Tensor]]:
        """Each served rank's bucket buffer (None until the first sync and after :meth:`release`)."""
        return self._mem.buffers

    # ------------------------------------------------------------- calls
    def _check_registered(self) -> None:
        # SGLang raises NotImplementedError inside the scheduler for a load_format that is not in its
        # custom_weight_loader list, which kills it and, through SIGQUIT, the trainer.
        if self._registered:
            return
        config = getattr(self.engine, "config", None)
        if config is not None and self.load_format not in (config.to_server_args().get("custom_weight_loader") or []):
            raise FastPathError(f"the engine was not launched with {self.load_format} in custom_weight_loader "
                                "(RolloutConfig(fast_sync=True)); nothing was sent")
        self._registered = True

    @trace.traced("rollout.call")
    def _call(self, headers: List[dict], buffers: List[Optional[torch.Tensor]]) -> List[dict]:
        """One ``update_weights_from_tensor`` with a request per rank; returns each rank's answer body.

        Raises:
            FastPathError: the engine's config does not register the loader (nothing sent), or a
                rank's loader failed or did not answer.
            RuntimeError: SGLang itself reported a failure.
        """
        self._check_registered()
        self._seq += 1
        seq = self._seq
        t_ser = time.perf_counter()
        payloads = []
        for i, (h, buf) in enumerate(zip(headers, buffers)):
            h = dict(h, seq=seq, key=f"{self.key}/{self.tp_ranks[i]}")
            if self.fault:
                h["fault"], self.fault = self.fault, None
            st = self._mem.status_block(i)
            payloads.append(serialize([(header_name(h), st if buf is None else buf), (STATUS_NAME, st)]))
        t_wait = self._tick("gather.serialize", t_ser)
        for d in {d for d in self.devices if d.type == "cuda"}:
            torch.cuda.current_stream(d).synchronize()  # a cached handle skips torch's IPC event wait
        self._tick("gather.wait", t_wait)
        t1 = time.perf_counter()
        self._tick("gather", self._t_mark)
        m1 = time.monotonic()
        raise_on_failure(self.engine.update_weights_from_tensor(payloads, load_format=self.load_format,
                                                                 flush_cache=False))
        m2 = time.monotonic()
        t2 = self._tick("call", t1)
        bodies, errors, split = _read_answers(self._mem.status, self.tp_ranks, seq, self.load_format)
        if split is not None:  # this process's first rank's split of the round trip (one CLOCK_MONOTONIC)
            t_in, t_out = split
            for part, secs in (("call.request", t_in - m1), ("call.loader", t_out - t_in), ("call.reply", m2 - t_out)):
                self.timings[part] = self.timings.get(part, 0.0) + secs
        errors = [msg for part in self._agree([errors]) for msg in part]  # every process's, so all raise
        if errors:
            raise FastPathError("; ".join(errors))
        self._t_mark = self._tick("check", t2)
        return bodies

    def _call_each(self, op: str) -> List[dict]:
        """:meth:`_call` of request ``op`` with no bucket, for every TP rank served."""
        return self._call([dict(op=op) for _ in self.tp_ranks], [None] * len(self.tp_ranks))

    def _tick(self, part: str, since: float) -> float:
        now = time.perf_counter()
        self.timings[part] = self.timings.get(part, 0.0) + now - since
        return now

    # ------------------------------------------------------------- plan
    def ensure_plan(self) -> bool:
        """Ask the engine for the copy plan once; True when every rank's layout is covered.

        Call inside a sync fence (:mod:`.driver`): it goes through ``update_weights_from_tensor`` but
        changes no weight.
        """
        if self.covered is not None:
            return self.covered
        entries = manifest_entries(self.manifest)
        headers = [dict(op="plan", manifest=entries, bucket_bytes=self.bucket_bytes,
                        plan_id=plan_id(entries, self.bucket_bytes, r, self.tp_size)) for r in self.tp_ranks]
        bodies = self._call(headers, [None] * len(self.tp_ranks))
        # every rank's answer on every process: each runs the same buckets in the same order
        answers = sorted(self._agree([(r, bool(b.get("covered")), b.get("reason", ""), unpack_chunks(b))
                                      for r, b in zip(self.tp_ranks, bodies)]), key=lambda a: a[0])
        if [a[0] for a in answers] != list(range(self.tp_size)):
            raise FastPathError(f"copy plans came for TP ranks {[a[0] for a in answers]}, not each of {self.tp_size}")
        if not all(a[1] for a in answers):
            self.covered = False
            self.reason = "; ".join(a[2] for a in answers if not a[1])
            logger.warning("weight sync: the copy plan does not cover this model (%s); using SGLang's load_weights "
                           "on flattened buckets", self.reason)
            return False
        self.plan = CopyPlan([h["plan_id"] for h in headers], [a[3] for a in answers], self.bucket_bytes,
                             entries, self.manifest.optional)
        self.covered = True
        return True

    # ------------------------------------------------------------- sync
    def gather_ahead(self, named_tensors: Iterable[NamedTensor], validator=None) -> Optional["GatheredAhead"]:
        """Gather the plan path's first bucket before the sync, without calling the engine: it may run
        while SGLang resumes the weights (:meth:`Switch.wake <sgl_rollout.switch.Switch.wake>`'s
        ``while_resuming``), so the gather (~2-3 ms for SmolLM2-135M under TRL on an H200) overlaps the
        resume (~6 ms). Pass the result to :meth:`send` as ``ahead``; the stream is then read from it.

        Returns:
            the gathered bucket with the rest of the stream; None (nothing read) when the plan is not known
            yet (the first sync asks for it inside the fence) or does not cover the model (the load path).

        Raises:
            SyncValidationError: as :meth:`send`, for the tensors the first bucket needs; nothing was sent.
        """
        if self.covered is not True or self.plan is None:
            return None
        self.timings = {}
        t0 = self._t_mark = time.perf_counter()
        with torch.no_grad():  # trainer parameters require grad; copies into the buffer must not record
            feed = SourceFeed(named_tensors, validator, self.plan.program.steps.last_use)
            first = self._fill_bucket(0, feed) if self.plan.program.n_buckets else None
        self._tick("gather.ahead", t0)
        return GatheredAhead(feed, first)

    def send(self, named_tensors: Iterable[NamedTensor], validator=None, partial: bool = False,
             group_of: Optional[Callable[[str], object]] = None, release: bool = False,
             ahead: Optional["GatheredAhead"] = None) -> SyncStats:
        """Sync ``named_tensors`` (call inside a sync fence: :func:`~.driver.sync_fenced`).

        Args:
            named_tensors: (HF name, tensor), CPU or CUDA, any float dtype (cast to the engine's),
                consumed lazily; best in the model's order.
            validator: optional :class:`~.manifest.SyncValidator`, checking each tensor before the
                bucket that needs it is sent.
            partial: a sync of some weights only (goes through op ``load``).
            group_of: on the ``load`` path, a bucket closes where its value changes (layered sync).
                The plan path's buckets follow the plan, each gathered in steps (:class:`GatherSteps`); a
                source is dropped once the step with its last piece is gathered, so with a stream in the
                plan's order the sender holds about one step (:data:`GATHER_STEP_BYTES`) of gathered
                sources besides the buffer.
            release: free the buffers after this sync. The plan path's last bucket asks the engine to close
                its handles (:meth:`release`'s end state without its round trip: ~3 ms under TRL on an H200);
                on the load path, or with no bucket sent, they stay for :meth:`release` (a no-op once freed).
            ahead: :meth:`gather_ahead`'s result for this sync: its first bucket is sent as gathered and the
                stream read on from it (``named_tensors`` and ``validator`` are then not read); its
                timings are kept (``gather.ahead`` and its parts).

        Returns:
            SyncStats; ``bytes`` counts rank 0's bytes, ``max_bucket_bytes`` the largest buffer.

        Raises:
            SyncValidationError: ``validator`` refused a tensor, or (full sync) names of the plan
                never came; nothing of the bucket that needed them was sent.
            FastPathError: the loader failed inside SGLang (the engine lives; sync again).
            ValueError: ``ahead`` with ``partial`` (a partial sync takes the load path).
        """
        if ahead is not None and partial:
            raise ValueError("a bucket gathered ahead is for the plan path; a partial sync takes the load path")
        t0 = self._t_mark = time.perf_counter()
        if ahead is None:
            self.timings = {}
        with torch.no_grad():  # trainer parameters require grad; copies into the buffer must not record
            if ahead is None and (partial or not self.ensure_plan()):
                stats, closed = _send_load(self, named_tensors, validator, group_of), False
            else:
                if ahead is None:
                    ahead = GatheredAhead(SourceFeed(named_tensors, validator, self.plan.program.steps.last_use), None)
                stats = self._send_plan(ahead.feed, release, ahead.first)
                closed = release and stats.n_buckets > 0
        if stats.n_buckets:
            self.engine.flush_cache()
        if closed:  # the engine dropped its handles with the last bucket: free ours without a call
            self.release(notify=False)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _fill_bucket(self, b: int, feed: "SourceFeed") -> list:
        """Each served rank's (header, buffer) of plan bucket ``b``, gathered from ``feed`` step by step
        (:class:`GatherSteps`); a rank whose plan has fewer buckets gets a no-op header and no buffer."""
        prog = self.plan.program
        t_alloc = time.perf_counter()
        served = {r: i for i, r in enumerate(self.tp_ranks) if b < len(prog.ops[r])}  # engine TP rank -> index
        bufs = {r: self._mem.buffer(i, prog.buffer_bytes[r]) for r, i in served.items()}
        self._tick("gather.alloc", t_alloc)
        prog.steps.gather(b, feed, bufs, lambda s, r, step, srcs: self._mem.dsts(served[r], s, bufs[r], step, srcs),
                          self.gather, self._tick)
        return [(self._copy_header(i, b), bufs[r]) if r in bufs else (self._copy_header(i, -1), None)
                for i, r in enumerate(self.tp_ranks)]

    def _copy_header(self, i: int, b: int) -> dict:
        """Op ``copy``'s header for served rank ``i`` and plan bucket ``b`` (-1: nothing for this rank)."""
        return dict(op="copy", plan_id=self.plan.plan_ids[i], bucket=b)

    def _send_plan(self, feed: "SourceFeed", release: bool = False, first: Optional[list] = None) -> SyncStats:
        """Op ``copy``: the copy plan's buckets gathered from ``feed`` into each served rank's buffer and
        scattered by the engine, each in steps (:class:`GatherSteps`): a source is dropped once the step with
        its last piece is gathered. ``release``: the last bucket's headers ask the engine to close its handles.
        ``first``: bucket 0's round, gathered ahead (:meth:`gather_ahead`)."""
        stats = self._plan_rounds(lambda b: first if b == 0 and first is not None else self._fill_bucket(b, feed),
                                  feed.finish, release)
        stats.n_tensors = feed.seen
        return stats

    def _plan_rounds(self, fill: Callable[[int], list], done: Callable[[], None], release: bool = False) -> SyncStats:
        """The plan path's bucket rounds (:func:`~.protocol.bucket_rounds`): ``fill(b)`` gives each served
        rank's (header, buffer) of bucket ``b``, the engine scatters them; ``done()`` after the last bucket
        of a sync that did not fail. ``release``: the last bucket's headers carry ``release`` (the receiver
        closes its handles after answering OK)."""
        prog, stats = self.plan.program, SyncStats()

        def next_round(b: int) -> list:
            return [None] * len(self.tp_ranks) if b >= prog.n_buckets else fill(b)

        def load(payloads: list, b: int) -> None:
            last = release and b == prog.n_buckets - 1
            self._call([dict(h, release=True) if last else h for h, _ in payloads], [buf for _, buf in payloads])
            stats.n_buckets += 1
            stats.bytes += prog.bytes_rank0[b]
            stats.max_bucket_bytes = max(stats.max_bucket_bytes, *(x.numel() for x in self._buffers if x is not None))

        bucket_rounds(next_round=next_round, load=load)
        done()
        return stats

    def scratch(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of served rank 0's buffer (``torch.uint8``), to read into what must be discarded."""
        return self._mem.buffer(0, nbytes)

    def ping(self) -> float:
        """Seconds of one fast-path round trip that copies nothing (op ``noop``), inside a sync fence."""
        t0 = time.perf_counter()
        self._call_each("noop")
        return time.perf_counter() - t0

    def digest(self) -> List[Dict[str, str]]:
        """SHA-256 of each SGLang parameter's bytes, one dict per TP rank served (for bit-exact checks).

        Call inside a sync fence (:func:`~.driver.fenced`); it copies every parameter to the CPU
        inside the scheduler, so it is slow for big models.
        """
        bodies = self._call_each("digest")
        return [b["digest"] for b in bodies]

    # ------------------------------------------------------------- release
    def release(self, notify: bool = True) -> None:
        """Free the buffers and status blocks; the engine first closes its handles (op ``release``).

        Call before the engine's weights are released (the call needs a sync fence) and at shutdown
        (``notify=False``: the engine's processes are gone or going). The next sync allocates again.
        """
        if notify and any(b is not None for b in self._mem.status):
            self._call_each("release")
        self._mem.free()
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()

    def reset(self, new_key: bool = True) -> None:
        """Forget the engine's state after a restart (new plan, new handles); keeps nothing shared.

        Args:
            new_key: False keeps the key, so an engine that lives on replaces the handles it still
                holds (the old buffer's memory is freed at the next sync's first call) rather than
                keeping them open under a key no sender uses again (after a failed sync).
        """
        self.release(notify=False)
        if new_key:
            self.key = uuid.uuid4().hex
        self.covered, self.plan, self.reason = None, None, ""


def load_written(sender: FastPathSender, write: Callable[[int, torch.Tensor], None]) -> SyncStats:
    """The plan path's bucket rounds of ``sender``, which serves one TP rank and whose buckets are written by
    someone else (the p2p receive, :mod:`.p2p`): ``write(b, buf)`` fills ``buf`` (``torch.uint8``,
    ``plan.bucket_sizes(r)[b]`` bytes of the persistent buffer) with bucket ``b`` (timed as ``gather.copy``),
    then the engine scatters it. Call inside a sync fence; the prefix cache is flushed after the last
    bucket. The sender's timings restart (:attr:`FastPathSender.timings`).

    Returns:
        SyncStats of the engine's rounds (``n_tensors`` 0: no tensor passes here).

    Raises:
        FastPathError: the loader failed inside SGLang; whatever ``write`` raised.
    """
    r, prog = sender.tp_ranks[0], sender.plan.program
    t0 = sender._t_mark = time.perf_counter()
    sender.timings = {}

    def fill(b: int) -> list:
        if b >= len(prog.ops[r]):  # this rank's plan has fewer buckets: a no-op for it
            return [(sender._copy_header(0, -1), None)]
        t_alloc = time.perf_counter()
        buf = sender._mem.buffer(0, prog.buffer_bytes[r])
        t_copy = sender._tick("gather.alloc", t_alloc)
        write(b, buf[: prog.sizes[r][b]])
        sender._tick("gather.copy", t_copy)
        return [(sender._copy_header(0, b), buf)]

    with torch.no_grad():
        stats = sender._plan_rounds(fill, lambda: None)
    if stats.n_buckets:
        sender.engine.flush_cache()
    stats.seconds = time.perf_counter() - t0
    return stats


def _served_ranks(n_devices: int, tp_ranks: Optional[Sequence[int]], tp_size: int, shared: bool
                  ) -> Tuple[List[int], int]:
    """:class:`FastPathSender`'s TP ranks served and the engine's TP size, checked (its ``ValueError``s)."""
    if tp_ranks is None:
        tp_ranks, tp_size = range(n_devices), n_devices
    ranks, tp_size = [int(r) for r in tp_ranks], int(tp_size)
    if len(ranks) != n_devices or not all(0 <= r < tp_size for r in ranks):
        raise ValueError(f"tp_ranks {ranks} must give one rank below tp_size {tp_size} per device ({n_devices} devices)")
    if len(set(ranks)) < tp_size and not shared:
        raise ValueError(f"serving TP ranks {ranks} of {tp_size} needs share (the other ranks' senders)")
    return ranks, tp_size


def _read_answers(status: List[torch.Tensor], tp_ranks: List[int], seq: int, load_format: str
                  ) -> Tuple[List[dict], List[str], Optional[Tuple[float, float]]]:
    """Each served rank's answer to call ``seq`` from its status block: the bodies, the errors ("TP rank r:
    ...": no answer, or the loader's failure) and, when rank 0 answered OK, its loader's ``(t_in, t_out)``
    (CLOCK_MONOTONIC seconds)."""
    bodies, errors, split = [], [], None
    for i, r in enumerate(tp_ranks):
        got, code, raw = _read_status(status[i])
        body = json.loads(raw) if raw and got == seq else {}
        if got != seq:
            errors.append(f"TP rank {r}: the fast-path loader did not answer (is {load_format} in the "
                          "engine's custom_weight_loader?)")
        elif code != OK:
            errors.append(f"TP rank {r}: the fast-path loader failed inside SGLang: {body.get('error')}")
        t = body.pop("t", None)
        if i == 0 and not errors and t is not None:
            split = (t[0], t[1])
        bodies.append(body)
    return bodies, errors, split


@dataclass
class GatheredAhead:
    """The plan path's first bucket, gathered before its sync (:meth:`FastPathSender.gather_ahead`).

    Attributes:
        feed: the trainer's stream, read up to what bucket 0 needed (the sources later buckets need held).
        first: bucket 0's round: each served rank's (header, buffer); None when the plan has no bucket.
    """

    feed: "SourceFeed"
    first: Optional[list]


def _send_load(sender: FastPathSender, named_tensors, validator, group_of=None) -> SyncStats:
    """Op ``load`` of ``sender`` (partial syncs, and layouts the copy plan does not cover): each bucket of
    :func:`~.bucket.iter_buckets` flattened into every served rank's buffer, SGLang's ``load_weights`` on
    views of it; the protocol's bucket rounds (:func:`~.protocol.bucket_rounds`, inside the fence of
    :func:`~.driver.sync_fenced`). One buffer of min(bucket, model) bytes serves the whole sync: a buffer
    replaced while the engine still holds its handle is not freed, so growing it per bucket would double
    the peak."""
    stats = SyncStats()
    model_bytes = sum((spec.nbytes + ALIGN - 1) // ALIGN * ALIGN for spec in sender.manifest.specs.values())
    buckets = iter_buckets(named_tensors, sender.bucket_bytes, validator=validator, group_of=group_of)

    def next_round(_b: int) -> list:
        bucket = next(buckets, None)
        if bucket is None:
            return [None] * len(sender.tp_ranks)
        _, total = bucket_layout(bucket)
        size = max(total, min(sender.bucket_bytes, model_bytes))
        out = []
        for i in range(len(sender.tp_ranks)):
            flat = flatten_bucket(bucket, device=sender.devices[i], out=sender._mem.buffer(i, size))
            out.append((dict(op="load", meta=[[m.name, dtype_name(m.dtype), list(m.shape), m.start_idx,
                                               m.end_idx] for m in flat.metadata]), sender._buffers[i], flat))
        return out

    def load(payloads: list, _b: int) -> None:
        sender._call([h for h, _, _ in payloads], [buf for _, buf, _ in payloads])
        stats.add(payloads[-1][2])

    bucket_rounds(next_round=next_round, load=load)
    return stats


#: Ways :class:`FastPathSender` writes a bucket into its buffer (its ``gather`` argument).
GATHER_METHODS = ("auto", "copy", "foreach", "cat")
#: ``gather="auto"`` copies piece by piece when a bucket's pieces average this many bytes or more.
AUTO_COPY_MIN_BYTES = 4 << 20


def _contiguous_in_source(ch: Chunk) -> bool:
    expect = 1
    for size, stride in zip(reversed(ch.sizes), reversed(ch.strides)):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True


class _GatherOp:
    """One piece of a bucket, with what the sender needs every sync computed once (plain attributes:
    a sync of a few hundred tensors must cost little Python)."""

    __slots__ = ("name", "offset", "sizes", "strides", "dtype", "start", "end", "numel", "whole")

    def __init__(self, pc):
        ch = pc.chunk
        self.name, self.offset, self.sizes, self.strides = ch.name, ch.offset, torch.Size(ch.sizes), ch.strides
        self.dtype = dtype_of(ch.dtype)
        self.start, self.end, self.numel = pc.start, pc.end, ch.numel
        # a contiguous run from the start of the (contiguous) source: the whole source when its numel is ``numel``
        self.whole = ch.offset == 0 and _contiguous_in_source(ch)

    def dst_view(self, buf: torch.Tensor) -> torch.Tensor:
        """This piece's bytes of ``buf`` as a tensor of the piece's dtype and sizes."""
        return buf[self.start : self.end].view(self.dtype).view(self.sizes)

    def src(self, held: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The piece's elements of its source tensor (a view; the source made contiguous once if needed)."""
        t = held[self.name]
        if self.whole and t.numel() == self.numel:
            return t if t.shape == self.sizes else t.reshape(self.sizes)
        if not t.is_contiguous():
            t = held[self.name] = t.contiguous()
        return t.as_strided(self.sizes, self.strides, t.storage_offset() + self.offset)


class _BucketOps:
    """The pieces of one bucket of one TP rank, and what decides how they are gathered."""

    __slots__ = ("ops", "tiles", "mean_bytes")

    def __init__(self, pieces=(), ops: Optional[List["_GatherOp"]] = None):
        self.ops = list(ops) if ops is not None else [_GatherOp(pc) for pc in pieces]
        prev, self.tiles = (self.ops[0].start if self.ops else 0), True
        for op in self.ops:  # contiguous pieces of one dtype from the first one's byte: one cat can write them
            self.tiles = self.tiles and op.start == prev and op.dtype == self.ops[0].dtype
            prev = op.end
        self.mean_bytes = ((self.ops[-1].end - self.ops[0].start) / len(self.ops)) if self.ops else 0.0

    def span(self, buf: torch.Tensor) -> torch.Tensor:
        """The bytes of ``buf`` from the first piece's start to the last one's end."""
        return buf[self.ops[0].start : self.ops[-1].end]


class CopyPlan:
    """The engine's copy plan as one sender holds it: op ``plan``'s answer of every TP rank (which bytes of
    which trainer tensor go where), cut into buckets of at most ``bucket_bytes`` (:func:`~.plan.layout`),
    and the plan path's per-sync constants (:class:`SendProgram`).

    Args:
        plan_ids: per served rank, the id the loader checks each bucket against (:func:`~.plan.plan_id`).
        chunks: per TP rank, the engine's copy plan (:class:`~.plan.Chunk` lists, as lists).
        bucket_bytes: most bytes per bucket.
        entries: the manifest's entries (:func:`~.plan.manifest_entries`) the plan was asked for.
        optional: names a full sync may leave out.
    """

    def __init__(self, plan_ids: List[str], chunks: List[list], bucket_bytes: int, entries: list, optional):
        self.plan_ids, self.chunks, self.bucket_bytes = list(plan_ids), chunks, int(bucket_bytes)
        self._entries, self._optional = entries, sorted(optional)
        self.layouts = [layout([Chunk.from_list(c) for c in ch], self.bucket_bytes) for ch in chunks]
        self.program = SendProgram(self.layouts)

    def message(self, r: int) -> dict:
        """What a sender elsewhere needs to pack TP rank ``r``'s buckets: ``tp_rank``, ``chunks``,
        ``bucket_bytes``, ``manifest`` (the entries) and ``optional``. JSON-able."""
        return dict(tp_rank=r, chunks=self.chunks[r], bucket_bytes=self.bucket_bytes, manifest=self._entries,
                    optional=self._optional)

    def bucket_sizes(self, r: int) -> List[int]:
        """Bytes of each bucket of TP rank ``r``, in order."""
        return [int(self.program.sizes[r][b]) for b in range(len(self.program.ops[r]))]


#: A sender gathers each bucket in steps of about this many bytes of pieces (over all TP ranks; a tensor
#: whose pieces are larger is a step alone), dropping each trainer tensor after the step with its last piece:
#: it holds about one step of the trainer's tensors besides its bucket buffers, not a whole bucket
#: (:class:`GatherSteps`).
GATHER_STEP_BYTES = 256 << 20


class SendProgram:
    """The plan path's per-sync constants, from the layouts (per TP rank, per bucket, the pieces):
    ops per rank and bucket, bytes, and the gather steps (:attr:`steps`)."""

    def __init__(self, layouts: List[List[list]]):
        self.ops = [[_BucketOps(pieces) for pieces in lay] for lay in layouts]
        self.n_buckets = max(len(lay) for lay in layouts)
        self.buffer_bytes = [max(bucket_size(p) for p in lay) for lay in layouts]
        self.bytes_rank0 = [sum(pc.chunk.nbytes for pc in layouts[0][b]) if b < len(layouts[0]) else 0
                            for b in range(self.n_buckets)]
        self.sizes = [[bucket_size(p) for p in lay] for lay in layouts]  # bytes of each rank's buckets
        self.steps = GatherSteps(self.ops, GATHER_STEP_BYTES)


class GatherSteps:
    """How every sender of a plan gathers a bucket: in steps, each a run of the bucket's trainer tensors (in
    the order the TP ranks' pieces first name them) whose pieces over all ranks come to about ``step_bytes``;
    in a step each rank served writes its pieces of those tensors into its own buffer. The steps depend on
    the plan alone, so every process serving some of its ranks reads the trainer's stream to the same
    point before each step (verl's weights generator gathers collectively, and the ranks agree after each
    bucket: a process that read further than another would wait on it inside the generator).

    Attributes:
        in_bucket: per bucket, its step indices in order.
        of: ``(step, rank) -> _BucketOps`` of the rank's pieces in that step (absent: it has none there).
        needed: per step, the trainer tensor names it reads.
        last_use: per name, the last step that reads it (:class:`SourceFeed` holds a tensor while a step
            at or after the current one needs it).
        drop_after: per step, the names whose last step it is: dropped once it is gathered.
    """

    def __init__(self, ops: List[List[_BucketOps]], step_bytes: int):
        self.in_bucket: List[List[int]] = []
        self.of: Dict[Tuple[int, int], _BucketOps] = {}
        self.needed: List[set] = []
        self.last_use: Dict[str, int] = {}
        for b in range(max(len(rank_ops) for rank_ops in ops)):
            ranks = [r for r, rank_ops in enumerate(ops) if b < len(rank_ops)]
            size: Dict[str, int] = {}  # insertion order: the order the ranks' pieces first name them
            for r in ranks:
                for op in ops[r][b].ops:
                    size[op.name] = size.get(op.name, 0) + op.end - op.start
            self.in_bucket.append([self._step(group, b, ranks, ops) for group in _runs(size, step_bytes)])
        self.drop_after: List[List[str]] = [[] for _ in self.needed]
        for name, last in self.last_use.items():
            self.drop_after[last].append(name)

    def _step(self, names: set, b: int, ranks: List[int], ops: List[List[_BucketOps]]) -> int:
        s = len(self.needed)
        self.needed.append(names)
        for name in names:
            self.last_use[name] = s
        for r in ranks:
            mine = [op for op in ops[r][b].ops if op.name in names]
            if mine:
                self.of[(s, r)] = _BucketOps(ops=mine)
        return s

    def gather(self, b: int, feed: "SourceFeed", bufs: Dict[int, torch.Tensor],
               dsts: Callable[[int, int, _BucketOps, List[torch.Tensor]], List[torch.Tensor]], method: str = "auto",
               tick: Optional[Callable[[str, float], float]] = None) -> None:
        """Write bucket ``b`` of each rank in ``bufs`` (rank -> its buffer) step by step: read the stream on
        until the step's tensors are held, gather each rank's pieces of them (:func:`gather_bucket`;
        ``dsts(step, rank, its ops, sources)`` gives the pieces' views of that rank's buffer), drop the
        tensors whose last step it was. ``tick(part, since)`` (a sender's timings) gets ``gather.read``
        (the stream: the trainer's gather, the checks) and ``gather.copy``.

        Raises:
            SyncValidationError: from :meth:`SourceFeed.take`, before the bucket is sent.
        """
        t = time.perf_counter()
        for s in self.in_bucket[b]:
            feed.take(s, self.needed[s])
            t = tick("gather.read", t) if tick is not None else t
            for r, buf in bufs.items():
                step = self.of.get((s, r))
                if step is not None:
                    gather_bucket(step, feed.held, buf, lambda srcs, k=s, q=r, o=step: dsts(k, q, o, srcs), method)
            feed.drop(self.drop_after[s])
            t = tick("gather.copy", t) if tick is not None else t


def _runs(size: Dict[str, int], step_bytes: int) -> List[set]:
    """The names of ``size`` (name -> bytes, in order) cut into runs, a run closed once it holds
    ``step_bytes`` bytes."""
    runs: List[set] = []
    held = step_bytes
    for name, nbytes in size.items():
        if held >= step_bytes:
            runs.append(set())
            held = 0
        runs[-1].add(name)
        held += nbytes
    return runs


class _RankBuffers:
    """Per TP rank served (index ``r`` into ``devices``): the persistent bucket buffer and the status block
    that :class:`FastPathSender` shares with the engine over CUDA IPC, and each bucket's views of the buffer."""

    def __init__(self, devices: List[torch.device]):
        self.devices = devices
        self.buffers: List[Optional[torch.Tensor]] = [None] * len(devices)
        self.status: List[Optional[torch.Tensor]] = [None] * len(devices)
        self.views: Dict[tuple, tuple] = {}  # (rank, bucket) -> (buffer address, views of the buffer)

    @property
    def nbytes(self) -> int:
        return sum(x.numel() for x in self.buffers + self.status if x is not None)

    @property
    def holds(self) -> bool:
        return any(x is not None for x in self.buffers + self.status)

    def status_block(self, r: int) -> torch.Tensor:
        if self.status[r] is None:
            self.status[r] = torch.zeros(STATUS_BYTES, dtype=torch.uint8, device=self.devices[r])
        return self.status[r]

    def buffer(self, r: int, nbytes: int) -> torch.Tensor:
        """Rank ``r``'s buffer, replaced by one of ``nbytes`` when it is smaller."""
        buf = self.buffers[r]
        if buf is None or buf.numel() < nbytes:
            self.buffers[r] = None
            self.views.clear()
            buf = self.buffers[r] = torch.empty(nbytes, dtype=torch.uint8, device=self.devices[r])
        return buf

    def dsts(self, r: int, b: int, buf: torch.Tensor, bucket: _BucketOps, srcs: List[torch.Tensor]) -> List[torch.Tensor]:
        """Each piece's view of ``buf`` (rank ``r``, gather step ``b`` of :class:`GatherSteps`), made once per
        buffer: in one C++ call (``torch._C._nn.unflatten_dense_tensors``, ``torch/csrc/utils/tensor_flatten.cpp``)
        when the pieces tile their span of the buffer, else one Python view per piece (about 1 us each on an
        H100 host)."""
        ptr, dsts = self.views.get((r, b), (None, None))
        if ptr != buf.data_ptr():  # a new buffer (or, on the CPU, one moved into shared memory)
            ops = bucket.ops
            if bucket.tiles and ops:
                dsts = list(torch._C._nn.unflatten_dense_tensors(bucket.span(buf).view(ops[0].dtype), srcs))
            else:
                dsts = [op.dst_view(buf) for op in ops]
            self.views[(r, b)] = (buf.data_ptr(), dsts)
        return dsts

    def free(self) -> None:
        """Drop every buffer, status block and view (the views keep the buffers' storage alive)."""
        self.buffers = [None] * len(self.devices)
        self.status = [None] * len(self.devices)
        self.views.clear()


class SourceFeed:
    """The plan path's reading of the trainer's stream of (name, tensor): each tensor checked by the
    validator as it comes, and held (``held``) from then until the last gather step that reads it
    (``last_use``: name -> step index, :class:`GatherSteps`)."""

    def __init__(self, named_tensors: Iterable[NamedTensor], validator, last_use: Dict[str, int]):
        self.items = iter(named_tensors)
        self.validator = validator
        self.check = validator.check if validator is not None else None
        self.last_use = last_use
        self.held: Dict[str, torch.Tensor] = {}
        self.seen = 0  # tensors read from the stream

    def _read(self, item) -> Tuple[str, torch.Tensor]:
        name, tensor = _checked_item(item)
        self.seen += 1
        if self.check is not None:
            self.check(name, tensor)
        return name, tensor

    def _raise_if_refused(self) -> None:
        if self.validator is not None:
            self.validator.finish()
            self.validator.raise_if_failed()

    def take(self, b: int, needed: set) -> None:
        """Read on until ``held`` has every name of ``needed`` (the sources of gather step ``b``,
        :class:`GatherSteps`); a tensor read on the way is held if a step from ``b`` on needs it.

        Raises:
            SyncValidationError: the stream ended without some of them, or the validator refused a
                tensor so far (then after checking the rest of the stream); before the bucket of step
                ``b`` is sent.
        """
        wanted = needed - self.held.keys()
        while wanted:
            item = next(self.items, None)
            if item is None:
                missing = sorted(wanted)
                self._raise_if_refused()
                raise SyncValidationError([f"the sync ended without {len(missing)} weight(s) of the copy plan: "
                                           f"{missing[:5]}"])
            name, tensor = self._read(item)
            if self.last_use.get(name, -1) >= b:
                self.held[name] = tensor
                wanted.discard(name)
        if self.validator is not None and not self.validator.ok:
            for rest in self.items:
                self.validator.check(*_checked_item(rest))
            self._raise_if_refused()

    def drop(self, names: Iterable[str]) -> None:
        for name in names:
            self.held.pop(name, None)

    def finish(self) -> None:
        """Read the rest of the stream (names without chunks, a tied lm_head: checked, not sent); raises
        SyncValidationError if the validator refused a tensor."""
        for item in self.items:
            self._read(item)
        self._raise_if_refused()


@trace.traced("rollout.bucket")
def gather_bucket(bucket: _BucketOps, held: Dict[str, torch.Tensor], buf: torch.Tensor,
            dsts: Callable[[List[torch.Tensor]], List[torch.Tensor]], method: str = "auto") -> None:
    """Write the pieces of ``bucket`` from the sources in ``held`` into ``buf`` by ``method``
    (:data:`GATHER_METHODS`); ``dsts(sources)`` gives each piece's view of ``buf`` (made once per buffer).

    ``"copy"``: one ``copy_`` per piece (casts and moves across devices as needed; a same-dtype piece
    is a device-to-device memcpy). ``"foreach"``: one ``torch._foreach_copy_`` (casting) when every
    source is on the buffer's device, else as ``"copy"``. ``"cat"``: one ``torch.cat`` of the sources'
    flat views into the buffer when the pieces tile it and every source is contiguous, of the buffer's
    dtype and on its device; else as ``"foreach"``. ``"auto"``: ``"copy"`` for pieces of
    :data:`AUTO_COPY_MIN_BYTES` or more on average, else ``"foreach"``.

    Why (``python -m sgl_rollout.bench gather``, H100, ``examples/bench/gather_h100_s5_hostB.json``):
    for the demo's 272 tensors (269 MB) ``_foreach_copy_`` into views made once took 0.13 ms of CPU
    and 0.30 ms in all, ``torch.cat`` 0.51 / 1.13 ms and a ``copy_`` per piece 2.01 ms of CPU; for the
    1.1B model's 201 tensors (2.2 GB) all are bound by the GPU's copy (1.9-2.1 ms). ``torch._chunk_cat``
    (FSDP2's packing op) was tried and dropped: 5.1 ms of CPU for the 2.2 GB bucket (it builds
    per-block metadata on the host).
    """
    ops = bucket.ops
    srcs = [op.src(held) for op in ops]
    if method == "auto":
        method = "copy" if bucket.mean_bytes >= AUTO_COPY_MIN_BYTES else "foreach"
    device = buf.device
    if method == "cat":
        dtype = ops[0].dtype if ops else None
        if bucket.tiles and all(s.dtype == dtype and s.device == device and s.is_contiguous() for s in srcs):
            torch.cat([s.view(-1) for s in srcs], out=bucket.span(buf).view(dtype))
            return
        method = "foreach"
    views = dsts(srcs)
    if method == "foreach" and all(s.device == device for s in srcs):
        torch._foreach_copy_(views, srcs)
        return
    for d, s in zip(views, srcs):
        d.copy_(s, non_blocking=True)
