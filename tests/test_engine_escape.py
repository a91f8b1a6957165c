"""A SystemExit or KeyboardInterrupt that escapes an SGLang coroutine on the engine's loop makes the engine
dead (EngineDeadError for that call and every later one), instead of ending the loop's thread and leaving
its caller waiting forever."""

import asyncio
import threading

import pytest

from fakes import FakeSGLangEngine
from sgl_rollout.config import RolloutConfig
from sgl_rollout.engine import EngineDeadError, RolloutEngine


def _call_in_thread(fn, timeout_s=10.0):
    """``fn()``'s result or error, from another thread; fails the test if it does not return in time."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "the call never returned: the engine's loop thread died under it"
    return out


@pytest.mark.parametrize("escape", [SystemExit, KeyboardInterrupt])
def test_an_escape_from_sglang_makes_the_engine_dead_not_hung(escape):
    eng = RolloutEngine(RolloutConfig(model_path="/fake", enforce_eager=True), engine_factory=FakeSGLangEngine)
    try:
        tm = eng._engine.tokenizer_manager

        async def release(obj, request):
            raise escape(1)

        tm.release_memory_occupation = release
        out = _call_in_thread(lambda: eng.release(["kv_cache"]))
        assert isinstance(out.get("error"), EngineDeadError), out
        assert not eng.alive
        # every later call says the engine is dead, not that a release is in progress
        for call in (lambda: eng.resume(["kv_cache"]), lambda: eng.generate([[1]], {"max_new_tokens": 1})):
            later = _call_in_thread(call)
            assert isinstance(later.get("error"), EngineDeadError), later
        eng.restart()
        assert eng.alive and eng.generate([[1, 2]], {"max_new_tokens": 2})[0][0].output_ids
    finally:
        eng.shutdown()


def test_an_escape_from_a_generate_fails_the_awaiting_caller():
    eng = RolloutEngine(RolloutConfig(model_path="/fake", enforce_eager=True), engine_factory=FakeSGLangEngine)
    try:
        async def generate(**kwargs):
            raise SystemExit(3)

        eng._engine.async_generate = generate

        async def scenario():
            return await asyncio.wait_for(eng.async_generate([[1]], {"max_new_tokens": 1}), 10)

        out = _call_in_thread(lambda: asyncio.run(scenario()))
        assert isinstance(out.get("error"), EngineDeadError), out
        assert "SystemExit" in str(out["error"])
    finally:
        eng.shutdown()
