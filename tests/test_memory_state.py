import threading

import pytest
import torch

from fakes import FakeSGLangEngine
from sgl_rollout.config import RolloutConfig
from sgl_rollout.engine import RolloutEngine
from sgl_rollout.memory import MemoryState, MemoryStateError
from sgl_rollout.weight_sync import SyncStats
from sgl_rollout.worker import RolloutWorker


def make_worker(**cfg):
    config = RolloutConfig(model_path="/fake", **cfg)
    engine = RolloutEngine(config, engine_factory=FakeSGLangEngine)
    return RolloutWorker(config, engine=engine), engine._engine


def serves(worker):
    out = worker.generate([[1, 2, 3]], {"max_new_tokens": 2})
    return out[0][0].output_ids == [4, 5]


def test_state_machine_unit():
    s = MemoryState(("weights", "kv_cache"))
    assert s.begin_release(None) == ["weights", "kv_cache"]
    s.commit(["kv_cache"], released=True)
    with pytest.raises(MemoryStateError, match="already released"):
        s.begin_release(["kv_cache"])
    with pytest.raises(MemoryStateError, match="resident"):
        s.begin_resume(["weights"])
    with pytest.raises(MemoryStateError, match="unknown"):
        s.begin_release(["cuda_graph"])
    with pytest.raises(MemoryStateError, match="empty"):
        s.begin_release([])
    with pytest.raises(MemoryStateError, match="duplicate"):
        s.begin_resume(["kv_cache", "kv_cache"])
    with pytest.raises(ValueError):
        MemoryState(("weights", "activations"))


def test_sleep_levels_release_the_right_tags():
    w1, fake1 = make_worker(sleep_level=1)
    assert w1.sleep() == ["kv_cache", "cuda_graph"]
    w2, fake2 = make_worker(sleep_level=2, enforce_eager=True)
    assert w2.sleep() == ["weights", "kv_cache"]  # no cuda_graph tag without CUDA graphs
    assert fake1.calls[-1] == ("release", ("kv_cache", "cuda_graph"))
    assert fake2.calls[-1] == ("release", ("weights", "kv_cache"))


def test_double_release_refused_and_engine_keeps_serving():
    w, fake = make_worker()
    w.sleep()
    n = len(fake.calls)
    with pytest.raises(MemoryStateError, match="already released"):
        w.sleep()
    with pytest.raises(MemoryStateError, match="already released"):
        w.engine.release(["weights"])
    assert len(fake.calls) == n  # nothing reached the engine
    with pytest.raises(MemoryStateError, match="asleep"):
        w.generate([[1]])
    w.wake_up()
    assert not fake.dead and serves(w)


def test_resume_resident_refused_and_engine_keeps_serving():
    w, fake = make_worker()
    with pytest.raises(MemoryStateError, match="resident"):
        w.engine.resume(["kv_cache"])
    with pytest.raises(MemoryStateError, match="resident"):
        w.engine.resume()
    assert not any(c[0] == "resume" for c in fake.calls)
    assert serves(w)


def test_release_while_requests_run_refused():
    w, fake = make_worker()
    fake.block = threading.Event()
    t = threading.Thread(target=lambda: w.generate([[7]], {"max_new_tokens": 1}))
    t.start()
    assert fake.entered.wait(5)
    try:
        with pytest.raises(MemoryStateError, match="request"):
            w.sleep()
    finally:
        fake.block.set()
        t.join(5)
    assert not fake.dead
    assert w.engine.state.in_flight == 0
    w.sleep()  # idle now: allowed
    w.wake_up()
    assert serves(w)


def test_weights_update_refused_while_weights_released():
    w, fake = make_worker()
    w.sleep()
    with pytest.raises(MemoryStateError, match="resume 'weights'"):
        w.engine.update_weights_from_tensor([b"x"], load_format="flattened_bucket")
    assert not fake.dead


def test_staged_wake_order():
    w, fake = make_worker(update_weights_bucket_megabytes=1)
    w.sleep()
    order = []
    fake_calls_before = len(fake.calls)
    tensors = [(f"layer{i}.weight", torch.randn(512, 512)) for i in range(3)]  # 1 MiB each -> 3 buckets
    stats = w.update_weights(iter(tensors), offload_trainer=lambda: order.append(("offload", list(fake.released))))
    calls = fake.calls[fake_calls_before:]
    kinds = [c[0] for c in calls]
    # no flush: SGLang flushed the prefix cache when it released the KV cache
    assert kinds == ["resume", "update_weights", "update_weights", "update_weights", "resume"]
    assert calls[0] == ("resume", ("weights",))
    assert calls[-1] == ("resume", ("kv_cache", "cuda_graph"))
    assert all(c[1] == "flattened_bucket" and c[2] == 1 and c[3] is False for c in calls[1:4])
    # the trainer offloads after the weights are in and before the KV cache comes back
    assert len(order) == 1 and sorted(order[0][1]) == ["cuda_graph", "kv_cache"]
    assert stats.n_buckets == 3 and stats.n_tensors == 3 and stats.bytes == 3 * 512 * 512 * 4
    assert not w.asleep and serves(w)
    phases = [r.phase for r in w.timeline.records]
    assert phases[-5:] == ["resume_weights", "sync", "offload_trainer", "empty_cache", "resume_kv_cache"]
    assert set(w.last_phase_seconds) >= {"resume_weights", "sync", "switch_total"}


