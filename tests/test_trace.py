"""sgl_rollout.trace: the spans the package emits for benchmarks and tracers (timing, fields, nesting,
async, listener failures contained, nothing done while nobody listens)."""

import asyncio
import logging
import time

import pytest

from sgl_rollout import trace


@pytest.fixture
def spans():
    """Every span delivered while the test runs (a listener registered for it alone)."""
    got = []
    trace.add_listener(got.append)
    yield got
    trace.remove_listener(got.append)


@pytest.fixture(autouse=True)
def no_listener_left():
    before = trace._listeners
    yield
    assert trace._listeners == before, "a test left a listener registered"


def test_a_span_has_its_wall_start_duration_and_fields(spans):
    t_before = time.time()
    with trace.span("rollout.call", bucket=3) as s:
        time.sleep(0.05)
        s.set(bytes=1024)
    (got,) = spans
    assert got.name == "rollout.call" and got.error is None and got.parent is None
    assert dict(got.fields) == {"bucket": 3, "bytes": 1024}
    assert 0.05 <= got.dt < 1.0
    assert t_before <= got.t0 <= t_before + 0.05  # wall clock, at the start


def test_an_exception_ends_the_span_with_its_class_name_and_still_propagates(spans):
    with pytest.raises(KeyError):
        with trace.span("server.resume", stage="weights"):
            raise KeyError("x")
    assert [(s.name, s.error, dict(s.fields)) for s in spans] == [("server.resume", "KeyError", {"stage": "weights"})]


def test_nested_spans_end_innermost_first_and_know_their_parent(spans):
    with trace.span("rollout.update_weights"):
        with trace.span("rollout.bucket"):
            time.sleep(0.01)
        with trace.span("rollout.call"):
            pass
    assert [(s.name, s.parent) for s in spans] == [("rollout.bucket", "rollout.update_weights"),
                                                  ("rollout.call", "rollout.update_weights"),
                                                  ("rollout.update_weights", None)]
    outer = spans[-1]
    assert outer.dt >= spans[0].dt and outer.t0 <= spans[0].t0


def test_async_spans_and_concurrent_tasks_keep_their_own_parent(spans):
    async def request(i):
        async with trace.span("server.generate", request=i):
            await asyncio.sleep(0.02)
            with trace.span("engine.step"):
                await asyncio.sleep(0)

    async def main():
        await asyncio.gather(request(0), request(1))

    asyncio.run(main())
    by_name = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    assert sorted(s.fields["request"] for s in by_name["server.generate"]) == [0, 1]
    assert all(s.dt >= 0.02 for s in by_name["server.generate"])  # overlapping: each its own clock
    assert [s.parent for s in by_name["engine.step"]] == ["server.generate", "server.generate"]
    assert all(s.parent is None for s in by_name["server.generate"])


def test_traced_records_sync_and_async_calls_with_named_arguments(spans):
    class Server:
        @trace.traced("server.resume", fields=("stage",))
        async def resume_stage(self, stage, force=False):
            await asyncio.sleep(0.01)
            if stage == "bad":
                raise ValueError(stage)
            return [stage]

        @trace.traced("rollout.bucket")
        def next_payload(self, n=1):
            return b"x" * n

    srv = Server()
    assert asyncio.run(srv.resume_stage("weights")) == ["weights"]
    assert asyncio.run(srv.resume_stage(stage="kv_cache")) == ["kv_cache"]
    with pytest.raises(ValueError):
        asyncio.run(srv.resume_stage("bad"))
    assert srv.next_payload(3) == b"xxx"
    assert [(s.name, dict(s.fields), s.error) for s in spans] == [
        ("server.resume", {"stage": "weights"}, None), ("server.resume", {"stage": "kv_cache"}, None),
        ("server.resume", {"stage": "bad"}, "ValueError"), ("rollout.bucket", {}, None)]
    assert all(s.dt >= 0.01 for s in spans[:3])
    # what Ray and verl inspect is the original method's
    assert asyncio.iscoroutinefunction(Server.resume_stage) and Server.resume_stage.__name__ == "resume_stage"
    assert Server.resume_stage.__qualname__.endswith("Server.resume_stage")
    import inspect

    assert list(inspect.signature(Server.resume_stage).parameters) == ["self", "stage", "force"]


