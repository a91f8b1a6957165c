"""``sgl_rollout.bench.cpu_use``: the CPU time of a ``bench verl`` side's processes by role, and the report's
table of it while the requests were served (issue 47 goal 1)."""

import argparse
import os
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sgl_rollout.bench import verl_compare, verl_report
from sgl_rollout.bench.cpu_use import CPU_FILE, CpuSampler, cpu_in_windows
from sgl_rollout.workloads import load_metrics

FIXTURES = Path(__file__).parent / "fixtures" / "verl_compare"

CHILD = """
import time
t = time.process_time()
while time.process_time() - t < 0.6:  # 0.6 s of CPU
    pass
open({done!r}, "w").close()
time.sleep(30)
"""

ROOT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, {child!r}])
time.sleep(30)
"""


def test_sampler_counts_the_cpu_of_the_processes_below_the_root_by_role(tmp_path):
    child, done = tmp_path / "spinner.py", tmp_path / "done"
    child.write_text(CHILD.format(done=str(done)))
    root = tmp_path / "root.py"
    root.write_text(ROOT.format(child=str(child)))
    proc = subprocess.Popen([sys.executable, str(root)])
    try:
        sampler = CpuSampler(proc.pid, interval_s=0.05).start()
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            t = time.process_time()  # this process spins too: it is not below the root and must not count
            while time.process_time() - t < 0.05:
                pass
        assert done.exists()
        time.sleep(0.2)
        rec = sampler.stop()
    finally:
        proc.kill()
        subprocess.run(["pkill", "-f", str(child)], check=False)
    assert rec["error"] is None
    names = rec["names"]
    spinner = names.index(f"{Path(sys.executable).name} spinner.py")
    assert f"{Path(sys.executable).name} root.py" in names
    assert len(names) == 2  # pytest's own process, busy all along, is not below the root
    values = [r[spinner + 1] for r in rec["rows"]]
    assert values == sorted(values)  # cumulative
    assert 0.5 <= values[-1] < 5.0  # its 0.6 s of CPU (plus the interpreter's start), seen from outside
    times = [r[0] for r in rec["rows"]]
    assert times == sorted(times) and abs(times[-1] - time.time()) < 30


def test_sampler_without_psutil_records_why_and_the_run_goes_on(monkeypatch):
    import psutil

    def no_table(*_args, **_kwargs):
        raise PermissionError("no /proc here")

    monkeypatch.setattr(psutil, "process_iter", no_table)
    sampler = CpuSampler(1).start()
    rec = sampler.stop()
    assert rec["rows"] == [] and "PermissionError: no /proc here" in rec["error"]


def test_cpu_in_windows_reads_each_role_linearly_between_samples():
    cpu = {"names": ["a", "b"], "rows": [[100.0, 0.0, 0.0], [101.0, 1.0, 0.5], [103.0, 1.0, 2.5]]}
    got = cpu_in_windows(cpu, {1: (100.5, 102.0), 2: (99.0, 101.0), 3: (101.0, 103.0)})
    assert set(got) == {1, 3}  # window 2 starts before the record
    assert got[1]["a"] == pytest.approx(0.5) and got[1]["b"] == pytest.approx(1.5 - 0.25)
    assert got[3] == {"a": pytest.approx(0.0), "b": pytest.approx(2.0)}
    assert cpu_in_windows({"names": ["a"], "rows": [[1.0, 0.0]]}, {1: (1.0, 1.0)}) == {}


def _record_for(run: Path, rate: dict) -> dict:
    """A ``cpu.json`` for the fixture run ``run``: each role of ``rate`` used that many CPU seconds per second,
    sampled every 0.5 s over the run's spans."""
    spans = verl_report.load_spans(run / "spans")
    t0, t1 = min(s["t0"] for s in spans) - 1, max(s["t0"] + s["dt"] for s in spans) + 1
    names = sorted(rate)
    rows, t = [], t0
    while t <= t1 + 0.5:
        rows.append([t] + [rate[n] * (t - t0) for n in names])
        t += 0.5
    return {"interval_s": 0.5, "names": names, "rows": rows, "error": None}


