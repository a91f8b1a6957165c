"""One body, two faces: a call written once as a generator, run by a blocking caller or an awaiting one.

A *body* is a generator function. Wherever it has to wait (for SGLang's answer, for a stage of the
switch, for a trainer's hook) it yields a :class:`Step`, which knows how to wait both ways; the value
of the wait is sent back into the body, an error is thrown into it (so its ``try``/``finally`` hold
in both faces). The body's ``return`` is the call's result.

:func:`twin` turns one body into the pair ``(sync_method, async_method)``:

.. code-block:: python

    def _release(self, tags=None):
        tags = self.state.begin_release(tags)
        yield self.waiting(self._start_op("release", tags, released=True))
        return tags

    release, async_release = twin(_release)

This is how the engine's calls (:mod:`sgl_rollout.engine`) and the staged switch
(:mod:`sgl_rollout.switch`) avoid writing each call twice, once blocking and once ``async``.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generator, Optional, Tuple

Body = Generator["Step", Any, Any]


@dataclass(frozen=True)
class Step:
    """One wait of a body, in both faces.

    Attributes:
        sync: called with ``args`` by the blocking face; its return value is sent into the body.
        async_: called with ``args`` by the awaiting face; its result is awaited when awaitable.
        args: the positional arguments of either.
    """

    sync: Callable[..., Any]
    async_: Callable[..., Any]
    args: Tuple[Any, ...] = ()

    @classmethod
    def call(cls, fn: Callable[..., Any], *args: Any) -> "Step":
        """A step that calls ``fn(*args)`` in both faces; the awaiting face awaits a coroutine it
        returns (a hook that may be a plain function or an ``async def``)."""
        return cls(fn, fn, args)

    @classmethod
    def of(cls, pair: Tuple[Callable[..., Any], Callable[..., Any]], *args: Any) -> "Step":
        """A step that calls the blocking or the awaiting member of ``pair`` (``(obj.release,
        obj.async_release)``), as the face running the body is."""
        return cls(pair[0], pair[1], args)


_END = object()


def _advance(body: Body, value: Any, error: Optional[BaseException]) -> Tuple[Any, Any]:
    """Resume ``body`` with a step's value or error: ``(next step, None)``, or ``(_END, its result)``."""
    try:
        return (body.throw(error) if error is not None else body.send(value)), None
    except StopIteration as stop:
        return _END, stop.value


def run_sync(body: Body) -> Any:
    """Run ``body`` to its end, blocking on each step; returns its return value.

    Raises:
        whatever the body raises, including a step's error the body did not catch.
    """
    value, error = None, None
    while True:
        step, result = _advance(body, value, error)
        if step is _END:
            return result
        try:
            value, error = step.sync(*step.args), None
        except BaseException as exc:  # noqa: BLE001 - thrown into the body, which decides
            value, error = None, exc


async def run_async(body: Body) -> Any:
    """Run ``body`` to its end, awaiting each step; returns its return value.

    Raises:
        whatever the body raises, including a step's error (CancelledError too) the body did not catch.
    """
    value, error = None, None
    while True:
        step, result = _advance(body, value, error)
        if step is _END:
            return result
        try:
            value, error = step.async_(*step.args), None
            if inspect.isawaitable(value):
                value = await value
        except BaseException as exc:  # noqa: BLE001 - thrown into the body, which decides
            value, error = None, exc


def twin(body_fn: Callable[..., Body], before_sync: Optional[Callable[[Any], None]] = None,
         async_doc: Optional[str] = None) -> Tuple[Callable[..., Any], Callable[..., Awaitable[Any]]]:
    """The blocking and the awaiting method of one body method.

    Args:
        body_fn: ``(self, *args, **kwargs) -> generator`` yielding :class:`Step`.
        before_sync: ``(self) -> None`` run before the blocking face starts the body (the engine's
            refusal of a blocking call on the thread whose loop must answer it).
        async_doc: the awaiting face's docstring; by default one line pointing at the blocking one.

    Returns:
        ``(sync_method, async_method)``, both named after ``body_fn`` without its leading ``_``
        (the awaiting one with ``async_`` in front), the blocking one carrying ``body_fn``'s docstring.
    """
    name = body_fn.__name__.lstrip("_")

    @functools.wraps(body_fn)
    def sync_method(self, *args, **kwargs):
        if before_sync is not None:
            before_sync(self)
        return run_sync(body_fn(self, *args, **kwargs))

    @functools.wraps(body_fn)
    async def async_method(self, *args, **kwargs):
        return await run_async(body_fn(self, *args, **kwargs))

    sync_method.__name__ = sync_method.__qualname__ = name
    async_method.__name__ = async_method.__qualname__ = "async_" + name
    async_method.__doc__ = async_doc or (
        f":meth:`{name}` from inside an event loop: same arguments, result and errors; a cancelled "
        "caller does not undo what was already sent to SGLang.")
    return sync_method, async_method