def test_traced_refuses_a_field_the_function_does_not_have_and_generators():
    with pytest.raises(ValueError, match=r"has no parameter\(s\) \['tags'\]"):
        @trace.traced("rollout.resume", fields=("tags",))
        def resume(self, stages):
            pass

    with pytest.raises(TypeError, match="generator"):
        @trace.traced("rollout.bucket")
        def buckets():
            yield 1

    with pytest.raises(TypeError, match="generator"):
        @trace.traced("rollout.bucket")
        async def abuckets():
            yield 1


def test_a_raising_listener_never_breaks_the_call_nor_the_other_listeners(spans, caplog):
    calls = []

    def broken(span):
        calls.append(span.name)
        raise RuntimeError("listener bug")

    @trace.traced("rollout.call")
    def call():
        return 42

    trace.add_listener(broken)
    trace.add_listener(spans.append)  # already registered: still once
    try:
        with caplog.at_level(logging.DEBUG, logger="sgl_rollout.trace"):
            assert call() == 42
            assert call() == 42
            with trace.span("x"):
                pass
    finally:
        trace.remove_listener(broken)
    assert calls == ["rollout.call", "rollout.call", "x"]
    assert [s.name for s in spans] == ["rollout.call", "rollout.call", "x"]  # the good listener got every span
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "listener bug" in (warnings[0].exc_text or str(warnings[0].exc_info))
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 2  # later failures: quieter


def test_without_a_listener_nothing_is_timed_or_recorded(monkeypatch):
    assert not trace.enabled()

    def no_span(*a, **k):
        raise AssertionError("a span was opened (and the clock read) while nobody listens")

    monkeypatch.setattr(trace, "ActiveSpan", no_span)

    @trace.traced("server.resume", fields=("stage",))
    async def resume_stage(stage):
        return stage

    @trace.traced("rollout.bucket")
    def next_payload():
        return b"p"

    assert asyncio.run(resume_stage("weights")) == "weights" and next_payload() == b"p"
    s1, s2 = trace.span("a", x=1), trace.span("b")
    assert s1 is s2  # one shared no-op object: nothing allocated per span
    with s1 as s:
        s.set(y=2)

    async def in_async():
        async with trace.span("c"):
            return 1

    assert asyncio.run(in_async()) == 1


def test_a_listener_removed_gets_nothing_more_and_bad_listeners_are_refused():
    got = []
    trace.add_listener(got.append)
    with trace.span("one"):
        pass
    trace.remove_listener(got.append)
    trace.remove_listener(got.append)  # not registered: a no-op
    with trace.span("two"):
        pass
    assert [s.name for s in got] == ["one"] and not trace.enabled()
    with pytest.raises(TypeError, match="callable"):
        trace.add_listener("not a function")


def test_the_package_emits_its_spans_where_the_probe_expects_them():
    """The methods the benchmark's probe reads are marked with the span names its report knows."""
    from sgl_rollout.integrations.verl_rollout import SglRollout
    from sgl_rollout.integrations.verl_server import VerlRolloutServer
    from sgl_rollout.server import RolloutServer
    from sgl_rollout.weight_sync import fast_path, flattened_bucket

    marked = {
        flattened_bucket.BucketStream.next_payload: "rollout.bucket", fast_path.gather_bucket: "rollout.bucket",
        fast_path.FastPathSender._call: "rollout.call", RolloutServer.sleep: "server.sleep",
        RolloutServer.resume_stage: "server.resume", RolloutServer.begin_weight_sync: "server.begin_weight_sync",
        RolloutServer.update_weights_from_payloads: "server.update_weights_from_payloads",
        RolloutServer.finish_weight_sync: "server.finish_weight_sync",
        SglRollout.resume: "rollout.resume", SglRollout.release: "rollout.release",
        SglRollout.update_weights: "rollout.update_weights", VerlRolloutServer.generate: "server.generate",
    }
    assert [(fn.__qualname__, name) for fn, name in marked.items()
            if getattr(fn, "__sgl_rollout_span__", None) != name] == []