def test_report_gives_cpu_seconds_by_role_while_the_requests_were_served(tmp_path):
    out = tmp_path / "complete"
    shutil.copytree(FIXTURES / "complete", out)
    rates = {"builtin": {"ray::SGLangHttpServer": 0.8, "raylet": 0.1},
             "ours": {"ray::VerlRolloutServer": 0.6, "raylet": 0.2}}
    for side, rate in rates.items():
        run = out / "pair1" / side
        # the recorded H100 runs predate the request spans: three requests 0.5 s after each update's end
        ends = [w["t0"] + w["dt"] for w in sorted((ss[0] for ss in verl_report.steps_of(
            verl_report.load_spans(run / "spans")).values()), key=lambda w: w["t0"])]
        reqs = [{"name": "sglang.generate_request", "t0": e + 0.5 + 0.1 * i, "dt": 1.0 + 0.1 * i, "pid": 9}
                for e in ends for i in range(3)]
        (run / "spans" / "spans-9.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
        (run / CPU_FILE).write_text(json.dumps(_record_for(run, rate)))
    parser = argparse.ArgumentParser()
    verl_compare.add_arguments(parser)
    assert verl_compare.main(parser.parse_args(["--out", str(out), "--report-only"])) == 0
    comp = json.loads((out / "comparison.json").read_text())
    md = (out / "comparison.md").read_text()
    for side, rate in rates.items():
        run = out / "pair1" / side
        spans = verl_report.load_spans(run / "spans")
        later = {r["step"] for r in verl_report.training_rows(load_metrics(run / "metrics.jsonl"))[1:]}
        windows = [b - a for k, (a, b) in verl_report.serving_windows(spans).items() if k in later]
        assert windows == [pytest.approx(1.4)] * len(windows) and len(windows) >= 2, side
        got = comp["pairs"][0]["runs"][side]["cpu_serving"]
        want_window = verl_report.med(windows)
        assert got[verl_report.CPU_WINDOW]["median"] == pytest.approx(want_window)
        for role, r in rate.items():
            assert got[role]["median"] == pytest.approx(r * want_window, rel=1e-6)
        assert got[verl_report.CPU_ALL]["median"] == pytest.approx(sum(rate.values()) * want_window, rel=1e-6)
    assert "CPU seconds by process while the step's requests were served" in md
    got = comp["pairs"][0]["runs"]["builtin"]["cpu_serving"]["ray::SGLangHttpServer"]["median"]
    cells = next(x for x in md.splitlines() if x.startswith("| ray::SGLangHttpServer |")).split("|")[2:4]
    assert [c.strip() for c in cells] == [f"{got:.2f}", ""]  # the built-in's server actor: none on our side


def test_run_side_writes_the_cpu_record_of_the_side_s_processes(tmp_path):
    """``bench verl``'s runner samples the side it starts (its root and everything below it) into ``cpu.json``."""
    child = tmp_path / "spinner.py"
    child.write_text("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6:\n    pass\n"
                     "time.sleep(1.5)\n")
    root = tmp_path / "root.py"
    root.write_text(f"import subprocess, sys\nsubprocess.run([sys.executable, {str(child)!r}], check=True)\n")
    run_dir = tmp_path / "pair1" / "ours"
    info = verl_compare.run_side("ours", 1, [sys.executable, str(root)], dict(os.environ), run_dir, 1, 60.0)
    assert info["exit_code"] == 0
    rec = json.loads((run_dir / CPU_FILE).read_text())
    spinner = rec["names"].index(f"{Path(sys.executable).name} spinner.py")
    assert 0.5 <= rec["rows"][-1][spinner + 1] < 5.0


RAY_DRIVER = """
import time
import ray

ray.init(num_cpus=1, include_dashboard=False)


@ray.remote
class Spinner:
    async def spin(self, s):
        t = time.process_time()
        while time.process_time() - t < s:
            pass
        return s


assert ray.get(Spinner.remote().spin.remote(0.8)) == 0.8
time.sleep(1.0)
ray.shutdown()
"""


def test_a_side_s_ray_cluster_is_below_its_root_and_counted_by_role(tmp_path):
    """The sampler's premise on a real (CPU) Ray cluster that the side's driver starts, as verl's does:
    Ray's GCS, raylet and workers descend from the driver, and an actor's CPU is counted under its role."""
    driver = tmp_path / "driver.py"
    driver.write_text(RAY_DRIVER)
    run_dir = tmp_path / "pair1" / "ours"
    info = verl_compare.run_side("ours", 1, [sys.executable, str(driver)], dict(os.environ), run_dir, 1, 180.0)
    assert info["exit_code"] == 0, (run_dir / "train.log").read_text()[-2000:]
    rec = json.loads((run_dir / CPU_FILE).read_text())
    used = dict(zip(rec["names"], rec["rows"][-1][1:]))
    assert {"raylet", "gcs_server"} <= set(used), used
    assert 0.7 <= used["ray::Spinner"] < 10.0, used


def test_cpu_table_sums_the_roles_under_a_hundredth_of_a_second_in_one_row():
    def stat(x):
        return {"median": x, "p90": x, "n": 5}

    runs = {"builtin": {"cpu_serving": {"ray::SGLangHttpServer": stat(0.49), "raylet": stat(0.004),
                                        "ray::IDLE": stat(0.02), verl_report.CPU_ALL: stat(0.514),
                                        verl_report.CPU_WINDOW: stat(2.7)}},
            "ours": {"cpu_serving": {"ray::VerlRolloutServer": stat(0.57), "raylet": stat(0.003),
                                     "gcs_server": stat(0.006), "ray::IDLE": stat(0.001),
                                     verl_report.CPU_ALL: stat(0.58), verl_report.CPU_WINDOW: stat(3.1)}}}
    lines = verl_report._cpu_lines(runs, ["builtin", "ours"])
    rows = [x for x in lines if x.startswith("| ") and not x.startswith("| process") and not x.startswith("| ---")]
    names = [x.split("|")[1].strip() for x in rows]
    # ray::IDLE stays (0.02 s on the built-in's side); raylet and gcs_server are under 0.01 s on both sides
    assert names == ["ray::VerlRolloutServer", "ray::SGLangHttpServer", "ray::IDLE",
                     "(2 other roles, each under 0.01 s)", verl_report.CPU_ALL, verl_report.CPU_WINDOW]
    assert [c.strip() for c in rows[3].split("|")[2:4]] == ["0.00", "0.01"]  # 0.004 and 0.003 + 0.006
