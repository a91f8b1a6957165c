"""Named spans at the package's phase boundaries, for whoever listens: a stable hook for benchmarks and tracers.

The package marks where its time goes (the staged wake, each weight bucket, each engine call) with
:func:`span` and :func:`traced`; a listener registered with :func:`add_listener` receives one
:class:`Span` per finished span. ``python -m sgl_rollout.bench verl``'s probe
(:mod:`sgl_rollout.bench.verl_probe`) is one such listener: it writes the spans to JSONL instead of
wrapping this package's private names, so a rename inside the package cannot silently break it.

With no listener registered a span costs one check of an empty tuple: :func:`span` returns a shared
no-op context manager and a :func:`traced` function calls straight through, without reading the clock.

Listeners run synchronously in the thread (and event loop) of the code that ran the span, when the
span ends, innermost first. A listener that raises never breaks the package's call: the exception is
logged (WARNING with its traceback the first time per listener, DEBUG after) and dropped; the
listener stays registered and the other listeners still get the span.

Spans the package emits (name: where; fields):

* ``rollout.resume``: ``SglRollout.resume`` (verl's trainer worker); ``tags``, verl's argument.
* ``rollout.release``: ``SglRollout.release``.
* ``rollout.update_weights``: ``SglRollout.update_weights``.
* ``rollout.bucket``: one bucket made ready to send: ``BucketStream.next_payload`` (flattened,
  serialized) or, on the fast path, its pieces written into the persistent buffer.
* ``rollout.call``: one round of the fast path's engine call over the TP ranks (``FastPathSender``).
* ``gather.state_dict``, ``gather.rename``: the layered gather's set-up in verl's trainer worker
  (:mod:`sgl_rollout.integrations.verl_gather`): FSDP2's ``state_dict()``, verl's key renaming.
* ``server.sleep``, ``server.resume`` (``stage``: ``"weights"`` or ``"kv_cache"``),
  ``server.begin_weight_sync``, ``server.update_weights_from_payloads``, ``server.finish_weight_sync``:
  the engine's Ray actor (``RolloutServer``).
* ``server.generate``: one verl request in the engine's Ray actor (``VerlRolloutServer.generate``),
  until it returns.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

__all__ = ["Span", "add_listener", "remove_listener", "enabled", "span", "traced"]


@dataclass(frozen=True)
class Span:
    """One finished span, as listeners receive it.

    Attributes:
        name: the span's name (``"rollout.bucket"``, ...; see the module docstring).
        t0: start, wall-clock seconds (``time.time()``: comparable across the processes of one host).
        dt: duration, seconds (``time.perf_counter()``).
        fields: the keyword fields given to :func:`span` or :meth:`ActiveSpan.set`, or the arguments
            :func:`traced` records; values as the package passed them (not copied, not converted).
        error: class name of the exception that ended the span (``"ValueError"``), None when it ended
            normally. ``asyncio.CancelledError`` and ``KeyboardInterrupt`` count as errors too.
        parent: name of the span this one ran inside (same thread, or same asyncio task), None at the
            top level.
    """

    name: str
    t0: float
    dt: float
    fields: Mapping[str, Any] = field(default_factory=dict)
    error: Optional[str] = None
    parent: Optional[str] = None


Listener = Callable[[Span], None]

#: Registered listeners, replaced (never mutated) under ``_lock``, so a span reads it without locking.
_listeners: Tuple[Listener, ...] = ()
_lock = threading.Lock()
#: ``id(listener)`` of the listeners whose failure was already logged at WARNING.
_warned: set = set()
#: Name of the innermost open span of this thread / asyncio task.
_current: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("sgl_rollout_trace_span", default=None)


def add_listener(fn: Listener) -> None:
    """Call ``fn(span)`` for every span that ends from now on, in this process (registering it again is a no-op).

    Args:
        fn: a callable of one :class:`Span`; what it returns is ignored, what it raises is logged and dropped.

    Raises:
        TypeError: ``fn`` is not callable.
    """
    global _listeners
    if not callable(fn):
        raise TypeError(f"a trace listener must be callable, got {type(fn).__name__}")
    with _lock:
        if fn not in _listeners:
            _listeners = _listeners + (fn,)


def remove_listener(fn: Listener) -> None:
    """Stop calling ``fn`` (a no-op when it is not registered). Spans already open still end quietly
    for it: each span calls the listeners registered when it ends."""
    global _listeners
    with _lock:
        _listeners = tuple(f for f in _listeners if f != fn)
        _warned.discard(id(fn))


def enabled() -> bool:
    """True when at least one listener is registered (spans are then timed and delivered)."""
    return bool(_listeners)


def _deliver(s: Span) -> None:
    for fn in _listeners:
        try:
            fn(s)
        except Exception:  # noqa: BLE001 - a listener must never break the package's call
            if id(fn) not in _warned:
                _warned.add(id(fn))
                logger.warning("trace listener %r raised on span %s; dropped (later failures are logged at DEBUG)",
                               fn, s.name, exc_info=True)
            else:
                logger.debug("trace listener %r raised on span %s; dropped", fn, s.name, exc_info=True)


class ActiveSpan:
    """An open span (what ``with span(...) as s`` gives): :meth:`set` adds fields before it ends.

    Usable as a context manager in sync code (``with``) and in async code (``async with``); the span
    ends, and is delivered, when the block exits, with the exception's class name if one left it.
    """

    __slots__ = ("name", "fields", "_t0", "_c0", "_token", "_parent")

    def __init__(self, name: str, fields: Dict[str, Any]):
        self.name = name
        self.fields = fields
        self._token = None

    def set(self, **fields: Any) -> None:
        """Add or replace fields of this span (e.g. a count known only at the end)."""
        self.fields.update(fields)

    def __enter__(self) -> "ActiveSpan":
        self._parent = _current.get()
        self._token = _current.set(self.name)
        self._t0, self._c0 = time.time(), time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        dt = time.perf_counter() - self._c0
        try:
            _current.reset(self._token)
        except ValueError:  # ended in another context (a generator resumed elsewhere): keep going
            pass
        _deliver(Span(self.name, self._t0, dt, self.fields, exc_type.__name__ if exc_type else None, self._parent))

    async def __aenter__(self) -> "ActiveSpan":
        return self.__enter__()

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self.__exit__(exc_type, exc, tb)


class _NoSpan:
    """The span :func:`span` returns while nobody listens: does nothing, in ``with`` and ``async with``."""

    __slots__ = ()
    name = None

    def set(self, **fields: Any) -> None:
        """Ignored: nobody listens."""

    def __enter__(self) -> "_NoSpan":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        return None

    async def __aenter__(self) -> "_NoSpan":
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        return None


_NO_SPAN = _NoSpan()


def span(name: str, **fields: Any):
    """A span named ``name`` around a block: ``with span("rollout.call"):`` or ``async with span(...) as s:``.

    Args:
        name: the span's name; dotted, ``<component>.<phase>`` (see the module docstring).
        **fields: values handed to the listeners as :attr:`Span.fields` (keep them small: they are
            kept until the span ends).

    Returns:
        an :class:`ActiveSpan` when a listener is registered, else a shared no-op object with the same
        methods (the clock is not read).
    """
    if not _listeners:
        return _NO_SPAN
    return ActiveSpan(name, fields)


def traced(name: str, *, fields: Sequence[str] = ()) -> Callable[[Callable], Callable]:
    """Decorator: every call of the function is a span named ``name``.

    A coroutine function stays one (its span covers the awaited call); a plain function's span covers
    the call. ``functools.wraps`` keeps the name, qualified name, docstring and signature, so Ray and
    verl see the original method. With no listener registered the wrapper calls straight through.

    Args:
        name: the span's name.
        fields: names of the function's parameters whose values (defaults applied) become the span's
            fields, e.g. ``fields=("stage",)``.

    Raises:
        ValueError: a name in ``fields`` is not a parameter of the function (raised at decoration,
            i.e. at import, so a renamed argument cannot silently drop a field).
        TypeError: the function is a generator or an async generator (a call's span would end before
            any item is made).
    """
    fields = tuple(fields)

    def decorate(fn: Callable) -> Callable:
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(f"traced({name!r}) cannot time the generator function {fn.__qualname__}")
        sig = inspect.signature(fn) if fields else None
        if sig is not None:
            unknown = [f for f in fields if f not in sig.parameters]
            if unknown:
                raise ValueError(f"traced({name!r}): {fn.__qualname__} has no parameter(s) {unknown}")

        def values(args, kwargs) -> Dict[str, Any]:
            if sig is None:
                return {}
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:  # the call itself will raise it
                return {}
            bound.apply_defaults()
            return {f: bound.arguments.get(f) for f in fields}

        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def wrapper(*args, **kwargs):
                if not _listeners:
                    return await fn(*args, **kwargs)
                with ActiveSpan(name, values(args, kwargs)):
                    return await fn(*args, **kwargs)
        else:
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                if not _listeners:
                    return fn(*args, **kwargs)
                with ActiveSpan(name, values(args, kwargs)):
                    return fn(*args, **kwargs)
        wrapper.__sgl_rollout_span__ = name
        return wrapper

    return decorate
