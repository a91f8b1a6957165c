"""The copy plan's buckets sent point to point from trainer ranks into rollout TP ranks' fast-path
buffers (:mod:`sgl_rollout.weight_sync.p2p`), on the CPU: gloo process groups over a real ``TCPStore``,
one thread per process, SGLang-shaped TP shards behind SGLang's own unpickler (``test_fast_path``'s rig).
"""

import threading

import pytest
import torch

from sgl_rollout.weight_sync.fast_path import FastPathError
from sgl_rollout.weight_sync.manifest import SyncValidationError
from sgl_rollout.weight_sync.p2p import PeerGroup, PlanReceipt, TrainerRefused, receive_plan_buckets, send_plan_buckets
from test_fast_path import SGLangShaped, _as_rank, assert_same_params, hf_weights, reference, split_senders

KW = dict(tie=True, qk_norm=True)


def _free_port():
    from torch.distributed.elastic.utils.distributed import get_free_port

    return get_free_port()


def on_threads(calls, timeout_s=90):
    """Each callable on a thread of its own, as each process would run its side; each one's result or
    raised exception, in order. Fails when a thread is still running after ``timeout_s`` (a hang)."""
    out = [None] * len(calls)

    def body(i):
        try:
            out[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out[i] = exc

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(calls))]
    [t.start() for t in threads]
    [t.join(timeout_s) for t in threads]
    assert not any(t.is_alive() for t in threads), "a side of the sync hangs"
    return out


def gloo_groups(world):
    """One gloo :class:`PeerGroup` per rank of ``world``, each made on a thread of its own (as each
    process makes its own), over a fresh store address."""
    port = _free_port()
    groups = on_threads([lambda r=r: PeerGroup("127.0.0.1", port, r, world, "cpu", timeout_s=30) for r in range(world)])
    assert all(isinstance(g, PeerGroup) for g in groups), groups
    return groups


class Rig:
    """``n_trainers`` trainer ranks and one rollout replica of ``tp`` TP ranks (split fast-path senders,
    one per rank, as under verl) in one process group; rollout worker ``k`` gets trainer ``k % n_trainers``."""

    def __init__(self, n_trainers, tp, bucket_bytes=3000, uncovered=False):
        self.a, self.tp = n_trainers, tp
        self.models = [SGLangShaped(r, tp, uncovered=uncovered, **KW) for r in range(tp)]
        self.tp_group, self.senders = split_senders(self.models, hf_weights(seed=0, **KW), bucket_bytes, tp)
        self.groups = gloo_groups(n_trainers + tp)

    def peers(self, j):
        return [(self.a + k, k) for k in range(self.tp) if k % self.a == j]

    def sync(self, streams):
        """One sync; ``streams[j]``: trainer j's (name, tensor) iterable. Each thread's result or exception
        (trainers first, then rollout ranks)."""
        trainers = [lambda j=j: send_plan_buckets(self.groups[j], self.peers(j), streams[j]) for j in range(self.a)]
        rollouts = [lambda k=k: _as_rank(k, lambda: receive_plan_buckets(
            self.senders[k], PlanReceipt(self.groups[self.a + k], source=k % self.a, index=k))) for k in range(self.tp)]
        return on_threads(trainers + rollouts)


class Counting:
    def __init__(self, items):
        self.items, self.read = list(items), 0

    def __iter__(self):
        for item in self.items:
            self.read += 1
            yield item


@pytest.mark.parametrize("n_trainers", [1, 2])
def test_each_rollout_rank_gets_only_its_shard_and_the_engine_equals_load_weights(n_trainers):
    rig = Rig(n_trainers, 2)
    for seed in (1, 2):  # two syncs over the same groups: the plans are published again each time
        w = hf_weights(seed=seed, **KW)
        out = rig.sync([iter(w) for _ in range(n_trainers)])
        assert not any(isinstance(o, BaseException) for o in out), out
        assert_same_params(rig.models, reference(2, w, **KW))
    # trainer j sent exactly the bytes of its rollout ranks' plans, and each rank's plan is its shard:
    # about half the model at TP=2 (norms are whole on both), not the whole model to every rank
    per_rank = [sum(sizes) for sizes in rig.senders[0].plan.program.sizes]
    per_trainer = [sum(per_rank[k] for k in range(2) if k % n_trainers == j) for j in range(n_trainers)]
    assert [o.bytes for o in out[:n_trainers]] == per_trainer
    model = sum(t.numel() * t.element_size() for _, t in w)
    assert all(n < 0.6 * model for n in per_rank), (per_rank, model)
    assert out[n_trainers].n_buckets > 3  # many buckets: rows split between them
    assert all(o.max_bucket_bytes <= 3000 for o in out[:n_trainers])
    assert all(s._buffers == [None] for s in rig.senders)  # the fast path's buffer is freed after the sync


