"""verl's partial rollout through :class:`VerlRolloutServer` (issue 39), SGLang being the engine double of
``tests/fakes.py`` with its decode model (one token per step, an abort ends a request with the tokens it
has) and its prefix-cache model; the server's coroutines are awaited directly (no Ray).

* Stress: 1,000 requests in concurrent waves while weight updates come at random points, each as verl's
  ``CheckpointEngineManager`` makes it for a partial rollout: ``abort_all_requests`` -> ``begin_weight_sync``
  / ``update_weights_from_payloads`` / ``finish_weight_sync`` -> ``resume_generation``. An aborted request
  (``stop_reason == "abort"``, its tokens so far) is sent again as verl's partial-rollout agent loop sends
  it: prompt + tokens so far, the remaining budget.
* The cache rule: a complete sync flushes the prefix cache; a failed one refuses generates until a
  complete one.
"""

import asyncio
import random
import time
import types

import pytest

pytest.importorskip("ray")
pytest.importorskip("verl")

from fakes import FakeSGLangEngine  # noqa: E402
from sgl_rollout.memory import MemoryStateError  # noqa: E402


@pytest.fixture
def plain_requests(monkeypatch):
    """SGLang's io_struct needs its serving stack; the double reads only the request objects' fields."""
    import sgl_rollout.engine.io_struct as engine_mod

    monkeypatch.setattr(engine_mod, "make", lambda name, **fields: types.SimpleNamespace(**fields))


def _server():
    from sgl_rollout.integrations.verl_server import VerlRolloutServer

    class Server(VerlRolloutServer):
        engine_factory = FakeSGLangEngine

    return Server({"model_path": "/fake", "enforce_eager": True}, response_length=64)


def _run(scenario):
    """``scenario(server, double)`` on a started server, shut down after."""
    srv = _server()

    async def body():
        await srv.start()
        try:
            await scenario(srv, srv._engine._engine)
        finally:
            await srv.shutdown()

    asyncio.run(body())
    return srv


async def _weight_update(srv, step, buckets=2):
    """verl's partial-rollout weight update: pause and abort, a complete bucketed sync, resume."""
    await srv.abort_all_requests()
    await srv.begin_weight_sync()
    ok = False
    try:
        for _ in range(buckets):
            await srv.update_weights_from_payloads([b"bucket"])
        ok = True
    finally:
        await srv.finish_weight_sync(ok, global_steps=step)
    await srv.resume_generation()


