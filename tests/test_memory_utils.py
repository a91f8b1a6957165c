import gc
import json
import pickle
import types

import pytest
import torch

from sgl_rollout import memory
from sgl_rollout.memory import GiB, CacheRound, EmptyCacheResult, MemoryTimeline, aggressive_empty_cache


class _FakeCuda:
    """A caching allocator and a driver, without CUDA.

    ``allocated``/``reserved`` are this process's allocator bytes, ``free`` the driver's free bytes.
    ``ipc_frees[i]`` bytes of IPC-held blocks go back to the cache at the i-th ``ipc_collect``
    (receivers closing handles over time); ``empty_cache`` returns every cached byte to the driver.
    """

    def __init__(self, monkeypatch, ipc_frees=(), allocated=0, cached=0):
        self.free = 10 * GiB
        self.allocated = allocated
        self.reserved = allocated + cached
        self.ipc_frees = list(ipc_frees)
        self.calls = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "memory_stats", self._stats)
        monkeypatch.setattr(torch.cuda, "ipc_collect", self._ipc_collect)
        monkeypatch.setattr(torch.cuda, "empty_cache", self._empty)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.calls.append("sync"))
        monkeypatch.setattr(memory, "device_memory", lambda device=None: (self.free, 80 * GiB))
        real_collect = gc.collect

        def collect(generation=2):
            self.calls.append(f"gc{generation}")
            return real_collect(generation)

        monkeypatch.setattr(memory.gc, "collect", collect)

    def _stats(self, device=None):
        return {"allocated_bytes.all.current": self.allocated, "reserved_bytes.all.current": self.reserved}

    def _ipc_collect(self):
        self.calls.append("ipc_collect")
        n = self.ipc_frees.pop(0) if self.ipc_frees else 0
        self.allocated -= n

    def _empty(self):
        self.calls.append("empty_cache")
        self.free += self.reserved - self.allocated
        self.reserved = self.allocated

    def tensor(self, nbytes):
        return _FakeTensor(self, nbytes)


class _FakeTensor:
    def __init__(self, fake, nbytes):
        self.fake, self.nbytes = fake, nbytes
        fake.allocated += nbytes
        fake.reserved += nbytes

    def __del__(self):
        self.fake.allocated -= self.nbytes  # the block goes back to the cache, not the driver