def test_a_refused_tensor_ends_the_sync_on_every_side_and_the_next_sync_succeeds():
    rig = Rig(1, 2)
    w = hf_weights(seed=3, **KW)
    bad = list(w)
    bad[-2] = (bad[-2][0], torch.zeros(5, 5, dtype=torch.bfloat16))  # late: buckets were sent before it
    stream = Counting(bad)
    out = rig.sync([iter(stream)])
    assert isinstance(out[0], SyncValidationError) and bad[-2][0] in str(out[0]), out
    assert stream.read == len(bad)  # the trainer read its (collective) generator to the end
    for o in out[1:]:
        assert isinstance(o, TrainerRefused) and bad[-2][0] in str(o), o
    out = rig.sync([iter(w)])
    assert not any(isinstance(o, BaseException) for o in out), out
    assert_same_params(rig.models, reference(2, w, **KW))
    # an iterable that is not an iterator (each iter() a fresh pass, as a collective gather would be):
    # after the refusal the pass begun is read to its end, and no second pass is started
    again = Counting(bad)
    out = rig.sync([again])
    assert isinstance(out[0], SyncValidationError) and again.read == len(bad), (out[0], again.read)


def test_a_rollout_rank_without_a_covered_plan_tells_the_trainer():
    rig = Rig(1, 2, uncovered=True)
    stream = Counting(hf_weights(seed=4, **KW))
    out = rig.sync([iter(stream)])
    assert isinstance(out[0], TrainerRefused) and "does not cover" in str(out[0]), out
    assert all(isinstance(o, FastPathError) for o in out[1:]), out
    assert stream.read == len(stream.items)


class VerlBackend:
    """``checkpoint_engine.backend=sgl_rollout`` through verl's registry and its manager's contract
    (``verl/checkpoint_engine/base.py``): trainers made with ``is_master``, rollout workers without;
    each sync runs ``prepare`` on all, ``build_topology`` (lists as long as each group),
    ``init_process_group``, the trainers' ``send_weights`` and the rollout workers' ``receive_weights``
    (handed to the adapter, here the fast path directly), ``finalize``."""

    def __init__(self, a=2, tp=2, timeout_s=600.0):
        pytest.importorskip("verl")
        import verl  # noqa: F401 - loads this package's plugin, which registers the backend
        from verl.checkpoint_engine.base import CheckpointEngineRegistry

        from sgl_rollout.integrations.verl_checkpoint_engine import BACKEND

        self.a, self.tp = a, tp
        self.trainers = [CheckpointEngineRegistry.new(BACKEND, is_master=(j == 0), bucket_size=1 << 20,
                                                      timeout_s=timeout_s) for j in range(a)]
        self.rollouts = [CheckpointEngineRegistry.new(BACKEND, bucket_size=1 << 20, timeout_s=timeout_s)
                         for _ in range(tp)]
        self.models = [SGLangShaped(r, tp, **KW) for r in range(tp)]
        _, self.senders = split_senders(self.models, hf_weights(seed=0, **KW), 3000, tp)

    @property
    def engines(self):
        return self.trainers + self.rollouts

    def build(self):
        """verl's ``build_process_group``: prepare, build_topology, init_process_group on every side."""
        with _stub_node_ip():
            self.metadata = [e.prepare() for e in self.engines]
        assert [m["role"] for m in self.metadata] == ["trainer"] * self.a + ["rollout"] * self.tp
        actor, rollout = type(self.trainers[0]).build_topology(self.a, self.tp, self.metadata)
        assert all(len(v) == self.a for v in actor.values()) and all(len(v) == self.tp for v in rollout.values())
        kwargs = [{k: v[j] for k, v in actor.items()} for j in range(self.a)]
        kwargs += [{k: v[i] for k, v in rollout.items()} for i in range(self.tp)]
        on_threads([lambda e=e, kw=kw: e.init_process_group(**kw) for e, kw in zip(self.engines, kwargs)])
        return [e._group for e in self.engines]

    def sync(self, w, step, rollout_ranks=None):
        """One sync of ``w`` (each trainer's stream a fresh iterator); ``rollout_ranks``: the rollout workers
        that take part (None: all). Each side's result or exception, trainers first."""
        import asyncio

        from sgl_rollout.weight_sync.p2p import PlanReceipt

        self.build()

        def rollout(k):
            receipt = self.rollouts[k].receive_weights(global_steps=step)
            assert isinstance(receipt, PlanReceipt) and receipt.source == k % self.a
            return _as_rank(k, lambda: receive_plan_buckets(self.senders[k], receipt))

        ranks = range(self.tp) if rollout_ranks is None else rollout_ranks
        out = on_threads([lambda j=j: asyncio.run(self.trainers[j].send_weights(iter(w), global_steps=step))
                          for j in range(self.a)] + [lambda k=k: rollout(k) for k in ranks])
        [e.finalize() for e in self.engines]
        return out


