"""The async methods (used inside the Ray actor) go through the same guards as the sync ones."""

import asyncio

import pytest

from fakes import FakeAsyncSGLangEngine
from sgl_rollout.config import RolloutConfig
from sgl_rollout.engine import RolloutEngine
from sgl_rollout.memory import MemoryStateError


def test_async_guards_and_calls(monkeypatch):
    # SGLang's io_struct imports its whole serving stack, absent on the CPU test machine; the request
    # objects only carry fields here.
    import types

    import sgl_rollout.engine.guarded as engine_mod

    monkeypatch.setattr(engine_mod, "_req", lambda name, **fields: types.SimpleNamespace(**fields))
    eng = RolloutEngine(RolloutConfig(model_path="/fake", enforce_eager=True), engine_factory=FakeAsyncSGLangEngine)
    fake = eng._engine

    async def scenario():
        out = await eng.async_generate([[1, 2]], {"max_new_tokens": 3}, n=2)
        assert [g.output_ids for g in out[0]] == [[3, 4, 5], [3, 4, 5]]
        assert await eng.async_release(["kv_cache", "weights"]) == ["kv_cache", "weights"]
        with pytest.raises(MemoryStateError):
            await eng.async_release(["kv_cache"])
        with pytest.raises(MemoryStateError):
            await eng.async_update_weights_from_tensor([b"p"], load_format="flattened_bucket")
        with pytest.raises(MemoryStateError):
            await eng.async_generate([[1]])
        await eng.async_resume(["weights"])
        with pytest.raises(MemoryStateError, match="begin_sync"):
            await eng.async_update_weights_from_tensor([b"p"], load_format="flattened_bucket")
        await eng.async_begin_sync()
        assert await eng.async_update_weights_from_tensor([b"p"], load_format="flattened_bucket") == (True, "Success")
        eng.end_sync(True)
        await eng.async_flush_cache()  # KV cache released: skipped
        await eng.async_resume(["kv_cache"])
        with pytest.raises(MemoryStateError):
            await eng.async_resume(["kv_cache"])
        await eng.async_flush_cache()

    asyncio.run(scenario())
    kinds = [c[0] for c in fake.calls]
    assert kinds == ["generate", "release", "resume", "update_weights", "resume", "flush_cache"]
    assert not fake.dead
