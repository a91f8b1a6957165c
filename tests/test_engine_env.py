import atexit
import os
import subprocess
import sys

import pytest

from fakes import FakeSGLangEngine
from sgl_rollout.config import RolloutConfig
from sgl_rollout.engine import RolloutEngine, engine_env_updates, patched_environ, strip_expandable_segments
from sgl_rollout.patches import tp_memory_imbalance as tpi


@pytest.mark.parametrize(
    "conf,expected",
    [
        (None, None),
        ("", None),
        ("expandable_segments:True", None),
        ("expandable_segments:True,max_split_size_mb:128", "max_split_size_mb:128"),
        ("max_split_size_mb:128, expandable_segments:False,garbage_collection_threshold:0.6",
         "max_split_size_mb:128,garbage_collection_threshold:0.6"),
    ],
)
def test_strip_expandable_segments(conf, expected):
    assert strip_expandable_segments(conf) == expected


def test_engine_env_updates():
    u = engine_env_updates("0.5.10", base={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert u == {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1", "PYTORCH_CUDA_ALLOC_CONF": None, tpi.NEW_VAR: "0", tpi.LEGACY_VAR: None}
    u = engine_env_updates("0.5.10", base={}, disable_tp_imbalance_check=False)
    assert u == {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}


#: A scheduler's first distributed step, as SGLang's ``init_distributed_environment`` takes it (TP=1): its own
#: TCPStore on a free port, then a gloo group of one.
_RENDEZVOUS = """
import datetime, socket, sys
import torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
try:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0,
                            timeout=datetime.timedelta(seconds=3))
except Exception as exc:
    print(type(exc).__name__, exc)
    sys.exit(3)
dist.destroy_process_group()
"""


def test_an_engine_started_by_a_torchrun_rank_does_not_wait_on_the_agents_store(monkeypatch):
    """torchrun (``accelerate launch``) sets ``TORCHELASTIC_USE_AGENT_STORE=True`` for its ranks; inherited, it
    makes the scheduler's rendezvous a client of a store nobody serves (two TRL ranks' engines hung there on
    4xH200). The engine's environment drops it; the host process keeps it."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")

    def rendezvous():
        return subprocess.run([sys.executable, "-c", _RENDEZVOUS], capture_output=True, text=True, timeout=120)

    inherited = rendezvous()
    assert inherited.returncode == 3, inherited.stdout + inherited.stderr  # the hang, cut by the 3 s timeout
    updates = engine_env_updates("0.5.12")
    assert updates["TORCHELASTIC_USE_AGENT_STORE"] is None
    with patched_environ(updates):
        fixed = rendezvous()
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_patched_environ_restores(monkeypatch):
    monkeypatch.setenv("A_KEEP", "1")
    monkeypatch.delenv("B_NEW", raising=False)
    with patched_environ({"A_KEEP": None, "B_NEW": "x"}):
        assert "A_KEEP" not in os.environ and os.environ["B_NEW"] == "x"
    assert os.environ["A_KEEP"] == "1" and "B_NEW" not in os.environ


def test_engine_processes_see_the_env_and_host_env_is_restored(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64")
    monkeypatch.setenv(tpi.LEGACY_VAR, "true")
    monkeypatch.delenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", raising=False)
    eng = RolloutEngine(RolloutConfig(model_path="/fake"), engine_factory=FakeSGLangEngine)
    seen = eng._engine.env_at_start
    assert seen["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "1"
    assert seen["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
    assert seen[tpi.NEW_VAR] == "0" and tpi.LEGACY_VAR not in seen
    assert eng._engine.server_args["enable_memory_saver"] is True
    # the host keeps its own settings
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:64"
    assert os.environ[tpi.LEGACY_VAR] == "true"
    assert "SGLANG_MEMORY_SAVER_CUDA_GRAPH" not in os.environ
    assert "SGLANG_VLM_CACHE_SIZE_MB" not in seen  # fast_sync (default): the receiver empties the cache
    eng.shutdown()


def test_without_the_fast_path_sglangs_multimodal_embedding_cache_is_off(monkeypatch):
    """SGLang's own loader leaves the vision-tower outputs it cached per image across a sync; only the
    fast-path loader empties them, so an engine without it runs with the cache off."""
    monkeypatch.delenv("SGLANG_VLM_CACHE_SIZE_MB", raising=False)
    assert engine_env_updates("0.5.12", base={}, mm_embedding_cache=False)["SGLANG_VLM_CACHE_SIZE_MB"] == "0"
    eng = RolloutEngine(RolloutConfig(model_path="/fake", fast_sync=False), engine_factory=FakeSGLangEngine)
    try:
        assert eng._engine.env_at_start["SGLANG_VLM_CACHE_SIZE_MB"] == "0"
    finally:
        eng.shutdown()
    assert "SGLANG_VLM_CACHE_SIZE_MB" not in os.environ


class _SpawningEngine(FakeSGLangEngine):
    """Starts a child process, as SGLang starts its scheduler."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        atexit.register(self.shutdown)  # as sglang.Engine does


def test_shutdown_ends_only_the_engines_processes(monkeypatch):
    unregistered = []
    real_unregister = atexit.unregister
    monkeypatch.setattr(atexit, "unregister", lambda f: (unregistered.append(f), real_unregister(f)))
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        eng = RolloutEngine(RolloutConfig(model_path="/fake"), engine_factory=_SpawningEngine)
        child = eng._engine.proc
        assert eng._child_pids == sorted([child.pid, eng._engine.scheduler.pid])
        eng.shutdown()
        assert child.wait(timeout=15) is not None
        assert bystander.poll() is None  # the unrelated child of the host still runs
        eng.shutdown()  # idempotent
        # SGLang's atexit hook (which kills every child of the host) was removed, and never ran
        assert eng._engine.shutdown in unregistered
        assert ("sglang_shutdown",) not in eng._engine.calls
    finally:
        bystander.kill()
        bystander.wait()


def test_a_child_whose_pid_was_reused_is_neither_killed_nor_taken_for_alive():
    """The engine keeps psutil handles of its children, not pids: once a child has exited and its pid
    belongs to another process (pids wrap at pid_max, 32768 here), shutdown must not kill that
    process, and the watchdog must see the child as dead."""
    import psutil

    from sgl_rollout.engine.lifecycle import dead_pids, kill_trees

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        stale = psutil.Process(other.pid)
        # the handle the engine took of its own child, which had this pid earlier and exited since
        stale._ident = (other.pid, stale.create_time() - 100.0)
        assert not stale.is_running()
        kill_trees([stale], timeout_s=2)
        assert other.poll() is None  # the process that now has the pid still runs
        assert dead_pids([stale]) == [other.pid]
        assert dead_pids([psutil.Process(other.pid)]) == []
    finally:
        other.kill()
        other.wait()


#: a process that starts a child of its own and waits (a scheduler and its compile worker)
_SPAWN_GRANDCHILD = ("import subprocess, sys, time; "
                     "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)")


class _TreeEngine(FakeSGLangEngine):
    """Starts a child that starts a child of its own."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.proc = subprocess.Popen([sys.executable, "-c", _SPAWN_GRANDCHILD])
        atexit.register(self.shutdown)


def _first_child(pid: int, timeout_s: float = 30.0):
    import time

    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kids = psutil.Process(pid).children()
        if kids:
            return kids[0]
        time.sleep(0.05)
    raise AssertionError(f"process {pid} started no child within {timeout_s} s")


def test_the_watchdog_records_the_childrens_children_in_one_pass_and_only_the_engines(monkeypatch):
    """Every engine child's own children are recorded from one read of the process table (not one per
    child: the watchdog held the GIL in verl's server actor doing that), an unrelated tree of the host is
    not, and shutdown ends the recorded ones."""
    import psutil

    bystander = subprocess.Popen([sys.executable, "-c", _SPAWN_GRANDCHILD])
    eng = RolloutEngine(RolloutConfig(model_path="/fake"), engine_factory=_TreeEngine)
    try:
        grandchild = _first_child(eng._engine.proc.pid)
        theirs = _first_child(bystander.pid)
        passes = []
        real_iter = psutil.process_iter
        monkeypatch.setattr(psutil, "process_iter", lambda *a, **k: (passes.append(1), real_iter(*a, **k))[1])
        procs = eng._procs
        assert len(procs.children) >= 2  # the fake's scheduler and its own child
        procs.track_descendants()
        assert len(passes) == 1
        assert grandchild.pid in procs.descendants
        assert not {bystander.pid, theirs.pid} & procs.descendants.keys()
        eng.shutdown()
        grandchild.wait(timeout=15)
        assert not grandchild.is_running()
        assert bystander.poll() is None and theirs.is_running()
    finally:
        eng.shutdown()
        for p in psutil.Process(bystander.pid).children(recursive=True):
            p.kill()
        bystander.kill()
        bystander.wait()


def test_the_watchdog_reads_the_process_table_often_at_start_and_rarely_after():
    from sgl_rollout.engine.lifecycle import DESCENDANT_SCAN_EARLY, descendant_scan_due

    early = [t for t in range(DESCENDANT_SCAN_EARLY) if descendant_scan_due(t)]
    late = [t for t in range(DESCENDANT_SCAN_EARLY, 2 * DESCENDANT_SCAN_EARLY) if descendant_scan_due(t)]
    assert early[0] == 0 and len(early) == 30  # every 2 s of the first minute at the default 0.2 s tick
    assert len(late) == 2  # every 30 s after