def test_partial_rollout_stress_1000_requests_with_weight_updates(plain_requests):
    rng = random.Random(39)
    n_requests = 1000
    budgets = {f"req{i}": rng.randint(3, 30) for i in range(n_requests)}
    prompts = {rid: [1000 * (i + 1), 1000 * (i + 1) + 1] for i, rid in enumerate(budgets)}
    finished = {}  # rid -> how many times it was answered with a final (not aborted) output
    tokens = {rid: [] for rid in budgets}
    steps_seen = {rid: [] for rid in budgets}
    segments = {rid: 0 for rid in budgets}
    errors = []
    updates = []
    admitted_in_sync = []

    async def scenario(srv, fake):
        fake.decode_step_s = 0.001
        real_generate = fake.async_generate

        async def watched_generate(*args, **kwargs):
            # runs on the engine's loop: what the server let through while a sync was in progress
            if srv._engine.state.busy == "sync":
                admitted_in_sync.append(kwargs.get("rid"))
            return await real_generate(*args, **kwargs)

        fake.async_generate = watched_generate

        async def request(rid):
            try:
                while True:
                    so_far = tokens[rid]
                    out = await srv.generate(prompts[rid] + so_far, {"max_new_tokens": budgets[rid] - len(so_far),
                                                                       "logprobs": True}, request_id=rid)
                    segments[rid] += 1
                    assert len(out.log_probs) == len(out.token_ids)
                    steps_seen[rid].append(out.extra_fields["global_steps"])
                    so_far.extend(out.token_ids)
                    if out.stop_reason != "abort":
                        assert out.stop_reason == "length", out.stop_reason
                        finished[rid] = finished.get(rid, 0) + 1
                        return
            except Exception as exc:  # noqa: BLE001 - reported by the test
                errors.append((rid, repr(exc)))

        done = asyncio.Event()

        async def updater():
            step = 0
            while not done.is_set():
                # at random points; now and then the next one at once, before the requests the resume
                # woke have run (the case _admit must hold again)
                if step == 0 or rng.random() >= 0.2:
                    await asyncio.sleep(rng.uniform(0.002, 0.03))
                step += 1
                t0 = time.perf_counter()
                await _weight_update(srv, step, buckets=rng.randint(1, 3))
                updates.append(time.perf_counter() - t0)

        upd = asyncio.ensure_future(updater())
        rids = list(budgets)
        waves = []
        while rids:
            k = rng.randint(50, 250)
            waves.append(rids[:k])
            rids = rids[k:]
        for wave in waves:
            await asyncio.gather(*(request(rid) for rid in wave))
        done.set()
        await upd
        assert srv._engine.state.in_flight == 0

    t0 = time.perf_counter()
    srv = _run(scenario)
    wall = time.perf_counter() - t0
    fake = srv.engine._engine
    assert errors == []
    assert admitted_in_sync == []
    assert fake.mixed_weight_generates == 0 and not fake.dead
    # every request finished exactly once, none lost, none answered twice
    assert finished == {rid: 1 for rid in budgets}
    for rid, budget in budgets.items():
        start = prompts[rid][-1] + 1
        # the partial outputs join into exactly the tokens one uninterrupted request would have made
        assert tokens[rid] == list(range(start, start + budget)), rid
        steps = [-1 if s is None else s for s in steps_seen[rid]]  # None: no sync yet
        assert steps == sorted(steps)  # each segment on the weights of its time, never older
    aborted = sum(s - 1 for s in segments.values())
    assert len(updates) >= 5 and aborted >= 50, (len(updates), aborted)  # the updates did cut requests
    assert srv.request_counts()["total"] == sum(segments.values())
    print(f"\n{n_requests} requests, {sum(segments.values())} generates ({aborted} aborted and resent), "
          f"{len(updates)} weight updates (longest {max(updates) * 1e3:.0f} ms), {wall:.1f} s")


def test_complete_sync_flushes_the_prefix_cache(plain_requests):
    prompt = [5, 6, 7, 8]

    async def scenario(srv, fake):
        fake.prefix_cache = set()
        await srv.generate(prompt, {"max_new_tokens": 3}, request_id="a")
        await srv.generate(prompt + [99], {"max_new_tokens": 3}, request_id="b")
        assert fake.cached_tokens == [0, 4]  # the second shares the first's prompt: a prefix hit
        await _weight_update(srv, 1)
        assert fake.calls[-1] == ("flush_cache",)  # after the last bucket
        await srv.generate(prompt + [99], {"max_new_tokens": 3}, request_id="c")
        assert fake.cached_tokens[-1] == 0  # nothing computed on the old weights is reused
        await srv.generate(prompt + [98], {"max_new_tokens": 3}, request_id="d")
        assert fake.cached_tokens[-1] == 4  # the cache fills again on the new weights

    fake = _run(scenario).engine._engine
    assert not fake.dead


def test_the_flush_runs_before_the_sync_fence_lifts(plain_requests):
    """No generate can be admitted between the end of a sync and the flush of old-weight prefixes."""
    seen = []

    async def scenario(srv, fake):
        flush = srv.engine.async_flush_cache

        async def recording_flush():
            seen.append(("flush", srv.engine.state.busy))
            await flush()

        srv.engine.async_flush_cache = recording_flush
        await _weight_update(srv, 1)

    _run(scenario)
    assert seen == [("flush", "sync")]


def test_failed_sync_refuses_generates_until_a_complete_one(plain_requests):
    prompt = [5, 6, 7, 8]

    async def scenario(srv, fake):
        fake.prefix_cache = set()
        await srv.generate(prompt, {"max_new_tokens": 2}, request_id="a")
        await srv.abort_all_requests()
        await srv.begin_weight_sync()
        await srv.update_weights_from_payloads([b"half"])
        await srv.finish_weight_sync(ok=False)
        await srv.resume_generation()
        n_generates = sum(c[0] == "generate" for c in fake.calls)
        with pytest.raises(MemoryStateError, match="weight sync"):
            await srv.generate(prompt, {"max_new_tokens": 2}, request_id="b")
        assert sum(c[0] == "generate" for c in fake.calls) == n_generates  # nothing reached the engine
        assert srv.global_steps is None
        await _weight_update(srv, 2)
        out = await srv.generate(prompt, {"max_new_tokens": 2}, request_id="c")
        assert out.stop_reason == "length" and out.token_ids == [9, 10]
        assert out.extra_fields["global_steps"] == 2
        assert fake.cached_tokens[-1] == 0  # the complete sync flushed what the first request cached

    fake = _run(scenario).engine._engine
    assert fake.mixed_weight_generates == 0 and not fake.dead