def test_verl_drives_the_backend_as_its_checkpoint_engine_manager_does():
    """Two syncs over the one group, each bit-exact against SGLang's ``load_weights``."""
    from sgl_rollout.integrations.verl_checkpoint_engine import WIRE_FORMAT

    v = VerlBackend()
    assert v.rollouts[0].wire_format == WIRE_FORMAT
    for seed in (5, 6):
        w = hf_weights(seed=seed, **KW)
        out = v.sync(w, seed)
        assert not any(isinstance(o, BaseException) for o in out), out
        assert all(o["sgl_rollout/send_bytes"] > 0 for o in out[:v.a])
        assert_same_params(v.models, reference(v.tp, w, **KW))
        if seed == 5:
            first = [e._group for e in v.engines]
    assert all(e._group is f for e, f in zip(v.engines, first))  # the group lived across both syncs



def test_finalize_hands_the_syncs_cached_blocks_back_on_every_side_and_keeps_the_group(monkeypatch):
    """After a sync each side's ``finalize`` empties torch's CUDA cache (as verl's ``nccl`` backend does),
    so the send buffer's blocks do not stay reserved into training; the group is kept. Where CUDA was
    never used nothing is called (no context is made)."""
    from sgl_rollout import memory

    v = VerlBackend()
    out = v.sync(hf_weights(seed=7, **KW), 1)  # its own finalize runs on the CPU: CUDA never initialised
    assert not any(isinstance(o, BaseException) for o in out), out
    groups = [e._group for e in v.engines]
    emptied = []
    monkeypatch.setattr(memory, "has_cuda_context", lambda device=None: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    for e in v.engines:
        e.finalize()
    assert len(emptied) == len(v.engines) == v.a + v.tp
    assert [e._group for e in v.engines] == groups and not any(g.broken for g in groups)
    monkeypatch.setattr(memory, "has_cuda_context", lambda device=None: False)
    memory.release_cached_blocks()
    assert len(emptied) == len(v.engines)


def test_finalize_empties_the_cache_only_when_the_sync_grew_it(monkeypatch):
    """``prepare`` notes torch's reserved bytes; ``finalize`` empties the cache only when they grew since.
    After a training step the cache is most of the GPU and emptying it cost the trainer 210-250 ms a sync
    on 4xH200: a sync served from that cache must not pay it, one that grew it must give its blocks back."""
    from sgl_rollout import memory

    v = VerlBackend()
    e = v.engines[0]
    reserved = [80 << 30]
    emptied = []
    monkeypatch.setattr(memory, "has_cuda_context", lambda device=None: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved[0])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(reserved[0]))
    e.prepare()
    e.finalize()  # nothing grew: the training cache stays
    assert emptied == []
    e.prepare()
    reserved[0] += 2 << 30  # the sync's bucket needed a new segment
    e.finalize()
    assert emptied == [82 << 30]
    e.finalize()  # no prepare before it: empties, as verl's own backend always does
    assert len(emptied) == 2
    assert memory.release_cached_blocks(grown_since=reserved[0]) is False
    assert memory.release_cached_blocks(grown_since=reserved[0] - 1) is True


# ====================================================================== bad input never hangs or aborts
# Issue 46: each of these hung until the transport's timeout, aborted the process, or broke later syncs.

