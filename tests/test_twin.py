"""One body, two faces (sgl_rollout.twin): the same steps, results and errors blocking and awaited."""

import asyncio

import pytest

from sgl_rollout.twin import Step, run_async, run_sync, twin


class Box:
    def __init__(self):
        self.log = []

    def _work(self, x, fail_at=None):
        """Doubles x in two waits."""
        self.log.append("start")
        try:
            a = yield Step(lambda v: v + 1, self._aplus, (x,))
            if fail_at == "body":
                raise ValueError("body failed")
            b = yield Step.call(self._maybe_fail, a, fail_at == "step")
            return a + b
        finally:
            self.log.append("finally")

    async def _aplus(self, v):
        await asyncio.sleep(0)
        return v + 1

    def _maybe_fail(self, v, fail):
        if fail:
            raise KeyError("step failed")
        return v - 1

    work, async_work = twin(_work, before_sync=lambda self: self.log.append("checked"))


def test_both_faces_give_the_same_result_and_run_the_same_steps():
    box = Box()
    assert box.work(3) == 4 + 3
    assert box.log == ["checked", "start", "finally"]
    box.log.clear()
    assert asyncio.run(box.async_work(3)) == 4 + 3
    assert box.log == ["start", "finally"]  # before_sync is the blocking face's only
    assert box.work.__name__ == "work" and box.async_work.__name__ == "async_work"
    assert "Doubles" in box.work.__doc__ and ":meth:`work`" in box.async_work.__doc__


@pytest.mark.parametrize("where,exc", [("body", ValueError), ("step", KeyError)])
def test_errors_reach_the_caller_through_the_body(where, exc):
    box = Box()
    with pytest.raises(exc):
        box.work(1, fail_at=where)
    assert box.log[-1] == "finally"
    box.log.clear()
    with pytest.raises(exc):
        asyncio.run(box.async_work(1, fail_at=where))
    assert box.log[-1] == "finally"


def test_a_body_may_catch_a_step_error_and_go_on():
    def body():
        try:
            yield Step.call(lambda: 1 / 0)
        except ZeroDivisionError:
            pass
        return (yield Step.call(lambda: "after"))

    assert run_sync(body()) == "after"
    assert asyncio.run(run_async(body())) == "after"


def test_a_cancelled_await_is_thrown_into_the_body():
    seen = []

    def body():
        try:
            yield Step(lambda: None, lambda: asyncio.sleep(10))
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def scenario():
        task = asyncio.ensure_future(run_async(body()))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert seen == ["cancelled"]
