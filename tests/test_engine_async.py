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

    import sgl_rollout.engine.io_struct as engine_mod

    monkeypatch.setattr(engine_mod, "make", lambda name, **fields: types.SimpleNamespace(**fields))
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


def _engine_on_the_callers_loop(**kwargs) -> RolloutEngine:
    """An engine over the async SGLang double that runs SGLang's calls on the running loop (``loop=``)."""
    return RolloutEngine(RolloutConfig(model_path="/fake", enforce_eager=True), engine_factory=FakeAsyncSGLangEngine,
                         loop=asyncio.get_running_loop(), **kwargs)


def _on_a_loop_thread(scenario):
    """Run ``scenario()`` on an event loop in a thread of its own, as Ray runs an async actor's loop."""
    from sgl_rollout.bench.requests import on_a_loop_thread

    return on_a_loop_thread(scenario, timeout_s=60)


def test_an_engine_on_the_callers_loop_runs_sglang_there_and_refuses_waiting_calls():
    """``RolloutEngine(loop=...)``: SGLang's coroutines run on the caller's loop (no thread hand-over);
    a synchronous call that waits for SGLang raises there before anything is sent."""
    import threading

    async def scenario():
        eng = _engine_on_the_callers_loop()
        fake, seen = eng._engine, []
        plain = fake.async_generate

        async def recorded(*args, **kwargs):
            seen.append(threading.current_thread().name)
            return await plain(*args, **kwargs)

        fake.async_generate = recorded
        try:
            assert eng._loop_thread is None
            out = await asyncio.gather(*[eng.async_generate([[i, i + 1]], {"max_new_tokens": 2}) for i in range(4)])
            assert [o[0][0].output_ids for o in out] == [[i + 2, i + 3] for i in range(4)]
            assert seen == ["actor-loop"] * 4
            with pytest.raises(RuntimeError, match="async_"):
                eng.release(["kv_cache"])
            with pytest.raises(RuntimeError, match="async_"):
                eng.generate([[1]])
            assert not eng.state.released and [c[0] for c in fake.calls] == ["generate"] * 4
            assert await eng.async_release(["kv_cache", "weights"]) == ["kv_cache", "weights"]
            await eng.async_resume(["weights", "kv_cache"])
            await eng.async_begin_sync()
            eng.end_sync(True)
            assert [c[0] for c in fake.calls][4:] == ["release", "resume"]
        finally:
            eng.shutdown()
        await asyncio.sleep(0.01)  # the loop is the caller's: shutdown leaves it running
        return "done"

    assert _on_a_loop_thread(scenario) == "done"


def test_a_death_on_the_callers_loop_fails_the_call_and_spares_the_loop():
    """A scheduler death fails the request in flight with EngineDeadError and cancels only the engine's
    own coroutines: the caller's other tasks keep running, and restart() serves on the same loop."""
    import threading

    from sgl_rollout.engine import EngineDeadError

    async def scenario():
        eng = _engine_on_the_callers_loop(watch_interval_s=0.05)
        ticks = []

        async def other_work():
            while True:
                ticks.append(1)
                await asyncio.sleep(0.005)

        bystander = asyncio.get_running_loop().create_task(other_work())
        try:
            fake = eng._engine
            fake.block = threading.Event()
            req = asyncio.get_running_loop().create_task(eng.async_generate([[1, 2]], {"max_new_tokens": 2}))
            while not fake.entered.is_set():
                await asyncio.sleep(0.005)
            fake.kill_scheduler()
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(req, 10)
            before = len(ticks)
            await asyncio.sleep(0.05)
            assert not bystander.done() and len(ticks) > before
            eng.restart()
            out = await eng.async_generate([[5]], {"max_new_tokens": 1})
            assert out[0][0].output_ids == [6]
        finally:
            bystander.cancel()
            eng.shutdown()
        return "done"

    assert _on_a_loop_thread(scenario) == "done"


def test_a_cancelled_caller_on_the_callers_loop_aborts_its_request_which_stays_counted():
    """On the caller's loop SGLang's coroutine is a task of that loop: cancelling the caller aborts the
    request by id, and it counts as running (a release is refused) until SGLang has ended it."""
    import threading

    async def scenario():
        eng = _engine_on_the_callers_loop()
        fake = eng._engine
        fake.block = threading.Event()
        fake.tokenizer_manager.abort_request = lambda rid="", abort_all=False: fake.calls.append(("abort", rid))
        try:
            task = asyncio.get_running_loop().create_task(eng.async_generate([[1], [2]], {"max_new_tokens": 1}))
            while not fake.entered.is_set():
                await asyncio.sleep(0.002)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.02)
            assert len([c for c in fake.calls if c[0] == "abort"]) == 2 and eng.state.in_flight == 1
            with pytest.raises(MemoryStateError, match="request"):
                await eng.async_release(["kv_cache"])
            fake.block.set()  # SGLang ends them
            for _ in range(200):
                if not eng.state.in_flight:
                    break
                await asyncio.sleep(0.005)
            assert eng.state.in_flight == 0
            assert await eng.async_release(["kv_cache"]) == ["kv_cache"]
            assert not fake.dead
        finally:
            eng.shutdown()
        return "done"

    assert _on_a_loop_thread(scenario) == "done"


