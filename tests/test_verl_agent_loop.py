"""The freeze of verl's agent-loop workers' heap (``sgl_rollout.integrations.verl_agent_loop``): the verl plugin
hooks verl's real ``AgentLoopWorker`` at import; a worker built for ``rollout.name=sglang`` freezes once when
built and once after its first batch, and never again; other rollouts and the ``0`` switch are left alone; a
failing freeze does not fail verl's rollout."""

import asyncio
import os
import subprocess
import sys
import types

import numpy as np
import pytest

pytest.importorskip("verl")
pytest.importorskip("ray")

from fakes import verl_server  # noqa: E402
from sgl_rollout.bench import agent_task  # noqa: E402
from sgl_rollout.bench.chat_tokenizer import build_chat_model_dir, build_chat_tokenizer  # noqa: E402
from sgl_rollout.integrations import verl_agent_loop  # noqa: E402
from sgl_rollout.integrations.verl import NAME  # noqa: E402
from test_agent_task import _config  # noqa: E402
from test_multimodal import _verl_client  # noqa: E402

_CHECK = """
import gc, sys
import verl.experimental.agent_loop.agent_loop as m
from sgl_rollout.integrations import verl_agent_loop as v
print(bool(getattr(m.AgentLoopWorker.__init__, v._WRAPPED, False)))
w = type("W", (), {})()
before = gc.get_freeze_count()
v._freeze(w, "built")
print(gc.get_freeze_count() > before)
"""


def _fresh(policy):
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": policy}
    out = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_verls_plugin_hooks_the_real_agent_loop_worker_and_the_freeze_freezes():
    assert _fresh("auto") == ["True", "True"]  # the entry point installed the hook; gc.freeze ran
    assert _fresh("none")[0] == "False"  # verl's switch for its built-in rollout: verl's worker untouched


@pytest.fixture
def plain_requests(monkeypatch):
    import sgl_rollout.engine.io_struct as engine_mod

    monkeypatch.setattr(engine_mod, "make", lambda name, **fields: types.SimpleNamespace(**fields))


def _run_worker(tmp_path, cfg, batches):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    tok = build_chat_tokenizer()
    srv = verl_server(256, max_model_len=768, model_path=cfg.actor_rollout_ref.model.path)

    async def body():
        await srv.start()
        try:
            srv._engine._engine.reply = lambda ids: tok.encode("Answer: 42<|im_end|>", add_special_tokens=False)
            worker = AgentLoopWorker(cfg, _verl_client(srv))
            return [await worker.generate_sequences(b) for b in batches]
        finally:
            await srv.shutdown()

    return asyncio.run(body())


def _batch():
    from verl.protocol import DataProto

    prompt = [{"role": "user", "content": "What is 12 + 30?"}]
    return DataProto(non_tensor_batch={
        "raw_prompt": np.array([np.array(prompt, dtype=object)], dtype=object),
        "agent_name": np.array([agent_task.LOOP_NAME], dtype=object),
        "data_source": np.array(["t"], dtype=object),
    }, meta_info={"global_steps": 1, "validate": True})


@pytest.mark.parametrize("name, switch, frozen", [
    ("sglang", "1", ["built", "first batch"]),
    ("vllm", "1", []),
    ("sglang", "0", []),
])
def test_verls_worker_freezes_once_built_and_once_after_its_first_batch(tmp_path, plain_requests, monkeypatch,
                                                                        name, switch, frozen):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    assert verl_agent_loop.patch(AgentLoopWorker, NAME)  # the plugin's hook did it at import already: idempotent
    calls = []
    monkeypatch.setattr(verl_agent_loop, "freeze_long_lived", lambda: calls.append(len(calls)) or 0)
    monkeypatch.setenv(verl_agent_loop.ENV, switch)
    _, _, loops = agent_task.write_tools_task(tmp_path / "data", n_train=2, n_val=2)
    cfg = _config(tmp_path, build_chat_model_dir(tmp_path / "model"), loops)
    cfg.actor_rollout_ref.rollout.name = name
    outs = _run_worker(tmp_path, cfg, [_batch(), _batch()])
    assert [len(o) for o in outs] == [1, 1]  # verl's rollout ran both batches
    assert len(calls) == len(frozen)


def test_a_failing_freeze_does_not_fail_the_rollout(tmp_path, plain_requests, monkeypatch, caplog):
    def broken():
        raise RuntimeError("gc")

    monkeypatch.setattr(verl_agent_loop, "freeze_long_lived", broken)
    monkeypatch.setenv(verl_agent_loop.ENV, "1")
    _, _, loops = agent_task.write_tools_task(tmp_path / "data", n_train=2, n_val=2)
    cfg = _config(tmp_path, build_chat_model_dir(tmp_path / "model"), loops)
    (out,) = _run_worker(tmp_path, cfg, [_batch()])
    assert len(out) == 1
    assert "could not freeze" in caplog.text


def test_serves_this_rollout_reads_the_name_and_never_raises(monkeypatch):
    monkeypatch.delenv(verl_agent_loop.ENV, raising=False)
    cfg = types.SimpleNamespace(actor_rollout_ref=types.SimpleNamespace(rollout=types.SimpleNamespace(name="sglang")))
    assert verl_agent_loop.serves_this_rollout(cfg, NAME)
    assert not verl_agent_loop.serves_this_rollout(cfg, "vllm")
    assert not verl_agent_loop.serves_this_rollout(object(), NAME)
    monkeypatch.setenv(verl_agent_loop.ENV, "0")
    assert not verl_agent_loop.serves_this_rollout(cfg, NAME)


def test_a_class_without_verls_methods_is_left_alone():
    class Other:
        def __init__(self, config):
            pass

    assert not verl_agent_loop.patch(Other, NAME)
    assert Other.__init__.__name__ == "__init__" and not getattr(Other.__init__, verl_agent_loop._WRAPPED, False)
