"""The guarded SGLang engine: one body per call into SGLang, checked before anything reaches the scheduler.

:class:`RolloutEngine` starts ``sglang.Engine`` in the environment :mod:`.lifecycle` prepares, keeps the
memory tags' state (:class:`~sgl_rollout.memory.MemoryState`) so that a release of a released tag, a
resume of a resident one or a release while requests run is refused before SGLang sees it, runs SGLang's
tokenizer-manager coroutines on one event loop (its own thread's, or the caller's: a Ray async actor's),
and turns a dead engine process into
:class:`~.lifecycle.EngineDeadError` for every call in flight and after (with :meth:`RolloutEngine.restart`).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import logging
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from ..config import RolloutConfig
from ..memory import ALL_TAGS, CUDA_GRAPH, KV_CACHE, WEIGHTS, MemoryState, MemoryStateError
from .lifecycle import EngineClosedError, EngineDeadError, EngineProcesses, engine_env_updates, on_sigquit

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    """One sampled completion.

    Attributes:
        output_ids: generated token ids (int), prompt excluded.
        logprobs: log-probability (float, natural log) of each generated token under the engine's
            sampling distribution, same length as ``output_ids``; empty if not requested.
        finish_reason: SGLang's finish reason type, e.g. ``"length"`` or ``"stop"``.
    """

    output_ids: List[int]
    logprobs: List[float] = field(default_factory=list)
    finish_reason: Optional[str] = None


@dataclass
class LoraAdapter:
    """A LoRA adapter the engine serves (see :meth:`RolloutEngine.load_lora_adapter_from_tensors`).

    Attributes:
        name: the name callers use (``generate(..., lora_path=name)``).
        version: 1 for the first load under ``name``, +1 for each replacement.
        sglang_name: the name SGLang knows this version by (``"<name>@v<version>.<n>"``, ``n`` counting
            this engine object's loads): a replacement is loaded next to the previous version and only
            then is the previous one unloaded.
        config: the PEFT config dict SGLang got.
        n_tensors: tensors of the adapter.
        nbytes: bytes of the serialized payload.
    """

    name: str
    version: int
    sglang_name: str
    config: Dict[str, Any] = field(default_factory=dict)
    n_tensors: int = 0
    nbytes: int = 0



def engine_tags(config: RolloutConfig) -> tuple:
    """The tags an engine built from ``config`` has: ``cuda_graph`` only when CUDA graphs are on."""
    return tuple(t for t in ALL_TAGS if t != CUDA_GRAPH or not config.enforce_eager)


def _check_tp_for_sglang(config: RolloutConfig) -> None:
    """Refuse, before SGLang spawns anything, a TP size the model's heads do not split over or that needs
    more GPUs than this process sees (:func:`~sgl_rollout.config.tp_layout_problem`)."""
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


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold off Ctrl-C while a call is sent to SGLang and recorded here; raise it when the block ends.

    Python raises KeyboardInterrupt in the main thread between any two bytecodes. Landing after a
    release, resume, bucket load or generate has been handed to the engine's loop but before this
    object recorded it, it would leave SGLang running a call this object believes was never sent: a
    resume sent again is a ``KeyError`` that kills the scheduler, a generate counted as ended lets a
    release trip the scheduler's idle assertion, a load counted as answered lets its buffer go while
    SGLang reads it. Inside this block SIGINT is only noted; on leaving it the previous handler runs
    (Python's default raises KeyboardInterrupt), after the call is sent and recorded, so the caller is
    interrupted as before and the next call waits for SGLang's answer.

    Does nothing outside the main thread (Python delivers signals there only) or where SIGINT's handler
    was not set from Python (it could not be put back).
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
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


def _waits(method: Callable) -> Callable:
    """Mark a synchronous method that waits for SGLang's answer: on the thread of a borrowed loop
    (``RolloutEngine(loop=...)``) it raises RuntimeError before anything reaches SGLang."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self._check_not_on_loop()
        return method(self, *args, **kwargs)
    return wrapper


class RolloutEngine:
    """SGLang engine for rollouts: generation, guarded release/resume and weight sync, contained death.

    Every call to SGLang runs as a coroutine of its tokenizer manager on one event loop: by default in a
    thread of this object (``sgl-rollout-engine``), where the synchronous methods wait for it and the
    ``async_`` ones await it from any other loop; or, with ``loop``, on the caller's own loop (a Ray
    async actor's, as verl's ``SGLangHttpServer`` runs SGLang), where the ``async_`` methods are
    awaited on that loop and no request crosses a thread. So:

    * a release, resume or weight sync changes :attr:`state` when SGLang *answers*, even if its caller
      was interrupted (KeyboardInterrupt, ``asyncio.wait_for`` timeout, ``ray.cancel``); the next call
      waits for the answer instead of acting on a stale state (a Ctrl-C that lands while a call is being
      handed to the loop is held off until it is recorded, :func:`_sigint_deferred`);
    * a generate whose caller is interrupted or cancelled is aborted in SGLang by request id and stays
      counted until SGLang has ended it, so a release cannot trip the scheduler's idle assertion;
    * one lock (:class:`~sgl_rollout.memory.MemoryState`) covers check-and-act for release, resume,
      sync and the admission of generates;
    * a dead scheduler (an exception in it, ``kill -9``, an OOM kill) does not take the host process
      down: SGLang's SIGQUIT handler is replaced by :func:`on_sigquit`, a watchdog thread watches the
      engine's processes, and every call (also those in flight) raises :class:`EngineDeadError`
      until :meth:`restart`;
    * with ``lora_rank > 0`` it serves LoRA adapters (:meth:`load_lora_adapter_from_tensors`,
      ``generate(..., lora_path=name)``) under the same sync fence as a weight sync, and records what
      :func:`~sgl_rollout.weight_sync.lora.needs_base_sync` needs to know: whether a complete weight sync
      reached it since it started (:attr:`weights_synced`) and whether its weights were released since
      (:attr:`weights_released_since_sync`).

    Args:
        config: the rollout settings.
        engine_factory: ``(**server_args) -> engine``; defaults to ``sglang.Engine``. Tests pass a
            double with the same ``tokenizer_manager`` coroutines and ``async_generate``.
        disable_tp_imbalance_check: switch SGLang's TP memory-imbalance start-up check off (default),
            so that colocated workers that loaded in any order do not stop the engine from starting.
        watch_interval_s: seconds between two looks of the watchdog at the engine's processes.
        loop: a running event loop, not the main thread's, to run SGLang's coroutines on instead of
            the engine's own thread (the loop of a Ray async actor). Its thread may then call only the
            ``async_`` methods and the ones that do not wait for SGLang (``end_sync``, ``abort_all``,
            ``fail``, ``restart``, ``shutdown``); a waiting method raises RuntimeError there. A death
            or shutdown cancels this engine's coroutines on it, never the loop.

    Raises:
        ImportError: SGLang is not installed.
        TPLayoutError: the TP size does not split the model's attention or KV heads, or exceeds the
            GPUs this process sees (checked before SGLang starts anything).
        RuntimeError: SGLang fails to start (its own error).
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
        self._sync_lock = threading.Lock()
        self._lifecycle_lock = threading.RLock()
        self._generation = 0
        self._lora_seq = 0
        self._bucket_loading = False
        self._sync_abandoned = False
        atexit.register(self.shutdown)
        try:
            self._start()
        except BaseException:  # nothing to shut down: at exit, shutdown() would find no machinery
            self._closed = True
            atexit.unregister(self.shutdown)
            raise

    # ----------------------------------------------------------------- life cycle
    def _start(self) -> None:
        factory = self._factory
        if factory is None:
            _check_tp_for_sglang(self.config)
            from sglang.srt.entrypoints.engine import Engine as factory  # noqa: N813

        self._generation += 1
        self.state = MemoryState(engine_tags(self.config))
        self._last_op = None
        self._bucket_loading = self._sync_abandoned = False
        # LoRA adapters SGLang serves (name -> LoraAdapter), versions SGLang still holds that an
        # unload did not remove, and what is known of the base weights (weight_sync.lora's rule)
        self._lora: Dict[str, LoraAdapter] = {}
        self._lora_orphans: List[str] = []
        self._weights_synced = False
        self._weights_released_since_sync = False
        self._sync_bytes_sent = False
        server_args = self.config.to_server_args()
        if threading.current_thread() is threading.main_thread():
            # SGLang installs this in place of its own launch-phase handler, which kills the host.
            server_args["custom_sigquit_handler"] = on_sigquit
        generation = self._generation
        try:
            self._procs = EngineProcesses(
                factory, server_args, engine_env_updates(disable_tp_imbalance_check=self._disable_tp_imbalance_check),
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
            self._loop_thread = threading.Thread(target=self._loop.run_forever, name="sgl-rollout-engine",
                                                 daemon=True)
            self._loop_thread.start()
        logger.info("SGLang engine up: tp=%d, child processes %s", self.config.tensor_model_parallel_size, self._child_pids)

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
        with self._pending_lock:
            pending, self._pending = list(self._pending), set()
        for fut in pending:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                fut.set_exception(exc)

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
    def _submit(self, make_coro: Callable[[], Any], on_done: Optional[Callable[[Optional[BaseException]], None]] = None
                ) -> concurrent.futures.Future:
        """Run ``make_coro()`` on the engine's loop; the returned future fails with EngineDeadError on death.

        ``on_done(exc)`` runs when SGLang has answered (``exc`` None on success), before the returned
        future resolves, whatever became of the caller.
        """
        self.check_alive()
        outer: concurrent.futures.Future = concurrent.futures.Future()
        with self._pending_lock:
            self._pending.add(outer)

        if self._on_home_loop():  # the caller's own loop: a task of it, awaited directly (see _await)
            inner = self._loop.create_task(make_coro())
            outer.task = inner
        else:
            async def run():
                return await make_coro()

            inner = asyncio.run_coroutine_threadsafe(run(), self._loop)
        with self._pending_lock:
            self._inner.add(inner)

        def finish(f: concurrent.futures.Future) -> None:
            with self._pending_lock:
                self._inner.discard(f)
            exc = f.exception() if not f.cancelled() else concurrent.futures.CancelledError()
            if on_done is not None:
                on_done(exc)
            if isinstance(exc, (concurrent.futures.CancelledError, asyncio.CancelledError)) and (
                self._dead is not None or self._closed
            ):
                return  # the dead/closed engine's loop dropped the call: _fail_pending gives its error
            with self._pending_lock:
                self._pending.discard(outer)
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                if exc is None:
                    outer.set_result(f.result())
                else:
                    outer.set_exception(exc)

        inner.add_done_callback(finish)
        return outer

    def _on_home_loop(self) -> bool:
        """True when called from inside the borrowed loop SGLang runs on (``RolloutEngine(loop=...)``)."""
        if self._home_loop is None:
            return False
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _check_not_on_loop(self) -> None:
        """Refuse a waiting call on the thread of a borrowed loop: SGLang's answer needs that loop."""
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
    async def _await(fut: concurrent.futures.Future, on_cancel: Optional[Callable[[], None]] = None):
        task = getattr(fut, "task", None)
        try:  # shielded: a cancelled caller must not cancel the record of SGLang's answer
            if task is None:
                return await asyncio.shield(asyncio.wrap_future(fut))
            # a task of this very loop (_submit): no hop through thread-safe futures. Its done-callback
            # (_submit's finish) has resolved ``fut`` before this coroutine resumes.
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # this caller was cancelled
                return await asyncio.wrap_future(fut)  # the engine's death or shutdown: its error
            return fut.result()
        except BaseException:
            if not fut.done() and on_cancel is not None:
                on_cancel()
            raise

    @_waits
    def settle(self) -> None:
        """Wait until the last release/resume/sync bucket has been answered by SGLang (it may have been
        sent by a caller that was interrupted), so that :attr:`state` is what the engine holds.

        Raises:
            EngineClosedError, EngineDeadError: as :meth:`check_alive`.
        """
        last = self._last_op
        if last is not None and not last.done():
            with contextlib.suppress(Exception):
                last.result()
        self.check_alive()

    async def async_settle(self) -> None:
        """:meth:`settle` from inside an event loop."""
        last = self._last_op
        if last is not None and not last.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.wrap_future(last))
        self.check_alive()

    def _tm(self):
        return self._engine.tokenizer_manager

    def _op_done(self, op: str, tags: Optional[List[str]] = None, released: Optional[bool] = None):
        generation, state = self._generation, self.state

        def on_done(exc: Optional[BaseException]) -> None:
            if exc is None:
                state.commit(tags or [], released=bool(released))
                if released and WEIGHTS in (tags or []) and generation == self._generation:
                    self._weights_released_since_sync = True
            else:  # the outcome is unknown: never guess; the engine is unusable until restart()
                self._mark_dead(f"{op} {tags} failed in SGLang: {exc!r}", generation)
        return on_done

    def _start_op(self, op: str, tags: List[str], released: bool) -> concurrent.futures.Future:
        cls = "ReleaseMemoryOccupationReqInput" if released else "ResumeMemoryOccupationReqInput"
        with _sigint_deferred():  # sent and recorded, or neither
            try:
                call = getattr(self._tm(), "release_memory_occupation" if released else "resume_memory_occupation")
                req = _req(cls, tags=tags)
                fut = self._submit(lambda: call(req, None), self._op_done(op, tags, released))
            except BaseException:
                self.state.cancel()
                raise
            self._last_op = fut
        return fut

    # ----------------------------------------------------------------- generation
    def _start_generate(self, input_ids, sampling_params, n, return_logprob, lora_path=None):
        batch = _expand(input_ids, n)
        self.check_alive()
        if lora_path is not None and not isinstance(lora_path, str):
            raise TypeError(f"lora_path must be an adapter name (str) or None, got {type(lora_path).__name__}")
        rids = [uuid.uuid4().hex for _ in batch]
        sent = None
        try:
            with _sigint_deferred():  # counted and sent, or neither
                self.state.admit_request()
                try:
                    extra = {}
                    if lora_path is not None:
                        # read after admission: adapters change only inside a sync, which no request overlaps
                        adapter = self._lora.get(lora_path)
                        if adapter is None:
                            raise ValueError(f"no LoRA adapter {lora_path!r} is loaded "
                                             f"(loaded: {sorted(self._lora)})")
                        extra["lora_path"] = [adapter.sglang_name] * len(batch)
                    sent = self._submit(
                        lambda: self._engine.async_generate(input_ids=batch, sampling_params=dict(sampling_params or {}),
                                                            return_logprob=return_logprob, rid=rids, **extra),
                        lambda _exc: self.state.request_done(),
                    )
                except BaseException:
                    self.state.request_done()
                    raise
        except BaseException:
            if sent is not None:  # a Ctrl-C held off while the batch was sent: it runs, so abort it
                self._abort(rids)
            raise
        return sent, rids

    def _abort(self, rids: List[str]) -> None:
        """Abort ``rids`` in SGLang (from the engine's loop); they stay counted until SGLang ends them."""
        if not self.alive:
            return
        tm = self._tm()

        def abort():
            for rid in rids:
                tm.abort_request(rid=rid)

        self._loop.call_soon_threadsafe(abort)
        logger.warning("generate interrupted: aborting %d request(s) in SGLang", len(rids))

    @_waits
    def generate(
        self,
        input_ids: List[List[int]],
        sampling_params: Optional[Dict[str, Any]] = None,
        n: int = 1,
        return_logprob: bool = True,
        lora_path: Optional[str] = None,
    ) -> List[List[Generation]]:
        """Sample ``n`` completions for each prompt.

        Args:
            input_ids: prompts as token-id lists, batch of B.
            sampling_params: SGLang sampling params (``temperature``, ``top_p``, ``max_new_tokens``, ...).
            n: samples per prompt, >= 1.
            return_logprob: also return each sampled token's log-probability.
            lora_path: name of a loaded LoRA adapter (:meth:`load_lora_adapter_from_tensors`) to apply;
                None: the base weights alone.

        Returns:
            B lists of ``n`` :class:`Generation` each, in prompt order.

        Raises:
            MemoryStateError: a memory region is released, a release/resume/sync is in progress, or the
                last weight sync did not complete.
            EngineDeadError: the engine died (before or during the call); EngineClosedError: shut down.
            ValueError: ``n`` < 1, an empty batch, or ``lora_path`` names no loaded adapter.
            KeyboardInterrupt: re-raised after the batch's requests were aborted in SGLang.
        """
        fut, rids = self._start_generate(input_ids, sampling_params, n, return_logprob, lora_path)
        return _group(self._wait(fut, lambda: self._abort(rids)), n, return_logprob)

    async def async_generate(
        self,
        input_ids: List[List[int]],
        sampling_params: Optional[Dict[str, Any]] = None,
        n: int = 1,
        return_logprob: bool = True,
        lora_path: Optional[str] = None,
    ) -> List[List[Generation]]:
        """:meth:`generate` for code that runs inside an event loop (a Ray async actor, say).

        Concurrent calls are batched by SGLang's scheduler. A cancelled call aborts its requests in
        SGLang. Same arguments, return value and errors as :meth:`generate`.
        """
        fut, rids = self._start_generate(input_ids, sampling_params, n, return_logprob, lora_path)
        return _group(await self._await(fut, lambda: self._abort(rids)), n, return_logprob)

    def abort_all(self) -> None:
        """Abort every request running in SGLang (``abort_request(abort_all=True)``); they end shortly after.

        Raises:
            EngineDeadError, EngineClosedError: as every call.
        """
        self.check_alive()
        self._loop.call_soon_threadsafe(lambda: self._tm().abort_request(abort_all=True))

    # ----------------------------------------------------------------- memory
    @_waits
    def release(self, tags: Optional[Sequence[str]] = None) -> List[str]:
        """Release the memory of ``tags`` (None: all of this engine's tags).

        Returns:
            the tags released.

        Raises:
            MemoryStateError: a tag is already released or unknown, requests run, or another
                operation is in progress. Nothing reaches the engine then, so it keeps serving.
            EngineDeadError, EngineClosedError: as every call.
        """
        self.settle()
        tags = self.state.begin_release(tags)
        self._wait(self._start_op("release", tags, released=True))
        return tags

    @_waits
    def resume(self, tags: Optional[Sequence[str]] = None) -> List[str]:
        """Resume the memory of ``tags`` (None: all of this engine's tags).

        Returns:
            the tags resumed.

        Raises:
            MemoryStateError: a tag is resident or unknown, or another operation is in progress.
                Nothing reaches the engine then.
            EngineDeadError, EngineClosedError: as every call.
        """
        self.settle()
        tags = self.state.begin_resume(tags)
        self._wait(self._start_op("resume", tags, released=False))
        return tags

    async def async_release(self, tags: Optional[Sequence[str]] = None) -> List[str]:
        """:meth:`release` from inside an event loop; a cancelled caller does not undo it."""
        await self.async_settle()
        tags = self.state.begin_release(tags)
        await self._await(self._start_op("release", tags, released=True))
        return tags

    async def async_resume(self, tags: Optional[Sequence[str]] = None) -> List[str]:
        """:meth:`resume` from inside an event loop; a cancelled caller does not undo it."""
        await self.async_settle()
        tags = self.state.begin_resume(tags)
        await self._await(self._start_op("resume", tags, released=False))
        return tags

    # ----------------------------------------------------------------- weights
    @_waits
    def begin_sync(self) -> None:
        """Fence off generates for a weight sync (waits for the last release/resume to be answered).

        Raises:
            MemoryStateError: weights released, requests running, or another operation in progress.
        """
        self.settle()
        self.state.begin_sync()
        self._sync_bytes_sent = False

    async def async_begin_sync(self) -> None:
        """:meth:`begin_sync` from inside an event loop."""
        await self.async_settle()
        self.state.begin_sync()
        self._sync_bytes_sent = False

    @contextlib.contextmanager
    def weight_sync(self) -> Iterator[None]:
        """:meth:`begin_sync` on entry, :meth:`end_sync` on exit (complete unless the block raised)."""
        self.begin_sync()
        complete = False
        try:
            yield
            complete = True
        finally:
            self.end_sync(complete)

    def end_sync(self, complete: bool) -> None:
        """End the fence of :meth:`begin_sync` once the last bucket was answered.

        ``complete`` False (a failed or interrupted sync) leaves the engine refusing generates until a
        complete sync, if any byte had reached it.
        """
        with self._sync_lock:
            if self.state.busy != "sync":
                return
            if self._bucket_loading:  # an interrupted caller's bucket is still loading: end when it is answered
                self._sync_abandoned = True
            else:
                self.state.end_sync(complete)
                if complete and self._sync_bytes_sent:
                    self._weights_synced, self._weights_released_since_sync = True, False

    def _bucket_answered(self, _exc: Optional[BaseException]) -> None:
        with self._sync_lock:
            self._bucket_loading = False
            if self._sync_abandoned:
                self._sync_abandoned = False
                self.state.end_sync(False)

    def _submit_sync_op(self, fn):
        """Submit ``fn`` (a coroutine function) as the sync fence's in-flight load: an interrupted caller's
        :meth:`end_sync` waits for its answer (:meth:`_bucket_answered`). Returns its future."""
        with _sigint_deferred():  # sent and recorded, or neither
            with self._sync_lock:
                self._bucket_loading = True
            try:
                fut = self._submit(fn, self._bucket_answered)
            except BaseException:
                self._bucket_answered(None)
                raise
            self._last_op = fut
        return fut

    def _start_update(self, payloads: list, load_format: Optional[str], flush_cache: bool):
        if self.state.is_released(WEIGHTS):
            raise MemoryStateError("weights are released: resume 'weights' before loading new weights")
        if self.state.busy != "sync":
            raise MemoryStateError("call begin_sync() before loading weights (no generate may see half-new weights)")
        req = _req("UpdateWeightsFromTensorReqInput", serialized_named_tensors=payloads, load_format=load_format,
                   flush_cache=flush_cache)
        self.state.sync_sent()
        self._sync_bytes_sent = True
        return self._submit_sync_op(lambda: self._tm().update_weights_from_tensor(req, None))

    @_waits
    def update_weights_from_tensor(self, named_tensors: list, load_format: Optional[str] = None, flush_cache: bool = False):
        """SGLang's ``update_weights_from_tensor`` for one bucket, inside :meth:`begin_sync` / :meth:`end_sync`.

        Args:
            named_tensors: for ``load_format="flattened_bucket"``, one serialized payload (bytes) per TP
                rank; see :mod:`sgl_rollout.weight_sync`.

        Returns:
            SGLang's ``(success, message)``.

        Raises:
            MemoryStateError: no sync was begun, or the ``weights`` tag is released.
            EngineDeadError, EngineClosedError: as every call.
        """
        return self._wait(self._start_update(named_tensors, load_format, flush_cache))

    async def async_update_weights_from_tensor(self, payloads: list, load_format: Optional[str] = None,
                                               flush_cache: bool = False):
        """:meth:`update_weights_from_tensor` from inside an event loop; returns ``(success, message)``."""
        return await self._await(self._start_update(payloads, load_format, flush_cache))

    # ----------------------------------------------------------------- LoRA adapters
    @property
    def generation(self) -> int:
        """1 for the first engine start, +1 for each :meth:`restart` (a restart loads the weights anew
        as ``config.load_format`` says and drops every adapter)."""
        return self._generation

    @property
    def weights_synced(self) -> bool:
        """True once a complete weight sync (:meth:`update_weights_from_tensor` buckets inside
        :meth:`begin_sync` / :meth:`end_sync` ``(True)``) reached this engine since it started.

        A sync of only some weights counts too: the engine cannot tell (the worker's ``partial=True``)."""
        return self._weights_synced

    @property
    def weights_released_since_sync(self) -> bool:
        """True when SGLang released the ``weights`` tag since the last complete weight sync (or since
        the start, if none): without ``enable_weights_cpu_backup`` their contents are then undefined."""
        return self._weights_released_since_sync

    @property
    def lora_adapters(self) -> Dict[str, LoraAdapter]:
        """The adapters SGLang serves now, by name (a copy)."""
        return dict(self._lora)

    def _check_lora_call(self, what: str) -> None:
        if not self.config.lora_enabled:
            raise ValueError(f"cannot {what}: the engine was started without LoRA (set lora_rank > 0 in the "
                             "rollout config)")
        if self.state.is_released(WEIGHTS):
            raise MemoryStateError(f"cannot {what}: the weights are released; resume 'weights' first")
        if self.state.busy != "sync":
            raise MemoryStateError(f"call begin_sync() before you {what} (no generate may run meanwhile)")

    def _adapter_request(self, name: str, tensors, config_dict, load_format):
        from ..weight_sync import lora

        if not isinstance(name, str) or not name or "@" in name:
            raise ValueError(f"adapter name must be a non-empty str without '@', got {name!r}")
        if isinstance(tensors, lora.AdapterPayload):
            payload = tensors
            if config_dict is not None and dict(config_dict) != payload.config:
                raise ValueError("config_dict differs from the AdapterPayload's own config; pass one of them")
            problems = lora.check_adapter_config(payload.config, self.config)
            if problems:
                raise lora.SyncValidationError(problems, f"LoRA adapter {name!r}")
            data, config, n_tensors = payload.data, payload.config, payload.n_tensors
        elif isinstance(tensors, (bytes, str)):
            if load_format != "flattened_bucket":
                raise ValueError("a serialized adapter payload needs load_format='flattened_bucket'")
            if config_dict is None:
                raise ValueError("config_dict is required with a serialized adapter payload")
            config = lora.adapter_config_dict(config_dict)
            problems = lora.check_adapter_config(config, self.config)
            if problems:
                raise lora.SyncValidationError(problems, f"LoRA adapter {name!r}")
            data, n_tensors = tensors, -1
        else:
            if config_dict is None:
                raise ValueError("config_dict (the adapter's PEFT config) is required")
            payload = lora.build_adapter_payload(tensors, config_dict, engine_config=self.config)
            data, config, n_tensors = payload.data, payload.config, payload.n_tensors
        self._lora_seq += 1
        old = self._lora.get(name)
        record = LoraAdapter(name=name, version=(old.version + 1) if old else 1, sglang_name="",
                             config=dict(config), n_tensors=n_tensors, nbytes=len(data))
        record.sglang_name = f"{name}@v{record.version}.{self._lora_seq}"
        req = _req("LoadLoRAAdapterFromTensorsReqInput", lora_name=record.sglang_name, config_dict=dict(config),
                   serialized_tensors=data, load_format="flattened_bucket")
        return record, req

    def _start_lora_load(self, name: str, tensors, config_dict, load_format) -> concurrent.futures.Future:
        self._check_lora_call(f"load LoRA adapter {name!r}")
        record, req = self._adapter_request(name, tensors, config_dict, load_format)
        tm, generation = self._tm(), self._generation

        async def swap():
            # the new version next to the old one, then the old one out: a failed load leaves the old
            # version serving, and no request ever finds the name without an adapter
            out = await tm.load_lora_adapter_from_tensors(req, None)
            if not getattr(out, "success", False):
                return out
            if generation != self._generation:
                return out
            old = self._lora.get(name)
            self._lora[name] = record  # committed on SGLang's answer, whatever became of the caller
            stale = ([old.sglang_name] if old is not None else []) + self._lora_orphans
            self._lora_orphans = []
            for sglang_name in stale:
                res = await tm.unload_lora_adapter(_req("UnloadLoRAAdapterReqInput", lora_name=sglang_name), None)
                if not getattr(res, "success", False):
                    logger.warning("SGLang did not unload LoRA adapter version %s: %s", sglang_name,
                                   getattr(res, "error_message", res))
                    self._lora_orphans.append(sglang_name)
            return out

        return self._submit_sync_op(swap)

    @staticmethod
    def _lora_result(name: str, out) -> None:
        if not getattr(out, "success", False):
            raise RuntimeError(f"SGLang did not load LoRA adapter {name!r}: {getattr(out, 'error_message', out)}")

    @_waits
    def load_lora_adapter_from_tensors(self, name: str, tensors, config_dict: Optional[Dict[str, Any]] = None,
                                       load_format: Optional[str] = "flattened_bucket") -> LoraAdapter:
        """Load a LoRA adapter into SGLang (``load_lora_adapter_from_tensors``), replacing the version
        loaded under ``name``; inside :meth:`begin_sync` / :meth:`end_sync` (:meth:`weight_sync`).

        Replacement: SGLang 0.5.10 refuses a second adapter under a loaded name, so the new version is
        loaded under its own SGLang name, ``name`` then points to it, and the previous version is
        unloaded. A failed load leaves the previous version serving. The mapping changes when SGLang
        answers, also if this caller was interrupted meanwhile.

        Only CPU memory changes in SGLang (it keeps adapters on the CPU and copies them into its
        LoRA memory pool per batch), so a released KV cache (the staged wake) is no obstacle;
        released weights are.

        Args:
            name: the adapter's name, for ``generate(..., lora_path=name)``; no ``'@'``.
            tensors: a :class:`~sgl_rollout.weight_sync.lora.AdapterPayload` (built and checked by
                :func:`~sgl_rollout.weight_sync.lora.build_adapter_payload`); or the adapter's
                ``(name, tensor)`` pairs (a dict too), built here (rank and target modules are checked
                against this engine's LoRA settings, shapes against the base model only by the
                builder with a manifest); or an already serialized ``flattened_bucket`` payload
                (bytes), sent as it is.
            config_dict: the adapter's PEFT config (dict or ``peft.LoraConfig``); taken from an
                :class:`AdapterPayload` when None.
            load_format: ``"flattened_bucket"`` (SGLang's flattened format; the only one sent).

        Returns:
            the :class:`LoraAdapter` now served under ``name``.

        Raises:
            MemoryStateError: no sync was begun, or the weights are released. Nothing reached SGLang.
            ValueError: the engine has no LoRA, a bad name, a config the engine cannot serve
                (``SyncValidationError``, a ValueError, lists every problem). Nothing reached SGLang.
            RuntimeError: SGLang refused the adapter (its message); the previous version still serves.
            EngineDeadError, EngineClosedError: as every call.
        """
        fut = self._start_lora_load(name, tensors, config_dict, load_format)
        self._lora_result(name, self._wait(fut))
        return self._lora[name]

    async def async_load_lora_adapter_from_tensors(self, name: str, tensors,
                                                   config_dict: Optional[Dict[str, Any]] = None,
                                                   load_format: Optional[str] = "flattened_bucket") -> LoraAdapter:
        """:meth:`load_lora_adapter_from_tensors` from inside an event loop."""
        fut = self._start_lora_load(name, tensors, config_dict, load_format)
        self._lora_result(name, await self._await(fut))
        return self._lora[name]

    def _start_lora_unload(self, name: str) -> concurrent.futures.Future:
        self._check_lora_call(f"unload LoRA adapter {name!r}")
        record = self._lora.get(name)
        if record is None:
            raise ValueError(f"no LoRA adapter {name!r} is loaded (loaded: {sorted(self._lora)})")
        tm, generation = self._tm(), self._generation

        async def unload():
            out = await tm.unload_lora_adapter(_req("UnloadLoRAAdapterReqInput", lora_name=record.sglang_name), None)
            if getattr(out, "success", False) and generation == self._generation and self._lora.get(name) is record:
                del self._lora[name]
            return out

        return self._submit_sync_op(unload)

    @_waits
    def unload_lora_adapter(self, name: str) -> None:
        """Unload the adapter served under ``name``, inside :meth:`begin_sync` / :meth:`end_sync`.

        Raises:
            MemoryStateError: no sync was begun, or the weights are released.
            ValueError: no adapter ``name`` is loaded, or the engine has no LoRA. Nothing reached SGLang.
            RuntimeError: SGLang refused (its message).
        """
        out = self._wait(self._start_lora_unload(name))
        if not getattr(out, "success", False):
            raise RuntimeError(f"SGLang did not unload LoRA adapter {name!r}: {getattr(out, 'error_message', out)}")

    async def async_unload_lora_adapter(self, name: str) -> None:
        """:meth:`unload_lora_adapter` from inside an event loop."""
        out = await self._await(self._start_lora_unload(name))
        if not getattr(out, "success", False):
            raise RuntimeError(f"SGLang did not unload LoRA adapter {name!r}: {getattr(out, 'error_message', out)}")

    @_waits
    def flush_cache(self) -> None:
        """Drop SGLang's prefix (radix) cache, stale after new weights.

        Skipped while the KV cache is released: SGLang flushed it when it released the KV cache.
        """
        if not self.state.is_released(KV_CACHE):
            self._wait(self._submit(lambda: self._tm().flush_cache()))

    async def async_flush_cache(self) -> None:
        """:meth:`flush_cache` from inside an event loop."""
        if not self.state.is_released(KV_CACHE):
            await self._await(self._submit(lambda: self._tm().flush_cache()))

    def server_info(self) -> Dict[str, Any]:
        """SGLang's server args plus scheduler info such as ``max_total_num_tokens`` (KV-cache capacity
        in tokens), as ``Engine.get_server_info()`` gives them."""
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

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _req(cls_name: str, **fields):
    """An SGLang request object (``sglang/srt/managers/io_struct.py``) for the tokenizer manager."""
    from sglang.srt.managers import io_struct

    return getattr(io_struct, cls_name)(**fields)


def _expand(input_ids: List[List[int]], n: int) -> List[List[int]]:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not input_ids:
        raise ValueError("empty batch")
    return [list(p) for p in input_ids for _ in range(n)]


def _group(outs: List[Dict[str, Any]], n: int, with_logprob: bool) -> List[List[Generation]]:
    if isinstance(outs, dict):  # SGLang returns a bare dict for a batch of one
        outs = [outs]
    gens = [_to_generation(o, with_logprob) for o in outs]
    return [gens[i : i + n] for i in range(0, len(gens), n)]


def _to_generation(out: Dict[str, Any], with_logprob: bool) -> Generation:
    meta = out.get("meta_info", {})
    finish = meta.get("finish_reason")
    logprobs: List[float] = []
    if with_logprob:
        logprobs = [float(lp) for lp, _tok, *_ in meta.get("output_token_logprobs", [])]
    return Generation(
        output_ids=list(out["output_ids"]),
        logprobs=logprobs,
        finish_reason=finish.get("type") if isinstance(finish, dict) else finish,
    )