def test_on_the_callers_loop_a_caller_settling_on_another_call_is_not_tied_to_that_call_s_caller():
    """``async_settle`` waits for the last release/resume/bucket, which another caller submitted on the same
    loop. Cancelling either caller reaches only that caller: the other gets SGLang's answer (until the
    seventeenth session both awaited one waiter, and the cancel of one was a ``CancelledError`` in the other)."""

    async def scenario():
        eng = _engine_on_the_callers_loop()
        fake = eng._engine
        fake.answer_delay_s = 0.2
        loop = asyncio.get_running_loop()

        async def then_settle(op):  # op on its way to SGLang, then a caller settling on it
            first = loop.create_task(op)
            await asyncio.sleep(0.05)
            settle = loop.create_task(eng.async_settle())
            await asyncio.sleep(0.02)
            return first, settle

        try:
            release, settle = await then_settle(eng.async_release(["kv_cache"]))
            settle.cancel()
            with pytest.raises(asyncio.CancelledError):
                await settle
            assert await release == ["kv_cache"]

            resume, settle = await then_settle(eng.async_resume(["kv_cache"]))
            resume.cancel()
            with pytest.raises(asyncio.CancelledError):
                await resume
            assert not settle.done()  # it waits for SGLang's answer to the resume
            await settle
            assert eng.state.released == () and eng.state.busy is None
            assert [c[0] for c in fake.calls] == ["release", "resume"] and not fake.dead
        finally:
            eng.shutdown()
        return "done"

    assert _on_a_loop_thread(scenario) == "done"


def test_on_the_callers_loop_a_request_reaches_sglang_in_the_callers_own_turn_where_python_can():
    """Python 3.12+ (``EAGER_TASKS``): the task running SGLang's call takes its first step at once, so the
    request is in SGLang's hands before the caller's turn of the loop ends, as in verl's own server; older
    Pythons schedule that step behind whatever the loop holds. Either way the answer is the same."""
    from sgl_rollout.engine.core import EAGER_TASKS

    async def scenario():
        loop = asyncio.get_running_loop()
        eng = _engine_on_the_callers_loop()
        fake = eng._engine
        reached = []
        answer = fake.async_generate

        async def sglang(*args, **kwargs):
            reached.append(len(order))
            return await answer(*args, **kwargs)

        fake.async_generate = sglang
        order = []
        try:
            callers = [loop.create_task(eng.async_generate([[i]], {"max_new_tokens": 2})) for i in range(3)]
            # three callers' turns, then what they scheduled: eager tasks reach SGLang inside each turn
            loop.call_soon(order.append, "callers' turns done")
            outs = await asyncio.gather(*callers)
            assert [o[0][0].output_ids for o in outs] == [[1, 2], [2, 3], [3, 4]]
            return reached
        finally:
            eng.shutdown()

    reached = _on_a_loop_thread(scenario)
    assert reached == ([0, 0, 0] if EAGER_TASKS else [1, 1, 1])


def test_a_death_that_cancels_the_task_before_failing_the_call_still_raises_engine_dead(monkeypatch):
    """The engine's death cancels its tasks on the caller's loop, and fails the calls in flight from the
    watchdog's thread: whichever comes first, the caller gets EngineDeadError, not CancelledError."""
    import threading
    import time

    from sgl_rollout.engine import EngineDeadError

    real_fail = RolloutEngine._fail_pending

    def fail_late(self, exc):
        time.sleep(0.2)  # the loop has cancelled the task meanwhile
        real_fail(self, exc)

    monkeypatch.setattr(RolloutEngine, "_fail_pending", fail_late)

    async def scenario():
        eng = _engine_on_the_callers_loop(watch_interval_s=0.05)
        fake = eng._engine
        fake.block = threading.Event()
        try:
            req = asyncio.get_running_loop().create_task(eng.async_generate([[1]], {"max_new_tokens": 1}))
            while not fake.entered.is_set():
                await asyncio.sleep(0.002)
            fake.kill_scheduler()
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(req, 10)
        finally:
            eng.shutdown()
        return "done"

    assert _on_a_loop_thread(scenario) == "done"


def test_on_the_callers_loop_a_generate_s_record_is_a_future_of_that_loop_failed_from_any_thread():
    """A generate on the caller's loop is recorded in a future of that loop (``LoopAnswer``), not a
    thread-safe one: the engine's death fails it from the loop's own thread at once (``fail()`` called by
    the actor) and from another thread through the loop, and its caller gets EngineDeadError either way."""
    import threading

    from sgl_rollout.engine import EngineDeadError
    from sgl_rollout.engine.core import LoopAnswer

    async def scenario():
        loop = asyncio.get_running_loop()
        eng = _engine_on_the_callers_loop()
        fake = eng._engine
        records = []
        submit = eng._submit

        def recording(*args, **kwargs):
            records.append(submit(*args, **kwargs))
            return records[-1]

        eng._submit = recording
        try:
            for kill in ("on the loop", "from a thread"):
                fake.block, fake.entered = threading.Event(), threading.Event()
                req = loop.create_task(eng.async_generate([[1]], {"max_new_tokens": 1}))
                while not fake.entered.is_set():
                    await asyncio.sleep(0.002)
                assert isinstance(records[-1], LoopAnswer)
                if kill == "on the loop":
                    eng.fail("another node of the replica died")
                else:
                    await loop.run_in_executor(None, eng.fail, "another node of the replica died")
                with pytest.raises(EngineDeadError, match="another node"):
                    await asyncio.wait_for(req, 10)
                fake.block.set()
                eng.restart()
                fake = eng._engine
        finally:
            eng.shutdown()
        return "done"

    assert _on_a_loop_thread(scenario) == "done"


