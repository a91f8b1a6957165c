"""The verl adapter's bucketed weight sync (``SglRollout._send_buckets``) without Ray or GPUs: the
engine actor is a double whose calls answer when the test says so. It checks the pipelining (the engine
loads bucket k while the trainer flattens bucket k+1), that no bucket's buffer is dropped before the load
that reads it answered, and how a refusal at each step ends the sync. The TP=2 protocol over
torch.distributed, with verl's own worker, is ``tests/test_verl_rollout.py``'s."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from sgl_rollout.integrations.verl_rollout import SglRollout
from sgl_rollout.weight_sync import BucketStream


class Engine:
    """The engine actor: ``method.remote(...)`` records the call and returns a future the double answers
    on the loop's next turns (or fails, for the methods in ``refuse``)."""

    def __init__(self, events, refuse=()):
        self.events, self.refuse = events, dict(refuse)

    def __getattr__(self, method):
        def remote(*args, **kwargs):
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            n = sum(1 for e in self.events if e[0] == "submit" and e[1] == method)
            self.events.append(("submit", method, n))

            def answer():
                self.events.append(("answered", method, n))
                if (method, n) in self.refuse:
                    fut.set_exception(RuntimeError(self.refuse[(method, n)]))
                else:
                    fut.set_result(None)

            loop.call_soon(answer)
            return fut

        return SimpleNamespace(remote=remote)


def adapter(engine, bucket_bytes):
    a = object.__new__(SglRollout)
    from sgl_rollout.weight_sync.path import SyncPath

    a.tp_rank, a.tp_size, a._tp_group, a._server, a._fp8 = 0, 1, None, engine, False
    a.base_syncs = 0
    a.rollout_config = SimpleNamespace(bucket_bytes=bucket_bytes, layered_summon=False, validate_sync=True)
    a._sync_path = SyncPath(a.rollout_config, "/none")
    a._sync_path.manifest = None
    return a


def weights(events, n=4, fail_at=None):
    """``n`` float32 tensors of 1 KiB; records when each is read (and fails at ``fail_at``)."""
    for i in range(n):
        events.append(("read", i))
        if i == fail_at:
            raise RuntimeError("boom")
        yield f"w{i}", torch.full((256,), float(i))


@pytest.fixture
def held(monkeypatch):
    """The most buckets any stream held, seen at each flatten."""
    seen = []
    orig = BucketStream.next_payload

    def next_payload(self):
        out = orig(self)
        seen.append(self.held)
        return out

    monkeypatch.setattr(BucketStream, "next_payload", next_payload)
    return seen


def test_the_engine_loads_a_bucket_while_the_next_is_flattened(held):
    events = []
    a = adapter(Engine(events), bucket_bytes=1024)  # one tensor per bucket
    asyncio.run(a._send_buckets(weights(events), global_steps=5))
    loads = [e for e in events if e[:2] == ("submit", "update_weights_from_payloads")]
    assert len(loads) == 4 and a.base_syncs == 1
    # begin is sent before the first tensor is read; bucket k's load before bucket k+1 is flattened
    # (the bucketer reads one tensor ahead: bucket k is whole when tensor k+1 is read)
    assert events.index(("submit", "begin_weight_sync", 0)) < events.index(("read", 0))
    for k in range(2):
        assert events.index(("submit", "update_weights_from_payloads", k)) < events.index(("read", k + 2))
    # never more than two buckets held (the one being loaded, the one just flattened)
    assert max(held) == 2
    assert events[-2:] == [("submit", "finish_weight_sync", 0), ("answered", "finish_weight_sync", 0)]


def test_a_buffer_is_kept_until_the_load_that_reads_it_answered(monkeypatch):
    events = []
    orig = BucketStream.release

    def release(self, keep_newest=False):
        events.append(("release", self.held - (1 if keep_newest and self.held else 0)))
        orig(self, keep_newest)

    monkeypatch.setattr(BucketStream, "release", release)
    a = adapter(Engine(events), bucket_bytes=1024)
    asyncio.run(a._send_buckets(weights(events, n=3), global_steps=None))
    # every drop of a bucket comes after the load of that bucket answered
    dropped = 0
    for i, e in enumerate(events):
        if e[0] == "release" and e[1] > 0:
            for k in range(dropped, dropped + e[1]):
                assert ("answered", "update_weights_from_payloads", k) in events[:i], (k, events)
            dropped += e[1]
    assert dropped == 3


@pytest.mark.parametrize("refused, finished", [(("begin_weight_sync", 0), False),
                                               (("update_weights_from_payloads", 1), True)])
def test_a_refusal_ends_the_sync_and_is_raised(refused, finished):
    events = []
    a = adapter(Engine(events, refuse={refused: "busy"}), bucket_bytes=1024)
    with pytest.raises(RuntimeError, match="busy") as got:
        asyncio.run(a._send_buckets(weights(events), global_steps=3))
    assert str(got.value) == "busy"  # the engine's own error, as before the pipelining
    loads = [e for e in events if e[:2] == ("submit", "update_weights_from_payloads")]
    assert len(loads) == (0 if refused[0] == "begin_weight_sync" else 2)  # nothing after the refused step
    assert (("submit", "finish_weight_sync", 0) in events) is finished
    assert a.base_syncs == 0


def test_a_failing_generator_waits_for_the_load_in_flight_then_ends_the_sync(held):
    events = []
    a = adapter(Engine(events), bucket_bytes=1024)
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(a._send_buckets(weights(events, fail_at=3), global_steps=3))
    i = events.index(("read", 3))  # while bucket 2 is flattened and bucket 1 loads
    assert ("answered", "update_weights_from_payloads", 1) in events[i:]  # bucket 1's load answered after the failure
    assert events.index(("answered", "update_weights_from_payloads", 1)) < events.index(("submit", "finish_weight_sync", 0))
    assert len([e for e in events if e[:2] == ("submit", "update_weights_from_payloads")]) == 2


def test_an_engine_actor_that_cannot_be_reached_is_reported_not_raised_before_the_round():
    """At TP > 1 the leader must still take part in the round that reports a failure, or the other ranks
    wait for it for ever; here: the actor lookup fails when the sync starts."""
    class Missing:
        def __getattr__(self, method):
            raise ValueError("Failed to look up actor 'sgl_rollout_server_0'")

    events = []
    a = adapter(Missing(), bucket_bytes=1024)
    with pytest.raises(ValueError, match="Failed to look up actor"):
        asyncio.run(a._send_buckets(weights(events), global_steps=None))
    assert ("read", 0) in events  # the round ran (every rank reads its first bucket), then the error


def test_a_failed_sync_still_reads_verls_weights_to_the_end():
    """verl's generator gathers each tensor over every trainer rank: a rank that stopped reading at the
    failure would leave the other ranks (its TP peers, other replicas) waiting in that collective."""
    events = []
    a = adapter(Engine(events, refuse={("update_weights_from_payloads", 0): "busy"}), bucket_bytes=1024)
    with pytest.raises(RuntimeError, match="busy"):
        asyncio.run(a._send_buckets(weights(events, n=8), global_steps=3))
    assert [e for e in events if e[0] == "read"] == [("read", i) for i in range(8)]
    assert events.index(("read", 7)) < events.index(("submit", "finish_weight_sync", 0))  # before the fence lifts
