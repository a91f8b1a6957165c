"""A bad call never kills the engine or the trainer.

Each test drives the package with the engine double of ``fakes.py``, which behaves as SGLang 0.5.10
does: release/resume take effect when sent and are answered later, generates outlive cancelled
callers until aborted, and every call that would kill the real scheduler "kills" the double's
scheduler process (``fake.dead``). Each scenario here failed before the engine ran every SGLang call
on its own event loop with state changed only on SGLang's answer.
"""

import asyncio
import os
import signal
import threading
import time

import pytest
import torch

from fakes import FakeSGLangEngine
from sgl_rollout.config import RolloutConfig
from sgl_rollout.engine import EngineClosedError, EngineDeadError, RolloutEngine
from sgl_rollout.memory import MemoryStateError
from sgl_rollout.server import RolloutServer
from sgl_rollout.weight_sync.manifest import SyncValidationError, WeightManifest
from sgl_rollout.worker import RolloutWorker

WEIGHTS = [("model.embed.weight", torch.randn(16, 8)), ("model.layers.0.w.weight", torch.randn(8, 8)),
           ("lm_head.weight", torch.randn(16, 8))]


def make_worker(**cfg):
    config = RolloutConfig(model_path="/fake", **cfg)
    engine = RolloutEngine(config, engine_factory=FakeSGLangEngine, watch_interval_s=0.05)
    worker = RolloutWorker(config, engine=engine)
    worker.manifest = WeightManifest.from_named_tensors(WEIGHTS)
    return worker, engine._engine


def serves(worker):
    return worker.generate([[1, 2, 3]], {"max_new_tokens": 2})[0][0].output_ids == [4, 5]


def interrupt_main_when(sent):
    """Ctrl-C as a user sends it (a real SIGINT, which wakes a blocked wait, unlike
    _thread.interrupt_main), as soon as ``sent()`` says the request reached the engine double."""

    def fire():
        deadline = time.monotonic() + 5
        while not sent() and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=fire, daemon=True)
    t.start()
    return t


def sent(fake, kind):
    n = sum(c[0] == kind for c in fake.calls)
    return lambda: sum(c[0] == kind for c in fake.calls) > n


@pytest.fixture
def worker():
    w, fake = make_worker()
    yield w, fake
    w.shutdown()


# ----------------------------------------------------------------- interrupted release / resume
def test_interrupted_release_then_retry_does_not_release_twice(worker):
    w, fake = worker
    fake.answer_delay_s = 0.3
    t = interrupt_main_when(sent(fake, "release"))
    with pytest.raises(KeyboardInterrupt):
        w.sleep()
        t.join()
    # SGLang did release; the retry waits for its answer and is refused instead of releasing twice
    with pytest.raises(MemoryStateError, match="already released"):
        w.sleep()
    assert set(w.engine.state.released) == {"weights", "kv_cache", "cuda_graph"}
    assert [c for c in fake.calls if c[0] == "release"] == [("release", ("weights", "kv_cache", "cuda_graph"))]
    fake.answer_delay_s = 0.0
    w.update_weights(WEIGHTS)
    assert serves(w) and not fake.dead


def test_interrupted_resume_then_retry_does_not_resume_twice(worker):
    w, fake = worker
    w.sleep()
    fake.answer_delay_s = 0.3
    t = interrupt_main_when(sent(fake, "resume"))
    with pytest.raises(KeyboardInterrupt):
        w.engine.resume(["kv_cache", "cuda_graph"])
        t.join()
    with pytest.raises(MemoryStateError, match="resident"):
        w.engine.resume(["kv_cache", "cuda_graph"])
    assert not fake.dead