def test_generate_waiting_at_the_pause_is_held_through_back_to_back_updates(plain_requests):
    """A request held by the pause is woken by ``resume_generation``; if the next update's
    ``abort_all_requests`` comes before it runs, it must wait again, not reach the engine inside the sync."""

    async def scenario(srv, fake):
        await srv.abort_all_requests()
        waiting = asyncio.ensure_future(srv.generate([5, 6], {"max_new_tokens": 2}, request_id="w"))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        await srv.resume_generation()
        # the next update at once, before the woken request has run
        await srv.abort_all_requests()
        await srv.begin_weight_sync()
        await asyncio.sleep(0.01)  # the woken request runs now, inside the sync
        await srv.update_weights_from_payloads([b"w"])
        await srv.finish_weight_sync(True, global_steps=1)
        await srv.resume_generation()
        out = await waiting
        assert out.token_ids == [7, 8] and out.extra_fields["global_steps"] == 1

    fake = _run(scenario).engine._engine
    assert fake.mixed_weight_generates == 0 and not fake.dead


# ------------------------------------------------------------------ parked requests never wait forever
# A request parked at a pause waits for resume_generation; when that cannot come, it ends with the reason
# (issue 46: each case hung until the caller gave up).
async def _parked(srv):
    await srv.abort_all_requests()
    waiting = asyncio.ensure_future(srv.generate([5, 6], {"max_new_tokens": 2}, request_id="w"))
    await asyncio.sleep(0.02)
    assert not waiting.done()
    return waiting


async def _ends_within(waiting, seconds):
    t0 = time.monotonic()
    done, _ = await asyncio.wait([waiting], timeout=seconds)
    assert done, f"the parked request was still waiting after {seconds} s"
    return time.monotonic() - t0


def test_a_parked_request_ends_when_the_pauses_sync_fails(plain_requests):
    async def scenario(srv, fake):
        waiting = await _parked(srv)
        await srv.begin_weight_sync()
        await srv.update_weights_from_payloads([b"half"])
        await srv.finish_weight_sync(ok=False)  # verl's manager raises here and never resumes generation
        assert await _ends_within(waiting, 0.2) < 0.2
        with pytest.raises(RuntimeError, match="will not come: the weight sync of this pause failed"):
            waiting.result()
        with pytest.raises(RuntimeError, match="weight sync of this pause failed"):  # and so does a new one
            await srv.generate([5, 6], {"max_new_tokens": 2}, request_id="late")
        await _weight_update(srv, 2)  # the next complete update serves again
        assert (await srv.generate([5, 6], {"max_new_tokens": 2}, request_id="ok")).token_ids == [7, 8]

    assert not _run(scenario).engine._engine.dead


def test_a_parked_request_ends_when_the_engine_dies(plain_requests):
    from sgl_rollout.engine import EngineDeadError

    async def scenario(srv, fake):
        waiting = await _parked(srv)
        fake.kill_scheduler()
        await _ends_within(waiting, 5.0)
        with pytest.raises(EngineDeadError):
            waiting.result()

    _run(scenario)


def test_a_parked_request_ends_when_the_engine_restarts(plain_requests):
    async def scenario(srv, fake):
        waiting = await _parked(srv)
        await srv.restart()
        await _ends_within(waiting, 2.0)
        with pytest.raises(RuntimeError, match="the engine restarted while this request waited"):
            waiting.result()

    _run(scenario)


def test_a_parked_request_ends_when_the_server_shuts_down(plain_requests):
    srv = _server()

    async def body():
        await srv.start()
        waiting = await _parked(srv)
        await srv.shutdown()
        await _ends_within(waiting, 1.0)
        return waiting

    waiting = asyncio.run(body())
    with pytest.raises(RuntimeError, match="will not come: the server shut down"):
        waiting.result()
