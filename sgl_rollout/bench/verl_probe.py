"""Phase timer for verl's weight update, for both verl's built-in SGLang rollout and this package.

``python -m sgl_rollout.bench verl`` (:mod:`.verl_compare`) runs verl's own trainer twice and must say
where ``timing_s/update_weights`` goes on both sides without changing verl.

How it gets into verl's processes: each side's command passes
``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=sgl_rollout.bench.verl_probe.setup_hook``
(:data:`SETUP_HOOK`), which verl's ``main_ppo`` hands to ``ray.init``. Ray keeps the hook in the job's
runtime environment (as an environment variable every actor inherits, whatever environment variables
verl adds to it) and runs :func:`setup_hook` in each worker process it starts, before any task or actor
(``ray/_private/workers/default_worker.py``). So the probe reaches verl's TaskRunner, the trainer
workers, the engine actors and the agent-loop workers on both sides, independently of verl's plugin
list: the built-in side loads no plugin at all (``VERL_USE_EXTERNAL_PLUGINS=none``).

With ``SGLROLLOUT_PROBE_DIR`` set, :func:`install` (the hook's work) does two things:

* for this package, it subscribes to the spans the package emits itself (:mod:`sgl_rollout.trace`:
  ``rollout.*``, ``server.*``) and writes each one as a record (:func:`record_span`); nothing of this
  package is wrapped or named by its module path here, so a rename inside the package cannot break it;
* for verl, SGLang and torch, which emit no spans, it wraps the functions of :data:`TARGETS` as their
  modules are imported (``wrapt``'s post-import hooks).

Each span becomes one JSON line of ``$SGLROLLOUT_PROBE_DIR/spans-<pid>.jsonl``. Without the variable it
does nothing.

A span is ``{"name", "t0", "dt", "pid", "rank", "step"?, "busy"?, "n"?, "error"?}``: ``t0`` wall-clock
seconds (``time.time``, comparable across the processes of one host), ``dt`` seconds (``perf_counter``).
``busy`` spans sum the time spent inside an iterator's ``next`` over ``n`` items (the weights generator:
FSDP's ``full_tensor`` gathers; verl's bucketer), emitted when the iterator ends. What is timed, and
where it comes from (verl 0.9.1, SGLang 0.5.10):

* trainer worker (``verl/workers/engine_workers.py``): ``ActorRolloutRefWorker.update_weights``
  (``verl.update_weights``, with ``step``); the FSDP engine's ``get_per_tensor_param``
  (``verl.get_per_tensor_param``) and its generator (``verl.weights`` busy); ``FSDPEngine.to``
  (``verl.engine_to``: the actor's offload); and, only while ``update_weights`` runs, torch's
  ``empty_cache``, ``synchronize`` and ``barrier``, verl's ``set_expandable_segments``, its
  ``convert_weight_keys`` (``verl.convert_weight_keys``, inside ``get_per_tensor_param``) and its
  ``log_gpu_memory_usage`` calls (``verl.log_gpu_memory_usage``);
* the rollout adapter in the trainer worker: verl's ``ServerAdapter``
  (``verl/workers/rollout/sglang_rollout/sglang_rollout.py``, wrapped) or this package's
  ``SglRollout`` (its spans): ``resume`` (``rollout.resume[<tags>]``), ``release``,
  ``update_weights`` (``rollout.update_weights``); their bucketers (verl's ``get_named_tensor_buckets``:
  ``rollout.bucket`` busy, the weights generator included; this package: ``rollout.bucket`` per bucket
  flattened, or on its fast path written into the buffer) and engine calls (verl's
  ``sgl_update_weights`` per bucket: ``rollout.call``; this package's fast path: ``rollout.call`` per
  round over the TP ranks, its engine call included);
* the engine's process (verl's ``SGLangHttpServer`` actor or this package's ``VerlRolloutServer``):
  SGLang's ``TokenizerCommunicatorMixin`` coroutines (``sglang.resume[<tags>]``, ``sglang.release[...]``,
  ``sglang.update_weights_from_tensor``, ``sglang.flush_cache``) and this package's server spans
  (``server.sleep``, ``server.resume[<stage>]``, ``server.begin_weight_sync``,
  ``server.update_weights_from_payloads``, ``server.finish_weight_sync``);
* the engine's process, once: the SGLang ``ServerArgs`` its ``TokenizerManager`` was made with
  (``sglang.server_args``, ``args``: field -> value, JSON-safe; :func:`_server_args_recorder`), so a report
  can show where the two sides' engines were set up differently;
* the engine's process, per request: SGLang's ``TokenizerManager.generate_request`` until its answer
  (``sglang.generate_request``; both sides call it once per request and take the first item);
  and the server actor's ``generate`` (verl's ``SGLangHttpServer``, wrapped, or this package's
  ``server.generate`` span: until the actor returns);
* verl's driver (the TaskRunner), between an update's end and the next step's first request (verl
  0.9.1's ``trainer.use_v1`` trainers, ``verl/trainer/ppo/v1/trainer_base.py``): ``PPOTrainer._compute_metrics``
  (``verl.driver.compute_metrics``), ``Tracking.log`` (``verl.driver.log``), ``PPOTrainer._next_train_batch``
  (``verl.driver.next_batch``), ``PPOTrainer._submit_batch_to_rollout`` (``verl.driver.submit``) and, inside it,
  ``AgentLoopManager.generate_sequences`` (``verl.driver.generate_sequences``);
* verl's agent-loop workers: ``LLMServerClient.generate`` per request (``verl.client_generate``, until
  the answer is back over Ray), and its round trip to verl's load balancer first
  (``LLMServerClient._acquire_server``: ``verl.acquire_server``);
* stalls in the engine's process and in verl's agent-loop workers: their event loops and their GIL, each
  watched by a ticker that reports waking more than :data:`STALL_S` late (``probe.loop_stall``,
  ``probe.gil_stall``; see :func:`_watch_stalls`), and the same processes' garbage collections longer than
  :data:`STALL_S` (``probe.gc``, with ``generation`` and ``collected``; see :func:`_watch_gc`);
* the driver (verl's TaskRunner), inside ``timing_s/gen``: the replay buffer of verl's default trainer
  (``trainer.use_v1``, ``verl/trainer/ppo/v1/replay_buffer.py``) waiting for the step's samples
  (``ReplayBuffer.sample``: ``verl.replay_buffer.sample``) and each of its polls
  (``_wait_for_next_poll``, a ``time.sleep`` of its ``poll_interval``, 2 s: ``verl.replay_buffer.poll``),
  then ``RolloutReplica.sleep`` (``replica.sleep``).

Around each ``verl.update_weights`` the trainer worker also writes a ``probe.memory`` record (at its start
and at its end, outside the span; see :func:`memory_snapshot`): the device memory each process on its GPU
holds (NVML) and its own torch allocator's figures, so a difference in the peak can be split into
memory torch allocated and memory outside torch's allocator (CUDA context, loaded kernels).

:mod:`.verl_report` turns the spans into the per-phase breakdowns of ``update_weights`` and ``gen``.
"""

