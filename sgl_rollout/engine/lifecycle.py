"""The engine's processes and the host around them: spawning, death, SIGQUIT, shutdown.

What SGLang 0.5.10 needs of the environment its processes are spawned with, so that tagged release
works (each learnt from its source):

* ``enable_memory_saver=True``: otherwise ``release_memory_occupation`` silently frees nothing
  (``TorchMemorySaverAdapter`` is a no-op, ``sglang/srt/utils/torch_memory_saver_adapter.py``);
* ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1``: otherwise CUDA-graph memory is not tagged
  (``CudaGraphRunner._capture_graph``, ``sglang/srt/model_executor/cuda_graph_runner.py``);
* piecewise CUDA graphs off unless the config asks for them: their memory is never released;
* no ``expandable_segments`` in ``PYTORCH_CUDA_ALLOC_CONF`` for the engine's processes:
  torch-memory-saver raises on it. It is removed only while the engine's processes are spawned,
  so a trainer in the host process keeps its own setting.
* no ``TORCHELASTIC_USE_AGENT_STORE`` (torchrun, ``accelerate launch``): with it, torch's
  ``_create_c10d_store`` (``torch/distributed/rendezvous.py``) makes every rank a TCPStore *client* of the
  agent's store, so the scheduler's own ``init_process_group(tcp://127.0.0.1:<nccl_port>)``
  (``init_distributed_environment``, ``sglang/srt/distributed/parallel_state.py``) waits for a server nobody
  starts. Seen on 4xH200: two TRL ranks' TP=1 engines hung there until the test's deadline.

Containment: any exception in SGLang's scheduler, or its death, makes SGLang SIGQUIT the host process
and kill it (the trainer). :func:`install_sigquit_handler` replaces that handling; the engine's watchdog
(:class:`~.rollout_engine.RolloutEngine`) finds the dead process (:func:`dead_pids`) and turns the death into
:class:`EngineDeadError`.

Shutdown: ``sglang.Engine.shutdown()`` kills *every* child process of the host
(``kill_process_tree(os.getpid(), include_parent=False)``), and SGLang registers it with atexit; the
engine records which children it started (:func:`child_processes`) and ends only those
(:func:`kill_trees`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import time
import weakref
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set

logger = logging.getLogger(__name__)


def strip_expandable_segments(conf: Optional[str]) -> Optional[str]:
    """``PYTORCH_CUDA_ALLOC_CONF`` without its ``expandable_segments`` option; None when nothing is left.

    >>> strip_expandable_segments("expandable_segments:True,max_split_size_mb:128")
    'max_split_size_mb:128'
    """
    if not conf:
        return None
    kept = [opt for opt in conf.split(",") if opt.strip() and not opt.strip().startswith("expandable_segments")]
    return ",".join(kept) or None


#: Set by torchrun's agent for the processes it starts (``torch/distributed/elastic/agent/server/local_elastic_agent.py``);
#: inherited by SGLang's scheduler, it turns the scheduler's own TCPStore server into a client (module docstring).
TORCHELASTIC_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


def engine_env_updates(
    sglang_version: Optional[str] = None,
    base: Optional[Dict[str, str]] = None,
    disable_tp_imbalance_check: bool = True,
    mm_embedding_cache: bool = True,
) -> Dict[str, Optional[str]]:
    """Environment changes for the engine's processes (None: remove the variable).

    Args:
        sglang_version: SGLang version for the version-gated patches; None reads the installed one.
        base: environment to start from (``os.environ`` by default); only read.
        disable_tp_imbalance_check: apply ``patches/tp_memory_imbalance.py`` (default). False leaves
            SGLang's own setting, which refuses to start TP on GPUs with unequal free memory.
        mm_embedding_cache: False turns SGLang's multimodal embedding cache off
            (``SGLANG_VLM_CACHE_SIZE_MB=0``): it keeps vision-tower outputs per image across weight syncs
            and only this package's fast-path loader empties it (``weight_sync/receiver.py``), so an
            engine that syncs through SGLang's own loader (``fast_sync=False``) must not keep one.

    Returns:
        dict of variable -> value or None: memory-saver CUDA-graph tagging, the allocator config
        without ``expandable_segments``, torchrun's ``TORCHELASTIC_USE_AGENT_STORE`` removed (the module's
        docstring says why), and the TP memory-imbalance check switched off
        (``patches/tp_memory_imbalance.py``).
    """
    from ..patches import tp_memory_imbalance

    base = os.environ if base is None else base
    updates: Dict[str, Optional[str]] = {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}
    if "PYTORCH_CUDA_ALLOC_CONF" in base:
        updates["PYTORCH_CUDA_ALLOC_CONF"] = strip_expandable_segments(base["PYTORCH_CUDA_ALLOC_CONF"])
    if TORCHELASTIC_AGENT_STORE in base:
        updates[TORCHELASTIC_AGENT_STORE] = None
    if disable_tp_imbalance_check:
        updates.update(tp_memory_imbalance.env_updates(sglang_version))
    if not mm_embedding_cache:
        updates["SGLANG_VLM_CACHE_SIZE_MB"] = "0"
    return updates


@contextlib.contextmanager
def patched_environ(updates: Dict[str, Optional[str]]) -> Iterator[None]:
    """Apply ``updates`` to ``os.environ`` (None removes a variable) and restore it on exit."""
    from ..patches import apply_env_updates

    saved = {k: os.environ.get(k) for k in updates}
    try:
        apply_env_updates(os.environ, updates)
        yield
    finally:
        apply_env_updates(os.environ, saved)



def host_helper_pids() -> set:
    """Pids of ``multiprocessing``'s helpers that serve the whole host process: the resource tracker and
    the forkserver. They can start during an engine's launch (SGLang spawns its scheduler) without
    belonging to it; killing the resource tracker loses its registry (leaked-semaphore warnings and a
    ``KeyError`` from ``multiprocessing/resource_tracker.py`` at exit)."""
    from multiprocessing import forkserver, resource_tracker

    pids = {getattr(resource_tracker._resource_tracker, "_pid", None),
            getattr(forkserver._forkserver, "_forkserver_pid", None)}
    return {p for p in pids if p}


def child_processes() -> list:
    """This process's children (``psutil.Process``), ``multiprocessing``'s host-wide helpers excepted.

    The handles, not bare pids, are what the engine keeps: a ``psutil.Process`` remembers its start
    time, so signalling it or asking whether it runs never reaches another process that was given
    the same pid after it exited (pids wrap at ``/proc/sys/kernel/pid_max``, often 32768)."""
    import psutil

    helpers = host_helper_pids()
    return [p for p in psutil.Process().children(recursive=False) if p.pid not in helpers]


def kill_trees(roots: Sequence, timeout_s: float = 10.0) -> None:
    """End each ``psutil.Process`` of ``roots`` that still runs, with its descendants (:func:`kill_procs`)."""
    import psutil

    procs = []
    for root in roots:
        try:
            if not root.is_running():  # exited, or its pid now belongs to another process
                continue
            procs.extend(root.children(recursive=True))
            procs.append(root)
        except psutil.NoSuchProcess:
            continue
    kill_procs(procs, timeout_s)


def kill_procs(procs: list, timeout_s: float = 10.0) -> None:
    """SIGTERM ``procs`` (psutil.Process), then SIGKILL those still alive after ``timeout_s``.

    SGLang's scheduler and detokenizer are ``multiprocessing`` children: they are reaped through
    ``Process.join`` so that ``multiprocessing`` records their exit. Reaped behind its back (by
    ``os.waitpid``), it would believe them alive forever and its exit hook, which joins every child,
    would hang the host process at exit.
    """
    import multiprocessing

    import psutil

    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    mp_children = {c.pid: c for c in multiprocessing.active_children()}
    others = []
    for p in procs:
        child = mp_children.get(p.pid)
        if child is None:
            others.append(p)
            continue
        child.join(timeout_s)
        if child.is_alive():
            child.kill()
            child.join(timeout_s)
    procs = others
    _gone, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=timeout_s)



class EngineDeadError(RuntimeError):
    """The engine's scheduler (or another of its processes) died; every call raises this until :meth:`RolloutEngine.restart`."""


