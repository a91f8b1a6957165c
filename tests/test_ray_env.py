"""On a local CPU Ray cluster: engine actors started in reverse order see the intended env vars;
the runtime_env does not leak into unrelated actors."""

import os

import pytest

ray = pytest.importorskip("ray")

from sgl_rollout.config import RolloutConfig  # noqa: E402
from sgl_rollout.server import RolloutServer, launch_rollout_server, merge_visible_devices, rollout_env_vars  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    for k in ("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", "NCCL_CUMEM_ENABLE", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"):
        assert k not in os.environ, f"{k} set in the test's own environment"
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="sgl_rollout_test")
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Bystander:
    def env(self):
        return {k: os.environ.get(k) for k in ("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", "NCCL_CUMEM_ENABLE",
                                               "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")}


def test_merge_visible_devices():
    assert merge_visible_devices(["3", "1", "1,2", ""]) == "1,2,3"


def test_env_vars_content():
    env = rollout_env_vars("0,1", sglang_version="0.5.10")
    assert env == {"SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "0", "NCCL_CUMEM_ENABLE": "0",
                   "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert rollout_env_vars("2", sglang_version="0.5.6")["SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK"] == "true"


def test_actors_started_in_reverse_order_see_their_env(cluster):
    cfg = RolloutConfig(model_path="/fake")
    device_sets = ["0,1", "2,3", "4"]
    actors = {}
    for devices in reversed(device_sets):  # start order: last first
        actors[devices] = launch_rollout_server(cfg, devices, name=f"srv_{devices}", actor_cls=RolloutServer)
    for devices, actor in actors.items():
        env = ray.get(actor.env.remote())
        assert env["CUDA_VISIBLE_DEVICES"] == devices
        assert env["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] == "0"
        assert env["NCCL_CUMEM_ENABLE"] == "0"
        assert env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
        assert env["SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK"] is None
    assert ray.get_actor("srv_2,3") is not None
    # an unrelated actor, started after them, gets none of it
    other = Bystander.remote()
    env = ray.get(other.env.remote())
    assert env["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] is None
    assert env["NCCL_CUMEM_ENABLE"] is None
    assert env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] is None
    assert env["CUDA_VISIBLE_DEVICES"] not in device_sets
    for a in actors.values():
        ray.kill(a)


def test_engine_not_started_is_a_clear_error(cluster):
    actor = launch_rollout_server(RolloutConfig(model_path="/fake"), "0", actor_cls=RolloutServer)
    with pytest.raises(ray.exceptions.RayTaskError, match="engine not started"):
        ray.get(actor.sleep.remote())
    ray.kill(actor)
