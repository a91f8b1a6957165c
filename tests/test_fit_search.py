"""examples/layered/fit_search.py: the binary search and how a trial's outcome is read (the trials
themselves need a GPU and SGLang: ``python examples/layered/fit_search.py`` on one); and how
bench_layered.py reads a trial's peak memory from the worker's timeline."""

import importlib.util
import json
import os
import subprocess
import types
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "examples" / "layered" / "fit_search.py"
spec = importlib.util.spec_from_file_location("fit_search", PATH)
fit_search = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fit_search)
_bl = importlib.util.spec_from_file_location("bench_layered", PATH.with_name("bench_layered.py"))
bench_layered = importlib.util.module_from_spec(_bl)
_bl.loader.exec_module(bench_layered)


@pytest.mark.parametrize("limit", [28, 29, 57, 100, 149, 150])
def test_search_finds_the_largest_fitting_size_in_few_trials(limit):
    calls = []

    def fits(n):
        calls.append(n)
        return n <= limit

    best, tried = fit_search.largest_fitting(fits, 28, 150)
    assert best == limit and tried == calls
    assert len(calls) <= 9  # 1 + ceil(log2(123))


def test_search_says_none_when_the_smallest_does_not_fit():
    assert fit_search.largest_fitting(lambda n: False, 28, 150) == (None, [28])
    with pytest.raises(ValueError):
        fit_search.largest_fitting(lambda n: True, 5, 4)


def _args(**kw):
    return types.SimpleNamespace(mem_fraction=0.9, bucket_mb=2048, trial_timeout=10.0, **kw)


def test_a_trial_fits_only_when_the_run_generated_after_its_sync():
    def ok_runner(cmd, **kw):
        assert cmd[1].endswith("bench_layered.py") and "--engine" in cmd and cmd[cmd.index("--layers") + 1] == "60"
        assert cmd[cmd.index("--mem-fraction") + 1] == "0.9" and cmd[cmd.index("--methods") + 1] == "layered"
        out = cmd[cmd.index("--out") + 1]
        info = {"weight_bytes": 30_000_000_000, "generate_after_sync": "ok",
                "methods": {"layered": {"sync_s": 0.7, "switch_s": 1.1, "peak_bytes": 2_000_000_000}}}
        Path(out).write_text(json.dumps({"layouts": {"offload": info}}))
        return subprocess.CompletedProcess(cmd, 0, "table", "")

    rec = fit_search.run_trial("layered", 60, _args(), runner=ok_runner)
    assert rec["fits"] and rec["weight_bytes"] == 30_000_000_000 and rec["sync_s"] == 0.7

    def oom_runner(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB")

    rec = fit_search.run_trial("layered", 160, _args(), runner=oom_runner)
    assert not rec["fits"] and "out of memory" in rec["reason"] and rec["reason"].startswith("exit 1")

    def slow_runner(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    rec = fit_search.run_trial("all_at_once", 90, _args(), runner=slow_runner)
    assert not rec["fits"] and "timed out" in rec["reason"]


def test_run_in_group_kills_what_a_trial_leaves_behind(tmp_path):
    """A grandchild (as SGLang's scheduler is to the trial's runner) does not outlive the trial."""
    import subprocess
    import sys
    import time

    pidfile = tmp_path / "pid"
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))")
    done = fit_search.run_in_group([sys.executable, "-c", code], timeout=30)
    assert done.returncode == 0
    pid = int(pidfile.read_text())
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if open(f"/proc/{pid}/stat").read().split()[2] == "Z":  # killed, not yet reaped by init
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"grandchild {pid} still alive")
    with pytest.raises(subprocess.TimeoutExpired):
        fit_search.run_in_group([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)


def test_bench_peak_is_the_max_over_the_workers_phases():
    """The worker's timeline resets torch's peak at every phase: an all-at-once gather's peak sits in an
    earlier phase than the last, so the bench takes the max over the phases of the sync."""
    from sgl_rollout.memory import MemoryRecord

    recs = [MemoryRecord("resume_weights", 0.1, 10, 70, 15_000), MemoryRecord("sync", 0.5, 8, 72, 2_000),
            MemoryRecord("offload_trainer", 0.6, 20, 60, 1_000)]
    got = bench_layered.timeline_peaks(recs)
    assert got == {"phase_peak_allocated_bytes": 15_000, "device_used_max_bytes": 72}
    assert bench_layered.timeline_peaks([]) == {"phase_peak_allocated_bytes": 0, "device_used_max_bytes": None}


def test_failure_reason_keeps_the_error_lines_of_a_long_output():
    out = "\n".join(["loading"] * 50 + ["Traceback (most recent call last):", '  File "x.py", line 1',
                                        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
                    + ["shutting down"] * 20 + ["AttributeError: 'RolloutEngine' object has no attribute 'x'"])
    reason = fit_search.failure_reason(out)
    assert "torch.OutOfMemoryError: CUDA out of memory" in reason and "AttributeError" in reason
    assert "Traceback" not in reason and reason.count("loading") == 0


def test_a_timed_out_trial_keeps_what_it_printed(tmp_path):
    import sys

    done = []

    def runner(cmd, **kw):
        done.append(cmd)
        raise subprocess.TimeoutExpired(cmd, 1.0, output="starting engine\nCapturing batches", stderr=b"")

    rec = fit_search.run_trial("layered", 150, _args(), runner=runner)
    assert not rec["fits"] and rec["reason"].startswith("timed out") and "Capturing batches" in rec["reason"]
    code = "import time, sys; print('half way', flush=True); time.sleep(30)"
    with pytest.raises(subprocess.TimeoutExpired) as info:
        fit_search.run_in_group([sys.executable, "-c", code], timeout=2)
    assert "half way" in info.value.output


def test_sigterm_to_the_search_kills_the_running_trial():
    import signal
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    previous = signal.getsignal(signal.SIGTERM)
    fit_search._RUNNING.append(proc.pid)
    try:
        fit_search._end_on_sigterm()
        with pytest.raises(SystemExit) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode
        assert info.value.code == 128 + signal.SIGTERM
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        signal.signal(signal.SIGTERM, previous)
        fit_search._RUNNING.remove(proc.pid)
        if proc.poll() is None:
            proc.kill()
