"""The engine's core: SGLang started in a guarded environment, one event loop for its calls, death and restart.

:class:`EngineCore` starts ``sglang.Engine`` in the environment :mod:`.lifecycle` prepares, runs SGLang's
tokenizer-manager coroutines on one event loop (its own thread's, or the caller's: a Ray async actor's),
and turns a dead engine process, or an error that escapes SGLang on that loop, into
:class:`~.lifecycle.EngineDeadError` for every call in flight and after (until :meth:`EngineCore.restart`).
The calls themselves live beside it, one part each (:mod:`.generate`, :mod:`.memory_calls`,
:mod:`.weight_calls`, :mod:`.lora_calls`), each written once and run blocking or awaited
(:mod:`sgl_rollout.twin`).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import logging
import signal
import sys
import threading
import time
from typing import Any, Callable, ContextManager, Iterator, List, Optional

from ..config import RolloutConfig
from ..memory import ALL_TAGS, CUDA_GRAPH, MemoryState
from ..twin import Step, twin
from .lifecycle import EngineClosedError, EngineDeadError, EngineProcesses, engine_env_updates, on_sigquit
from .sglang_version import UnsupportedSGLangVersion, check_sglang_version, installed_sglang

logger = logging.getLogger(__name__)


def engine_tags(config: RolloutConfig) -> tuple:
    """The tags an engine built from ``config`` has: ``cuda_graph`` only when CUDA graphs are on."""
    return tuple(t for t in ALL_TAGS if t != CUDA_GRAPH or not config.enforce_eager)


def check_model_for_sglang(config: RolloutConfig) -> None:
    """Refuse, before SGLang starts, a model whose scheduler would die under the installed SGLang and
    transformers: a Qwen2.5-VL on its first image (``patches/qwen2_5_vl_vision_rope.py``, :func:`refusal`), a
    Qwen3-MoE whose head size SGLang's fused rotary kernel does not take on its first request
    (:func:`fused_kv_rope_problem`).

    Raises:
        UnsupportedSGLangVersion: one line naming the versions and what to install, or the head size and the
            settings that serve it.
    """
    from ..patches import qwen2_5_vl_vision_rope

    why = qwen2_5_vl_vision_rope.refusal(config.model_path, installed_sglang()) or fused_kv_rope_problem(config)
    if why:
        raise UnsupportedSGLangVersion(why)


#: Head sizes SGLang's CUDA rotary kernel takes; any other size runs a fallback kernel that cannot also write
#: the KV cache (``RotaryEmbedding.__init__`` and ``forward_cuda``, ``sglang/srt/layers/rotary_embedding/base.py``,
#: 0.5.10.post1 and 0.5.12).
FUSED_ROPE_HEAD_SIZES = (64, 128, 256, 512)
#: Model types whose attention asks the rotary kernel to write a bf16 KV cache (``enable_fused_set_kv_buffer``,
#: ``sglang/srt/models/utils.py``) without checking that kernel first (``Qwen3MoeAttention``,
#: ``sglang/srt/models/qwen3_moe.py``): with another head size the first request fails an assertion inside
#: the scheduler ("save kv cache is not supported for fallback_rotary_embedding"), which then dies (seen on
#: an H200 with SGLang 0.5.12 and head_dim 32, 2026-11-28).
FUSED_KV_ROPE_MODEL_TYPES = ("qwen3_moe",)


def fused_kv_rope_problem(config: RolloutConfig) -> Optional[str]:
    """Why an engine for ``config`` would die on its first request, in one line, or None: a model type of
    :data:`FUSED_KV_ROPE_MODEL_TYPES` whose head size is outside :data:`FUSED_ROPE_HEAD_SIZES`, served with a
    bf16 KV cache (``kv_cache_dtype`` ``auto`` with a bf16 model, or ``bfloat16``). ``config.json`` is read as
    JSON from ``config.model_path`` (none there: None)."""
    from ..config import config_json_of_model_path

    cfg = config_json_of_model_path(config.model_path)
    if cfg is None or cfg.get("model_type") not in FUSED_KV_ROPE_MODEL_TYPES:
        return None
    heads = cfg.get("num_attention_heads") or 1
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", 0) // heads
    dtype = str(config.dtype if config.dtype != "auto" else cfg.get("dtype") or cfg.get("torch_dtype") or "")
    kv = str(config.engine_kwargs.get("kv_cache_dtype") or "auto")
    bf16_kv = (kv == "auto" and dtype in ("bfloat16", "bf16")) or kv in ("bfloat16", "bf16")
    if head_dim in FUSED_ROPE_HEAD_SIZES or not bf16_kv:
        return None
    return (f"SGLang's {cfg['model_type']} attention dies on its first request with head_dim {head_dim} and a bf16 KV "
            f"cache (its fused rotary kernel takes head sizes {', '.join(map(str, FUSED_ROPE_HEAD_SIZES))}); "
            "serve it with dtype='float32' or kv_cache_dtype='fp8_e4m3', or use one of those head sizes")


def check_tp_for_sglang(config: RolloutConfig) -> None:
    """Refuse, before SGLang spawns anything, a TP size the model's heads do not split over or that needs
    more GPUs than this process sees (:func:`~sgl_rollout.config.tp_layout_problem`).

    Raises:
        TPLayoutError: as :func:`~sgl_rollout.config.check_tp_layout`.
    """
    from ..config import check_tp_layout, heads_of_model_path

    args = config.engine_kwargs
    tp = config.tensor_model_parallel_size
    attn_tp = tp // int(args.get("dp_size", 1) or 1) if args.get("enable_dp_attention") else tp
    check_tp_layout(attn_tp, heads_of_model_path(config.model_path))
    try:
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else None
    except ImportError:
        visible = None
    if visible:
        # a replica over N nodes needs tp / N GPUs here (its other ranks run on the other nodes)
        nnodes = max(1, int(args.get("nnodes", 1) or 1))
        base, step = int(args.get("base_gpu_id", 0) or 0), int(args.get("gpu_id_step", 1) or 1)
        check_tp_layout(tp // nnodes, gpus=max(0, (visible - base + step - 1) // step),
                        key="tensor_model_parallel_size" + (f" / nnodes={nnodes}" if nnodes > 1 else ""))


def sigint_deferred() -> ContextManager[None]:
    """Hold off Ctrl-C while a call is sent to SGLang and recorded here; raise it when the block ends.

    Python raises KeyboardInterrupt in the main thread between any two bytecodes. Landing after a
    release, resume, bucket load or generate has been handed to the engine's loop but before the engine
    recorded it, it would leave SGLang running a call the engine believes was never sent: a resume sent
    again is a ``KeyError`` that kills the scheduler, a generate counted as ended lets a release trip the
    scheduler's idle assertion, a load counted as answered lets its buffer go while SGLang reads it.
    Inside this block SIGINT is only noted; on leaving it the previous handler runs (Python's default
    raises KeyboardInterrupt), after the call is sent and recorded, so the caller is interrupted as
    before and the next call waits for SGLang's answer.

    Does nothing outside the main thread (Python delivers signals there only; a Ray actor's loop runs
    outside it) or where SIGINT's handler was not set from Python (it could not be put back); it then
    returns one shared ``contextlib.nullcontext``, which costs a request about 1 us less than entering and
    leaving a generator's context manager.
    """
    if threading.get_ident() != threading.main_thread().ident or signal.getsignal(signal.SIGINT) is None:
        return _NOTHING_HELD
    return _sigint_held()


#: :func:`sigint_deferred` outside the main thread: a context manager that does nothing.
_NOTHING_HELD = contextlib.nullcontext()


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """:func:`sigint_deferred` in the main thread."""
    caught: List[Any] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda _signum, frame: caught.append(frame))
    except ValueError:  # a subinterpreter's main thread: no handlers to set
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(signal.SIGINT, caught[0])
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)


#: Whether this Python runs a new task's first step at once (``asyncio.Task(..., eager_start=True)``, 3.12+).
EAGER_TASKS = sys.version_info >= (3, 12)


def start_task(loop: asyncio.AbstractEventLoop, coro) -> asyncio.Task:
    """A task of ``loop`` (the running one) for ``coro``, whose first step runs now where Python can (3.12+).

    An SGLang call on the caller's loop then reaches SGLang's tokenizer manager (which tokenizes the request
    and sends it to the scheduler before its first wait, ``TokenizerManager.generate_request``, 0.5.12) in
    the caller's own turn, as it does in verl's ``SGLangHttpServer``, which awaits that coroutine directly.
    A scheduled first step runs only after every callback the loop already holds; in a Ray actor taking a
    burst of calls those are the deliveries of the other calls, so each request reached SGLang only after
    the whole burst had been delivered. Through Ray on Python 3.12 with uvloop (2-core CPU, ``python -m
    sgl_rollout.bench requests --engine ray``, three runs each way, medians;
    ``examples/bench/requests_ray_py312_eager_s17.json``) the k-th of 256 requests came 16.1 ms after the same
    actor's with the plain actor's ``generate`` when the first step was scheduled, 8.1 ms when it ran at once.
    On Python 3.11 (no eager tasks) the first step is scheduled (``loop.create_task``).
    """
    if EAGER_TASKS:
        return asyncio.Task(coro, loop=loop, eager_start=True)
    return loop.create_task(coro)


class _Call:
    """One call into SGLang, as :meth:`EngineCore._submit` runs it: the coroutine on the engine's loop
    (:meth:`run`), and what happens when it ends (:meth:`finish`: ``on_done``, then ``outer`` (a
    ``concurrent.futures.Future``, or a :class:`LoopAnswer` for a generate on the caller's loop), then, on the
    caller's own loop, ``outer.waiter``: the future :meth:`EngineCore._await` awaits there instead of
    shielding the task; only the caller that submitted the call awaits it, any other through a shielded
    wrapper of ``outer``, :meth:`EngineCore._await` with ``shared``). One object per call rather than closures and a
    shield: a generate holds it while SGLang serves the request, and a replica has hundreds in flight, each more
    work for Python's garbage collector. Each generate in flight on the caller's loop held 75 tracked objects before,
    48 after that, and 38 since its record became a :class:`LoopAnswer` (SGLang's own call: 10; ``python -m
    sgl_rollout.bench requests``, CPU double); against a real engine (one H200, 256 concurrent requests) the way in's lag behind SGLang's own fell from 24 to 13 ms a round
    and the garbage collector's extra time from 5.4 to 3.0 and 3.2 ms in two runs
    (``examples/bench/requests_h200_s15.json``)."""

    __slots__ = ("core", "make_coro", "on_done", "outer", "generation")

    def __init__(self, core: "EngineCore", make_coro: Callable[[], Any],
                 on_done: Optional[Callable[[Optional[BaseException]], None]], outer: Optional["LoopAnswer"] = None):
        self.core, self.make_coro, self.on_done = core, make_coro, on_done
        self.outer = concurrent.futures.Future() if outer is None else outer
        self.generation = core._generation

    async def run(self) -> Any:
        try:
            return await self.make_coro()
        except (SystemExit, KeyboardInterrupt) as exc:
            # on the loop's thread this would end the loop (and every caller would wait forever);
            # what SGLang did is unknown, so the engine is dead
            self.core._mark_dead(f"{exc!r} escaped an SGLang call", self.generation)
            raise EngineDeadError(f"the SGLang engine died ({exc!r} escaped an SGLang call); "
                                  "call restart()") from exc

    def finish(self, f: concurrent.futures.Future) -> None:
        core, outer = self.core, self.outer
        with core._pending_lock:
            core._inner.discard(f)
        exc = f.exception() if not f.cancelled() else concurrent.futures.CancelledError()
        if self.on_done is not None:
            self.on_done(exc)
        if isinstance(exc, (concurrent.futures.CancelledError, asyncio.CancelledError)) and (
            core._dead is not None or core._closed
        ):
            # the dead/closed engine's loop dropped the call: _fail_pending gives its error, maybe from
            # another thread, and the caller's waiter wakes once it has
            if hasattr(outer, "waiter"):
                outer.add_done_callback(self._wake_from_any_thread)
            return
        with core._pending_lock:
            core._pending.discard(outer)
        if exc is None:
            with contextlib.suppress(concurrent.futures.InvalidStateError, asyncio.InvalidStateError):
                outer.set_result(f.result())
        else:
            _set_error(outer, exc)
        if hasattr(outer, "waiter"):  # finish runs on that loop: the inner future is its task
            self._wake(outer)

    @staticmethod
    def _wake(outer: concurrent.futures.Future) -> None:
        """Wake the caller awaiting ``outer.waiter`` (on its loop's thread); a caller that stopped waiting
        cancelled it."""
        if not outer.waiter.done():
            outer.waiter.set_result(None)

    def _wake_from_any_thread(self, outer: concurrent.futures.Future) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is awaiting there any more
            outer.waiter.get_loop().call_soon_threadsafe(self._wake, outer)


class LoopAnswer(asyncio.Future):
    """The record of a call that only its own caller waits for, made on the engine's borrowed loop (a generate
    in verl's server actor): a future of that loop (``asyncio.Future``, C-implemented), resolved on it by
    :meth:`_Call.finish`, in place of the ``concurrent.futures.Future`` of every other call, whose lock and
    condition a blocking or another thread's waiter needs and a request on its caller's loop does not.
    ``waiter`` is the future that caller awaits (:meth:`EngineCore._await`). From another thread it is failed
    only through its loop (:meth:`EngineCore._fail_pending`).

    Cost: with this record and the same commit's smaller trims (:func:`sigint_deferred`'s shared no-op, the
    server's common path), this package's server actor spent 61 us of its loop's CPU per request more than the
    same actor with a plain ``generate``, against 88 us before (``python -m sgl_rollout.bench requests --engine
    ray``, 2-core CPU, Python 3.11, three alternated runs each; ``examples/bench/requests_ray_cpu_s18.json``),
    and a request in flight holds 38 objects for the garbage collector instead of 48.
    """

    __slots__ = ("waiter",)


def _set_error(fut, exc: BaseException) -> None:
    """Fail a call's record (either kind) with ``exc`` unless it is resolved already, and read the error back:
    asyncio logs "exception was never retrieved" for a :class:`LoopAnswer` whose caller gave up. A
    :class:`LoopAnswer` only on its own loop's thread (:meth:`EngineCore._fail_pending`)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError, asyncio.InvalidStateError):
        if not fut.done():
            fut.set_exception(exc)
            fut.exception()


def _running_loop() -> Optional[asyncio.AbstractEventLoop]:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class EngineCore:
    """SGLang's engine, started and watched; the loop its calls run on; death, restart and shutdown.

    Every call to SGLang runs as a coroutine of its tokenizer manager on one event loop: by default in a
    thread of this object (``sgl-rollout-engine``), where the blocking methods wait for it and the
    ``async_`` ones await it from any other loop; or, with ``loop``, on the caller's own loop (a Ray
    async actor's, as verl's ``SGLangHttpServer`` runs SGLang), where the ``async_`` methods are awaited
    on that loop and no request crosses a thread.

    A dead scheduler (an exception in it, ``kill -9``, an OOM kill) does not take the host process down:
    SGLang's SIGQUIT handler is replaced by :func:`~.lifecycle.on_sigquit`, a watchdog thread watches the
    engine's processes, and every call (also those in flight) raises :class:`EngineDeadError` until
    :meth:`restart`. So does a ``SystemExit`` or ``KeyboardInterrupt`` that escapes an SGLang coroutine
    on the engine's loop: SGLang's state is then unknown, and the loop's thread would otherwise end with
    its callers waiting forever.

    The parts of :class:`~sgl_rollout.engine.RolloutEngine` reset their own state in ``_on_start``
    (called by every start and restart).
    """

    def __init__(
        self,
        config: RolloutConfig,
        engine_factory: Optional[Callable[..., Any]] = None,
        disable_tp_imbalance_check: bool = True,
        watch_interval_s: float = 0.2,
        loop: Optional[asyncio.AbstractEventLoop] = None,
    ):
        self.config = config
        self._home_loop = loop
        self._inner: set = set()
        self._factory = engine_factory
        self._disable_tp_imbalance_check = disable_tp_imbalance_check
        self._watch_interval_s = watch_interval_s
        self._closed = False
        self._dead: Optional[str] = None
        self._pending: set = set()
        self._pending_lock = threading.Lock()
        self._last_op: Optional[concurrent.futures.Future] = None
        self._lifecycle_lock = threading.RLock()
        self._generation = 0
        atexit.register(self.shutdown)
        try:
            self._start()
        except BaseException:  # nothing to shut down: at exit, shutdown() would find no machinery
            self._closed = True
            atexit.unregister(self.shutdown)
            raise

    # ----------------------------------------------------------------- life cycle
    def _on_start(self) -> None:
        """Reset the state of the engine's parts for a fresh start (each part extends it)."""

    def _start(self) -> None:
        factory = self._factory
        if factory is None:
            check_sglang_version()
            check_tp_for_sglang(self.config)
            check_model_for_sglang(self.config)
            from sglang.srt.entrypoints.engine import Engine as factory  # noqa: N813

        self._generation += 1
        self.state = MemoryState(engine_tags(self.config))
        self._last_op = None
        self._on_start()
        server_args = self.config.to_server_args()
        if threading.current_thread() is threading.main_thread():
            # SGLang installs this in place of its own launch-phase handler, which kills the host.
            server_args["custom_sigquit_handler"] = on_sigquit
        generation = self._generation
        try:
            self._procs = EngineProcesses(
                factory, server_args, engine_env_updates(disable_tp_imbalance_check=self._disable_tp_imbalance_check,
                                                         mm_embedding_cache=self.config.fast_sync),
                on_death=lambda reason: self._mark_dead(reason, generation), watch_interval_s=self._watch_interval_s)
        except BaseException as exc:
            if self._generation > 1:  # a failed restart: calls keep raising EngineDeadError
                self._dead = f"restart failed: {exc!r}"
            raise
        self._engine = self._procs.engine
        self._dead = None
        if self._home_loop is not None:
            self._loop, self._loop_thread = self._home_loop, None
        else:
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=self._run_own_loop, args=(self._loop, generation),
                                                 name="sgl-rollout-engine", daemon=True)
            self._loop_thread.start()
        logger.info("SGLang engine up: tp=%d, child processes %s", self.config.tensor_model_parallel_size, self._child_pids)

    def _run_own_loop(self, loop: asyncio.AbstractEventLoop, generation: int) -> None:
        """The engine thread's body: if its loop ever ends by an error, the engine is dead (no call on it
        would be answered)."""
        try:
            loop.run_forever()
        except BaseException as exc:  # noqa: BLE001 - recorded as the engine's death
            self._mark_dead(f"the engine's event loop ended: {exc!r}", generation)

    @property
    def _child_pids(self) -> List[int]:
        """Pids of the engine's own child processes (its scheduler(s), detokenizer), sorted."""
        return self._procs.child_pids

    def _mark_dead(self, reason: str, generation: Optional[int] = None) -> None:
        """Record the engine's death, end what is left of its processes, then fail every call in flight.

        ``generation``: the engine start the caller saw; a late report about an engine that was
        already restarted is ignored. The processes are ended before the calls fail, and under the
        life-cycle lock, so a :meth:`restart` prompted by the error starts on freed GPUs and cannot
        have its own processes taken for the dead engine's.
        """
        with self._lifecycle_lock:
            if generation is not None and generation != self._generation:
                return
            if self._closed or self._dead is not None:
                return
            self._dead = reason
            logger.error("SGLang engine died: %s; calls raise EngineDeadError until restart()", reason)
            self._stop_machinery()
        self._fail_pending(EngineDeadError(f"the SGLang engine died ({reason}); call restart()"))

    def _fail_pending(self, exc: BaseException) -> None:
        """Fail every call in flight with ``exc``, from any thread (a :class:`LoopAnswer` on its own loop)."""
        with self._pending_lock:
            pending, self._pending = list(self._pending), set()
        for fut in pending:
            loop = fut.get_loop() if isinstance(fut, LoopAnswer) else None
            if loop is None or _running_loop() is loop:
                _set_error(fut, exc)
            else:
                with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits there any more
                    loop.call_soon_threadsafe(_set_error, fut, exc)

    def _stop_machinery(self) -> None:
        def stop_loop() -> None:  # calls that will never be answered are dropped quietly
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            self._loop.call_soon(self._loop.stop)

        def stop_ours() -> None:  # a borrowed loop: only this engine's calls and SGLang's own tasks
            for fut in doomed:
                fut.cancel()
            for task in list(getattr(tm, "asyncio_tasks", ())):
                task.cancel()

        # taken now: a restart's new engine takes calls on the same loop before stop_ours runs
        with self._pending_lock:
            doomed = list(self._inner)
        tm = getattr(self._engine, "tokenizer_manager", None)
        with contextlib.suppress(RuntimeError):  # a borrowed loop that is already closed
            self._loop.call_soon_threadsafe(stop_loop if self._home_loop is None else stop_ours)
        self._procs.stop()

    def fail(self, reason: str) -> None:
        """Declare the engine dead from outside: another node of its replica died, so SGLang's next
        collective would hang. Its processes are ended and every call in flight and after raises
        :class:`EngineDeadError` (naming ``reason``) until :meth:`restart`. No-op when already dead or
        shut down."""
        self._mark_dead(reason, self._generation)

    def check_alive(self) -> None:
        """Raise at once if the engine cannot take calls.

        Raises:
            EngineClosedError: after :meth:`shutdown`.
            EngineDeadError: after the engine died, until :meth:`restart`.
        """
        if self._closed:
            raise EngineClosedError("the engine was shut down")
        if self._dead is not None:
            raise EngineDeadError(f"the SGLang engine died ({self._dead}); call restart()")

    @property
    def tags(self) -> tuple:
        """Tags of this engine's memory regions."""
        return self.state.tags

    @property
    def alive(self) -> bool:
        """True while the engine is neither shut down nor dead."""
        return not self._closed and self._dead is None

    @property
    def generation(self) -> int:
        """1 for the first engine start, +1 for each :meth:`restart` (a restart loads the weights anew
        as ``config.load_format`` says and drops every adapter)."""
        return self._generation

    def restart(self) -> None:
        """Start a fresh engine with the same config after a death (or to recover from anything).

        What is left of the old engine's processes is killed first. The new engine loads weights as
        ``config.load_format`` says (random for ``"dummy"``): sync the trainer's weights before
        generating. All tags are resident afterwards.

        Raises:
            EngineClosedError: the engine was shut down.
            RuntimeError: SGLang fails to start.
        """
        if self._closed:
            raise EngineClosedError("the engine was shut down; make a new RolloutEngine")
        with self._lifecycle_lock:  # waits until a death being handled has ended the old processes
            if self._dead is None:
                self._dead = "restarting"
                self._stop_machinery()
                self._fail_pending(EngineDeadError("the engine is restarting"))
            t0 = time.perf_counter()
            self._start()
        logger.info("SGLang engine restarted in %.1f s", time.perf_counter() - t0)

    # ----------------------------------------------------------------- calls into SGLang
    def _submit(self, make_coro: Callable[[], Any], on_done: Optional[Callable[[Optional[BaseException]], None]] = None,
                private: bool = False) -> concurrent.futures.Future:
        """Run ``make_coro()`` on the engine's loop; the returned future fails with EngineDeadError on death.

        ``on_done(exc)`` runs when SGLang has answered (``exc`` None on success), before the returned
        future resolves, whatever became of the caller. ``private``: only the caller waits for the answer
        (never a settle, never a blocking waiter): on the caller's own loop the record is then a
        :class:`LoopAnswer`, not a ``concurrent.futures.Future``.
        """
        self.check_alive()
        home = self._on_home_loop()
        call = _Call(self, make_coro, on_done, LoopAnswer(loop=self._loop) if home and private else None)
        with self._pending_lock:
            self._pending.add(call.outer)
        if home:  # the caller's own loop: a task of it, whose end wakes call.outer.waiter
            call.outer.waiter = self._loop.create_future()
            inner = start_task(self._loop, call.run())
        else:
            inner = asyncio.run_coroutine_threadsafe(call.run(), self._loop)
        with self._pending_lock:
            self._inner.add(inner)
        inner.add_done_callback(call.finish)
        return call.outer

    def _on_home_loop(self) -> bool:
        """True when called from inside the borrowed loop SGLang runs on (``RolloutEngine(loop=...)``)."""
        return self._home_loop is not None and _running_loop() is self._loop

    def _check_not_on_loop(self) -> None:
        """Refuse a blocking call on the thread of a borrowed loop: SGLang's answer needs that loop.

        Raises:
            RuntimeError: called from inside the borrowed loop.
        """
        if self._on_home_loop():
            raise RuntimeError("this engine runs SGLang on this thread's event loop: use the async_ "
                               "methods here (a synchronous call would wait for itself)")

    @staticmethod
    def _wait(fut: concurrent.futures.Future, on_interrupt: Optional[Callable[[], None]] = None):
        try:
            return fut.result()
        except BaseException:
            if not fut.done() and on_interrupt is not None:
                on_interrupt()
            raise

    @staticmethod
    async def _await(fut: concurrent.futures.Future, on_cancel: Optional[Callable[[], None]] = None,
                     shared: bool = False):
        # shared: a caller that did not submit ``fut`` (_settle waiting for another caller's release, resume
        # or bucket) never awaits that caller's own waiter, whose cancellation by either caller would reach
        # the other as a CancelledError
        waiter = None if shared else getattr(fut, "waiter", None)
        try:  # shielded: a cancelled caller must not cancel the record of SGLang's answer
            if waiter is None:
                return await asyncio.shield(asyncio.wrap_future(fut))
            # a task of this very loop (_submit): no hop through thread-safe futures and no shield. The
            # task's end (_Call.finish) resolves ``fut``, then the waiter; a cancelled caller cancels only
            # the waiter, and SGLang's call runs on.
            await waiter
            return fut.result()
        except BaseException:
            if not fut.done() and on_cancel is not None:
                on_cancel()
            raise

    def waiting(self, fut: concurrent.futures.Future, on_interrupt: Optional[Callable[[], None]] = None,
                shared: bool = False) -> Step:
        """The step of a call body that waits for ``fut`` (SGLang's answer): blocking, or awaited and
        shielded; ``on_interrupt`` runs when the caller stops waiting before the answer. ``shared``: the
        body did not submit ``fut`` (another caller may be awaiting it too)."""
        return Step(self._wait, functools.partial(self._await, shared=True) if shared else self._await,
                    (fut, on_interrupt))

    def _settle(self):
        """Wait until the last release/resume/sync bucket has been answered by SGLang (it may have been
        sent by a caller that was interrupted), so that :attr:`state` is what the engine holds.

        Raises:
            EngineClosedError, EngineDeadError: as :meth:`check_alive`.
        """
        last = self._last_op
        if last is not None and not last.done():
            try:
                yield self.waiting(last, shared=True)
            except Exception:  # noqa: BLE001 - its own caller got the error; the state says the rest
                pass
        self.check_alive()

    settle, async_settle = twin(_settle, before_sync=_check_not_on_loop)

    def _tm(self):
        return self._engine.tokenizer_manager

    def server_info(self) -> dict:
        """SGLang's server args plus scheduler info such as ``max_total_num_tokens`` (KV-cache capacity
        in tokens), as ``Engine.get_server_info()`` gives them.

        Raises:
            EngineDeadError, EngineClosedError: as :meth:`check_alive`.
        """
        self.check_alive()
        info = dict(getattr(self._engine, "_scheduler_init_result").scheduler_infos[0])
        info.update({k: v for k, v in vars(self._engine.server_args).items() if not callable(v)})
        return info

    # ----------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Stop the engine's processes, and only those. Safe to call twice; later calls raise
        :class:`EngineClosedError`."""
        with self._lifecycle_lock:  # a death being handled ends its processes first
            if self._closed:
                return
            was_dead = self._dead is not None
            self._closed = True
            atexit.unregister(self.shutdown)
            if not was_dead:
                self._stop_machinery()
        self._fail_pending(EngineClosedError("the engine was shut down"))
        logger.info("SGLang engine stopped (processes %s)", self._child_pids)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
