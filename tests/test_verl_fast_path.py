"""The fast-path weight sync through verl (``engine_kwargs.sgl_rollout.fast_sync``) without Ray or GPUs:
each TP rank's trainer worker is a thread with its own ``SglRollout`` and fast-path sender, the
replica's TP group an all-gather over the threads, and the engine actor a double that runs the real
fast-path loader over SGLang-shaped models (``test_fast_path.py``). It checks that every rank's shard
arrives bit for bit, that the buffers are freed after each sync, and that a failure on any one rank
(its loader inside the engine, its weights generator, the engine's refusal) raises on every rank, ends
the sync with ``finish_weight_sync(ok=False)`` and leaves no rank waiting for a round."""

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

import sgl_rollout.integrations.verl_rollout as verl_rollout
from fakes import ThreadGroup
from sgl_rollout.config import FAST_SYNC_LOADER
from sgl_rollout.integrations.verl_rollout import SglRollout
from sgl_rollout.weight_sync.driver import GroupLoader, PeerLeft
from sgl_rollout.weight_sync.manifest import SyncValidationError
from sgl_rollout.weight_sync.path import SyncPath
from sgl_rollout.weight_sync import receiver
from sgl_rollout.weight_sync.fast_path import FastPathError, FastPathSender
from test_fast_path import SGLangLikeEngine, SGLangShaped, assert_same_params, hf_weights, manifest_of, reference


class Answer:
    """What a double's ``method.remote()`` returns: awaitable, and read by the patched ``ray.get``."""

    def __init__(self, fn):
        self.fn = fn

    def __await__(self):
        if False:
            yield
        return self.fn()


class Server:
    """The engine actor: the sync fence, and each fast-path call run by the real loader (the engine
    double unpickles the payloads with SGLang's own serializer and calls the loader per rank)."""

    def __init__(self, models, refuse=()):
        self.engine, self.refuse, self.calls = SGLangLikeEngine(models), set(refuse), []
        self.lock = threading.Lock()

    def __getattr__(self, method):
        def remote(*args, **kwargs):
            def run():
                with self.lock:
                    self.calls.append((method, kwargs))
                if method in self.refuse:
                    raise RuntimeError(f"{method} refused")
                if method == "update_weights_from_payloads":
                    assert kwargs == {"fast_path": True}
                    return self.engine.update_weights_from_tensor(args[0], load_format=FAST_SYNC_LOADER)
                return None

            return Answer(run)

        return SimpleNamespace(remote=remote)

    def finished(self):
        return [kw["ok"] for m, kw in self.calls if m == "finish_weight_sync"]


@pytest.fixture(autouse=True)
def ray_get(monkeypatch):
    monkeypatch.setattr(verl_rollout.ray, "get", lambda answer: answer.fn())


def rank_adapters(server, group, tp_size, manifest, bucket_bytes):
    """One adapter and fast-path sender per TP rank, as ``SglRollout._fast_sender`` makes them
    (on the CPU here)."""
    config = SimpleNamespace(fast_sync=True, bucket_bytes=bucket_bytes, dtype="bfloat16", layered_summon=False,
                             validate_sync=True, free_cache_engine=True, tensor_model_parallel_size=tp_size,
                             to_server_args=lambda: {"custom_weight_loader": [FAST_SYNC_LOADER]})
    out = []
    for r in range(tp_size):
        a = object.__new__(SglRollout)
        a.tp_rank, a.tp_size, a._tp_group, a._server, a._fp8 = r, tp_size, None, server, False
        a.base_syncs, a.rollout_config, a._executor = 0, config, None
        a._sync_path = SyncPath(config, "/none")
        a._sync_path.manifest = manifest
        a._all_gather = (lambda rank: lambda item: group.all_gather(rank, item))(r)
        group_r = a._sync_group()
        loader = GroupLoader(group_r, server if r == 0 else None, config)
        a._fast = FastPathSender(loader, manifest, bucket_bytes, devices=["cpu"], tp_size=tp_size, tp_ranks=[r],
                                 share=group_r.round if tp_size > 1 else None)
        out.append(a)
    return out


def sync(group, adapters, weights_per_rank, steps=7):
    return group.run(lambda r, a, w: asyncio.run(a._send_fast(a._fast, w, steps)), adapters, weights_per_rank)


def make(tp_size=2, bucket_bytes=3000, refuse=(), **kw):
    models = [SGLangShaped(r, tp_size, **kw) for r in range(tp_size)]
    server, group = Server(models, refuse), ThreadGroup(tp_size)
    w0 = hf_weights(seed=0, **kw)
    return models, server, group, rank_adapters(server, group, tp_size, manifest_of(w0), bucket_bytes)


@pytest.mark.parametrize("tp_size,bucket_bytes", [(1, 1 << 20), (2, 1 << 20), (2, 3000)])
def test_every_rank_gets_its_shard_bit_for_bit_and_frees_its_buffer(tp_size, bucket_bytes):
    models, server, group, adapters = make(tp_size, bucket_bytes, tie=True, qk_norm=True)
    for seed in (1, 2):
        w = hf_weights(seed=seed, tie=True, qk_norm=True)
        out = sync(group, adapters, [iter(w) for _ in range(tp_size)])
        assert out == [None] * tp_size
        assert_same_params(models, reference(tp_size, w, tie=True, qk_norm=True))
        assert not any(a._fast.holds_buffers for a in adapters)  # freed before verl's offload and training
        assert not any(k.startswith(a._fast.key) for a in adapters for k in receiver._SHARED)  # handles closed
    assert server.finished() == [True, True] and [a.base_syncs for a in adapters] == [2] * tp_size
    assert [m for m, _ in server.calls].count("begin_weight_sync") == 2
    # the handles closed with each sync's last bucket: per rank the plan and each sync's buckets, no release call
    n_buckets = adapters[0]._fast.plan.program.n_buckets
    assert server.engine.loader_calls == tp_size * (1 + 2 * n_buckets)