def test_async_timeout_on_release_leaves_no_lie_and_no_generate_on_released_memory(worker):
    w, fake = worker
    eng = w.engine
    fake.answer_delay_s = 0.3

    async def scenario():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(eng.async_release(["kv_cache"]), 0.05)
        with pytest.raises(MemoryStateError):  # in progress, then asleep: never reaches the engine
            await eng.async_generate([[1]])
        with pytest.raises(MemoryStateError, match="already released"):
            await eng.async_release(["kv_cache"])
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(eng.async_resume(["kv_cache"]), 0.05)
        with pytest.raises(MemoryStateError, match="resident"):
            await eng.async_resume(["kv_cache"])
        fake.answer_delay_s = 0.0
        return await eng.async_generate([[1, 2]], {"max_new_tokens": 1})

    out = asyncio.run(scenario())
    assert out[0][0].output_ids == [3]
    assert not fake.dead


# ----------------------------------------------------------------- cancelled generates
def test_cancelled_generate_is_aborted_and_counted_until_sglang_ends_it(worker):
    w, fake = worker
    eng = w.engine
    fake.block = threading.Event()

    async def scenario():
        task = asyncio.ensure_future(eng.async_generate([[1], [2]], {"max_new_tokens": 1}))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    aborts = [c for c in fake.calls if c[0] == "abort"]
    assert len(aborts) == 2  # both request ids of the batch
    deadline = time.monotonic() + 2
    while eng.state.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.state.in_flight == 0 and not fake.running  # SGLang ended them; only then uncounted
    w.sleep()
    assert not fake.dead


def test_cancelled_generate_still_running_blocks_release(worker):
    w, fake = worker
    eng = w.engine
    fake.block = threading.Event()
    fake.tokenizer_manager.abort_request = lambda rid="", abort_all=False: None  # an abort not yet processed

    async def scenario():
        task = asyncio.ensure_future(eng.async_generate([[1]], {"max_new_tokens": 1}))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert eng.state.in_flight == 1  # SGLang still runs it
    with pytest.raises(MemoryStateError, match="request"):
        w.sleep()
    fake.block.set()
    deadline = time.monotonic() + 2
    while eng.state.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    w.sleep()
    assert not fake.dead


def test_keyboard_interrupt_in_sync_generate_aborts_it(worker):
    w, fake = worker
    fake.block = threading.Event()
    t = interrupt_main_when(fake.entered.is_set)
    with pytest.raises(KeyboardInterrupt):
        w.generate([[5]], {"max_new_tokens": 1})
        t.join()
    deadline = time.monotonic() + 2
    while w.engine.state.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any(c[0] == "abort" for c in fake.calls)
    w.sleep()
    assert not fake.dead


# ----------------------------------------------------------------- one lock for check-and-act
def test_concurrent_sleeps_and_generates_in_the_async_actor():
    server = RolloutServer(RolloutConfig(model_path="/fake", validate_sync=False).model_dump())
    server.engine_factory = FakeSGLangEngine

    async def scenario():
        await server.start()
        fake = server.engine._engine
        fake.answer_delay_s = 0.1
        sleeps = await asyncio.gather(server.sleep(), server.sleep(), return_exceptions=True)
        fake.answer_delay_s = 0.1
        resumes = await asyncio.gather(server.wake_up(), server.wake_up(), return_exceptions=True)
        rel = asyncio.ensure_future(server.sleep())
        await asyncio.sleep(0.02)
        with pytest.raises(MemoryStateError):  # admitted while a release is in flight: never
            await server.generate_batch([[1]])
        await rel
        return fake, sleeps, resumes

    fake, sleeps, resumes = asyncio.run(scenario())
    assert sum(isinstance(r, MemoryStateError) for r in sleeps) == 1
    assert sum(1 for r in sleeps if isinstance(r, list) and r) == 1
    assert not any(isinstance(r, BaseException) and not isinstance(r, MemoryStateError) for r in resumes)
    assert [c[0] for c in fake.calls].count("release") == 2
    assert not fake.dead
    asyncio.run(server.shutdown())


