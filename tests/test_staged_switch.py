"""sgl_rollout.switch: release by sleep level, stage -> tags, the staged wake with hooks, both faces."""

import asyncio

import pytest

from fakes import FakeSGLangEngine
from sgl_rollout.config import RolloutConfig
from sgl_rollout.engine import RolloutEngine
from sgl_rollout.memory import MemoryStateError
from sgl_rollout.switch import STAGES, WAKE_ORDER, Switch, sleep_tags, stage_tags, stages_of


def test_stages_and_levels():
    assert STAGES == {"weights": ("weights",), "kv_cache": ("kv_cache", "cuda_graph")}
    assert WAKE_ORDER == ("weights", "kv_cache")
    all_tags = ("weights", "kv_cache", "cuda_graph")
    assert sleep_tags(all_tags, 1) == ["kv_cache", "cuda_graph"]
    assert sleep_tags(all_tags, 2) == ["weights", "kv_cache", "cuda_graph"]
    assert sleep_tags(("weights", "kv_cache"), 2) == ["weights", "kv_cache"]  # no CUDA graphs
    with pytest.raises(ValueError):
        sleep_tags(all_tags, 3)
    assert stage_tags("kv_cache", ("weights", "kv_cache")) == ["kv_cache"]
    with pytest.raises(ValueError, match="unknown stage"):
        stage_tags("optimizer")
    assert stages_of(["kv_cache", "weights"]) == ["weights", "kv_cache"]  # wake order, whatever the order asked
    assert stages_of(["cuda_graph"]) == ["kv_cache"]
    assert stages_of(None) == ["weights", "kv_cache"]
    with pytest.raises(ValueError, match="unknown tags"):
        stages_of(["optimizer"])


@pytest.fixture
def engine():
    eng = RolloutEngine(RolloutConfig(model_path="/fake", sleep_level=2), engine_factory=FakeSGLangEngine)
    yield eng
    eng.shutdown()


def test_sleep_then_staged_wake_runs_hooks_between_the_stages_in_order(engine):
    sw = Switch(engine, engine.config)
    fake = engine._engine
    assert sw.sleep() == ["weights", "kv_cache", "cuda_graph"]
    assert sw.released_stages() == ["weights", "kv_cache"]
    seen = []

    def hook(name):
        def fn():
            seen.append((name, sorted(engine.state.released)))
            return name.upper()
        return fn

    out = sw.wake([("sync", hook("sync")), ("offload_trainer", hook("offload_trainer"))], weights_undefined=True)
    assert out == {"sync": "SYNC", "offload_trainer": "OFFLOAD_TRAINER"}
    # the hooks ran with the weights back and the KV cache still released
    assert seen == [("sync", ["cuda_graph", "kv_cache"]), ("offload_trainer", ["cuda_graph", "kv_cache"])]
    assert [c for c in fake.calls if c[0] in ("release", "resume")] == [
        ("release", ("weights", "kv_cache", "cuda_graph")), ("resume", ("weights",)),
        ("resume", ("kv_cache", "cuda_graph"))]
    main = [p for p in sw.last_phase_seconds if "." not in p]
    assert main == ["resume_weights", "sync", "offload_trainer", "empty_cache", "resume_kv_cache", "switch_total"]
    # the weights were marked undefined before their resume and no complete sync followed
    with pytest.raises(MemoryStateError):
        engine.generate([[1]], {"max_new_tokens": 1})


def test_a_failing_hook_leaves_the_kv_cache_released(engine):
    sw = Switch(engine, engine.config)
    sw.sleep()

    def boom():
        raise RuntimeError("sync failed")

    with pytest.raises(RuntimeError, match="sync failed"):
        sw.wake([("sync", boom)])
    assert sorted(engine.state.released) == ["cuda_graph", "kv_cache"]
    assert sw.resume_stage("kv_cache") == ["kv_cache", "cuda_graph"]
    assert sw.resume_stage("kv_cache") == []  # nothing released: a no-op


def test_async_face_with_coroutine_hooks_and_release_stage(engine):
    sw = Switch(engine, engine.config.model_copy(update={"sleep_level": 1}))

    async def scenario():
        assert await sw.async_sleep() == ["kv_cache", "cuda_graph"]
        seen = []

        async def sync():
            await asyncio.sleep(0)
            seen.append(sorted(engine.state.released))
            return 7

        out = await sw.async_wake([("sync", sync)])
        assert out == {"sync": 7} and seen == [["cuda_graph", "kv_cache"]]
        assert await sw.async_release_stage("kv_cache") == ["kv_cache", "cuda_graph"]
        assert await sw.async_release_stage("kv_cache") == []
        assert await sw.async_resume_stage("kv_cache") == ["kv_cache", "cuda_graph"]

    asyncio.run(scenario())
    assert engine.state.released == ()


def test_free_cache_engine_off_releases_nothing(engine):
    sw = Switch(engine, engine.config.model_copy(update={"free_cache_engine": False}))
    assert sw.sleep() == [] and engine.state.released == ()
    assert sw.wake([("sync", lambda: 1)]) == {"sync": 1}