def test_a_plan_that_never_comes_is_named_to_the_trainer_and_to_the_ranks_already_waiting(monkeypatch):
    """Rollout worker 1's plan is lost on its way to the store: trainer 0 (serving workers 0 and 1) waits
    ``plan_wait_s`` for it, then ends the sync, and both workers, which wait for their buckets, learn why
    within seconds instead of after the transfer timeout. The next sync gets a new group on every side
    (the failed one may be mid-message) and succeeds."""
    import time

    from sgl_rollout.weight_sync import p2p

    v = VerlBackend(a=1, tp=2, timeout_s=30)
    v.build()
    for e in v.engines:
        e._group.plan_wait_s = 2.0
    publish = p2p.PlanReceipt.publish
    monkeypatch.setattr(p2p.PlanReceipt, "publish", lambda self, plan: None if self.index == 1 else publish(self, plan))
    w = hf_weights(seed=7, **KW)
    t0 = time.monotonic()
    out = _sync_with_groups(v, w, rollout_ranks=[0, 1])
    assert time.monotonic() - t0 < 15  # the plan wait (2 s), not the transfer timeout (30 s)
    assert isinstance(out[0], TrainerRefused) and "rollout worker 1: no copy plan came within 2 s" in str(out[0])
    for o in out[1:]:
        assert isinstance(o, TrainerRefused) and "rollout worker 1: no copy plan came" in str(o), out
    monkeypatch.setattr(p2p.PlanReceipt, "publish", publish)
    old = [e._group for e in v.engines]
    with _stub_node_ip():
        assert [e.prepare()["broken"] for e in v.engines] == [True, True, True]
    out = v.sync(w, 8)
    assert not any(isinstance(o, BaseException) for o in out), out
    assert all(e._group is not g for e, g in zip(v.engines, old))  # a new group on every side
    assert_same_params(v.models, reference(v.tp, w, **KW))


def _sync_with_groups(v, w, rollout_ranks):
    """One sync over the groups ``v`` has now (no new ``build``)."""
    import asyncio

    def rollout(k):
        return _as_rank(k, lambda: receive_plan_buckets(v.senders[k], v.rollouts[k].receive_weights(global_steps=1)))

    return on_threads([lambda j=j: asyncio.run(v.trainers[j].send_weights(iter(w), global_steps=1))
                       for j in range(v.a)] + [lambda k=k: rollout(k) for k in rollout_ranks])


def test_weights_that_are_not_iterable_end_every_link_with_the_reason():
    import time

    rig = Rig(1, 2)
    t0 = time.monotonic()
    out = rig.sync([42])
    assert time.monotonic() - t0 < 15  # not the group's 30-s timeout
    assert isinstance(out[0], TypeError), out
    for o in out[1:]:
        assert isinstance(o, TrainerRefused) and "TypeError" in str(o) and "not iterable" in str(o), o
    assert all(g.broken for g in rig.groups)


def test_plans_that_differ_fail_the_sync_without_aborting_the_process():
    """The trainer packs a plan other than the one the rollout rank receives by (here: the published
    plan's buckets are twice as large). The rollout rank reads the trainer's buckets by the sizes their
    headers give, so no read takes bytes for a header (gloo aborted the process on that), and the sync
    fails on the rollout side with the reason."""
    from sgl_rollout.weight_sync import p2p

    rig = Rig(1, 2)

    class Twice(PlanReceipt):
        def publish(self, plan):
            super().publish(dict(plan, bucket_bytes=2 * plan["bucket_bytes"]))

    def rollout(k):
        return _as_rank(k, lambda: receive_plan_buckets(rig.senders[k], Twice(rig.groups[1 + k], source=0, index=k)))

    w = hf_weights(seed=9, **KW)
    out = on_threads([lambda: send_plan_buckets(rig.groups[0], rig.peers(0), iter(w))] +
                     [lambda k=k: rollout(k) for k in range(2)])
    assert not isinstance(out[0], BaseException), out  # the trainer sent what it packed
    for o in out[1:]:
        assert isinstance(o, p2p.FastPathError) and "plans differ" in str(o), o
        assert all(g.broken for g in rig.groups[1:])


def test_send_and_receive_before_init_process_group_say_so():
    import asyncio

    v = VerlBackend(a=1, tp=1)
    stream = Counting(hf_weights(seed=2, **KW))
    with pytest.raises(RuntimeError, match="send_weights before init_process_group"):
        asyncio.run(v.trainers[0].send_weights(iter(stream)))
    assert stream.read == len(stream.items)  # read to the end all the same: verl's gathers are collective
    with pytest.raises(RuntimeError, match="receive_weights before init_process_group"):
        v.rollouts[0].receive_weights()