def test_no_generate_between_two_buckets(worker):
    w, fake = worker
    refused = []

    def try_generate(_payloads):
        t = threading.Thread(target=lambda: refused.append(_refused(lambda: w.generate([[1]]))))
        t.start()
        t.join()

    fake.on_update = try_generate
    w.config.update_weights_bucket_megabytes = 1
    big = [("model.embed.weight", torch.randn(16, 8)), ("model.layers.0.w.weight", torch.randn(8, 8)),
           ("lm_head.weight", torch.randn(16, 8))]
    w.update_weights(iter(big))
    assert refused and all(refused)
    assert fake.mixed_weight_generates == 0
    assert serves(w)


def _refused(fn):
    try:
        fn()
    except MemoryStateError:
        return True
    return False


def test_start_is_idempotent():
    made = []

    class Counting(FakeSGLangEngine):
        def __init__(self, **kw):
            made.append(1)
            super().__init__(**kw)

    server = RolloutServer(RolloutConfig(model_path="/fake").model_dump())
    server.engine_factory = Counting

    async def scenario():
        a = await server.start()
        b = await server.start()
        await server.shutdown()
        return a, b

    a, b = asyncio.run(scenario())
    assert a == b and len(made) == 1


# ----------------------------------------------------------------- closed and dead engines
def test_every_call_after_shutdown_raises_at_once(worker):
    w, fake = worker
    w.shutdown()
    t0 = time.monotonic()
    for call in (lambda: w.generate([[1]]), w.sleep, w.wake_up, lambda: w.update_weights(WEIGHTS),
                 lambda: w.engine.release(), lambda: w.engine.flush_cache()):
        with pytest.raises(EngineClosedError):
            call()
    with pytest.raises(EngineClosedError):
        asyncio.run(w.engine.async_generate([[1]]))
    assert time.monotonic() - t0 < 1.0


def test_scheduler_death_during_generate_raises_and_restart_recovers(worker):
    w, fake = worker
    fake.block = threading.Event()
    threading.Timer(0.1, fake.kill_scheduler).start()
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError):
        w.generate([[1]])  # in flight when the scheduler died: no hang
    assert time.monotonic() - t0 < 5
    for call in (lambda: w.generate([[1]]), w.sleep, lambda: w.update_weights(WEIGHTS)):
        with pytest.raises(EngineDeadError):
            call()
    old = fake
    w.restart()
    assert w.engine._engine is not old and w.engine.alive
    w.update_weights(WEIGHTS)
    assert serves(w)


def test_scheduler_death_during_sync_raises_and_restart_recovers(worker):
    w, fake = worker
    w.sleep()
    fake.on_update = lambda _p: fake.kill_scheduler()
    with pytest.raises(EngineDeadError):
        w.update_weights(WEIGHTS)
    w.restart()
    w.update_weights(WEIGHTS)
    assert serves(w)


def test_call_in_flight_gets_engine_dead_error_when_the_loop_cancels_it_first(worker, monkeypatch):
    # Seen on an H100: the dying engine's loop cancelled the sync call SGLang would never answer, and
    # the caller got the loop's CancelledError instead of EngineDeadError. Let the cancellation
    # reach the call before the engine fails its pending calls, as it did there.
    from sgl_rollout.engine import RolloutEngine

    real_stop = RolloutEngine._stop_machinery

    def stop_cancelling_first(self):
        self._loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(self._loop)])
        time.sleep(0.3)  # the loop runs on: the cancelled call completes before _fail_pending
        real_stop(self)

    monkeypatch.setattr(RolloutEngine, "_stop_machinery", stop_cancelling_first)
    w, fake = worker
    w.sleep()
    fake.on_update = lambda _p: fake.kill_scheduler()
    with pytest.raises(EngineDeadError):
        w.update_weights(WEIGHTS)
    monkeypatch.setattr(RolloutEngine, "_stop_machinery", real_stop)
    w.restart()
    w.update_weights(WEIGHTS)
    assert serves(w)


