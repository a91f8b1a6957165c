"""The bucket rounds (sgl_rollout.weight_sync.protocol) inside the driver's fence
(sgl_rollout.weight_sync.driver): begin -> bucket rounds -> finish, and the rule that every TP rank runs out
of buckets in the same round; the Ray driver follows it."""

import asyncio
import types

import pytest

from sgl_rollout.twin import Step
from sgl_rollout.weight_sync.driver import async_sync_fenced, sync_fenced
from sgl_rollout.weight_sync.protocol import RoundError, async_bucket_rounds, bucket_rounds, check_round


def test_check_round():
    assert check_round([None, None], 3) is True
    assert check_round([b"a", b"b"], 3) is False
    with pytest.raises(RoundError, match=r"different times \(bucket 2: done=\[False, True\]\)"):
        check_round([b"a", None], 2)


def _rig(per_rank, fail_load_at=None):
    log = []
    rounds = [iter(p) for p in per_rank]

    def next_round(n):
        log.append(("round", n))
        return [next(r, None) for r in rounds]

    def load(payloads, n):
        if n == fail_load_at:
            raise RuntimeError("SGLang refused")
        log.append(("load", n, tuple(payloads)))

    fence = types.SimpleNamespace(begin=lambda: Step.call(log.append, "begin"),
                                  finish=lambda ok: Step.call(log.append, ("finish", ok)))
    return log, fence, dict(next_round=next_round, load=load, release=lambda n: log.append(("release", n)))


def test_rounds_run_in_order_and_release_after_each_load():
    log, fence, kw = _rig([[b"a0", b"a1"], [b"b0", b"b1"]])
    assert sync_fenced(fence, lambda: bucket_rounds(**kw)) == 2
    assert log == ["begin", ("round", 0), ("load", 0, (b"a0", b"b0")), ("release", 0),
                   ("round", 1), ("load", 1, (b"a1", b"b1")), ("release", 1),
                   ("round", 2), ("release", 2), ("finish", True)]


@pytest.mark.parametrize("face", ["sync", "async"])
def test_disagreeing_ranks_or_a_failed_load_end_the_sync_as_failed(face):
    def run(fence, kw):
        if face == "sync":
            return sync_fenced(fence, lambda: bucket_rounds(**kw))
        return asyncio.run(async_sync_fenced(fence, lambda: async_bucket_rounds(**kw)))

    log, fence, kw = _rig([[b"a0", b"a1"], [b"b0"]])
    with pytest.raises(RoundError, match="different times"):
        run(fence, kw)
    assert log[-2:] == [("release", 1), ("finish", False)]
    log, fence, kw = _rig([[b"a0"]], fail_load_at=0)
    with pytest.raises(RuntimeError, match="SGLang refused"):
        run(fence, kw)
    assert log[-2:] == [("release", 0), ("finish", False)]


def test_a_refused_fence_runs_no_round_and_never_finishes():
    log, _, kw = _rig([[b"a0"]])

    def refuse():
        raise RuntimeError("weights released")

    fence = types.SimpleNamespace(begin=lambda: Step.call(refuse), finish=lambda ok: Step.call(log.append, ok))
    ended = []
    with pytest.raises(RuntimeError, match="weights released"):
        sync_fenced(fence, lambda: bucket_rounds(**kw), on_end=ended.append)
    assert log == [] and ended == [False]  # on_end always runs; the fence that never rose is not lowered


def test_the_ray_driver_follows_the_protocol(monkeypatch):
    import ray

    from sgl_rollout.server import sync_weights_from_workers

    monkeypatch.setattr(ray, "get", lambda x: [f() for f in x] if isinstance(x, list) else x())
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns: (refs, []))
    log = []

    def remote(fn):
        return types.SimpleNamespace(remote=lambda *a, **kw: (lambda: fn(*a, **kw)))

    def worker(payloads):
        it = iter(payloads)
        return types.SimpleNamespace(next_weight_payload=remote(lambda: next(it, None)),
                                     release_weight_payload=remote(lambda: log.append("release")))

    server = types.SimpleNamespace(begin_weight_sync=remote(lambda: log.append("begin")),
                                   update_weights_from_payloads=remote(lambda p: log.append(("load", tuple(p)))),
                                   finish_weight_sync=remote(lambda ok, global_steps=None: log.append(("finish", ok))))
    assert sync_weights_from_workers(server, [worker([b"a"]), worker([b"b"])]) == 1
    assert log == ["begin", ("load", (b"a", b"b")), "release", "release", "release", "release", ("finish", True)]
    log.clear()
    with pytest.raises(RuntimeError, match="different times"):
        sync_weights_from_workers(server, [worker([b"a", b"a2"]), worker([b"b"])])
    assert log[-1] == ("finish", False) and log.count("release") == 4