class _stub_node_ip:
    """verl's trainer rank 0 names its node's address through Ray; here the loopback."""

    def __enter__(self):
        from sgl_rollout.integrations import verl_checkpoint_engine as ce

        self.ce, self.old = ce, ce._node_ip
        ce._node_ip = lambda: "127.0.0.1"

    def __exit__(self, *exc):
        self.ce._node_ip = self.old


@pytest.mark.parametrize("cfg", [
    {"checkpoint_engine": {"backend": "sgl_rollout"}, "engine_kwargs": {"sgl_rollout": {"fast_sync": False}}},
    # the strings the engine reads as False (pydantic's bool), which a truth test took for True (issue 46)
    {"checkpoint_engine": {"backend": "sgl_rollout"}, "engine_kwargs": {"sgl_rollout": {"fast_sync": "no"}}},
    {"checkpoint_engine": {"backend": "sgl_rollout"}, "engine_kwargs": {"sgl_rollout": {"fast_sync": "false"}}},
    {"checkpoint_engine": {"backend": "sgl_rollout"}, "quantization": "fp8"},
])
def test_the_backend_without_the_fast_path_is_refused_at_start_up_in_one_line(cfg):
    from sgl_rollout.integrations.verl_config import ROLLOUT_PREFIX, UnsupportedVerlFeature, check_verl_features

    with pytest.raises(UnsupportedVerlFeature) as e:
        check_verl_features(cfg)
    lines = str(e.value).splitlines()[1:]
    assert len(lines) == 1 and lines[0].strip().startswith(f"{ROLLOUT_PREFIX}.checkpoint_engine.backend='sgl_rollout'")
    check_verl_features({"checkpoint_engine": {"backend": "sgl_rollout"}})  # fast path on (the default): served


# ====================================================================== through the adapter
# SglRollout._receive_plan as verl's CheckpointEngineWorker reaches it (wire_format sgl_rollout_plan):
# test_verl_fast_path's rig (one adapter per TP rank on threads, the engine actor a double running the
# real loader), fed by trainer threads over gloo.

@pytest.fixture
def ray_get(monkeypatch):
    """The engine actor double answers in place: ``ray.get`` reads its answer (as in test_verl_fast_path)."""
    import ray

    monkeypatch.setattr(ray, "get", lambda answer: answer.fn())


def _adapter_rig(n_trainers=2, tp=2, refuse=()):
    from test_verl_fast_path import make

    models, server, group, adapters = make(tp_size=tp, refuse=refuse, **KW)
    return models, server, adapters, gloo_groups(n_trainers + tp)


def _adapter_sync(adapters, groups, streams, steps=7, on_plan=None):
    import asyncio

    a, tp = len(streams), len(adapters)
    trainers = [lambda j=j: send_plan_buckets(groups[j], [(a + k, k) for k in range(tp) if k % a == j], streams[j],
                                              on_plan=on_plan and (lambda plan, j=j: on_plan(j, plan)))
                for j in range(a)]
    rollouts = [lambda k=k: asyncio.run(adapters[k]._receive_plan(PlanReceipt(groups[a + k], source=k % a, index=k),
                                                                  steps)) for k in range(tp)]
    return on_threads(trainers + rollouts)


def test_the_adapter_receives_in_the_engines_fence_and_frees_its_buffer(ray_get):
    models, server, adapters, groups = _adapter_rig()
    for seed in (1, 2):
        w = hf_weights(seed=seed, **KW)
        out = _adapter_sync(adapters, groups, [iter(w), iter(w)], steps=seed)
        assert out[2:] == [None, None] and not any(isinstance(o, BaseException) for o in out), out
        assert_same_params(models, reference(2, w, **KW))
        assert not any(a._fast.holds_buffers for a in adapters)
    assert server.finished() == [True, True] and [a.base_syncs for a in adapters] == [2, 2]
    steps = [kw.get("global_steps") for m, kw in server.calls if m == "finish_weight_sync"]
    assert steps == [1, 2]