def test_sigquit_from_a_dying_child_does_not_kill_the_host(worker):
    w, fake = worker
    os.kill(os.getpid(), signal.SIGQUIT)  # what SGLang's scheduler and watchdog send the host
    time.sleep(0.2)
    assert w.engine.alive and serves(w)  # this engine's processes are alive: not marked dead
    fake.kill_scheduler()
    os.kill(os.getpid(), signal.SIGQUIT)
    deadline = time.monotonic() + 3
    while w.engine.alive and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(EngineDeadError):
        w.generate([[1]])


# ----------------------------------------------------------------- sync validation and API edges
def test_bad_tensors_refused_before_any_byte_reaches_the_engine(worker):
    w, fake = worker
    w.sleep()
    bad = [("model.embed.weight", torch.randn(16, 8)), ("model.layers.0.w.weight", torch.randn(4, 8)),
           ("model.layers.9.w.weight", torch.randn(8, 8)), ("lm_head.weight", torch.ones(16, 8, dtype=torch.int32))]
    n = len(fake.calls)
    with pytest.raises(SyncValidationError) as err:
        w.update_weights(bad)
    text = str(err.value)
    assert "model.layers.0.w.weight" in text and "model.layers.9.w.weight" in text and "lm_head.weight" in text
    assert len(err.value.problems) >= 3
    assert fake.calls[n:] == []  # nothing resumed, nothing sent
    w.update_weights(WEIGHTS)
    assert serves(w) and not fake.dead


def test_streamed_bad_bucket_is_never_sent_and_all_problems_listed(worker):
    w, fake = worker
    w.config.update_weights_bucket_megabytes = 1
    big = [(f"t{i}", torch.zeros(256, 1024)) for i in range(3)]  # 1 MiB each: one bucket each
    w.manifest = WeightManifest.from_named_tensors(big)
    stream = iter([big[0], big[2], ("t1", torch.zeros(3, 3)), ("t7", torch.zeros(1))])
    with pytest.raises(SyncValidationError) as err:
        w.update_weights(stream)
    assert "t1" in str(err.value) and "t7" in str(err.value)  # the bad one, and one after it
    sent = [c for c in fake.calls if c[0] == "update_weights"]
    assert len(sent) == 1  # t0's bucket went before anything was wrong; no bucket after the problem did
    with pytest.raises(MemoryStateError, match="sync again"):
        w.generate([[1]])  # the weights are mixed now
    w.update_weights(iter(big))
    assert serves(w) and not fake.dead


def test_missing_names_refused_unless_partial(worker):
    w, fake = worker
    with pytest.raises(SyncValidationError, match="lm_head.weight"):
        w.update_weights(WEIGHTS[:2])
    w.update_weights(WEIGHTS[:2], partial=True)
    assert serves(w)


def test_empty_sync_after_level2_sleep_refused_and_engine_stays_asleep(worker):
    w, fake = worker
    w.sleep()
    consumed = iter(WEIGHTS)
    list(consumed)
    n = len(fake.calls)
    for empty in ([], iter(()), consumed):
        with pytest.raises(SyncValidationError, match="empty"):
            w.update_weights(empty)
    assert fake.calls[n:] == [] and "weights" in w.engine.state.released
    w.update_weights(WEIGHTS)
    assert serves(w)


def test_dict_instead_of_items_gives_the_documented_error(worker):
    w, fake = worker
    with pytest.raises(TypeError, match=r"dict\.items\(\)"):
        w.update_weights(dict(WEIGHTS))
    with pytest.raises(ValueError, match=r"dict\.items\(\)"):
        w.update_weights(iter(dict(WEIGHTS)))
    assert serves(w)