def test_the_wake_skips_the_empty_cache_step_only_where_the_device_has_room_for_the_kv_cache(engine, monkeypatch):
    """A device of 80 GiB: the engine's tagged regions (weights 3, KV cache 10, CUDA graphs 1 GiB) and a
    trainer whose memory changes between the sleep and the wake. The sleep measures what it freed (14 GiB),
    the wake what the weights took back (3 GiB); the empty-cache step is skipped only when the device's
    free memory before the KV cache's resume covers the other 11 GiB with the margin to spare."""
    import sgl_rollout.switch as switch_mod
    from sgl_rollout.memory import GiB, EmptyCacheResult

    sizes = {"weights": 3 * GiB, "kv_cache": 10 * GiB, "cuda_graph": 1 * GiB}
    trainer = {"bytes": 40 * GiB}

    def free():
        resident = sum(b for t, b in sizes.items() if t not in engine.state.released)
        return 80 * GiB - trainer["bytes"] - resident

    emptied = []
    monkeypatch.setattr(switch_mod, "aggressive_empty_cache", lambda: emptied.append(free()) or EmptyCacheResult())
    sw = Switch(engine, engine.config, free_bytes=free)
    assert sw.empty_cache_margin_bytes == switch_mod.EMPTY_CACHE_MARGIN_BYTES == 2 * GiB

    sw.sleep()
    sw.wake()  # 80 - 40 - 3 = 37 GiB free before the KV cache: room for 11 + 2
    assert sw.last_empty_cache == {"skipped": True, "free_bytes": 37 * GiB, "needed_bytes": 11 * GiB,
                                   "margin_bytes": 2 * GiB}
    assert emptied == [] and "empty_cache" in sw.last_phase_seconds and not engine.state.released

    sw.sleep()
    trainer["bytes"] = 65 * GiB  # the training step grew the trainer's cache: 12 GiB free, 13 needed
    sw.wake()
    assert emptied == [12 * GiB] and "skipped" not in sw.last_empty_cache

    sw.sleep()
    trainer["bytes"] = 64 * GiB  # exactly the margin left: skipped
    sw.wake()
    assert emptied == [12 * GiB] and sw.last_empty_cache["skipped"] is True

    sw.release_stage("kv_cache")  # a release the switch did not measure: the next wake empties the cache
    sw.wake()
    assert len(emptied) == 2

    trainer["bytes"] = 40 * GiB
    always = Switch(engine, engine.config.model_copy(update={"empty_cache": "always"}), free_bytes=free)
    always.sleep()
    always.wake()  # room enough (37 GiB free), but RolloutConfig(empty_cache="always"): emptied anyway
    assert len(emptied) == 3 and "skipped" not in always.last_empty_cache
    emptied.pop()

    unmeasured = Switch(engine, engine.config, free_bytes=lambda: None)  # no CUDA context here: never skipped
    unmeasured.sleep()
    unmeasured.wake()
    assert len(emptied) == 3
    asyncio.run(sw.async_sleep())  # the awaiting face measures and skips the same way
    trainer["bytes"] = 40 * GiB
    asyncio.run(sw.async_wake())
    assert len(emptied) == 3 and sw.last_empty_cache["skipped"] is True


def test_work_while_the_weights_resume_overlaps_the_resume_and_its_error_comes_after_the_answer(engine):
    """``while_resuming`` runs once the weights' resume is sent and before its answer is awaited (the fast
    path gathers its first bucket there); an error it raises comes out of the wake once SGLang has answered,
    the weights committed as resumed and the KV cache left released, as after a failing hook."""
    fake = engine._engine
    fake.answer_delay_s = 0.3  # SGLang answers the resume well after this process has gone on
    sw = Switch(engine, engine.config)
    sw.sleep()
    seen = []

    def meanwhile():
        seen.append((engine.state.busy, engine.state.is_released("weights")))

    sw.wake([("sync", lambda: seen.append("sync"))], while_resuming=meanwhile)
    assert seen == [("resume", True), "sync"]  # while the resume was in flight, then the hook
    assert engine.state.released == () and not fake.dead

    sw.sleep()

    def boom():
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        sw.wake([("sync", lambda: seen.append("sync2"))], while_resuming=boom)
    assert "sync2" not in seen and engine.state.busy is None
    assert sorted(engine.state.released) == ["cuda_graph", "kv_cache"]  # the weights' resume was answered
    assert sw.resume_stage("kv_cache") == ["kv_cache", "cuda_graph"]

    sw_awake = Switch(engine, engine.config.model_copy(update={"free_cache_engine": False}))
    sw_awake.wake([("sync", lambda: seen.append("sync3"))], while_resuming=lambda: seen.append("ahead"))
    assert seen[-2:] == ["ahead", "sync3"]  # nothing to resume: it runs before the hooks


def test_memory_the_work_while_resuming_takes_is_not_counted_as_the_weights(engine, monkeypatch):
    """The empty-cache step's skip reads what the weights took back from the device's free memory around their
    resume; memory ``while_resuming`` took meanwhile (the gather's buffer) is subtracted, as it returns it."""
    import sgl_rollout.switch as switch_mod
    from sgl_rollout.memory import GiB, EmptyCacheResult

    sizes = {"weights": 3 * GiB, "kv_cache": 10 * GiB, "cuda_graph": 1 * GiB}
    trainer = {"bytes": 54 * GiB}

    def free():
        resident = sum(b for t, b in sizes.items() if t not in engine.state.released)
        return 80 * GiB - trainer["bytes"] - resident

    def take_buffer(report):
        def fn():
            trainer["bytes"] += 2 * GiB
            return 2 * GiB if report else None
        return fn

    emptied = []
    monkeypatch.setattr(switch_mod, "aggressive_empty_cache", lambda: emptied.append(free()) or EmptyCacheResult())
    sw = Switch(engine, engine.config, free_bytes=free)
    sw.sleep()
    sw.wake(while_resuming=take_buffer(True))  # 80 - 56 - 3 = 21 GiB free, 11 needed
    assert sw.last_empty_cache["needed_bytes"] == 11 * GiB and sw.last_empty_cache["skipped"] is True
    trainer["bytes"] = 54 * GiB
    sw.sleep()
    sw.wake(while_resuming=take_buffer(False))  # not reported: read as the weights' (3 + 2), 9 GiB "needed"
    assert sw.last_empty_cache["needed_bytes"] == 9 * GiB
