"""The one driver of every weight sync: the fence, the closing round, and the rule TP ranks agree by.

Every way a sync comes in (the in-process :class:`~sgl_rollout.worker.RolloutWorker`, the LoRA adapter
loads, verl's colocated trainer workers, verl's engine actor, the ``sgl_rollout`` checkpoint engine's
point-to-point transfer, :func:`sgl_rollout.server.sync_weights_from_workers`) runs its transport as the
body of :func:`sync_fenced` (or :func:`async_sync_fenced`, the same body awaited):

1. **begin**: the fence goes up (:class:`EngineFence`: the engine's ``begin_sync``; :class:`ServerFence`:
   the engine actor's ``begin_weight_sync``, called by the TP leader only). From here no generate is
   admitted, so none sees half-new weights.
2. **the body**: the transport's bucket rounds (:func:`~.protocol.bucket_rounds`): SGLang's flattened
   buckets (:mod:`.flattened_bucket`), the copy-plan fast path (:mod:`.fast_path`), the p2p receive
   (:mod:`.p2p`), an adapter load.
3. **the closing round** (TP ranks in several processes, :class:`TPGroup`): every rank says how its sync
   ended, so a failure on any rank fails the sync on every rank.
4. **finish**: ``on_end(ok)`` (the caller's cleanup: buffers dropped, a generator closed), then the fence
   comes down complete or not (``end_sync(ok)`` / ``finish_weight_sync(ok)``). A sync that failed after
   its first byte leaves the engine refusing generates until a complete sync (:mod:`sgl_rollout.memory`).

The rule across TP ranks (:class:`TPGroup`), the only one: every exchange between the ranks of a sync is a
*round* (an all-gather of one item per rank). A rank that fails goes straight to the closing round with
its reason; the other ranks meet that item in whatever round they are in and raise :class:`PeerLeft`,
ending without a closing round of their own (the leaver's closing round was theirs too). So no rank waits
for a round the others never enter, and every rank learns the reason within one round, not after a timeout.
Outcomes that one rank decides (the leader's engine call) reach every rank through :meth:`TPGroup.agree`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

from ..twin import Body, Step, run_async, run_sync

logger = logging.getLogger(__name__)

#: First element of a rank's item in a round when that rank has left the sync (then its reason).
LEFT = "__sgl_rollout_left__"


class PeerLeft(RuntimeError):
    """Another TP rank ended the weight sync (it failed); raised on the ranks that meet its closing item in
    a round. The message names the rank and its reason."""


class RankFailed(RuntimeError):
    """Another TP rank failed an exchange of :meth:`TPGroup.agree`; the message names each rank and why."""


def _reason(error: Optional[BaseException]) -> str:
    return f"{type(error).__name__}: {error}" if error is not None else ""


class TPGroup:
    """The TP ranks of one replica that take part in a sync from processes of their own (verl's trainer
    workers, one per TP rank), and the rule they agree on errors by (the module docstring).

    Args:
        all_gather: ``(item) -> [item of rank 0, item of rank 1, ...]`` on every rank (a collective over
            the replica's TP group, ``torch.distributed.all_gather_object``); it blocks until every rank
            has called it.
        size: number of TP ranks; with 1 every round is local (``all_gather`` is never called).
    """

    def __init__(self, all_gather: Callable[[Any], List[Any]], size: int):
        self._all_gather, self.size = all_gather, int(size)

    def _gather(self, item) -> List[Any]:
        return [item] if self.size == 1 else list(self._all_gather(item))

    def round(self, item) -> List[Any]:
        """Every rank's ``item``, in TP rank order.

        Raises:
            PeerLeft: another rank has left the sync (its closing item came in this round).
        """
        got = self._gather((None, item))
        left = [f"TP rank {r}: {why}" for r, (mark, why) in enumerate(got) if mark == LEFT]
        if left:
            raise PeerLeft("the weight sync ended on another TP rank: " + "; ".join(left))
        return [x for _, x in got]

    def agree(self, value: Any = None, error: Optional[BaseException] = None) -> List[Any]:
        """A round that makes one rank's failure every rank's: each rank brings its ``value`` or the
        ``error`` it met; returns every rank's value when none failed.

        Raises:
            error: this rank's own ``error``, when it has one (so the caller sees the original).
            RankFailed: another rank failed ("TP rank r: ..." for each).
            PeerLeft: another rank has left the sync.
        """
        got = self.round((value, _reason(error)))
        failed = [f"TP rank {r}: {why}" for r, (_, why) in enumerate(got) if why]
        if error is not None:
            raise error
        if failed:
            raise RankFailed("; ".join(failed))
        return [v for v, _ in got]

    def leave(self, error: Optional[BaseException]) -> List[str]:
        """The closing round of a sync: this rank's reason (empty when it succeeded); returns every
        rank's reason ("TP rank r: ..."), empty when all succeeded."""
        got = self._gather((LEFT, _reason(error)))
        return [f"TP rank {r}: {why}" for r, (_, why) in enumerate(got) if why]


class EngineFence:
    """The fence of an engine in this process (:class:`sgl_rollout.engine.RolloutEngine`): its
    ``begin_sync`` / ``async_begin_sync`` and ``end_sync(ok)`` (``sgl_rollout/engine/weight_calls.py``).
    An engine actor's ``begin_weight_sync`` / ``finish_weight_sync`` (:class:`sgl_rollout.server.RolloutServer`)
    are :meth:`async_open` and :meth:`close` of its engine's fence, the other half of :class:`ServerFence`."""

    def __init__(self, engine):
        self.engine = engine

    def open(self) -> None:
        """Raise the fence (blocking). Raises: MemoryStateError: weights released, requests running, or
        another operation in progress."""
        self.engine.begin_sync()

    async def async_open(self) -> None:
        """:meth:`open` from inside an event loop."""
        await self.engine.async_begin_sync()

    def close(self, ok: bool) -> None:
        """Lower the fence; ``ok`` False after a failed sync (generates refused until a complete one, if
        any byte reached the engine). Never blocks on SGLang."""
        self.engine.end_sync(ok)

    def begin(self) -> Step:
        return Step(self.open, self.async_open)

    def finish(self, ok: bool) -> Step:
        return Step.call(self.close, ok)


class ServerFence:
    """The fence of an engine actor (:class:`sgl_rollout.server.RolloutServer` and verl's
    ``VerlRolloutServer``): ``begin_weight_sync`` / ``finish_weight_sync(ok, global_steps)`` over Ray,
    awaited by the awaiting face and ``ray.get`` by the blocking one. ``finish_weight_sync`` flushes the
    prefix cache before the fence lifts.

    Args:
        server: the actor handle, or a function returning it (looked up when the fence rises, so a failed
            lookup is the fence's refusal, met where every TP rank hears of it).
        global_steps: remembered by the engine with a complete sync (verl's ``global_steps``).
        overlap: awaiting face only: :meth:`begin` only sends the call, and the body awaits its answer
            with :meth:`confirm` where it first needs the fence (verl's bucketed sync reads its first
            bucket meanwhile, so every TP rank reads the same items of verl's weights generator, whose
            reads are collective, before any rank can learn of a refusal). The fence is lowered only if
            the engine answered the begin.
    """

    def __init__(self, server, global_steps: Optional[int] = None, overlap: bool = False):
        self._server, self.global_steps, self.overlap = server, global_steps, overlap
        self._begin_call = None  # overlap: the begin call sent, not yet awaited
        self._up = False  # overlap: the engine answered the begin

    @property
    def server(self):
        """The actor handle (looked up on first use when a function was given)."""
        self._server = _resolved(self._server)
        return self._server

    @staticmethod
    def _step(call: Callable[[], Any]) -> Step:
        import ray

        return Step(lambda: ray.get(call()), call)

    def begin(self) -> Step:
        if self.overlap:
            return Step.call(self._send_begin)
        return self._step(lambda: self.server.begin_weight_sync.remote())

    def _send_begin(self) -> None:
        try:
            self._begin_call = self.server.begin_weight_sync.remote()
        except Exception as exc:  # noqa: BLE001 - raised by confirm, where the body awaits the answer
            self._begin_call = _raising(exc)

    async def confirm(self) -> None:
        """The answer of the begin :meth:`begin` sent (overlap); nothing when already awaited.

        Raises:
            whatever the engine actor raised refusing the fence (MemoryStateError, say), or what sending
            the call raised (the actor not found).
        """
        call, self._begin_call = self._begin_call, None
        if call is not None:
            await call
            self._up = True

    def finish(self, ok: bool) -> Step:
        steps = self.global_steps if ok else None
        if not self.overlap:
            return self._step(lambda: self.server.finish_weight_sync.remote(ok=ok, global_steps=steps))

        async def finish_overlapped() -> None:
            try:
                await self.confirm()
            except Exception:  # noqa: BLE001 - the refusal was the body's to raise; no fence to lower
                return
            if self._up:
                await self.server.finish_weight_sync.remote(ok=ok, global_steps=steps)

        return Step.call(finish_overlapped)


async def _raising(exc: BaseException):
    raise exc


def _resolved(server):
    """The actor handle: ``server`` itself, or what it returns when it is a function (a lambda or method)
    looking the actor up."""
    return server() if inspect.isfunction(server) or inspect.ismethod(server) else server


def _fenced(fence, body: Callable[[], Any], group: Optional[TPGroup],
            on_end: Optional[Callable[[bool], Any]]) -> Body:
    """The body of :func:`sync_fenced` (:mod:`sgl_rollout.twin`)."""
    began, error, result = False, None, None
    try:
        if fence is not None:
            yield fence.begin()
            began = True
        result = yield Step.call(body)
    except BaseException as exc:  # noqa: BLE001 - re-raised below, after the closing round and the fence
        error = exc
    if group is not None and not isinstance(error, PeerLeft):
        try:
            peers = group.leave(error)
        except BaseException as exc:  # noqa: BLE001 - the fence must still come down
            peers, error = [], error or exc
        if error is None and peers:
            error = RankFailed("the weight sync failed on " + "; ".join(peers))
    ok = error is None
    try:
        if on_end is not None:
            yield Step.call(on_end, ok)
    finally:
        if began:
            try:
                yield fence.finish(ok)
            except BaseException:
                if ok:
                    raise
                logger.exception("ending the engine's sync fence failed after a failed weight sync")
    if error is not None:
        raise error
    return result


def sync_fenced(fence, body: Callable[[], Any], group: Optional[TPGroup] = None,
                on_end: Optional[Callable[[bool], Any]] = None) -> Any:
    """Run one weight sync: the fence up, ``body()``, the closing round, ``on_end(ok)``, the fence down.

    Args:
        fence: :class:`EngineFence`, :class:`ServerFence`, or None on a TP rank that does not call the
            engine (verl's non-leader trainer workers).
        body: the transport's work (its bucket rounds); its return value is returned.
        group: the TP ranks in other processes that take part (:class:`TPGroup`); None: this process sends
            for every rank.
        on_end: ``(ok)``, run on every exit (the fence refused included) before the fence comes down:
            buffers dropped, a generator closed.

    Returns:
        what ``body()`` returned.

    Raises:
        whatever ``body``, the fence or ``on_end`` raised (the first of them); :class:`PeerLeft` or
        :class:`RankFailed` when another rank failed. The fence came down with ``ok=False`` when it had
        gone up; a failure ending the fence after a failed sync is logged, not raised over the sync's own.
    """
    return run_sync(_fenced(fence, body, group, on_end))


async def async_sync_fenced(fence, body: Callable[[], Any], group: Optional[TPGroup] = None,
                            on_end: Optional[Callable[[bool], Any]] = None) -> Any:
    """:func:`sync_fenced` from inside an event loop; ``body`` and ``on_end`` may be coroutine functions."""
    return await run_async(_fenced(fence, body, group, on_end))


@contextlib.contextmanager
def fenced(engine) -> Iterator[None]:
    """:func:`sync_fenced` of an in-process engine as a ``with`` block: the fence is up inside it and
    comes down complete unless the block raised (a failed or interrupted sync).

    Raises:
        MemoryStateError: the engine refused the fence (weights released, requests running, another
            operation in progress); the block did not run.
    """
    fence = EngineFence(engine)
    fence.open()
    ok = False
    try:
        yield
        ok = True
    finally:
        fence.close(ok)


class GroupLoader:
    """The engine as the fast path's sender sees it (:class:`~.fast_path.FastPathSender`'s ``engine``)
    when each TP rank's payload comes from a process of its own: one :class:`TPGroup` round per call.

    :meth:`update_weights_from_tensor` exchanges every rank's payloads; the leader hands them all to the
    engine actor's ``update_weights_from_payloads(payloads, fast_path=True)``
    (:class:`sgl_rollout.server.RolloutServer`) and the outcome reaches every rank
    (:meth:`TPGroup.agree`), so every rank returns, or raises, once the engine has answered for all.

    Args:
        group: the replica's TP ranks.
        server: the engine actor, or a function returning it (looked up at the first call, inside the
            round's failure rule); None on every rank but the leader.
        config: the engine's :class:`~sgl_rollout.config.RolloutConfig` (the sender checks its loader is
            registered).
    """

    def __init__(self, group: TPGroup, server, config):
        self.group, self.server, self.config = group, server, config

    def update_weights_from_tensor(self, payloads: Sequence, load_format: Optional[str] = None,
                                   flush_cache: bool = False) -> Tuple[bool, str]:
        """Load this round's payloads of every TP rank (``payloads``: this rank's); ``(True, "Success")``.

        Raises:
            PeerLeft: another rank has left the sync (nothing was loaded).
            RuntimeError: the engine actor refused or failed the call (on the leader, its own error).
            RankFailed: the same, on the other ranks.
        """
        import ray

        everyone = [p for part in self.group.round(list(payloads)) for p in part]
        error = None
        if self.server is not None:
            try:
                self.server = _resolved(self.server)
                ray.get(self.server.update_weights_from_payloads.remote(everyone, fast_path=True))
            except Exception as exc:  # noqa: BLE001 - every TP rank must hear of it
                error = RuntimeError(f"the engine failed a fast-path weight sync call: {_reason(exc)}")
        self.group.agree(None, error)
        return True, "Success"

    def flush_cache(self) -> None:
        """Nothing: the fence's end (``finish_weight_sync``) flushes the prefix cache."""


__all__ = ["EngineFence", "GroupLoader", "LEFT", "PeerLeft", "RankFailed", "ServerFence", "TPGroup",
           "async_sync_fenced", "fenced", "sync_fenced"]
