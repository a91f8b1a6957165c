import json

import torch

from sgl_rollout import memory
from sgl_rollout.memory import GiB, MemoryTimeline, aggressive_empty_cache


class _FakeCuda:
    def __init__(self, monkeypatch, frees):
        self.free = 10 * GiB
        self.frees = list(frees)  # bytes each empty_cache returns to the driver
        self.calls = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: self.calls.append("ipc_collect"))
        monkeypatch.setattr(torch.cuda, "empty_cache", self._empty)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.calls.append("sync"))
        monkeypatch.setattr(memory, "device_memory", lambda device=None: (self.free, 80 * GiB))

    def _empty(self):
        self.calls.append("empty_cache")
        self.free += self.frees.pop(0) if self.frees else 0


def test_stops_when_a_round_frees_less_than_1gib(monkeypatch):
    fake = _FakeCuda(monkeypatch, [3 * GiB, GiB // 2, 5 * GiB])
    assert aggressive_empty_cache() == [3 * GiB, GiB // 2]
    assert fake.calls.count("empty_cache") == 2 and fake.calls.count("sync") == 2


def test_at_most_three_rounds(monkeypatch):
    fake = _FakeCuda(monkeypatch, [2 * GiB] * 5)
    assert aggressive_empty_cache() == [2 * GiB] * 3
    assert fake.calls.count("empty_cache") == 3


def test_one_round_when_nothing_to_free(monkeypatch):
    _FakeCuda(monkeypatch, [])
    assert aggressive_empty_cache() == [0]


def test_no_cuda_only_gc(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert aggressive_empty_cache() == []


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