def test_interrupted_sync_recovers(worker):
    w, fake = worker
    w.sleep()
    fake.answer_delay_s = 0.3
    t = interrupt_main_when(sent(fake, "resume"))
    with pytest.raises(KeyboardInterrupt):
        w.update_weights(WEIGHTS)
        t.join()
    fake.answer_delay_s = 0.0
    with pytest.raises(MemoryStateError):
        w.generate([[1]])  # KV cache still released and the weights mixed
    w.update_weights(WEIGHTS)
    assert serves(w) and not fake.dead


# ----------------------------------------------------------------- Ctrl-C between sending a call and recording it
@pytest.fixture
def ctrl_c_after_send(monkeypatch):
    """``arm(method)``: the next call of the engine double's ``method`` (``"resume_memory_occupation"``,
    ``"async_generate"``, ``"update_weights_from_tensor"``) handed to the engine's loop gets a Ctrl-C right
    after ``_submit`` returns, before its caller has recorded it: the window that a user's Ctrl-C (and
    one CI run of test_interrupted_sync_recovers, on a loaded 2-core machine) can hit."""
    original = RolloutEngine._submit
    armed: list = []

    def submit(self, make_coro, on_done=None, **kwargs):
        names = []

        def named():
            coro = make_coro()  # on the engine's loop thread
            names.append(coro.__qualname__)
            return coro

        fut = original(self, named, on_done, **kwargs)
        deadline = time.monotonic() + 5
        while not names and time.monotonic() < deadline:
            time.sleep(0.001)
        if armed and names and names[0].endswith("." + armed[0]):
            armed.clear()
            signal.raise_signal(signal.SIGINT)  # Python runs the SIGINT handler before this returns
        return fut

    monkeypatch.setattr(RolloutEngine, "_submit", submit)
    return lambda method: armed.append(method)


def interrupted_after_send(arm, fake, method, call) -> None:
    """``call()`` with SGLang answering 0.3 s late and a Ctrl-C right after ``method`` is sent; it must
    raise KeyboardInterrupt. Later calls are answered at once."""
    fake.answer_delay_s = 0.3
    arm(method)
    try:
        with pytest.raises(KeyboardInterrupt):
            call()
    finally:
        fake.answer_delay_s = 0.0


def test_ctrl_c_right_after_a_resume_is_sent_does_not_resume_twice(worker, ctrl_c_after_send):
    """Without the hold-off the interrupt cancelled the admitted resume although SGLang runs it: the next
    wake resumed the weights a second time, a KeyError that kills SGLang's scheduler."""
    w, fake = worker
    w.sleep()
    interrupted_after_send(ctrl_c_after_send, fake, "resume_memory_occupation", lambda: w.engine.resume(["weights"]))
    w.update_weights(WEIGHTS)  # waits for the resume in flight instead of sending another
    assert not fake.dead, fake.death_reason
    assert [c for c in fake.calls if c[0] == "resume"] == [("resume", ("weights",)),
                                                           ("resume", ("kv_cache", "cuda_graph"))]
    assert serves(w)


def test_ctrl_c_right_after_a_generate_is_sent_keeps_it_counted_and_aborts_it(worker, ctrl_c_after_send):
    """Without the hold-off the interrupted batch was counted as ended twice and never aborted: a sleep
    then released the memory under a running request (SGLang's idle assertion kills the scheduler)."""
    w, fake = worker
    arm = ctrl_c_after_send
    fake.block = threading.Event()
    arm("async_generate")
    with pytest.raises(KeyboardInterrupt):
        w.generate([[5]], {"max_new_tokens": 1})
    deadline = time.monotonic() + 2
    while w.engine.state.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any(c[0] == "abort" for c in fake.calls)  # the batch was aborted in SGLang
    assert w.engine.state.in_flight == 0 and not fake.running
    w.sleep()
    assert not fake.dead, fake.death_reason


