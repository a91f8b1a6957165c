"""verl's colocated ``update_weights`` with the trainer-cache guard (:mod:`sgl_rollout.integrations.verl_trainer_cache`),
run through verl 0.9.1's own ``ActorRolloutRefWorker.update_weights`` on the CPU: its two ``empty_cache`` calls
are skipped only where the room measured at the previous update's end holds this process's reservation plus
the headroom, and only with ``SGLROLLOUT_TRAINER_EMPTY_CACHE=auto``."""

import asyncio
import types

import pytest

pytest.importorskip("verl")
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.workers import engine_workers  # noqa: E402

from sgl_rollout.integrations import verl_trainer_cache  # noqa: E402
from sgl_rollout.integrations.verl_rollout import SglRollout  # noqa: E402

GB = 10**9


class Device:
    """``torch.cuda`` as verl's update sees it: a reservation, the device's free and total memory (bytes)."""

    def __init__(self, reserved: int, free: int, total: int = 140 * GB):
        self.reserved, self.free, self.total, self.calls = reserved, free, total, []

    def memory_reserved(self):
        return self.reserved

    def mem_get_info(self):
        return self.free, self.total

    def empty_cache(self):
        self.calls.append("empty_cache")

    def synchronize(self):
        self.calls.append("synchronize")


class Recorder:
    """A rollout without an engine: records the wake's stages."""

    async def resume(self, tags):
        self.events.append(("resume", tuple(tags)))

    async def update_weights(self, weights, **kwargs):
        self.events.append(("update_weights", len(list(weights))))


class Rollout(Recorder, SglRollout):
    """This package's rollout, without an engine."""


def _verls(fn):
    """verl's own function under any guard installed earlier in this process (an ``SglRollout`` made by
    another test installs it on verl's class)."""
    while getattr(fn, "_sgl_rollout_cache_guard", False):
        fn = fn.__wrapped__
    return fn


class Worker(engine_workers.ActorRolloutRefWorker):
    """verl's worker class with verl's real ``update_weights``, made without its ``__init__``."""

    update_weights = _verls(engine_workers.ActorRolloutRefWorker.update_weights)


def _worker(rollout, backend="naive"):
    w = object.__new__(Worker)
    w.config = OmegaConf.create({"rollout": {"name": "sglang", "free_cache_engine": True,
                                             "checkpoint_engine": {"backend": backend}}})
    w.rollout, w.layered_summon, w.peft_merge, w.base_sync_done = rollout, False, False, False
    engine = types.SimpleNamespace(is_param_offload_enabled=False,
                                   get_per_tensor_param=lambda **kw: (iter([("w", torch.zeros(2))]), None))
    w.actor = types.SimpleNamespace(engine=engine)
    return w


@pytest.fixture
def guarded(monkeypatch):
    """verl's worker module with its device, allocator switch, memory log and barrier replaced, and the guard
    installed on :class:`Worker` with a window of its own."""
    device = Device(reserved=2 * GB, free=60 * GB)
    monkeypatch.setattr(engine_workers, "get_torch_device", lambda: device)
    monkeypatch.setattr(engine_workers, "set_expandable_segments", lambda enable: None)
    monkeypatch.setattr(engine_workers, "log_gpu_memory_usage", lambda *a, **k: None)
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(Worker, "update_weights", Worker.update_weights)  # restored after: install wraps it
    window = verl_trainer_cache.TrainerCacheWindow()
    assert verl_trainer_cache.install(SglRollout, Worker, engine_workers, window)
    assert verl_trainer_cache.install(SglRollout, Worker, engine_workers, window)  # idempotent
    rollout = object.__new__(Rollout)
    rollout.events = []
    return device, window, rollout


def _update(worker, **kw):
    return asyncio.run(worker.update_weights(global_steps=1, **kw))


def test_verls_empty_cache_calls_run_unless_asked_to_skip(guarded, monkeypatch):
    device, window, rollout = guarded
    monkeypatch.delenv(verl_trainer_cache.ENV, raising=False)
    _update(_worker(rollout))
    assert device.calls == ["empty_cache", "synchronize", "empty_cache"]
    assert rollout.events == [("resume", ("weights",)), ("update_weights", 1), ("resume", ("kv_cache",))]
    assert window.room_bytes is None  # the default measures nothing


