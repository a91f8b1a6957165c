"""The host process exits after its engine's scheduler was killed and the engine shut down.

SGLang's scheduler is a ``multiprocessing`` child. If it is reaped with ``os.waitpid`` behind
``multiprocessing``'s back, the interpreter's exit hook (which joins every child) waits forever: a
trainer that cannot exit after training. Seen on an H100 before ``_kill_procs`` joined such children.
"""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import multiprocessing, os, signal, sys, time
    sys.path.insert(0, "tests")
    from fakes import FakeSGLangEngine
    from sgl_rollout.config import RolloutConfig
    from sgl_rollout.engine import EngineDeadError, RolloutEngine


    class MpScheduler(FakeSGLangEngine):
        # scheduler and detokenizer as multiprocessing children, as SGLang starts them

        def __init__(self, **kw):
            super().__init__(**kw)
            ctx = multiprocessing.get_context("fork")
            self.proc = ctx.Process(target=time.sleep, args=(600,))
            self.detok = ctx.Process(target=time.sleep, args=(600,))
            self.proc.start()
            self.detok.start()


    if __name__ == "__main__":
        eng = RolloutEngine(RolloutConfig(model_path="/fake"), engine_factory=MpScheduler, watch_interval_s=0.05)
        old = eng._engine
        old.block = __import__("threading").Event()
        __import__("threading").Timer(0.2, os.kill, (old.proc.pid, signal.SIGKILL)).start()
        try:
            eng.generate([[1]])
        except EngineDeadError:
            pass
        eng.restart()  # at once, as a trainer would on the error: must not race the dead engine's clean-up
        new = eng._engine
        assert not old.detok.is_alive(), "the dead engine's detokenizer was left running"
        assert new.proc.is_alive() and new.detok.is_alive(), "the new engine's processes were killed"
        assert eng.alive and eng.generate([[1, 2]], {"max_new_tokens": 1})[0][0].output_ids == [3]
        eng.shutdown()
        print("exiting", multiprocessing.active_children())
    """
)


def test_host_exits_after_a_killed_scheduler(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "exiting []" in out.stdout


HELPER_SCRIPT = textwrap.dedent(
    """
    import multiprocessing, os, sys, time
    from multiprocessing import resource_tracker
    sys.path.insert(0, "tests")
    from fakes import FakeSGLangEngine
    from sgl_rollout.config import RolloutConfig
    from sgl_rollout.engine import RolloutEngine


    class SpawningScheduler(FakeSGLangEngine):
        # SGLang spawns its scheduler: multiprocessing starts the host's resource tracker on the way

        def __init__(self, **kw):
            super().__init__(**kw)
            resource_tracker.ensure_running()
            self.proc = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
            self.proc.start()


    if __name__ == "__main__":
        eng = RolloutEngine(RolloutConfig(model_path="/fake"), engine_factory=SpawningScheduler)
        tracker = resource_tracker._resource_tracker._pid
        assert tracker and tracker not in eng._child_pids, (tracker, eng._child_pids)
        assert eng._engine.proc.pid in eng._child_pids
        proc = eng._engine.proc
        eng.shutdown()
        assert not proc.is_alive(), "the engine's own child survived its shutdown"
        os.kill(tracker, 0)  # raises if the shutdown killed the host's resource tracker
        print("tracker alive", tracker)
    """
)


def test_shutdown_spares_the_hosts_resource_tracker(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(HELPER_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tracker alive" in out.stdout and "died unexpectedly" not in out.stderr


FAILED_START = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests")
    from sgl_rollout.config import RolloutConfig
    from sgl_rollout.engine import RolloutEngine


    def no_memory(**kw):
        raise RuntimeError("Not enough memory. Please try to increase --mem-fraction-static.")


    if __name__ == "__main__":
        try:
            RolloutEngine(RolloutConfig(model_path="/fake"), engine_factory=no_memory)
        except RuntimeError as exc:
            print("start failed:", exc)
    """
)


def test_an_engine_that_failed_to_start_does_not_fail_the_exit(tmp_path):
    """Seen on an H100: SGLang's start ran out of memory, and at exit the registered shutdown of the
    half-built engine raised AttributeError over the real error."""
    script = tmp_path / "failed_start.py"
    script.write_text(FAILED_START)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=".")
    assert done.returncode == 0, done.stderr
    assert "start failed: Not enough memory" in done.stdout
    assert "Traceback" not in done.stderr and "AttributeError" not in done.stderr, done.stderr