def test_an_async_weights_iterator_is_read_from_the_event_loop():
    models, server, group, adapters = make(tp_size=1)
    w = hf_weights(seed=3)

    async def gen():
        for item in w:
            await asyncio.sleep(0)
            yield item

    assert sync(group, adapters, [gen()]) == [None]
    assert_same_params(models, reference(1, w))


def test_a_loader_failure_on_one_rank_fails_the_sync_on_every_rank_and_the_next_sync_replans():
    models, server, group, adapters = make()
    w = hf_weights(seed=4)
    sync(group, adapters, [iter(w) for _ in range(2)])
    adapters[1]._fast.fault = "raise"
    out = sync(group, adapters, [iter(hf_weights(seed=5)) for _ in range(2)])
    assert all(isinstance(o, FastPathError) and "TP rank 1" in str(o) for o in out), out
    assert server.finished() == [True, False]
    assert all(a._fast.covered is None and not a._fast.holds_buffers for a in adapters)  # asks for the plan again
    w = hf_weights(seed=6)
    assert sync(group, adapters, [iter(w) for _ in range(2)]) == [None, None]
    assert_same_params(models, reference(2, w))


def test_a_generator_failing_on_one_rank_ends_the_sync_on_both_without_a_hang():
    models, server, group, adapters = make()
    w = hf_weights(seed=7)

    def failing():
        for i, item in enumerate(w):
            if i == 9:
                raise RuntimeError("boom on rank 1")
            yield item

    out = sync(group, adapters, [iter(w), failing()])
    assert isinstance(out[1], RuntimeError) and str(out[1]) == "boom on rank 1"
    assert isinstance(out[0], PeerLeft) and "TP rank 1" in str(out[0]) and "boom on rank 1" in str(out[0])
    assert server.finished() == [False]
    assert sync(group, adapters, [iter(w) for _ in range(2)]) == [None, None]  # the same group goes on: no round left over
    assert_same_params(models, reference(2, w))


def test_weights_the_manifest_refuses_fail_on_every_rank_before_their_bucket():
    models, server, group, adapters = make(bucket_bytes=1 << 20)
    bad = [(n, t[:1] if n.endswith("down_proj.weight") else t) for n, t in hf_weights(seed=8)]
    out = sync(group, adapters, [iter(bad) for _ in range(2)])
    assert all(isinstance(o, SyncValidationError) for o in out), out
    assert server.finished() == [False]
    assert all(torch.count_nonzero(p) == 0 for m in models for p in m.parameters())  # nothing was loaded


def test_a_refused_begin_fails_every_rank_and_sends_nothing():
    models, server, group, adapters = make(refuse={"begin_weight_sync"})
    out = sync(group, adapters, [iter(hf_weights(seed=9)) for _ in range(2)])
    assert isinstance(out[0], RuntimeError) and "refused" in str(out[0])
    assert isinstance(out[1], PeerLeft) and "begin_weight_sync refused" in str(out[1])
    assert server.engine.loader_calls == 0 and server.finished() == []


def test_without_cuda_the_flattened_path_is_taken_and_the_reason_logged_once(caplog):
    if torch.cuda.is_available():
        pytest.skip("checks the choice on a machine without CUDA")
    from sgl_rollout.weight_sync.path import SyncPath

    def adapter(fast_sync):
        a = object.__new__(SglRollout)
        a.tp_rank, a.tp_size, a._tp_group, a._fast = 0, 1, None, None
        a.rollout_config = SimpleNamespace(fast_sync=fast_sync, validate_sync=True, model_path="/none")
        a._sync_path = SyncPath(a.rollout_config)
        return a

    with caplog.at_level("WARNING"):
        assert adapter(False)._fast_sender() is None and not caplog.records  # off: nothing to warn about
        a = adapter(True)
        assert a._fast_sender() is None and a._fast_sender() is None
    assert [r.getMessage() for r in caplog.records] == [
        "weight syncs go through SGLang's flattened buckets: no CUDA device in this process"]




def test_fast_sync_off_decides_without_a_collective():
    from sgl_rollout.weight_sync.path import SyncPath

    def no_collective(_reason):
        raise AssertionError("all-gather called although every rank's config has fast_sync off")

    path = SyncPath(SimpleNamespace(fast_sync=False, validate_sync=True, model_path="/none"))
    assert path.fast(agree=no_collective) is False and path.fast(agree=no_collective) is False


def test_an_engine_actor_lookup_that_fails_on_the_leader_ends_the_sync_on_every_rank(monkeypatch):
    """The leader looks the engine actor up when the fence rises (ray.get_actor): a failed lookup is the
    fence's refusal, which the other rank hears in its first round instead of waiting there for ever."""
    models, server, group, adapters = make()
    adapters[0]._server, adapters[0].replica_rank = None, 0

    def lookup(name):
        raise ValueError(f"Failed to look up actor {name!r}")

    monkeypatch.setattr(verl_rollout.ray, "get_actor", lookup)
    out = sync(group, adapters, [iter(hf_weights(seed=10)) for _ in range(2)])
    assert isinstance(out[0], ValueError) and "Failed to look up actor" in str(out[0])
    assert isinstance(out[1], PeerLeft) and "Failed to look up actor" in str(out[1])
    assert server.calls == []  # nothing reached the engine