def test_on_the_callers_loop_a_death_after_the_caller_gave_up_logs_no_unretrieved_error():
    """A caller that was cancelled leaves its generate's record to the engine; when the engine then dies, or
    SGLang's call fails, the record's error is its own business: asyncio must not log "Future exception was
    never retrieved" for each such request (a future of the loop logs that when dropped unread)."""
    import gc
    import threading

    async def scenario():
        loop = asyncio.get_running_loop()
        logged = []
        loop.set_exception_handler(lambda _loop, context: logged.append(context.get("message")))
        eng = _engine_on_the_callers_loop()
        fake = eng._engine
        fake.block = threading.Event()
        fake.tokenizer_manager.abort_request = lambda rid="", abort_all=False: None  # SGLang has yet to end them
        try:
            reqs = [loop.create_task(eng.async_generate([[i]], {"max_new_tokens": 1})) for i in range(1, 4)]
            while not fake.entered.is_set():
                await asyncio.sleep(0.002)
            for r in reqs:
                r.cancel()
            await asyncio.gather(*reqs, return_exceptions=True)
            await loop.run_in_executor(None, eng.fail, "another node of the replica died")
            for _ in range(5):
                await asyncio.sleep(0.01)
            del reqs
            gc.collect()
            await asyncio.sleep(0.01)
            return [m for m in logged if m and "never retrieved" in m]
        finally:
            fake.block.set()
            eng.shutdown()

    assert _on_a_loop_thread(scenario) == []


def test_on_the_callers_loop_a_blocking_settle_from_another_thread_waits_for_a_release_in_flight():
    """A release, resume or bucket keeps a thread-safe record on the caller's loop too: a blocking
    ``settle()`` from another thread returns only once SGLang has answered the release (a future of the loop
    would have answered "not done" at once, and the state would still be mid-release)."""

    async def scenario():
        loop = asyncio.get_running_loop()
        eng = _engine_on_the_callers_loop()
        eng._engine.answer_delay_s = 0.2
        try:
            release = loop.create_task(eng.async_release(["kv_cache"]))
            await asyncio.sleep(0.05)
            assert eng.state.busy == "release"
            await loop.run_in_executor(None, eng.settle)
            assert eng.state.busy is None and eng.state.released == ("kv_cache",)
            assert await release == ["kv_cache"]
        finally:
            eng.shutdown()
        return "done"

    assert _on_a_loop_thread(scenario) == "done"


def test_request_ids_are_unique_and_drawn_without_the_os_random_source_per_request(monkeypatch):
    """SGLang gets a fresh rid per request (its abort and its state are keyed by it) from a counter under a
    per-process prefix, not from ``uuid.uuid4()``, which reads the OS's random source and lets go of the GIL
    on every request of a Ray actor's loop."""
    import threading
    import uuid

    from sgl_rollout.engine import generate

    def no_uuid4():
        raise AssertionError("uuid4 drawn for a request")

    monkeypatch.setattr(uuid, "uuid4", no_uuid4)
    seen = []
    threads = [threading.Thread(target=lambda: seen.extend(generate.new_rid() for _ in range(2000))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == 8000 and all(r.startswith(generate.RID_PREFIX + "-") for r in seen)
    # SGLang's scheduler aborts every rid that starts with the aborted one: no id may start another
    assert len({len(r) for r in seen}) == 1
    ordered = sorted(seen)
    assert not any(b.startswith(a) for a, b in zip(ordered, ordered[1:]))
    assert len(generate.RID_PREFIX) == 12 and int(generate.RID_PREFIX, 16) >= 0

    eng = RolloutEngine(RolloutConfig(model_path="/fake", enforce_eager=True), engine_factory=FakeAsyncSGLangEngine)
    sent = []
    real = eng._engine.async_generate

    async def spy(input_ids, *args, rid=None, **kwargs):
        sent.append(rid)
        return await real(input_ids, *args, rid=rid, **kwargs)

    eng._engine.async_generate = spy
    try:
        eng.generate([[1, 2]], {"max_new_tokens": 1}, n=2)  # a batch of two: two rids
        eng.generate([[3]], {"max_new_tokens": 1})  # one request: a bare rid
    finally:
        eng.shutdown()
    assert len(sent[0]) == 2 and isinstance(sent[1], str)
    assert len({*sent[0], sent[1]}) == 3 and all(r.startswith(generate.RID_PREFIX) for r in [*sent[0], sent[1]])