def test_stops_when_a_round_frees_less_than_1gib(monkeypatch):
    fake = _FakeCuda(monkeypatch, [3 * GiB, GiB // 2, 5 * GiB], allocated=10 * GiB)
    assert aggressive_empty_cache() == [3 * GiB, GiB // 2]
    assert fake.calls.count("empty_cache") == 2 and fake.calls.count("sync") == 2


def test_at_most_three_rounds(monkeypatch):
    fake = _FakeCuda(monkeypatch, [2 * GiB] * 5, allocated=10 * GiB)
    assert aggressive_empty_cache() == [2 * GiB] * 3
    assert fake.calls.count("empty_cache") == 3


def test_nothing_to_free_one_round_no_gc_no_empty_cache(monkeypatch):
    fake = _FakeCuda(monkeypatch)
    res = aggressive_empty_cache()
    assert res == [0]
    assert fake.calls == ["ipc_collect", "sync"]
    r = res.rounds[0]
    assert r.gc_generation is None and r.empty_cache_skipped and r.cached_bytes == 0


def test_cached_memory_goes_back_without_gc_when_nothing_is_allocated(monkeypatch):
    fake = _FakeCuda(monkeypatch, cached=3 * GiB)  # the trainer offloaded everything
    assert aggressive_empty_cache() == [3 * GiB, 0]
    assert fake.calls == ["ipc_collect", "empty_cache", "sync", "ipc_collect", "sync"]
    assert fake.free == 13 * GiB


def test_cycle_garbage_in_the_oldest_generation_is_freed(monkeypatch):
    """A trainer tensor dropped inside a reference cycle that survived collections during the step
    (so it sits in generation 2, which a young collection does not see) still goes back."""
    fake = _FakeCuda(monkeypatch, allocated=GiB)  # 1 GiB stays live (e.g. an IPC buffer)
    holder = {"t": fake.tensor(2 * GiB)}
    holder["self"] = holder  # a cycle
    gc.collect()  # survives a full collection: now in the oldest generation
    del holder
    gc.collect(0)
    gc.collect(1)
    assert fake.allocated == 3 * GiB  # young collections do not free it
    res = aggressive_empty_cache()
    assert fake.allocated == GiB and res[0] == 2 * GiB
    assert res.rounds[0].gc_generation == 2 and res.rounds[0].gc_unreachable > 0
    # round 2 collects again (round 1 found garbage), frees nothing more, and stops
    assert res == [2 * GiB, 0] and res.rounds[1].gc_generation == 2
    assert res.rounds[1].empty_cache_skipped  # the allocator caches nothing now


def test_later_rounds_skip_gc_when_the_last_collection_freed_no_cuda_memory(monkeypatch):
    gc.collect()
    fake = _FakeCuda(monkeypatch, [2 * GiB, 2 * GiB, 0], allocated=8 * GiB)
    cpu_only = {}
    cpu_only["self"] = cpu_only  # garbage, but it holds no CUDA memory
    del cpu_only
    res = aggressive_empty_cache()
    assert res == [2 * GiB, 2 * GiB, 0]
    assert fake.calls.count("gc2") == 1
    assert res.rounds[0].gc_unreachable > 0 and res.rounds[0].gc_freed_bytes == 0
    assert [r.gc_generation for r in res.rounds] == [2, None, None]


def test_collection_repeats_while_it_frees_cuda_memory(monkeypatch):
    """A finaliser of round 1's garbage drops another cycle holding CUDA memory: round 2 collects it."""
    fake = _FakeCuda(monkeypatch, allocated=GiB)
    second = {"t": fake.tensor(GiB)}
    second["self"] = second
    registry = [second]
    del second

    class Finaliser:
        def __del__(self):
            registry.clear()  # the second cycle becomes garbage only now

    first = {"t": fake.tensor(2 * GiB), "f": Finaliser()}
    first["self"] = first
    del first
    res = aggressive_empty_cache()
    assert res == [2 * GiB, GiB, 0] and fake.allocated == GiB
    assert [r.gc_freed_bytes for r in res.rounds] == [2 * GiB, GiB, 0]
    assert [r.gc_generation for r in res.rounds] == [2, 2, 2]


def test_empty_cache_skipped_when_allocator_unchanged_since_last_call(monkeypatch):
    fake = _FakeCuda(monkeypatch, [2 * GiB], allocated=4 * GiB)

    def empty_keeps_some():  # fragmentation: a cached block in a segment with live blocks stays
        fake.calls.append("empty_cache")
        kept = 64 << 20
        fake.free += fake.reserved - fake.allocated - kept
        fake.reserved = fake.allocated + kept

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_keeps_some)
    res = aggressive_empty_cache()
    assert res == [2 * GiB - (64 << 20), 0]
    assert fake.calls.count("empty_cache") == 1
    assert res.rounds[1].cached_bytes == 64 << 20 and res.rounds[1].empty_cache_skipped


def test_collect_always_runs_a_full_collection_every_round(monkeypatch):
    fake = _FakeCuda(monkeypatch, cached=6 * GiB)  # nothing allocated: "auto" would not collect
    res = aggressive_empty_cache(collect="always")
    assert res == [6 * GiB, 0]
    assert fake.calls.count("gc2") == 2 and [r.gc_generation for r in res.rounds] == [2, 2]
    with pytest.raises(ValueError):
        aggressive_empty_cache(collect="never")


def test_result_timings_and_backward_compatibility(monkeypatch):
    _FakeCuda(monkeypatch, [3 * GiB, 0], allocated=5 * GiB)
    res = aggressive_empty_cache()
    assert isinstance(res, list) and res == [3 * GiB, 0] and json.loads(json.dumps(res)) == [3 * GiB, 0]
    assert len(res.rounds) == 2 and all(isinstance(r, CacheRound) for r in res.rounds)
    for r in res.rounds:
        assert min(r.gc_s, r.ipc_collect_s, r.empty_cache_s, r.synchronize_s, r.meminfo_s) >= 0
    ph = res.phase_seconds()
    assert set(ph) == {"empty_cache.gc", "empty_cache.ipc_collect", "empty_cache.empty_cache",
                      "empty_cache.synchronize", "empty_cache.meminfo"}
    assert sum(ph.values()) <= res.seconds + 1e-6
    assert res.seconds > 0
    d = res.to_dict()
    assert d["freed_bytes"] == [3 * GiB, 0] and d["rounds"][0]["freed_bytes"] == 3 * GiB
    json.dumps(d)
    back = pickle.loads(pickle.dumps(res))
    assert isinstance(back, EmptyCacheResult) and back == res and back.rounds == res.rounds
    assert back.seconds == res.seconds


def test_no_cuda_only_gc(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = aggressive_empty_cache()
    assert res == [] and res.rounds == []
    assert res.phase_seconds()["empty_cache.gc"] > 0


def test_timeline_records_phases(tmp_path):
    t = iter([0.0, 1.5, 2.0])
    mem = iter([(70, 100), (30, 100)])
    tl = MemoryTimeline(clock=lambda: next(t), meminfo=lambda: next(mem))
    tl.record("sleep")
    tl.record("resume_kv_cache")
    assert [(r.phase, r.wall_s, r.free_bytes, r.used_bytes) for r in tl.records] == [
        ("sleep", 1.5, 70, 30), ("resume_kv_cache", 2.0, 30, 70)]
    p = tmp_path / "timeline.json"
    tl.save(str(p))
    assert [d["phase"] for d in json.loads(p.read_text())] == ["sleep", "resume_kv_cache"]


class _Nvml:
    """pynvml double: device handles are what was asked; memory is (free, total) per handle."""

    def __init__(self, memory):
        self.memory, self.asked = memory, []

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        self.asked.append(("index", i))
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.asked.append(("uuid", uuid))
        return uuid

    def nvmlDeviceGetMemoryInfo(self, handle):
        free, total = self.memory[handle]
        return types.SimpleNamespace(free=free, total=total, used=total - free)


def test_nvml_device_memory_maps_the_device_through_cuda_visible_devices(monkeypatch):
    from sgl_rollout.memory import nvml_device_memory

    nvml = _Nvml({0: (5, 10), 3: (7, 10), 1: (2, 10), "GPU-abc": (9, 10)})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert nvml_device_memory(None, nvml=nvml) == (5, 10)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert nvml_device_memory(None, nvml=nvml) == (7, 10)  # this process's device 0 is physical GPU 3
    assert nvml_device_memory(1, nvml=nvml) == (2, 10)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")
    assert nvml_device_memory(0, nvml=nvml) == (9, 10)
    assert nvml.asked == [("index", 0), ("index", 3), ("index", 1), ("uuid", "GPU-abc")]
    assert nvml_device_memory(1, nvml=nvml) == (0, 0)  # not visible: no figures, no error


def test_timeline_does_not_create_a_cuda_context_in_a_host_without_one(monkeypatch):
    """The Ray server actor hosts the engine without using CUDA itself: a record must not give it a CUDA
    context (torch's mem_get_info or peak-stat calls would), so it reads NVML instead."""
    import sgl_rollout.memory as memory

    def touches_cuda(*a, **k):
        raise AssertionError("initialized CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # importing SGLang initializes torch's CUDA
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    contexts = {0: False}
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: contexts[i], raising=False)
    for name in ("mem_get_info", "max_memory_allocated", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, touches_cuda)
    monkeypatch.setattr(memory, "nvml_device_memory", lambda device=None: (30, 100))
    rec = MemoryTimeline().record("engine_ready")
    assert (rec.free_bytes, rec.used_bytes, rec.peak_allocated_bytes) == (30, 70, 0)
    # no NVML (pynvml missing): torch's figures rather than none
    monkeypatch.setattr(memory, "nvml_device_memory", lambda device=None: (0, 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20, 100))
    assert MemoryTimeline().record("sleep").free_bytes == 20
    # once this process has a context (a trainer in the same process), torch's figures are used
    contexts[0] = True
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40, 100))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 12)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    rec = MemoryTimeline().record("sync")
    assert (rec.free_bytes, rec.used_bytes, rec.peak_allocated_bytes) == (40, 60, 12)