def test_the_trainer_learns_the_rollouts_dtype_from_its_plan_before_reading_its_weights(ray_get, monkeypatch):
    """The rollout publishes its weight dtype with its plan; each trainer rank sees it before its stream is read,
    and the checkpoint engine hands it to the gather by FSDP unit (verl_gather), which then narrows to it."""
    import torch

    from sgl_rollout.integrations import verl_checkpoint_engine, verl_gather

    models, server, adapters, groups = _adapter_rig()
    w = hf_weights(seed=4, **KW)
    streams, seen = [Counting(w), Counting(w)], []
    out = _adapter_sync(adapters, groups, [iter(st) for st in streams],
                        on_plan=lambda j, plan: seen.append((j, plan.get("dtype"), streams[j].read)))
    assert not any(isinstance(o, BaseException) for o in out), out
    assert sorted(seen) == [(0, adapters[0].rollout_config.dtype, 0), (1, adapters[1].rollout_config.dtype, 0)]
    assert_same_params(models, reference(2, w, **KW))
    monkeypatch.setattr(verl_gather, "_ROLLOUT_DTYPE", None)
    verl_checkpoint_engine._tell_gather({"dtype": "bfloat16"})
    assert verl_gather._ROLLOUT_DTYPE is torch.bfloat16
    for plan in ({}, {"dtype": "auto"}):  # an older rollout's plan, or SGLang's "auto": nothing narrows
        verl_checkpoint_engine._tell_gather(plan)
        assert verl_gather._ROLLOUT_DTYPE is None


def test_a_refused_fence_tells_the_trainers_and_nothing_hangs(ray_get):
    models, server, adapters, groups = _adapter_rig(refuse={"begin_weight_sync"})
    stream = Counting(hf_weights(seed=3, **KW))
    out = _adapter_sync(adapters, groups, [iter(stream), iter(hf_weights(seed=3, **KW))])
    assert all(isinstance(o, TrainerRefused) for o in out[:2]), out
    assert isinstance(out[2], RuntimeError) and "refused" in str(out[2]), out
    assert isinstance(out[3], BaseException), out
    assert stream.read == len(stream.items) and server.engine.loader_calls == 0


def test_a_bad_tensor_fails_the_sync_everywhere_and_a_loader_failure_leaves_the_trainers_free(ray_get):
    models, server, adapters, groups = _adapter_rig()
    w = hf_weights(seed=4, **KW)
    assert not any(isinstance(o, BaseException) for o in _adapter_sync(adapters, groups, [iter(w), iter(w)]))
    bad = [(n, t[:1] if n.endswith("down_proj.weight") else t) for n, t in hf_weights(seed=5, **KW)]
    out = _adapter_sync(adapters, groups, [iter(bad), iter(bad)])
    assert all(isinstance(o, SyncValidationError) for o in out[:2]), out
    assert all(isinstance(o, BaseException) for o in out[2:]), out
    assert server.finished()[-1] is False
    # the failed sync made the senders ask for the copy plan again; a good sync does, then rank 1's loader
    # fails inside the engine at the first bucket
    assert not any(isinstance(o, BaseException) for o in _adapter_sync(adapters, groups, [iter(w), iter(w)]))
    adapters[1]._fast.fault = "raise"
    out = _adapter_sync(adapters, groups, [iter(w), iter(w)])
    assert not any(isinstance(o, BaseException) for o in out[:2]), out  # the trainers were read to the end
    assert all(isinstance(o, FastPathError) and "TP rank 1" in str(o) for o in out[2:]), out
    w = hf_weights(seed=6, **KW)
    assert not any(isinstance(o, BaseException) for o in _adapter_sync(adapters, groups, [iter(w), iter(w)]))
    assert_same_params(models, reference(2, w, **KW))
    assert server.finished()[-1] is True


