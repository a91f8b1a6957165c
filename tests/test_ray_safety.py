"""Under Ray, a dead engine is an error for the caller, not a hang and not a dead actor.

The server actor (``sgl_rollout.server.RolloutServer``) hosts the engine double of ``fakes.py``, whose
"scheduler" is a real child process. Killing it, as ``kill -9`` would the real scheduler, must make the
generate in flight and every later call fail with ``EngineDeadError``; SIGQUIT (what SGLang's dying
processes send the host) must not end the actor; ``restart()`` must bring serving back.
"""

import os
import signal
import sys
import threading

import pytest

ray = pytest.importorskip("ray")

import fakes  # noqa: E402
from sgl_rollout.config import RolloutConfig  # noqa: E402
from sgl_rollout.engine import EngineDeadError  # noqa: E402
from sgl_rollout.server import RolloutServer  # noqa: E402


class FakeServer(RolloutServer):
    engine_factory = fakes.FakeSGLangEngine

    async def scheduler_pid(self):
        return self.engine._engine.scheduler.pid

    async def block_generates(self):
        self.engine._engine.block = threading.Event()


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="sgl_rollout_safety_test")
    for mod in (sys.modules[__name__], fakes):
        ray.cloudpickle.register_pickle_by_value(mod)  # the actor cannot import the test files
    yield
    ray.shutdown()


def _cause(err):
    return getattr(err, "cause", None) or err


def test_dead_engine_under_ray_raises_and_restart_recovers(cluster):
    cfg = RolloutConfig(model_path="/fake", validate_sync=False).model_dump()
    server = ray.remote(FakeServer).options(max_concurrency=16).remote(cfg)
    ray.get(server.start.remote())
    assert ray.get(server.__ray_call__.remote(lambda self: self.sigquit_handled)) is True
    # the engine runs SGLang on the actor's own loop (Ray runs it off the main thread), not on a thread of its own
    assert ray.get(server.__ray_call__.remote(lambda self: self.engine._loop_thread is None)) is True
    pid = ray.get(server.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGQUIT)  # what SGLang's dying scheduler sends: the actor must survive it
    out = ray.get(server.generate_batch.remote([[1, 2]], {"max_new_tokens": 1}), timeout=30)
    assert out[0][0].output_ids == [3]

    ray.get(server.block_generates.remote())
    in_flight = server.generate_batch.remote([[1]], {"max_new_tokens": 1})
    os.kill(ray.get(server.scheduler_pid.remote()), signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        ray.get(in_flight, timeout=30)  # an error, not a hang
    assert isinstance(_cause(err.value), EngineDeadError)
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        ray.get(server.sleep.remote(), timeout=30)
    assert isinstance(_cause(err.value), EngineDeadError)

    ray.get(server.restart.remote(), timeout=60)
    out = ray.get(server.generate_batch.remote([[5]], {"max_new_tokens": 2}), timeout=30)
    assert out[0][0].output_ids == [6, 7]
    ray.get(server.shutdown.remote())