def test_ctrl_c_right_after_a_bucket_is_sent_waits_for_its_load(worker, ctrl_c_after_send):
    """Without the hold-off the interrupted bucket counted as answered while SGLang still loaded it, so the
    sync's fence ended at once: a generate could run on half-loaded weights, and the bucket's buffer
    could be freed while SGLang read it."""
    w, fake = worker
    w.sleep()
    interrupted_after_send(ctrl_c_after_send, fake, "update_weights_from_tensor", lambda: w.update_weights(WEIGHTS))
    assert w.engine.state.busy == "sync"  # the fence holds while SGLang loads the bucket
    with pytest.raises(MemoryStateError):
        w.generate([[1]])
    w.engine.settle()
    assert w.engine.state.busy is None  # and ends once SGLang has answered it
    assert [c[0] for c in fake.calls].count("update_weights") == 1
    w.update_weights(WEIGHTS)
    assert not fake.dead, fake.death_reason
    assert serves(w)


def test_sync_interrupted_right_after_the_weights_resume_leaves_them_marked_undefined(worker, monkeypatch):
    """A caller interrupted between the weights' resume and the first bucket: the weights are back with
    undefined contents (level 2, no CPU backup), so a wake_up() that follows must not serve them."""
    w, fake = worker
    w.sleep()
    resume = w.engine.resume

    def resume_then_ctrl_c(tags=None):
        resume(tags)
        raise KeyboardInterrupt

    monkeypatch.setattr(w.engine, "resume", resume_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        w.update_weights(WEIGHTS)
    monkeypatch.undo()
    assert "weights" not in w.engine.state.released
    w.wake_up()
    with pytest.raises(MemoryStateError, match="did not complete"):
        w.generate([[1]])
    w.update_weights(WEIGHTS)
    assert serves(w) and not fake.dead


def test_sigint_held_off_goes_to_the_handler_that_was_set():
    """The hold-off hands a held SIGINT to whatever handler was set (a trainer's own, say) once the block
    ends, and to none while it runs; an ignored SIGINT stays ignored."""
    from sgl_rollout.engine.core import sigint_deferred as _sigint_deferred

    got = []

    def handler(signum, frame):
        got.append(signum)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        with _sigint_deferred():
            signal.raise_signal(signal.SIGINT)
            assert got == []
        assert got == [signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is handler  # put back
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with _sigint_deferred():
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    with pytest.raises(KeyboardInterrupt):  # Python's default handler, as under pytest
        with _sigint_deferred():
            signal.raise_signal(signal.SIGINT)
            done = True
    assert done


def test_failed_load_reported_and_retry_succeeds(worker):
    w, fake = worker
    fake.fail_next_update = True
    with pytest.raises(RuntimeError, match="injected load failure"):
        w.update_weights(WEIGHTS)
    with pytest.raises(MemoryStateError, match="sync again"):
        w.generate([[1]])
    w.update_weights(WEIGHTS)
    assert serves(w) and not fake.dead


def test_engine_kwargs_that_undo_the_package_are_refused():
    with pytest.raises(ValueError, match="enforce_piecewise_cuda_graph -> piecewise_cuda_graph"):
        RolloutConfig(model_path="/m", engine_kwargs={"enforce_piecewise_cuda_graph": True})
    with pytest.raises(ValueError, match="disable_piecewise_cuda_graph -> piecewise_cuda_graph"):
        RolloutConfig(model_path="/m", engine_kwargs={"disable_piecewise_cuda_graph": False})
    cfg = RolloutConfig(model_path="/m", engine_kwargs={"attention_backend": "triton"})
    for key, value in (("enable_memory_saver", False), ("tp_size", 4), ("enforce_piecewise_cuda_graph", True)):
        cfg.engine_kwargs[key] = value  # mutated after validation
        with pytest.raises(ValueError, match=key):
            cfg.to_server_args()
        del cfg.engine_kwargs[key]
    args = cfg.to_server_args()
    assert args["enable_memory_saver"] is True and args["disable_piecewise_cuda_graph"] is True
