"""examples/layered/fit_search.py: the binary search and how a trial's outcome is read (the trials
themselves need a GPU and SGLang: ``python examples/layered/fit_search.py`` on one)."""

import importlib.util
import json
import subprocess
import types
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "examples" / "layered" / "fit_search.py"
spec = importlib.util.spec_from_file_location("fit_search", PATH)
fit_search = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fit_search)


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