from __future__ import annotations

import collections
import functools
import inspect
import json
import os
import re
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import trace
from .processes import GcClock

#: Environment variable naming the folder the spans go to; unset, the probe installs nothing.
ENV_DIR = "SGLROLLOUT_PROBE_DIR"
#: What each side's command gives Ray as ``runtime_env.worker_process_setup_hook`` (see the module docstring).
SETUP_HOOK = "sgl_rollout.bench.verl_probe.setup_hook"

_lock = threading.Lock()
_file = None
_installed = False
#: ``verl.update_weights`` calls running in this process; spans marked ``window_only`` (the torch
#: calls, frequent elsewhere) are emitted only while it is > 0.
_window = 0


def _open_window(n: int) -> None:
    """Add ``n`` to this process's count of running ``verl.update_weights`` calls."""
    global _window
    _window += n


def _in_window() -> bool:
    return _window > 0


def _mark(wrapper: Callable) -> Callable:
    """Mark ``wrapper`` as the probe's, so that :func:`timed` never wraps it twice.

    The wrapper keeps the wrapped function's qualified name (``functools.wraps``), so Ray's cloudpickle
    sends it *by reference*: verl colocates its trainer workers into a class made at run time
    (``WorkerDict``), pickled by value with the workers' methods, and a verl method carried by value
    with its globals (a torch config module among them) cannot be pickled at all. The worker finds the
    wrapper again because the probe is installed there before anything is imported (:func:`setup_hook`).
    """
    wrapper._sgl_rollout_probe = True
    return wrapper


def emit(name: str, t0: float, dt: float, **fields: Any) -> None:
    """Append one span to this process's ``spans-<pid>.jsonl`` (no-op when :data:`ENV_DIR` is unset).

    Args:
        name: span name (see the module docstring).
        t0: start, wall-clock seconds (``time.time()``).
        dt: duration, seconds.
        **fields: extra JSON fields (``step``, ``busy``, ``n``, ``error``).
    """
    global _file
    folder = os.environ.get(ENV_DIR)
    if not folder:
        return
    rec = {"name": name, "t0": t0, "dt": dt, "pid": os.getpid(), "rank": _rank(), **fields}
    line = json.dumps(rec, default=str) + "\n"
    with _lock:
        if _file is None:
            os.makedirs(folder, exist_ok=True)
            _file = open(os.path.join(folder, f"spans-{os.getpid()}.jsonl"), "a", encoding="utf-8", buffering=1)
        _file.write(line)


#: A loop or thread stalled longer than this (seconds) gets a ``probe.loop_stall`` / ``probe.gil_stall`` span.
STALL_S = 0.02
_TICK_S = 0.005
_watched_loops: "weakref.WeakSet" = weakref.WeakSet()
_gil_watch_started = False
#: Set to stop every stall watcher of this process (tests).
_stall_stop = threading.Event()