def test_the_room_of_one_update_lets_the_next_skip_both_calls_while_the_reservation_fits(guarded, monkeypatch):
    device, window, rollout = guarded
    monkeypatch.setenv(verl_trainer_cache.ENV, "auto")
    worker = _worker(rollout)
    _update(worker)  # the first: no room known yet, verl's calls run; the room is measured at its end
    assert device.calls == ["empty_cache", "synchronize", "empty_cache"] and window.kept == 2
    assert (window.room_bytes, window.total_bytes) == (62 * GB, 140 * GB)
    # training cached 40 GB: 40 + 14 (10% of 140) <= 62, both calls skipped; verl's wake is otherwise the same
    device.calls.clear()
    device.reserved, device.free = 42 * GB, 20 * GB
    _update(worker)
    assert device.calls == ["synchronize"] and window.skipped == 2
    assert rollout.events[-3:] == [("resume", ("weights",)), ("update_weights", 1), ("resume", ("kv_cache",))]
    assert window.room_bytes == 62 * GB  # the same room, measured again
    # training cached 50 GB: 50 + 14 > 62, verl empties the cache
    device.calls.clear()
    device.reserved, device.free = 50 * GB, 12 * GB
    _update(worker)
    assert device.calls == ["empty_cache", "synchronize", "empty_cache"] and window.kept == 4


def test_other_backends_and_other_rollouts_keep_verls_behaviour(guarded, monkeypatch):
    device, window, rollout = guarded
    monkeypatch.setenv(verl_trainer_cache.ENV, "auto")
    window.room_bytes, window.total_bytes = 100 * GB, 140 * GB  # room for anything
    other = Recorder()
    other.events = []
    _update(_worker(other))  # verl's built-in rollout would be here: not ours
    assert device.calls == ["empty_cache", "synchronize", "empty_cache"] and len(other.events) == 3
    sent = []

    class Engine:
        async def send_weights(self, weights, global_steps=None):
            sent.append(global_steps)

    worker = _worker(rollout, backend="nccl")
    worker.checkpoint_engine = Engine()
    device.calls.clear()
    _update(worker)  # the checkpoint engine's path: no empty_cache, nothing measured
    assert sent == [1] and device.calls == [] and window.room_bytes == 100 * GB


def test_a_failed_update_leaves_the_room_and_the_window_as_they_were(guarded, monkeypatch):
    device, window, rollout = guarded
    monkeypatch.setenv(verl_trainer_cache.ENV, "auto")
    window.room_bytes, window.total_bytes = 62 * GB, 140 * GB

    async def broken(weights, **kwargs):
        raise RuntimeError("sync refused")

    rollout.update_weights = broken
    device.reserved = 42 * GB
    with pytest.raises(RuntimeError, match="sync refused"):
        _update(_worker(rollout))
    assert window.room_bytes == 62 * GB and window.skipped == 1  # the first call was skipped, then it failed
    assert engine_workers.get_torch_device() is device  # outside an update: verl's own device, unguarded


def test_bench_verl_sets_the_switch_on_sgl_rollouts_side_only(tmp_path, monkeypatch):
    """``bench verl --ours-trainer-empty-cache auto``: the variable reaches sgl-rollout's Ray workers, not the
    built-in's, and the report's differences say so."""
    from sgl_rollout.bench import verl_compare
    from sgl_rollout.bench.__main__ import build_parser

    cmds = {}

    def fake_run_side(side, pair, cmd, env, run_dir, steps, timeout_s, sampler_factory=None):
        cmds[side] = cmd
        run_dir.mkdir(parents=True, exist_ok=True)
        return {"exit_code": 0, "wall_s": 0.1}

    monkeypatch.setattr(verl_compare, "run_side", fake_run_side)
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    args = build_parser().parse_args(["verl", "--steps", "2", "--ours-trainer-empty-cache", "auto"])
    run_dirs, orders = verl_compare.plan_pairs(out, 1, ["builtin", "ours"])
    verl_compare._run_pairs(args, out, run_dirs, orders, {"title": "t", "steps": 2}, tmp_path / "m", 4, {}, {})
    switch = f"env_vars.{verl_trainer_cache.ENV}='auto'"
    assert any(switch in a for a in cmds["ours"]) and not any(verl_trainer_cache.ENV in a for a in cmds["builtin"])
    assert any("--ours-trainer-empty-cache auto" in d for d in verl_compare.differences(trainer_empty_cache="auto"))
    assert not any("empty-cache" in d for d in verl_compare.differences())
    assert verl_compare.TRAINER_CACHE_ENV == verl_trainer_cache.ENV
