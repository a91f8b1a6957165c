"""``examples/verl/run_grpo.sh`` on this CPU machine: a start that fails a check leaves no run folder, and
the script runs one interpreter (``PYTHON``, else the active virtualenv's, else the checkout's ``.venv``)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "verl" / "run_grpo.sh"


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("VERL_USE_EXTERNAL_PLUGINS", "DRY_RUN", "OUT", "MODEL", "GGUF", "NGPUS", "TP", "STEPS",
                        "NNODES", "RAY_ADDRESS")}
    env.update(extra)
    return env


def _run(cwd, env, *args, timeout=300):
    """Run the script; past ``timeout`` s (a start that went on to train) kill its process group and fail."""
    proc = subprocess.Popen(["bash", str(SCRIPT), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=cwd, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"run_grpo.sh still running after {timeout} s (its checks did not stop it):\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _fake_model(path: Path) -> Path:
    """A folder the model check accepts (it has a config.json); nothing reaches the training."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


def test_missing_model_fails_before_creating_the_run_folder(tmp_path):
    run = tmp_path / "run"
    out = _run(tmp_path, _env(PYTHON=sys.executable, MODEL=str(tmp_path / "no-such-model"), OUT=str(run),
                              DRY_RUN="1"))
    assert out.returncode != 0, out.stderr[-3000:]
    assert "no config.json" in out.stderr, out.stderr[-3000:]
    assert not run.exists(), sorted(str(p) for p in run.rglob("*"))


def test_default_run_folder_is_not_created_when_a_check_fails(tmp_path):
    """Without OUT the run folder would be runs/verl-grpo-<time> under the working directory."""
    out = _run(tmp_path, _env(PYTHON=sys.executable, MODEL=str(tmp_path / "no-such-model"), DRY_RUN="1"))
    assert out.returncode != 0, out.stderr[-3000:]
    assert not (tmp_path / "runs").exists(), sorted(str(p) for p in (tmp_path / "runs").rglob("*"))


def test_bad_gpu_layout_fails_before_creating_the_run_folder(tmp_path):
    model = _fake_model(tmp_path / "model")
    run = tmp_path / "run"
    out = _run(tmp_path, _env(PYTHON=sys.executable, MODEL=str(model), OUT=str(run), DRY_RUN="1", NGPUS="3",
                              TP="2"))
    assert out.returncode != 0, out.stderr[-3000:]
    assert "TP" in out.stderr, out.stderr[-3000:]
    assert not run.exists(), sorted(str(p) for p in run.rglob("*"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_nnodes_without_a_ray_cluster_fails_before_creating_the_run_folder(tmp_path):
    model = _fake_model(tmp_path / "model")
    run = tmp_path / "run"
    out = _run(tmp_path, _env(PYTHON=sys.executable, MODEL=str(model), OUT=str(run), NNODES="2", TP="2"))
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1].startswith("run_grpo.sh: NNODES=2 needs a Ray cluster")
    assert "RAY_ADDRESS" in out.stderr
    assert not run.exists()


def test_no_gpu_fails_before_creating_the_run_folder(tmp_path):
    model = _fake_model(tmp_path / "model")
    run = tmp_path / "run"
    out = _run(tmp_path, _env(PYTHON=sys.executable, MODEL=str(model), OUT=str(run)), timeout=120)
    assert out.returncode != 0, out.stderr[-3000:]
    assert "CUDA GPU" in out.stderr, out.stderr[-3000:]
    assert "main_ppo" not in out.stdout + out.stderr  # stopped before verl
    assert not run.exists(), sorted(str(p) for p in run.rglob("*"))


def _fake_pythons(bin_dir: Path, marker: Path) -> dict:
    """``python3`` and ``python`` on PATH that only record that they ran."""
    bin_dir.mkdir()
    for name in ("python3", "python"):
        p = bin_dir / name
        p.write_text(f"#!/bin/sh\necho {name} >> '{marker}'\necho 'fake {name}' >&2\nexit 3\n")
        p.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_without_PYTHON_the_active_virtualenv_interpreter_runs_everything(tmp_path):
    """PYTHON unset: the active virtualenv's python, never python3/python from PATH (here fakes that fail)."""
    marker = tmp_path / "fake-python-ran"
    env = _env(MODEL=str(tmp_path / "no-such-model"), OUT=str(tmp_path / "run"), DRY_RUN="1",
               VIRTUAL_ENV=sys.prefix, **_fake_pythons(tmp_path / "bin", marker))
    env.pop("PYTHON", None)
    out = _run(tmp_path, env)
    assert not marker.exists(), marker.read_text()
    assert "verl_task prepare: --model" in out.stderr, out.stderr[-3000:]  # the real interpreter's check ran
    assert out.returncode != 0 and not (tmp_path / "run").exists()


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "python").exists(), reason="no .venv in this checkout")
def test_without_PYTHON_or_a_virtualenv_the_checkouts_venv_runs(tmp_path):
    marker = tmp_path / "fake-python-ran"
    env = _env(MODEL=str(tmp_path / "no-such-model"), OUT=str(tmp_path / "run"), DRY_RUN="1",
               **_fake_pythons(tmp_path / "bin", marker))
    env.pop("PYTHON", None)
    env.pop("VIRTUAL_ENV", None)
    out = _run(tmp_path, env)
    assert not marker.exists(), marker.read_text()
    assert "verl_task prepare: --model" in out.stderr, out.stderr[-3000:]
    assert out.returncode != 0 and not (tmp_path / "run").exists()


def test_PYTHON_wins(tmp_path):
    marker = tmp_path / "fake-python-ran"
    fakes = _fake_pythons(tmp_path / "bin", marker)
    env = _env(PYTHON=str(tmp_path / "bin" / "python3"), VIRTUAL_ENV=sys.prefix, MODEL=str(tmp_path / "m"),
               OUT=str(tmp_path / "run"), DRY_RUN="1", **fakes)
    out = _run(tmp_path, env)
    assert out.returncode != 0
    assert marker.read_text().split() == ["python3"]  # ran once, then the script stopped
    assert not (tmp_path / "run").exists()