def _watch_stalls() -> None:
    """Start, once per event loop and once per process, the stall watchers of the engine's process and of
    verl's agent-loop workers.

    Called from the wrappers of verl's server actor's ``generate``, SGLang's ``generate_request`` and verl's
    ``LLMServerClient.generate`` (the agent-loop worker's loop), and
    as this package's ``server.generate`` span ends (:func:`record_span`), so it runs on the actor's loop
    and on the loop SGLang's tokenizer manager runs on (the same loop for verl's server; this package's
    engine thread otherwise). The process's collections are timed from then on too (:func:`_watch_gc`). A task sleeping ``_TICK_S`` on that loop
    emits ``probe.loop_stall`` (``dt``: how late it woke, ``thread``: the loop's thread) when it woke
    more than :data:`STALL_S` late: the loop ran something else that long. A daemon thread sleeping
    ``_TICK_S`` emits ``probe.gil_stall`` the same way: another thread of the process held the GIL
    (or the CPU was taken) that long. Each watcher emits one ``probe.stall_watch`` span (``dt`` 0,
    ``watch``: ``"loop"`` or ``"gil"``) as it starts, so a report can tell a watched run without
    stalls (0) from a process nobody watched (n/a).
    """
    import asyncio

    global _gil_watch_started
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    stop = _stall_stop
    if loop not in _watched_loops:
        _watched_loops.add(loop)
        thread = threading.current_thread().name

        async def watch_loop():
            while not stop.is_set():
                c0 = time.perf_counter()
                await asyncio.sleep(_TICK_S)
                late = time.perf_counter() - c0 - _TICK_S
                if late > STALL_S:
                    emit("probe.loop_stall", time.time() - late, late, thread=thread)

        loop.create_task(watch_loop())
        emit("probe.stall_watch", time.time(), 0.0, watch="loop", thread=thread)
    if not _gil_watch_started:
        _gil_watch_started = True
        pending = _watch_gc()

        def watch_gil():
            while not stop.is_set():
                c0 = time.perf_counter()
                time.sleep(_TICK_S)
                late = time.perf_counter() - c0 - _TICK_S
                if late > STALL_S:
                    emit("probe.gil_stall", time.time() - late, late)
                while pending:
                    t0, dt, fields = pending.popleft()
                    emit("probe.gc", t0, dt, **fields)

        threading.Thread(target=watch_gil, name="sgl-rollout-probe-gil", daemon=True).start()
        emit("probe.stall_watch", time.time(), 0.0, watch="gil")


def _watch_gc() -> "collections.deque":
    """Time this process's garbage collections (:class:`~.processes.GcClock`), once per process.

    A collection longer than :data:`STALL_S` is queued as ``(t0, dt, {"generation", "collected"})`` (wall-clock
    start, seconds) on the returned deque, which the GIL watcher of :func:`_watch_stalls` drains into
    ``probe.gc`` spans: the callback runs inside the collection, on whichever thread allocated, maybe while
    that thread holds :func:`emit`'s lock, so it only appends. Emits ``probe.stall_watch`` (``watch="gc"``)
    once, so a report can tell a watched process without long collections from an unwatched one.
    """
    pending: "collections.deque" = collections.deque()

    def queue_long(t0: float, dt: float, info: dict) -> None:
        if dt > STALL_S:
            pending.append((t0, dt, {"generation": info.get("generation"), "collected": info.get("collected")}))

    GcClock(on_collection=queue_long).install()
    emit("probe.stall_watch", time.time(), 0.0, watch="gc")
    return pending


#: NVML handle per GPU UUID (``"GPU-..."``), made once per process by :func:`_nvml_handle`.
_nvml_handles: Dict[str, Any] = {}


def _nvml_handle(pynvml, uuid: str):
    """NVML's handle of the GPU ``uuid``: ``nvmlInit`` and the lookup on this process's first snapshot of
    that GPU, the cached handle after (two snapshots run inside every ``verl.update_weights`` timer).
    Raises what NVML raises; nothing is cached then, so the next snapshot tries again."""
    if uuid not in _nvml_handles:
        pynvml.nvmlInit()
        _nvml_handles[uuid] = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    return _nvml_handles[uuid]