def test_the_backend_refuses_a_rollout_worker_on_its_trainers_gpu_and_rebuilds_for_a_new_layout():
    pytest.importorskip("verl")
    import asyncio

    import verl  # noqa: F401
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    from sgl_rollout.integrations.verl_checkpoint_engine import BACKEND

    cls = CheckpointEngineRegistry.get(BACKEND)
    meta = [{"role": "trainer", "master": ["127.0.0.1", 1], "gpu": "GPU-a"}, {"role": "rollout", "master": None,
                                                                             "gpu": "GPU-a"}]
    with pytest.raises(ValueError, match="share a GPU"):
        cls.build_topology(1, 1, meta)
    meta[1]["gpu"] = "GPU-b"
    assert cls.build_topology(1, 1, meta)[1]["peers"] == [[(0, 0)]]

    # one trainer and one rollout worker, then a second rollout worker joins (verl's add_replicas): the
    # group is rebuilt on the same store address, and a sync goes through it
    trainer = CheckpointEngineRegistry.new(BACKEND, is_master=True, bucket_size=1 << 20)
    rollouts = [CheckpointEngineRegistry.new(BACKEND, bucket_size=1 << 20) for _ in range(2)]
    with _stub_node_ip():
        master = trainer.prepare()["master"]

    def join(engines, n):
        with _stub_node_ip():
            meta = [e.prepare() for e in engines]
        assert meta[0]["master"] == master  # the store's address stays
        actor, rollout = cls.build_topology(1, n, meta)
        kw = [{k: v[0] for k, v in actor.items()}] + [{k: v[i] for k, v in rollout.items()} for i in range(n)]
        assert not any(on_threads([lambda e=e, k=k: e.init_process_group(**k) for e, k in zip(engines, kw)]))

    join([trainer, rollouts[0]], 1)
    first = trainer._group
    join([trainer, rollouts[0]], 1)
    assert trainer._group is first  # the same layout keeps its group
    join([trainer, *rollouts], 2)
    assert trainer._group is not first and first.pg is None  # the old group was shut down
    assert all(e._group is not None for e in (trainer, *rollouts))
    from test_fast_path import SGLangLikeEngine, manifest_of
    from sgl_rollout.weight_sync.fast_path import FastPathSender

    models = [SGLangShaped(0, 1, **KW), SGLangShaped(0, 1, **KW)]
    w0 = hf_weights(seed=0, **KW)
    # two one-rank engines in one process: the loader keys its parameter map by plan id, so their plans
    # must differ (in SGLang each engine's scheduler is a process of its own): other bucket sizes
    senders = [FastPathSender(SGLangLikeEngine([m]), manifest_of(w0), b, devices=["cpu"])
               for m, b in zip(models, (3000, 4096))]
    w = hf_weights(seed=8, **KW)
    out = on_threads([lambda: asyncio.run(trainer.send_weights(iter(w)))] +
                     [lambda k=k: receive_plan_buckets(senders[k], rollouts[k].receive_weights()) for k in range(2)])
    assert not any(isinstance(o, BaseException) for o in out) and out[0]["sgl_rollout/send_bytes"] > 0, out
    for m in models:
        assert_same_params([m], reference(1, w, **KW))


def test_the_trainer_packs_each_bucket_in_steps_holding_about_a_step_of_its_tensors(monkeypatch):
    """The trainer rank's packer (``PlanPacker``) writes the same bytes whether a bucket is gathered at once
    or in steps; in steps of 4 KiB it holds about a step of the stream's tensors, not the bucket's (the
    stream in the plan's order, as in ``test_fast_path``)."""
    from sgl_rollout.weight_sync import fast_path as fast_path_mod
    from sgl_rollout.weight_sync.p2p import PlanPacker
    from test_fast_path import live_bytes_stream, rig

    models, engine, sender = rig(hf_weights(seed=0), 1 << 20)
    assert sender.ensure_plan()
    plans = [sender.plan.message(0)]
    first_use = {}
    for op in sender.plan.program.ops[0][0].ops:
        first_use.setdefault(op.name, len(first_use))
    w = sorted(hf_weights(seed=8), key=lambda nt: first_use[nt[0]])
    total = sum(t.numel() * t.element_size() for _, t in w)
    out = {}
    for step_bytes in (1 << 20, 4096):
        monkeypatch.setattr(fast_path_mod, "GATHER_STEP_BYTES", step_bytes)
        live = {"now": 0, "peak": 0}
        out[step_bytes] = ([(d, b, view.clone()) for d, b, view in PlanPacker(plans, "cpu").buckets(
            live_bytes_stream(w, live))], live["peak"])
    (whole, peak_whole), (stepped, peak_stepped) = out[1 << 20], out[4096]
    assert [(d, b) for d, b, _ in whole] == [(d, b) for d, b, _ in stepped] == [(0, 0)]
    assert torch.equal(whole[0][2], stepped[0][2])
    assert peak_whole >= 0.9 * total and peak_stepped < total // 2, (peak_whole, peak_stepped, total)
