"""``python -m sgl_rollout.bench requests`` on the CPU: every way serves every request its own answer, and
the command prints and writes one figure per way (the figures themselves are not asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_rollout.bench import requests

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("mode", requests.MODES)
def test_each_way_answers_every_request_and_times_the_rounds(mode):
    res = requests.measure(mode, requests=24, rounds=3, warmup=1, output_len=4)
    assert res["mode"] == mode and res["requests"] == 24 and len(res["rounds"]) == 3
    assert all(r["in_s"] > 0 and r["back_s"] >= 0 for r in res["rounds"])
    assert res["in_s"] == sorted(r["in_s"] for r in res["rounds"])[1]


@pytest.mark.parametrize("mode", ["caller-loop", "verl-server"])
def test_a_wrong_answer_is_caught(monkeypatch, mode):
    real = requests.BatchAnswerEngine.async_generate

    async def swapped(self, input_ids, *args, **kwargs):
        out = await real(self, input_ids, *args, **kwargs)
        if isinstance(out, dict):  # one request (SGLang's single form)
            return dict(out, output_ids=out["output_ids"][::-1])
        return [dict(o, output_ids=o["output_ids"][::-1]) for o in out]

    monkeypatch.setattr(requests.BatchAnswerEngine, "async_generate", swapped)
    with pytest.raises(AssertionError, match="not their request's"):
        requests.measure(mode, requests=8, rounds=1, warmup=0, output_len=3)


def test_the_command_prints_a_row_per_way_and_writes_the_json(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "sgl_rollout.bench", "requests", "--requests", "16", "--rounds", "2",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [ln.split()[0] for ln in proc.stdout.splitlines()[2:] if ln.strip()]
    assert rows == list(requests.MODES)
    got = json.loads(out.read_text())
    assert [r["mode"] for r in got] == list(requests.MODES)
    # each request in flight holds at least SGLang's own coroutine and its answer's future
    assert all(r["objects_per_request"] >= 2 for r in got), [r["objects_per_request"] for r in got]


def test_the_double_answers_both_of_sglangs_forms():
    import asyncio

    eng = requests.BatchAnswerEngine(batch=3, output_len=2)

    async def both():
        return await asyncio.gather(eng.async_generate([5, 6]), eng.async_generate([[7], [9]]))

    one, batch = asyncio.run(both())
    assert one["output_ids"] == [7, 8]
    assert [o["output_ids"] for o in batch] == [[8, 9], [10, 11]]


def test_the_real_engine_mode_refuses_an_unknown_way_before_starting_anything():
    with pytest.raises(ValueError, match="unknown mode 'engine-thread'"):
        requests.measure_real(modes=("sglang", "engine-thread"))


def test_the_real_engine_mode_times_single_and_batched_sends_to_the_scheduler():
    class TM:
        def __init__(self):
            self.got = []

        def _send_one_request(self, obj):
            self.got.append(obj)

        def _send_batch_request(self, objs):
            self.got.extend(objs)

    tm, sent = TM(), []
    requests._time_sends(tm, sent)
    tm._send_one_request("a")
    tm._send_batch_request(["b", "c", "d"])
    assert tm.got == ["a", "b", "c", "d"] and len(sent) == 4 and sent == sorted(sent)
    with pytest.raises(RuntimeError, match="no _send_one_request"):
        requests._time_sends(object(), [])


def test_the_real_engine_table_has_a_row_per_way(monkeypatch, tmp_path, capsys):
    import argparse

    rows = [{"mode": m, "requests": 4, "rounds": [], "in_s": 0.04, "back_s": 0.2, "round_s": 0.24, "gc_s": 0.003}
            for m in requests.REAL_MODES]
    seen = {}
    monkeypatch.setattr(requests, "measure_real", lambda modes, n, rounds: seen.update(modes=modes) or rows)
    args = argparse.Namespace(requests=4, rounds=2, modes=None, engine="sglang", out=str(tmp_path / "r.json"))
    assert requests.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert seen["modes"] == requests.REAL_MODES
    assert [ln.split()[0] for ln in lines[2:]] == list(requests.REAL_MODES)
    assert lines[2].split()[1:] == ["40.0", "200.0", "240.0", "10000", "3.0"]
    assert json.loads((tmp_path / "r.json").read_text()) == rows


def test_each_round_starts_one_mode_later_so_no_mode_always_follows_the_same_one():
    modes = requests.REAL_MODES
    orders = [requests.rotated(modes, r) for r in range(2 * len(modes))]
    assert all(sorted(o) == sorted(modes) for o in orders)
    assert [o[0] for o in orders[:len(modes)]] == list(modes)  # every mode leads one round in turn
    run = [m for o in orders for m in o]  # the rounds one after the other, as measure_real runs them
    for m in modes:
        assert len({run[i - 1] for i in range(1, len(run)) if run[i] == m}) > 1, m


def test_the_gc_clock_of_each_round_counts_the_collections_inside_its_block_only():
    import gc

    gc.collect()
    with requests.GcClock() as inside:
        junk = [[i] for i in range(200_000)]  # enough young objects for several collections
        gc.collect()
    del junk
    before = inside.seconds
    gc.collect()  # outside: not counted
    assert before > 0 and inside.seconds == before
    assert inside._on not in gc.callbacks


def test_through_ray_every_way_answers_every_request_and_the_command_prints_a_row_each(tmp_path):
    """``--engine ray``: two sending actors into each server actor (the floor, this package's, and this package's
    with the floor's ``generate``) on a local CPU Ray cluster; every answer is its request's (checked in the
    senders), every figure comes from a round."""
    out = tmp_path / "ray.json"
    proc = subprocess.run([sys.executable, "-m", "sgl_rollout.bench", "requests", "--engine", "ray", "--requests", "16",
                           "--clients", "2", "--rounds", "2", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from sgl_rollout.bench.ray_requests import RAY_MODES

    rows = [ln.split()[0] for ln in proc.stdout.splitlines() if ln.split() and ln.split()[0] in RAY_MODES]
    assert rows == list(RAY_MODES)
    got = json.loads(out.read_text())
    for r in got:
        assert r["requests"] == 16 and r["clients"] == 2 and len(r["rounds"]) == 2
        for row in r["rounds"]:
            assert 0 < row["kth_in_s"] <= row["last_in_s"] and row["back_s"] > 0 and row["loop_cpu_s"] > 0
        assert r["kth_in_s"] == pytest.approx(sum(x["kth_in_s"] for x in r["rounds"]) / 2)


def test_through_ray_a_wrong_or_lost_answer_is_caught():
    from sgl_rollout.bench.ray_requests import _round_figures

    sends = [{"sent": [1.0, 1.1], "done": [2.0, 2.1], "wrong": 0}]
    assert _round_figures(sends, {"arrivals": [1.2, 1.05], "answered": 1.5}, 2) == {
        "kth_in_s": pytest.approx(0.075), "last_in_s": pytest.approx(0.2), "back_s": pytest.approx(0.6)}
    with pytest.raises(AssertionError, match="1 wrong answers"):
        _round_figures([dict(sends[0], wrong=1)], {"arrivals": [1.2, 1.05], "answered": 1.5}, 2)
    with pytest.raises(AssertionError, match="1 of 2 requests arrived"):
        _round_figures(sends, {"arrivals": [1.2], "answered": 1.5}, 2)
