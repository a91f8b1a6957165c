import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _sglang_cpu import ensure_sglang_importable  # noqa: E402

ensure_sglang_importable()


@pytest.fixture(autouse=True)
def _agent_loop_heap_not_frozen(monkeypatch):
    """Tests that build verl's real ``AgentLoopWorker`` for ``rollout.name=sglang`` would freeze the test
    process's heap (``sgl_rollout.integrations.verl_agent_loop``) for every later test; off unless a test
    turns it on (``tests/test_verl_agent_loop.py``)."""
    from sgl_rollout.integrations.verl_agent_loop import ENV

    monkeypatch.setenv(ENV, "0")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (``bench.LLAMA_TINY``, bf16, weights saved) with the demo's byte-level
    tokenizer, as a Hugging Face folder: one per test module."""
    import torch

    from sgl_rollout.bench import LLAMA_TINY, make_llama_dir
    from sgl_rollout.demo.model import save_byte_level_tokenizer

    path = tmp_path_factory.mktemp("tiny")
    make_llama_dir(str(path), LLAMA_TINY, dtype=torch.bfloat16, with_weights=True, init_std=0.15)
    save_byte_level_tokenizer(path, LLAMA_TINY["vocab_size"])
    return str(path)


_SESSION = {}


def pytest_sessionfinish(session, exitstatus):
    _SESSION["exitstatus"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process with pytest's own status once pytest has reported everything, without the
    interpreter's teardown: that teardown finalises native extensions (triton's nanobind module prints
    its leaks there), and once in five clean-clone CI runs on 2 cores it ended in a segmentation fault
    after every test had passed, turning a green run red. ``SGLROLLOUT_TEST_TEARDOWN=1`` keeps the
    teardown (to look at that crash)."""
    if "exitstatus" in _SESSION and os.environ.get("SGLROLLOUT_TEST_TEARDOWN") != "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_SESSION["exitstatus"])
