"""On 2 GPUs: a TP=2 engine starts with ~20 GB held on GPU 0 only; SGLang's own check refuses that start
when the package's handling is switched off."""

import os
import subprocess
import sys

import pytest
import torch

from sgl_rollout.bench import LLAMA_TINY, make_llama_dir

SCRIPT = os.path.join(os.path.dirname(__file__), "tp_start.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    path = str(tmp_path_factory.mktemp("tiny_tp"))
    make_llama_dir(path, LLAMA_TINY, with_weights=True)
    return path


def _start(mode, model_dir):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, SCRIPT, mode, model_dir], env=env, capture_output=True, text=True, timeout=400)


def test_tp2_starts_with_unequal_gpus(model_dir):
    r = _start("package", model_dir)
    print(r.stdout[-2000:], r.stderr[-3000:])
    assert r.returncode == 0 and "GENERATED" in r.stdout


def test_sglang_refuses_without_the_package_handling(model_dir):
    r = _start("sglang-default", model_dir)
    print(r.stdout[-2000:], r.stderr[-3000:])
    assert r.returncode != 0 and "GENERATED" not in r.stdout
    assert "memory capacity is unbalanced" in (r.stdout + r.stderr)
