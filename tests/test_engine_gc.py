"""``RolloutConfig.freeze_gc``: once the engine answered its first generate, SGLang's ``freeze_gc`` is sent
(once per start, again after a restart), without holding up any call; off, missing or failing, nothing else
changes."""

import logging
import time

from fakes import FakeSGLangEngine
from sgl_rollout.bench.requests import on_a_loop_thread
from sgl_rollout.config import RolloutConfig
from sgl_rollout.engine import RolloutEngine


def _engine(**kw):
    return RolloutEngine(RolloutConfig(model_path="/fake", enforce_eager=True, **kw), engine_factory=FakeSGLangEngine)


def _freezes(fake, at_least, timeout_s=5.0):
    """``fake.gc_freezes`` once it reached ``at_least`` (the freeze is sent without waiting), or at the timeout."""
    t0 = time.monotonic()
    while fake.gc_freezes < at_least and time.monotonic() - t0 < timeout_s:
        time.sleep(0.01)
    return fake.gc_freezes


def test_the_first_answered_generate_freezes_once_per_start():
    eng = _engine()
    try:
        fake = eng._engine
        assert fake.gc_freezes == 0  # not at start: the heap is not warm yet
        eng.generate([[1, 2]], {"max_new_tokens": 2})
        assert _freezes(fake, 1) == 1
        eng.generate([[1, 2]], {"max_new_tokens": 2}, n=2)
        eng.generate([[3]], {"max_new_tokens": 1})
        time.sleep(0.1)
        assert fake.gc_freezes == 1
        eng.restart()
        fresh = eng._engine
        assert fresh is not fake and fresh.gc_freezes == 0
        eng.generate([[1, 2]], {"max_new_tokens": 2})
        assert _freezes(fresh, 1) == 1
    finally:
        eng.shutdown()


def test_off_missing_or_failing_freeze_changes_nothing_else(caplog):
    off = _engine(freeze_gc=False)
    try:
        off.generate([[1, 2]], {"max_new_tokens": 2})
        time.sleep(0.1)
        assert off._engine.gc_freezes == 0
    finally:
        off.shutdown()

    missing = _engine()
    try:
        missing._engine.tokenizer_manager.freeze_gc = None  # an SGLang without it
        with caplog.at_level(logging.INFO, logger="sgl_rollout.engine.generate"):
            out = missing.generate([[1, 2]], {"max_new_tokens": 2})
        assert len(out) == 1 and missing.alive
        assert any("no freeze_gc" in r.getMessage() for r in caplog.records)
    finally:
        missing.shutdown()

    failing = _engine()
    try:
        failing._engine.freeze_error = RuntimeError("freeze refused")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sgl_rollout.engine.generate"):
            failing.generate([[1, 2]], {"max_new_tokens": 2})
            t0 = time.monotonic()
            while not any("freeze_gc failed" in r.getMessage() for r in caplog.records) and time.monotonic() - t0 < 5:
                time.sleep(0.01)
        assert any("freeze refused" in r.getMessage() for r in caplog.records)
        assert failing.alive and len(failing.generate([[4]], {"max_new_tokens": 1})) == 1  # not tried again
        assert failing._engine.gc_freezes == 0
    finally:
        failing.shutdown()


def test_on_the_callers_loop_the_freeze_runs_there_after_the_first_answer():
    """As in verl's server actor (``RolloutEngine(loop=...)``): the freeze is a task of that loop."""

    async def scenario():
        import asyncio

        eng = RolloutEngine(RolloutConfig(model_path="/fake", enforce_eager=True), engine_factory=FakeSGLangEngine,
                            loop=asyncio.get_running_loop())
        try:
            await eng.async_generate([[1, 2]], {"max_new_tokens": 2})
            for _ in range(100):
                if eng._engine.gc_freezes:
                    break
                await asyncio.sleep(0.01)
            await eng.async_generate([[5]], {"max_new_tokens": 1})
            await asyncio.sleep(0.05)
            return eng._engine.gc_freezes
        finally:
            eng.shutdown()

    assert on_a_loop_thread(scenario, timeout_s=60) == 1