def memory_snapshot(at: str, **fields: Any) -> None:
    """Emit one ``probe.memory`` record of this process's GPU (no-op without :data:`ENV_DIR` or CUDA).

    Fields: ``at`` (``"start"`` / ``"end"`` of ``verl.update_weights``), ``torch`` (this process's
    ``torch.cuda.memory_stats``: ``allocated``, ``reserved`` bytes and ``segments``), ``procs`` (every
    compute process NVML lists on this GPU: ``{"pid", "name", "used"}``, bytes; name as
    :func:`.processes.process_name`), ``used`` (the GPU's ``nvmlDeviceGetMemoryInfo().used``, bytes),
    ``dt`` (seconds this snapshot took) and ``error`` where NVML could not be read.
    """
    if not os.environ.get(ENV_DIR):
        return
    t0, c0 = time.time(), time.perf_counter()
    rec: Dict[str, Any] = {"at": at, **fields}
    try:
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        dev = torch.cuda.current_device()
        st = torch.cuda.memory_stats(dev)
        rec["torch"] = {"allocated": st.get("allocated_bytes.all.current", 0),
                        "reserved": st.get("reserved_bytes.all.current", 0),
                        "segments": st.get("segment.all.current", 0)}
        import pynvml

        from .processes import process_name

        h = _nvml_handle(pynvml, "GPU-" + str(torch.cuda.get_device_properties(dev).uuid))
        rec["used"] = int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
        rec["procs"] = [{"pid": int(p.pid), "name": process_name(int(p.pid)), "used": p.usedGpuMemory}
                        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
        rec["self_pid"] = os.getpid()
    except Exception as exc:  # noqa: BLE001 - a diagnostic: the run goes on without it
        rec["error"] = f"{type(exc).__name__}: {exc}"
    emit("probe.memory", t0, time.perf_counter() - c0, **rec)


def _rank() -> Optional[int]:
    raw = os.environ.get("RANK")
    return int(raw) if raw and raw.isdigit() else None


def _tags_of(args: tuple, kwargs: dict, pos: int) -> str:
    """``"[kv_cache,weights]"`` from a ``tags`` argument (a list, or an object with ``.tags``)."""
    tags = kwargs.get("tags", kwargs.get("obj", args[pos] if len(args) > pos else None))
    tags = getattr(tags, "tags", tags)
    if tags is None:
        return "[all]"
    if isinstance(tags, str):
        tags = [tags]
    return "[" + ",".join(sorted(str(t) for t in tags)) + "]"


def _timed_iter(it, name: str):
    """Yield from ``it``; when it ends (or is closed), emit one busy span: seconds inside ``next``."""
    busy, n, first = 0.0, 0, None
    try:
        while True:
            t = time.perf_counter()
            if first is None:
                first = time.time()
            try:
                item = next(it)
            except StopIteration:
                busy += time.perf_counter() - t
                return
            busy += time.perf_counter() - t
            n += 1
            yield item
    finally:
        emit(name, first if first is not None else time.time(), busy, busy=True, n=n)


async def _timed_aiter(ait, name: str):
    """Async counterpart of :func:`_timed_iter`."""
    busy, n, first = 0.0, 0, None
    try:
        while True:
            t = time.perf_counter()
            if first is None:
                first = time.time()
            try:
                item = await ait.__anext__()
            except StopAsyncIteration:
                busy += time.perf_counter() - t
                return
            busy += time.perf_counter() - t
            n += 1
            yield item
    finally:
        emit(name, first if first is not None else time.time(), busy, busy=True, n=n)


def timed(fn: Callable, name: str, name_of: Optional[Callable[[tuple, dict], str]] = None,
          step_kw: Optional[str] = None, result: Optional[Callable[[Any], Any]] = None,
          window: bool = False, window_only: bool = False, watch: bool = False,
          memory: bool = False) -> Callable:
    """``fn`` wrapped to emit a span per call (a coroutine function stays one, a function of verl's
    ``auto_await`` stays one, see :func:`_auto_await_of`; attributes such as verl's dispatch-mode marks
    are kept by ``functools.wraps``).

    Args:
        fn: function or method.
        name: span name; ``name_of(args, kwargs)`` is appended when given (e.g. the tags).
        step_kw: keyword argument recorded as ``step`` (verl's ``global_steps``).
        result: applied to the return value (e.g. to time a returned generator).
        window: this call is verl's weight update: while it runs, ``window_only`` spans are emitted.
        window_only: emit only inside a ``window`` call of this process (torch's ``empty_cache``,
            ``synchronize``, ``barrier``: called often elsewhere).
        watch: start the stall watchers (:func:`_watch_stalls`) on the first call.
        memory: a :func:`memory_snapshot` before the span starts and after it is emitted (``step`` too).
    """
    if getattr(fn, "_sgl_rollout_probe", False):
        return fn

    def label(args, kwargs):
        return name + (name_of(args, kwargs) if name_of else "")

    def fields(kwargs, error):
        return _span_fields(kwargs, step_kw, error)

    deco = _auto_await_of(fn)
    if deco is not None:
        # verl's auto_await decides what to return from its caller's frame: re-decorate the timed
        # coroutine function, so the frame it reads is still the caller's, not this wrapper's
        timed_inner = _timed_coroutine(fn.__wrapped__, label, fields, result, window, window_only, watch, memory)
        wrapper = deco(timed_inner)
    elif inspect.iscoroutinefunction(fn):
        wrapper = _timed_coroutine(fn, label, fields, result, window, window_only, watch, memory)
    else:
        wrapper = _timed_function(fn, label, fields, result, window_only)
    return _mark(wrapper)


async def _a_coroutine() -> None:
    """A coroutine function for :func:`_auto_await_of` to decorate."""


def _auto_await_of(fn: Callable) -> Optional[Callable]:
    """verl's ``auto_await`` (``verl/utils/ray_utils.py``) when ``fn`` is a function it made, else None.

    ``auto_await`` wraps a coroutine function in a plain function that looks at its *caller's* frame: a
    coroutine caller gets the coroutine to await, any other caller gets the coroutine run to its end and
    its result (on a running loop, in a thread of its own). A plain wrapper around such a function is
    never a coroutine frame, so ``await manager.abort_replicas()`` inside verl's
    ``CheckpointEngineManager.update_weights`` would get ``None`` (issue 45). Every function
    ``auto_await`` makes shares one code object, which is how it is recognised here; verl is looked up
    only where it is already imported (a function it decorated means it is).
    """
    deco = getattr(sys.modules.get("verl.utils.ray_utils"), "auto_await", None)
    code = getattr(fn, "__code__", None)
    if deco is None or code is None or not inspect.iscoroutinefunction(getattr(fn, "__wrapped__", None)):
        return None
    return deco if code is deco(_a_coroutine).__code__ else None


def _span_fields(kwargs: dict, step_kw: Optional[str], error: Optional[BaseException]) -> Dict[str, Any]:
    """The extra fields of one :func:`timed` span: ``step`` (the ``step_kw`` keyword argument, when the
    call passed it) and ``error`` (the type name of what the call raised, if anything)."""
    out = {}
    if step_kw and kwargs.get(step_kw) is not None:
        out["step"] = kwargs[step_kw]
    if error is not None:
        out["error"] = type(error).__name__
    return out


def _timed_coroutine(fn: Callable, label: Callable, fields: Callable, result: Optional[Callable[[Any], Any]],
                     window: bool, window_only: bool, watch: bool, memory: bool) -> Callable:
    """:func:`timed`'s wrapper of a coroutine function (itself one): ``label(args, kwargs)`` names the
    span, ``fields(kwargs, error)`` gives its extra fields; the other arguments are :func:`timed`'s."""
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        if window_only and not _in_window():
            return await fn(*args, **kwargs)
        if watch:
            _watch_stalls()
        if memory:
            memory_snapshot("start", **fields(kwargs, None))
        t0, c0, err = time.time(), time.perf_counter(), None
        _open_window(int(window))
        try:
            out = await fn(*args, **kwargs)
            return result(out) if result else out
        except BaseException as exc:
            err = exc
            raise
        finally:
            _open_window(-int(window))
            emit(label(args, kwargs), t0, time.perf_counter() - c0, **fields(kwargs, err))
            if memory:
                memory_snapshot("end", **fields(kwargs, None))
    return wrapper


def _timed_function(fn: Callable, label: Callable, fields: Callable, result: Optional[Callable[[Any], Any]],
                    window_only: bool) -> Callable:
    """:func:`timed`'s wrapper of a plain function; an awaitable it returns is awaited by a coroutine that
    emits the span when it ends (verl's ``auto_await`` functions never come here: :func:`timed`). ``label`` and
    ``fields`` as in :func:`_timed_coroutine`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if window_only and not _in_window():
            return fn(*args, **kwargs)
        t0, c0 = time.time(), time.perf_counter()
        try:
            out = fn(*args, **kwargs)
        except BaseException as exc:
            emit(label(args, kwargs), t0, time.perf_counter() - c0, **fields(kwargs, exc))
            raise
        if inspect.isawaitable(out):

            async def finish():
                err = None
                try:
                    return await out
                except BaseException as exc:
                    err = exc
                    raise
                finally:
                    emit(label(args, kwargs), t0, time.perf_counter() - c0, **fields(kwargs, err))

            return finish()
        emit(label(args, kwargs), t0, time.perf_counter() - c0, **fields(kwargs, None))
        return result(out) if result else out
    return wrapper


def _gen_result(name: str) -> Callable[[Any], Any]:
    """For ``get_per_tensor_param``'s ``(generator, peft_config)``: the generator timed as busy ``name``."""
    def wrap(out):
        if isinstance(out, tuple) and out and hasattr(out[0], "__next__"):
            return (_timed_iter(out[0], name),) + tuple(out[1:])
        if hasattr(out, "__next__"):
            return _timed_iter(out, name)
        if isinstance(out, tuple) and out and hasattr(out[0], "__iter__") and not isinstance(out[0], (str, bytes)):
            return (_timed_iter(iter(out[0]), name),) + tuple(out[1:])
        return out
    return wrap


async def _first_item_aiter(ait, name: str):
    """Yield from ``ait``; emit one span when its first item arrives: wall seconds from the first ``next``.

    For a request whose caller takes one item and drops the iterator (SGLang's non-streaming
    ``generate_request``), the span is the request's time and is written at once, not at garbage
    collection."""
    t0, c0, first = time.time(), time.perf_counter(), True
    async for item in ait:
        if first:
            emit(name, t0, time.perf_counter() - c0)
            first = False
        yield item


def _agen_factory(fn: Callable, name: str, first_item: bool = False, watch: bool = False) -> Callable:
    """A function returning ``fn(...)``'s async iterator timed as busy ``name`` (``first_item``: as
    :func:`_first_item_aiter`; ``watch``: start the stall watchers on the caller's loop, see
    :func:`_watch_stalls`)."""
    timer = _first_item_aiter if first_item else _timed_aiter

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if watch:
            _watch_stalls()
        return timer(fn(*args, **kwargs).__aiter__(), name)
    return _mark(wrapper)


def _json_safe(value: Any) -> Any:
    """``value`` if JSON writes it as itself (nested lists and dicts too), else its ``str`` without memory
    addresses (``<... at 0x7f...>``: they differ between any two processes); ``"<unprintable>"`` where even
    ``str`` raises. It never raises: it runs inside SGLang's ``TokenizerManager.__init__``, the engine's start."""
    try:
        return json.loads(json.dumps(value))
    except Exception:  # noqa: BLE001 - not JSON: TypeError, ValueError, RecursionError, ...
        pass
    try:
        return re.sub(r" at 0x[0-9a-fA-F]+", "", str(value))
    except Exception:  # noqa: BLE001 - a value whose __str__ raises must not stop the engine's start
        return "<unprintable>"


def _server_args_recorder(fn: Callable, name: str = "sglang.server_args") -> Callable:
    """``TokenizerManager.__init__(self, server_args, ...)`` that, once it returns, emits ``name`` with
    ``args``: every field of the ``ServerArgs`` dataclass it was given (JSON-safe values)."""
    import dataclasses

    @functools.wraps(fn)
    def wrapper(self, server_args, *args, **kwargs):
        c0, t0 = time.perf_counter(), time.time()
        out = fn(self, server_args, *args, **kwargs)
        if dataclasses.is_dataclass(server_args):
            emit(name, t0, time.perf_counter() - c0,
                 args={f.name: _json_safe(getattr(server_args, f.name, None)) for f in dataclasses.fields(server_args)})
        return out
    return _mark(wrapper)


def _tags_at(pos: int) -> Callable[[tuple, dict], str]:
    return lambda args, kwargs: _tags_of(args, kwargs, pos)


# ------------------------------------------------------------------------------- this package's spans
#: This package's spans whose record name carries one of their fields, as the wrapped verl spans carry
#: an argument: ``rollout.resume[weights]`` (the adapter's ``tags``), ``server.resume[kv_cache]`` (the
#: server's ``stage``). The field is consumed by the name, so the record has the fields of any other span.
NAME_FIELDS: Dict[str, Tuple[str, Callable[[Any], str]]] = {
    "rollout.resume": ("tags", lambda tags: _tags_of((), {"tags": tags}, 0)),
    "server.resume": ("stage", lambda stage: f"[{stage}]"),
}
#: This package's spans that start the stall watchers (:func:`_watch_stalls`) on the loop they end on.
WATCH_SPANS = frozenset({"server.generate"})


def record_span(span: "trace.Span") -> None:
    """The :mod:`sgl_rollout.trace` listener: write one of this package's spans as a record.

    The record has the span's ``name`` (with :data:`NAME_FIELDS`' suffix), ``t0``, ``dt``, its other
    fields and ``error`` (the exception's class name) where the span ended in one: the format of the
    wrapped targets' spans, so :mod:`.verl_report` reads both sides alike. A span of :data:`WATCH_SPANS`
    also starts the stall watchers of the process.
    """
    fields = dict(span.fields)
    name = span.name
    if name in NAME_FIELDS:
        key, label = NAME_FIELDS[name]
        name += label(fields.pop(key, None))
    if span.error is not None:
        fields["error"] = span.error
    if span.name in WATCH_SPANS:
        _watch_stalls()
    emit(name, span.t0, span.dt, **fields)


# ------------------------------------------------------------------------------- verl, SGLang, torch
#: (module, attribute path, how): what :func:`install` wraps; only verl's, SGLang's and torch's functions
#: (this package emits its own spans, see :func:`record_span`). ``how`` is a dict of :func:`timed`'s
#: arguments, or ``{"agen": name, "first_item"?: bool, "watch"?: bool}`` (:func:`_agen_factory`'s) for an
#: async-generator function or method.
TARGETS: List[Tuple[str, str, Dict[str, Any]]] = [
    # driver (TaskRunner): the replicas' sleep at the end of timing_s/gen
    ("verl.workers.rollout.replica", "RolloutReplica.sleep", dict(name="replica.sleep")),
    # trainer worker: verl's naive update_weights and what it calls
    ("verl.workers.engine_workers", "ActorRolloutRefWorker.update_weights",
     dict(name="verl.update_weights", step_kw="global_steps", window=True, memory=True)),
    ("verl.workers.engine.fsdp.transformer_impl", "FSDPEngine.get_per_tensor_param",
     dict(name="verl.get_per_tensor_param", result=_gen_result("verl.weights"))),
    ("verl.workers.engine.fsdp.transformer_impl", "FSDPEngine.to", dict(name="verl.engine_to")),
    # inside get_per_tensor_param (what they leave is FSDP2's state_dict()) and between the update's calls:
    # the key renaming and verl's memory logs (each reads the device's memory whatever the log level)
    ("verl.workers.engine.fsdp.transformer_impl", "convert_weight_keys",
     dict(name="verl.convert_weight_keys", window_only=True)),
    *[(module, "log_gpu_memory_usage", dict(name="verl.log_gpu_memory_usage", window_only=True))
      for module in ("verl.workers.engine.fsdp.transformer_impl", "verl.workers.engine_workers")],
    ("verl.workers.engine_workers", "set_expandable_segments", dict(name="verl.set_expandable_segments",
                                                                    window_only=True)),
    # torch calls verl's update_weights makes between the adapter's (looked up at call time)
    ("torch.cuda", "empty_cache", dict(name="torch.empty_cache", window_only=True)),
    ("torch.cuda", "synchronize", dict(name="torch.synchronize", window_only=True)),
    ("torch.distributed", "barrier", dict(name="torch.barrier", window_only=True)),
    # verl's built-in adapter
    ("verl.workers.rollout.sglang_rollout.sglang_rollout", "ServerAdapter.resume",
     dict(name="rollout.resume", name_of=_tags_at(1))),
    ("verl.workers.rollout.sglang_rollout.sglang_rollout", "ServerAdapter.release", dict(name="rollout.release")),
    ("verl.workers.rollout.sglang_rollout.sglang_rollout", "ServerAdapter.update_weights",
     dict(name="rollout.update_weights")),
    ("verl.workers.rollout.sglang_rollout.sglang_rollout", "get_named_tensor_buckets", {"agen": "rollout.bucket"}),
    ("verl.workers.rollout.sglang_rollout.sglang_rollout", "sgl_update_weights", dict(name="rollout.call")),
    # the engine's process: SGLang's tokenizer manager (both sides); its control calls live in
    # tokenizer_communicator_mixin.py up to 0.5.10 and in tokenizer_control_mixin.py from 0.5.12 (a
    # module that is never imported never fires its hook)
    *[(module, f"{cls}.{method}", how)
      for module, cls in (("sglang.srt.managers.tokenizer_communicator_mixin", "TokenizerCommunicatorMixin"),
                          ("sglang.srt.managers.tokenizer_control_mixin", "TokenizerControlMixin"))
      for method, how in (("resume_memory_occupation", dict(name="sglang.resume", name_of=_tags_at(1))),
                          ("release_memory_occupation", dict(name="sglang.release", name_of=_tags_at(1))),
                          ("update_weights_from_tensor", dict(name="sglang.update_weights_from_tensor")),
                          ("flush_cache", dict(name="sglang.flush_cache")))],
    # the engine's settings, once per engine (both sides): where the two sides' engines differ
    ("sglang.srt.managers.tokenizer_manager", "TokenizerManager.__init__", {"server_args": "sglang.server_args"}),
    # timing_s/gen, per request: SGLang's own time of each request (its answer ends the span), both sides
    ("sglang.srt.managers.tokenizer_manager", "TokenizerManager.generate_request",
     {"agen": "sglang.generate_request", "first_item": True, "watch": True}),
    # timing_s/gen after SGLang's answer, per request: verl's server actor returning it (this package's
    # emits server.generate),
    # verl's client in the agent-loop worker getting it back over Ray; the driver's replay buffer
    # (verl's default trainer.use_v1) waiting for the step's samples, and each of its polls (a 2 s
    # sleep in verl 0.9.1)
    ("verl.workers.rollout.sglang_rollout.async_sglang_server", "SGLangHttpServer.generate",
     dict(name="server.generate", watch=True)),
    # (the agent-loop worker's loop, GIL and collections are watched from its first request on)
    ("verl.workers.rollout.llm_server", "LLMServerClient.generate", dict(name="verl.client_generate", watch=True)),
    # the client's round trip to verl's load balancer actor before it calls the server
    ("verl.workers.rollout.llm_server", "LLMServerClient._acquire_server", dict(name="verl.acquire_server")),
    # the driver between one update's end and the next step's first request (verl 0.9.1's v1 trainers,
    # verl/trainer/ppo/v1/trainer_base.py: PPOTrainer.fit records the step's metrics and logs them, then the
    # next step's prepare_step fetches the batch and hands it to the agent-loop manager)
    *[("verl.trainer.ppo.v1.trainer_base", f"PPOTrainer.{method}", dict(name=name)) for method, name in (
        ("_compute_metrics", "verl.driver.compute_metrics"), ("_next_train_batch", "verl.driver.next_batch"),
        ("_submit_batch_to_rollout", "verl.driver.submit"))],
    ("verl.utils.tracking", "Tracking.log", dict(name="verl.driver.log")),
    ("verl.experimental.agent_loop.agent_loop", "AgentLoopManager.generate_sequences",
     dict(name="verl.driver.generate_sequences")),
    ("verl.trainer.ppo.v1.replay_buffer", "ReplayBuffer.sample", dict(name="verl.replay_buffer.sample")),
    ("verl.trainer.ppo.v1.replay_buffer", "ReplayBuffer._wait_for_next_poll", dict(name="verl.replay_buffer.poll")),
    # verl's checkpoint engine (standalone replicas, the asynchronous trainers; issue 39: where
    # timing_s/sync_rollout_weights goes): the driver's steps around a sync
    # (CheckpointEngineManager.update_weights, verl/checkpoint_engine/base.py), the rollout worker's
    # receive-and-load, and each transport backend's calls on both sides
    *[("verl.checkpoint_engine.base", f"CheckpointEngineManager.{method}", dict(name=f"ckpt.{name}"))
      for method, name in (("abort_replicas", "abort"), ("release_kv_cache_replicas", "release_kv"),
                           ("build_process_group", "build_group"), ("resume_kv_cache_replicas", "resume_kv"),
                           ("resume_generation_replicas", "resume_generation"))],
    ("verl.checkpoint_engine.base", "CheckpointEngineWorker.update_weights", dict(name="ckpt.rollout_update")),
    *[(module, f"{cls}.{method}", how)
      for module, cls in (("verl.checkpoint_engine.nccl_checkpoint_engine", "NCCLCheckpointEngine"),
                          ("verl.checkpoint_engine.nixl_checkpoint_engine", "NIXLCheckpointEngine"))
      for method, how in (("prepare", dict(name="ckpt.prepare")), ("init_process_group", dict(name="ckpt.init_group")),
                          ("send_weights", dict(name="ckpt.send")), ("receive_weights", {"agen": "ckpt.receive"}),
                          ("finalize", dict(name="ckpt.finalize")))],
]


def _patch(module, path: str, how: Dict[str, Any]) -> bool:
    """Wrap ``module.<path>`` in place; False (and nothing changed) when it is not there."""
    *owners, attr = path.split(".")
    owner = module
    for part in owners:
        owner = getattr(owner, part, None)
        if owner is None:
            return False
    fn = (owner.__dict__ if isinstance(owner, type) else vars(owner)).get(attr)
    if fn is None or not callable(fn):
        return False
    if getattr(fn, "_sgl_rollout_probe", False):
        return True  # already the probe's
    if "agen" in how:
        new = _agen_factory(fn, **{("name" if k == "agen" else k): v for k, v in how.items()})
    elif "server_args" in how:
        new = _server_args_recorder(fn, how["server_args"])
    else:
        new = timed(fn, **how)
    setattr(owner, attr, new)
    return True


def install() -> bool:
    """Start recording in this process (once): subscribe :func:`record_span` to this package's spans and
    register the post-import hooks of :data:`TARGETS`.

    Returns:
        True when installed; False when :data:`ENV_DIR` is unset (nothing done).

    Raises:
        ImportError: ``wrapt`` is not installed (``pip install sgl-rollout[bench]``); nothing is installed.
    """
    global _installed
    if _installed:
        return True
    if not os.environ.get(ENV_DIR):
        return False
    import wrapt

    by_module: Dict[str, List[Tuple[str, Dict[str, Any]]]] = {}
    for mod, path, how in TARGETS:
        by_module.setdefault(mod, []).append((path, how))

    for mod, items in by_module.items():
        def hook(module, items=items):
            for path, how in items:
                _patch(module, path, how)
        wrapt.register_post_import_hook(hook, mod)
    trace.add_listener(record_span)
    _installed = True
    return True


def uninstall() -> None:
    """Stop recording this package's spans in this process (the wrapped targets stay wrapped); for tests."""
    global _installed
    trace.remove_listener(record_span)
    _installed = False


def setup_hook() -> None:
    """Ray's ``worker_process_setup_hook`` of both sides' runs (:data:`SETUP_HOOK`): :func:`install` in this worker.

    Never raises: Ray drains a worker whose setup hook raises, which would fail verl's run for the sake
    of its timing. A failure is logged at WARNING (the run then goes on untimed in this process), and
    ``python -m sgl_rollout.bench verl`` checks ``wrapt`` before it starts (:func:`.verl_compare.preflight`).
    """
    try:
        install()
    except Exception:  # noqa: BLE001 - see above
        import logging

        logging.getLogger(__name__).warning("sgl-rollout's verl probe could not be installed in this process",
                                            exc_info=True)
