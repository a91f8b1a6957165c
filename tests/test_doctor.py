"""``python -m sgl_rollout doctor``: one line per check, and a non-zero exit status with one ``missing`` line
per requirement the machine lacks (a CUDA GPU, the torch-memory-saver hook that release/resume needs)."""

import ctypes
import subprocess
import sys

import pytest
import torch

from sgl_rollout import doctor

LABELS = ("sglang", "torch", "torch-memory-saver", "verl", "memory-saver hook", "TP imbalance check",
          "SGLang plugin", "GPUs", 'verl resolves "sglang" to')


def _missing_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith("missing")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_doctor_command_fails_on_a_machine_without_gpu_or_hook():
    """The real command on this CPU machine: every check still reported, then what is missing, exit status 1."""
    out = subprocess.run([sys.executable, "-m", "sgl_rollout", "doctor"], capture_output=True, text=True,
                         timeout=600)
    lines = out.stdout.splitlines()
    for label in LABELS:
        assert any(line.startswith(label) for line in lines), (label, out.stdout)
    assert out.returncode != 0, out.stdout
    missing = _missing_lines(out.stdout)
    assert len([m for m in missing if "CUDA GPU" in m]) == 1, out.stdout
    hook = next(line for line in lines if line.startswith("memory-saver hook"))
    if not hook[28:].startswith("loads"):  # here: libcuda.so.1 is absent, so the hook cannot load
        assert len([m for m in missing if "hook" in m]) == 1, out.stdout
    assert all("release/resume" in m for m in missing), missing


@pytest.fixture
def fast_probes(monkeypatch):
    """No subprocess probes (the TP-check and verl lines are not what these tests are about)."""
    monkeypatch.setattr(doctor, "_imbalance_vars", lambda: "probe skipped")
    monkeypatch.setattr(doctor, "_verl", lambda: "probe skipped")


def _fake_gpu(monkeypatch, present: bool):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: present)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1 if present else 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake H100")


def _fake_hook(monkeypatch, loads: bool):
    def cdll(path, *a, **k):
        if not loads:
            raise OSError("libcuda.so.1: cannot open shared object file")
        return object()

    monkeypatch.setattr(ctypes, "CDLL", cdll)


@pytest.mark.parametrize("gpu,hook", [(False, False), (True, False), (False, True)])
def test_doctor_main_names_each_missing_piece_and_fails(monkeypatch, capsys, fast_probes, gpu, hook):
    _fake_gpu(monkeypatch, gpu)
    _fake_hook(monkeypatch, hook)
    status = doctor.main([])
    out = capsys.readouterr().out
    assert status != 0, out
    missing = _missing_lines(out)
    assert len(missing) == (not gpu) + (not hook), out
    assert any("CUDA GPU" in m for m in missing) == (not gpu)
    assert any("preload hook" in m for m in missing) == (not hook)
    for label in LABELS:  # the checks it made before are all still there
        assert any(line.startswith(label) for line in out.splitlines()), label


def test_doctor_main_passes_with_gpu_and_hook(monkeypatch, capsys, fast_probes):
    _fake_gpu(monkeypatch, True)
    _fake_hook(monkeypatch, True)
    status = doctor.main([])
    out = capsys.readouterr().out
    assert status == 0, out
    assert _missing_lines(out) == []
    assert "GPUs                        0: Fake H100" in out.splitlines()
    assert any(line.startswith("memory-saver hook           loads (") for line in out.splitlines()), out


def test_doctor_main_reports_a_check_that_raises(monkeypatch, capsys, fast_probes):
    """A check that raises is reported on its own line; a required one that raises counts as missing."""
    _fake_hook(monkeypatch, True)

    def broken():
        raise RuntimeError("no driver")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    status = doctor.main([])
    out = capsys.readouterr().out
    assert "GPUs                        error: RuntimeError('no driver')" in out.splitlines()
    assert status != 0
    assert [m for m in _missing_lines(out) if "CUDA GPU" in m], out


def test_sglang_plugin_line_says_whether_schedulers_will_load_it(monkeypatch):
    """CI installs the package (pip, editable): the entry point is there; SGLANG_PLUGINS can leave it out;
    without the entry point the line says how to get it."""
    import importlib.metadata

    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    assert doctor._sglang_plugin().startswith("2 registered (")
    monkeypatch.setenv("SGLANG_PLUGINS", "other_plugin")
    assert doctor._sglang_plugin().count("leaves it out") == 2
    monkeypatch.setenv("SGLANG_PLUGINS", "other_plugin, sgl_rollout_qwen2_5_vl_vision_rope")
    line = doctor._sglang_plugin()
    assert "sgl_rollout_qwen2_5_vl_vision_rope: loaded" in line and line.count("leaves it out") == 1
    monkeypatch.setenv("SGLANG_PLUGINS", "sgl_rollout_qwen_vl_weight_names,sgl_rollout_qwen2_5_vl_vision_rope")
    assert doctor._sglang_plugin().startswith("2 registered (")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [])
    assert doctor._sglang_plugin().startswith("not registered (install this package with pip")


@pytest.mark.parametrize("plugins,ours", [(None, True), ("none", False)])
def test_the_verl_line_reads_verls_registries_as_verl_leaves_them(monkeypatch, plugins, ours):
    """VERL_USE_EXTERNAL_PLUGINS=none gives verl's built-in and no sgl_rollout checkpoint engine; the check
    must not register this package itself while it looks."""
    pytest.importorskip("verl")
    if plugins is None:
        monkeypatch.delenv("VERL_USE_EXTERNAL_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", plugins)
    line = doctor._verl()
    assert ("(this package;" in line) is ours and ("NOT this package" in line) is not ours, line
    assert line.endswith("sgl_rollout registered" if ours else "sgl_rollout not registered"), line
