"""The one weight-sync driver (sgl_rollout.weight_sync.driver): the fence, the closing round, the one rule TP
ranks agree by, and that no other module raises or lowers a fence."""

import asyncio
import re
import types
from pathlib import Path

import pytest
from fakes import ThreadGroup

from sgl_rollout.twin import Step
from sgl_rollout.weight_sync.driver import (
    PeerLeft,
    RankFailed,
    ServerFence,
    TPGroup,
    async_sync_fenced,
    sync_fenced,
)

PACKAGE = Path(__file__).resolve().parents[1] / "sgl_rollout"


def _fence(log, refuse_begin=False):
    def begin():
        if refuse_begin:
            raise RuntimeError("weights released")
        log.append("begin")

    return types.SimpleNamespace(begin=lambda: Step.call(begin), finish=lambda ok: Step.call(log.append, ("finish", ok)))


def test_no_module_but_the_driver_raises_or_lowers_a_fence():
    """The fence lives in one module: the engine's begin/end calls and the actor's begin/finish calls appear
    nowhere else in the package (the engine's own definitions aside)."""
    calls = re.compile(r"\.(async_)?begin_sync\(|\.end_sync\(|begin_weight_sync\.remote\(|finish_weight_sync\.remote\(|"
                       r"\.weight_sync\(\)")
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ("weight_sync/driver.py", "engine/weight_calls.py", "memory.py"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if calls.search(code) and not code.strip().startswith(("\"", "'", "``", ":")):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert found == []


@pytest.mark.parametrize("face", ["sync", "async"])
def test_the_fence_comes_down_failed_after_a_failed_body_and_never_rises_twice(face):
    def run(fence, body, **kw):
        if face == "sync":
            return sync_fenced(fence, body, **kw)
        return asyncio.run(async_sync_fenced(fence, body, **kw))

    log, ended = [], []
    assert run(_fence(log), lambda: 7, on_end=ended.append) == 7
    assert log == ["begin", ("finish", True)] and ended == [True]

    def boom():
        raise ValueError("bad tensor")

    log, ended = [], []
    with pytest.raises(ValueError, match="bad tensor"):
        run(_fence(log), boom, on_end=ended.append)
    assert log == ["begin", ("finish", False)] and ended == [False]
    log, ended = [], []
    with pytest.raises(RuntimeError, match="weights released"):
        run(_fence(log, refuse_begin=True), lambda: 7, on_end=ended.append)
    assert log == [] and ended == [False]  # the body never ran; no fence to lower


def test_a_failing_finish_is_raised_after_a_good_sync_and_logged_after_a_failed_one(caplog):
    def fail_finish(ok):
        def f():
            raise RuntimeError(f"finish({ok}) failed")
        return Step.call(f)

    fence = types.SimpleNamespace(begin=lambda: Step.call(lambda: None), finish=fail_finish)
    with pytest.raises(RuntimeError, match=r"finish\(True\) failed"):
        sync_fenced(fence, lambda: None)

    def boom():
        raise ValueError("the sync's own error")

    with pytest.raises(ValueError, match="the sync's own error"):
        sync_fenced(fence, boom)
    assert "ending the engine's sync fence failed" in caplog.text


def test_a_rank_that_fails_between_rounds_ends_the_sync_on_every_rank_within_one_round():
    """Rank 1 fails after one round; rank 0 is in its second round: it meets rank 1's closing item there
    and raises PeerLeft naming the reason, with no closing round of its own, so nobody waits."""
    tg = ThreadGroup(2, timeout_s=5)
    log = []

    def rank(r, _):
        group = TPGroup(lambda item: tg.all_gather(r, item), 2)

        def body():
            group.round(f"bucket 0 of {r}")
            if r == 1:
                raise RuntimeError("CUDA out of memory on rank 1")
            group.round(f"bucket 1 of {r}")

        fence = _fence(log) if r == 0 else None
        return sync_fenced(fence, body, group=group)

    out = tg.run(rank, [None, None])
    assert isinstance(out[1], RuntimeError) and "out of memory" in str(out[1])
    assert isinstance(out[0], PeerLeft) and "TP rank 1: RuntimeError: CUDA out of memory on rank 1" in str(out[0])
    assert log == ["begin", ("finish", False)] and tg.rounds == 2


def test_a_failure_only_the_closing_round_hears_fails_every_rank():
    tg = ThreadGroup(2, timeout_s=5)

    def rank(r, _):
        group = TPGroup(lambda item: tg.all_gather(r, item), 2)

        def body():
            if r == 0:
                raise ValueError("refused by the manifest")

        return sync_fenced(None, body, group=group)

    out = tg.run(rank, [None, None])
    assert isinstance(out[0], ValueError)
    assert isinstance(out[1], RankFailed) and "TP rank 0: ValueError: refused by the manifest" in str(out[1])


def test_agree_raises_the_own_error_on_its_rank_and_names_it_on_the_others():
    tg = ThreadGroup(3, timeout_s=5)

    def rank(r, _):
        group = TPGroup(lambda item: tg.all_gather(r, item), 3)
        assert group.agree(r * 10) == [0, 10, 20]
        return group.agree(None, KeyError("no such adapter") if r == 2 else None)

    out = tg.run(rank, [None] * 3)
    assert isinstance(out[2], KeyError)
    assert all(isinstance(o, RankFailed) and "TP rank 2: KeyError" in str(o) for o in out[:2])
    assert TPGroup(lambda item: pytest.fail("one rank: no collective"), 1).agree(5) == [5]


class _Actor:
    """An engine actor's fence calls: awaitable answers, a refusal on demand."""

    def __init__(self, refuse_begin=False):
        self.calls, self.refuse_begin = [], refuse_begin

    def _call(self, name, **kw):
        async def answer():
            self.calls.append((name, kw))
            if name == "begin_weight_sync" and self.refuse_begin:
                raise RuntimeError("requests are running")
        return answer()

    def __getattr__(self, name):
        return types.SimpleNamespace(remote=lambda **kw: self._call(name, **kw))


def test_an_overlapped_begin_is_confirmed_in_the_body_and_a_refused_one_is_never_lowered():
    actor = _Actor()
    fence = ServerFence(actor, global_steps=4, overlap=True)

    async def body():
        assert actor.calls == []  # only sent: the body reads its first bucket meanwhile
        await fence.confirm()
        return "loaded"

    assert asyncio.run(async_sync_fenced(fence, body)) == "loaded"
    assert actor.calls == [("begin_weight_sync", {}), ("finish_weight_sync", {"ok": True, "global_steps": 4})]
    actor = _Actor(refuse_begin=True)
    fence = ServerFence(actor, overlap=True)

    async def refused():
        await fence.confirm()

    with pytest.raises(RuntimeError, match="requests are running"):
        asyncio.run(async_sync_fenced(fence, refused))
    assert [c for c, _ in actor.calls] == ["begin_weight_sync"]  # no finish for a fence that never rose

    async def fails_before_confirming():
        raise ValueError("the first bucket failed")

    actor = _Actor()
    fence = ServerFence(actor, overlap=True)
    with pytest.raises(ValueError, match="the first bucket failed"):
        asyncio.run(async_sync_fenced(fence, fails_before_confirming))
    assert actor.calls[-1] == ("finish_weight_sync", {"ok": False, "global_steps": None})  # the begin answered: lowered