class EngineClosedError(RuntimeError):
    """The engine was shut down; every call raises this at once."""



# --------------------------------------------------------------------------- engine death
#: The :class:`EngineProcesses` of this process that are watched (what :func:`on_sigquit` prompts).
LIVE_ENGINES: "weakref.WeakSet[EngineProcesses]" = weakref.WeakSet()


def on_sigquit(signum=None, frame=None) -> None:
    """SIGQUIT handler that replaces SGLang's: note the signal, kill nothing.

    SGLang's scheduler, detokenizer and ``SubprocessWatchdog`` send SIGQUIT to the host process
    when one of its processes fails (``run_scheduler_process``, ``sglang/srt/managers/scheduler.py``;
    ``sglang/srt/utils/watchdog.py``), and SGLang's own handlers answer with
    ``kill_process_tree(os.getpid())``: the trainer dies with the engine. Here each live engine's
    watchdog thread is told to look at its processes now; the one whose process died marks itself
    dead. Only a plain attribute is written (a signal handler must not take locks).
    """
    now = time.monotonic()
    for eng in list(LIVE_ENGINES):
        eng.sigquit_at = now


def install_sigquit_handler() -> bool:
    """Keep SIGQUIT from ending this process: :func:`on_sigquit` in the main thread, else ignore it.

    CPython takes signal handlers only in the main thread. A Ray actor runs its constructor and
    methods in other threads, so there the signal is set to ``SIG_IGN`` through libc (a process-wide
    disposition any thread may set): the engine's watchdog thread then sees a dead process by
    polling (every ``watch_interval_s``) instead of being prompted by the signal.

    Returns:
        True when SIGQUIT is handled or ignored; False when neither could be set up (no libc).
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGQUIT, on_sigquit)
        return True
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        sig_err = ctypes.c_void_p(-1).value
        if libc.signal(int(signal.SIGQUIT), ctypes.c_void_p(1)) == sig_err:  # 1 == SIG_IGN
            return False
    except (OSError, AttributeError):
        return False
    logger.info("SIGQUIT ignored in this process (not the main thread): engine deaths are found by polling")
    return True


def dead_pids(procs: Sequence) -> List[int]:
    """Pids of the ``psutil.Process`` handles in ``procs`` that exited (zombies included)."""
    import psutil

    dead = []
    for p in procs:
        try:
            if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE:
                dead.append(p.pid)
        except psutil.NoSuchProcess:
            dead.append(p.pid)
    return dead


#: The watchdog looks for the children's own children every this many ticks in the first
#: ``DESCENDANT_SCAN_EARLY`` ticks of a start (SGLang's compile workers and the like start with the
#: engine), and every ``DESCENDANT_SCAN_LATE`` ticks after (2 s and 30 s at the default 0.2 s tick).
DESCENDANT_SCAN_EVERY, DESCENDANT_SCAN_EARLY, DESCENDANT_SCAN_LATE = 10, 300, 150


def descendant_scan_due(tick: int) -> bool:
    """Whether watchdog tick ``tick`` (0 at the start) reads the process table for the engine's
    grandchildren (:meth:`EngineProcesses.track_descendants`): each read holds the GIL for a while, and
    once the engine has started new ones are rare."""
    if tick < DESCENDANT_SCAN_EARLY:
        return tick % DESCENDANT_SCAN_EVERY == 0
    return tick % DESCENDANT_SCAN_LATE == 0


def processes_below(roots: Set[int]) -> Dict[int, object]:
    """Every process descending from the pids ``roots`` (the roots left out), as ``psutil.Process`` by pid,
    from one pass over the process table (``psutil.process_iter(["ppid"])``); a process that ends during
    the pass is skipped. Empty for no roots, without reading the table."""
    import psutil

    if not roots:
        return {}
    below: Dict[int, list] = {}
    for p in psutil.process_iter(["ppid"]):
        ppid = p.info.get("ppid")
        if ppid is not None:
            below.setdefault(ppid, []).append(p)
    found: Dict[int, object] = {}
    stack = list(roots)
    while stack:
        for p in below.get(stack.pop(), ()):
            if p.pid not in found and p.pid not in roots:
                found[p.pid] = p
                stack.append(p.pid)
    return found


class EngineProcesses:
    """One start of an SGLang engine's processes in this host: spawned in the environment they need,
    recorded, watched, and ended (only they).

    ``factory(**server_args)`` runs with ``env_updates`` applied to this process's environment (its
    processes inherit them) and restored afterwards. The children it started are recorded (and their
    own children, at the watchdog ticks :func:`descendant_scan_due` names: they are re-parented away from a
    killed scheduler);
    SGLang's ``Engine.shutdown`` is taken off atexit (it kills every child of the host); SIGQUIT is
    handled (:func:`install_sigquit_handler`). Where SGLang loaded its Qwen-VL processor (a Qwen-VL model),
    that class gets ``patches/qwen_vl_processor_output.py``. A watchdog thread polls the children every
    ``watch_interval_s`` seconds and, when one has exited, calls ``on_death(reason)`` once and stops
    watching; a SIGQUIT makes it look at once.

    Used for every node of a replica: the leader's :class:`~.rollout_engine.RolloutEngine` and the
    scheduler-only engine processes of the other nodes (:class:`sgl_rollout.server.NodeEngineHost`).

    Attributes:
        engine: what ``factory`` returned (``sglang.Engine``; on a node other than 0 it has no tokenizer
            manager).
        children: ``psutil.Process`` of the processes the factory started, by pid.

    Raises:
        whatever ``factory`` raises, after the processes it started were killed.
    """

    def __init__(self, factory: Callable[..., object], server_args: Dict[str, object],
                 env_updates: Dict[str, Optional[str]], on_death: Callable[[str], None],
                 watch_interval_s: float = 0.2):
        before = set(child_processes())

        def started_here() -> list:  # psutil.Process compares by pid and start time
            return sorted((p for p in child_processes() if p not in before), key=lambda p: p.pid)

        try:
            with patched_environ(env_updates):
                self.engine = factory(**server_args)
        except BaseException:
            kill_trees(started_here())
            raise
        self.children: list = started_here()
        from ..patches import qwen_vl_processor_output

        qwen_vl_processor_output.apply()  # SGLang's tokenizer manager, in this process, loaded it for a Qwen-VL model
        self.descendants: Dict[int, object] = {}
        self.sigquit_at: Optional[float] = None
        self._on_death = on_death
        self._interval = watch_interval_s
        self.track_descendants()
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            atexit.unregister(shutdown)
        if not install_sigquit_handler():
            logger.warning("SIGQUIT could be neither handled nor ignored here: a dying scheduler's SIGQUIT "
                           "would end this process")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="sgl-rollout-watchdog", daemon=True)
        self._thread.start()
        LIVE_ENGINES.add(self)

    @property
    def child_pids(self) -> List[int]:
        """Pids of the engine's own child processes (its scheduler(s), detokenizer), sorted."""
        return [p.pid for p in self.children]

    def track_descendants(self) -> None:
        """Remember the children's own children (compile workers, ...): once a scheduler is killed they
        are re-parented away from it, and only this record lets :meth:`stop` end them.

        One pass over the process table whatever the number of children (:func:`processes_below`): psutil's
        ``children(recursive=True)`` reads all of ``/proc`` once per call, and the watchdog thread did that
        for each child every ``10 * watch_interval_s``, holding the GIL about 18 ms each time on a Ray host
        of 4×H200 (py-spy of verl's server actor, 2026-11-28: 74 of its 449 busy samples, more than a
        quarter of what its request loop took)."""
        live = {c.pid for c in self.children} - set(self.dead())
        for pid, p in processes_below(live).items():
            self.descendants.setdefault(pid, p)  # psutil.Process: safe against pid reuse

    def dead(self) -> List[int]:
        """Pids of the children that exited."""
        return dead_pids(self.children)

    def _watch(self) -> None:
        ticks = 0
        while not self._stop.wait(self._interval):
            if descendant_scan_due(ticks):
                self.track_descendants()
            ticks += 1
            gone = self.dead()
            if gone:
                self._stop.set()
                self._on_death(f"engine process(es) {gone} exited")
                return
            quit_at = self.sigquit_at
            if quit_at is not None and time.monotonic() - quit_at > 10.0:
                logger.warning("SIGQUIT received but this engine's processes are alive; ignored")
                self.sigquit_at = None

    def stop(self) -> None:
        """Stop watching and end the processes (and their recorded children); idempotent."""
        LIVE_ENGINES.discard(self)
        self._stop.set()
        tm = getattr(self.engine, "tokenizer_manager", None)
        watchdog = getattr(tm, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        kill_trees(self.children)
        kill_procs([p for p in self.descendants.values() if p.is_running()])