def test_tp_payload_per_rank():
    w, fake = make_worker(tensor_model_parallel_size=4)
    w.update_weights([("x", torch.ones(4))])
    assert ("update_weights", "flattened_bucket", 4, False) in fake.calls


def test_free_cache_engine_false_releases_nothing():
    w, fake = make_worker(free_cache_engine=False)
    assert w.sleep() == []
    w.update_weights([("x", torch.ones(4))], offload_trainer=lambda: None)
    assert not any(c[0] in ("release", "resume") for c in fake.calls)
    assert any(c[0] == "update_weights" for c in fake.calls)
    assert fake.calls[-1] == ("flush_cache",)  # awake engine: stale prefix cache is dropped
    assert serves(w)


class RecordingFastSender:
    """In place of the fast path's sender (no CUDA here): records when the worker sends and frees its
    buffers, against the engine's calls."""

    def __init__(self, fake):
        self.fake, self.holds_buffers, self.timings, self.events = fake, False, {"call": 0.001}, []
        self.release_asked = []  # send's release argument, per sync
        self.ahead_asked = 0  # gather_ahead calls (the worker's work while the weights resume)
        self.ahead_token, self.ahead_got = object(), []

    def send(self, items, release=False, **kw):
        items = list(items)
        self.ahead_got.append(kw.get("ahead"))
        self.release_asked.append(release)
        self.holds_buffers = True  # as the load path leaves them (the plan path frees them itself)
        self.events.append(("send", len(self.fake.calls)))
        return SyncStats(n_tensors=len(items), n_buckets=1, bytes=sum(t.numel() * t.element_size() for _, t in items))

    def gather_ahead(self, items, validator=None):
        self.ahead_asked += 1
        return self.ahead_token  # what send must be handed back

    def release(self, notify=True):
        self.holds_buffers = False
        self.events.append(("release", len(self.fake.calls)))


@pytest.mark.parametrize("cfg,freed_at_sync", [
    ({}, True),                                # level 2: the engine sleeps, the trainer runs
    ({"sleep_level": 1}, True),                # likewise (the weights stay resident, the buffer does not)
    ({"free_cache_engine": False}, False),     # the engine never sleeps: the buffer and its handles are kept
])
def test_fast_path_buffer_freed_before_the_kv_cache_when_the_engine_sleeps(cfg, freed_at_sync):
    w, fake = make_worker(**cfg)
    w._fast = sender = RecordingFastSender(fake)
    w.sleep()
    before = len(fake.calls)
    w.update_weights([("x", torch.ones(4))], offload_trainer=lambda: None)
    weights_resumed = int(cfg == {})  # only level 2 released them
    assert sender.events[0] == ("send", before + weights_resumed)  # sent after the weights came back
    assert sender.release_asked == [freed_at_sync]  # the plan path closes the handles with its last bucket
    assert sender.ahead_asked == 1  # the first bucket was offered to gather while the weights resumed
    assert sender.ahead_got == [sender.ahead_token]  # and what it gathered was sent
    kv_resumes = [i for i, c in enumerate(fake.calls) if c == ("resume", ("kv_cache", "cuda_graph"))]
    if freed_at_sync:
        assert sender.events[1][0] == "release" and not sender.holds_buffers
        assert kv_resumes and sender.events[1][1] <= kv_resumes[-1]  # freed before the KV cache came back
        assert "release_sync_buffers" in w.last_phase_seconds
    else:
        assert len(sender.events) == 1 and sender.holds_buffers
    w.sleep()  # frees nothing more
    assert sum(e[0] == "release" for e in sender.events) == int(freed_at_sync)


def test_fast_path_buffer_that_cannot_be_closed_after_a_sync_is_kept_and_the_sleep_tries_again(caplog):
    from sgl_rollout.weight_sync.fast_path import FastPathError

    w, fake = make_worker()
    w._fast = sender = RecordingFastSender(fake)
    fails = [True, True]

    def release(notify=True):
        sender.events.append(("release", len(fake.calls)))
        if fails.pop(0):
            raise FastPathError("the engine did not answer the release")
        sender.holds_buffers = False

    sender.release = release
    w.sleep()
    with caplog.at_level("WARNING", logger="sgl_rollout.worker"):
        w.update_weights([("x", torch.ones(4))])  # the weights are in: the sync does not fail for it
    assert "fast-path buffers kept until the next sleep" in caplog.text
    assert sender.holds_buffers and not w.asleep and serves(w)  # the KV cache came back
    with pytest.raises(FastPathError):
        w.sleep()  # tried again before the weights are released; nothing was released
    assert not fake.released and serves(w)
    fails.append(False)
    assert w.sleep() == ["weights", "kv_cache", "cuda_graph"] and not sender.holds_buffers
