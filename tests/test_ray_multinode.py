"""A replica over two Ray nodes (``sgl_rollout.server.launch_replica``), on the CPU with engine doubles.

Two raylets of ``ray.cluster_utils.Cluster`` stand for two nodes. The leader (``RolloutServer``, node
rank 0) hosts the engine double of ``fakes.py``; the other node's ``NodeEngineHost`` hosts
``fakes.FakeNodeEngine`` (no tokenizer manager, a real "scheduler" child process). Checked: what each
node's engine is started with (SGLang's ``nnodes``, ``node_rank``, ``dist_init_addr``, ports, the
non-blocking switch), that every call goes through the leader, per-node memory records at each stage,
that a dead scheduler on node 1 ends in ``EngineDeadError`` on the leader (for the call in flight and
the next) within seconds instead of a hang, that ``restart()`` brings both nodes back, and that
shutdown ends every node's processes.
"""

import os
import sys
import time

import pytest

ray = pytest.importorskip("ray")

import fakes  # noqa: E402
from sgl_rollout.config import RolloutConfig  # noqa: E402
from sgl_rollout.engine import EngineDeadError  # noqa: E402
from sgl_rollout.engine.layout import plan_replicas  # noqa: E402
from sgl_rollout.server import NodeEngineHost, RolloutServer, launch_replica  # noqa: E402


class FakeLeader(RolloutServer):
    engine_factory = fakes.FakeSGLangEngine

    async def engine_args(self):
        return dict(self.engine._engine.server_args)

    async def block_generates(self):
        import threading

        self.engine._engine.block = threading.Event()

    async def node_id(self):
        return ray.get_runtime_context().get_node_id()


class FakeHost(NodeEngineHost):
    engine_factory = fakes.FakeNodeEngine

    async def engine_args(self):
        eng = self._procs.engine
        return dict(eng.server_args), eng.env_at_start.get("SGLANG_BLOCK_NONZERO_RANK_CHILDREN")

    async def node_id(self):
        return ray.get_runtime_context().get_node_id()


@pytest.fixture(scope="module")
def two_nodes():
    with fakes.two_ray_nodes("sgl_rollout_multinode", modules=(sys.modules[__name__],), num_cpus=1) as node_ids:
        yield node_ids


def _cause(err):
    return getattr(err, "cause", None) or err


def test_a_replica_over_two_nodes_starts_serves_dies_restarts_and_stops(two_nodes):
    layout = plan_replicas(n_gpus=2, tp_size=2, gpus_per_node=1)[0]
    assert layout.nnodes == 2
    cfg = RolloutConfig(model_path="/fake", validate_sync=False, tensor_model_parallel_size=2)
    leader, hosts = launch_replica(cfg, layout, two_nodes, name="mn_replica", actor_cls=FakeLeader, host_cls=FakeHost)
    assert ray.get(leader.start.remote(layout, hosts), timeout=120)  # tags
    (host,) = hosts
    assert ray.get(leader.node_id.remote()) == two_nodes[0] and ray.get(host.node_id.remote()) == two_nodes[1]

    lead_args = ray.get(leader.engine_args.remote())
    host_args, block = ray.get(host.engine_args.remote())
    assert (lead_args["nnodes"], lead_args["node_rank"], host_args["node_rank"]) == (2, 0, 1)
    assert lead_args["tp_size"] == host_args["tp_size"] == 2
    assert lead_args["dist_init_addr"] == host_args["dist_init_addr"]
    assert lead_args["dist_init_addr"].endswith(f":{layout.dist_init_port}")  # the block was free: not moved
    assert lead_args["nccl_port"] == host_args["nccl_port"] == layout.nccl_port
    assert block == "0" and lead_args["enable_memory_saver"] is True and host_args["enable_memory_saver"] is True
    assert ray.get(host.__ray_call__.remote(lambda self: self.sigquit_handled)) is True

    out = ray.get(leader.generate_batch.remote([[1, 2]], {"max_new_tokens": 1}), timeout=30)
    assert out[0][0].output_ids == [3]
    ray.get(leader.sleep.remote(), timeout=30)
    ray.get(leader.wake_up.remote(), timeout=30)
    timeline = ray.get(leader.__ray_call__.remote(lambda self: self.node_timeline))
    assert [r["phase"] for r in timeline] == ["sleep", "resume_weights", "resume_kv_cache"]
    assert all(sorted(r["nodes"]) == [0, 1] for r in timeline)  # every node reported (no NVML here: {})

    # node 1's scheduler dies while a generate runs on the leader: an error, not a hang
    ray.get(leader.block_generates.remote())
    in_flight = leader.generate_batch.remote([[1]], {"max_new_tokens": 1})
    (pid,) = ray.get(host.child_pids.remote())
    t0 = time.monotonic()
    os.kill(pid, 9)
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        ray.get(in_flight, timeout=30)
    assert isinstance(_cause(err.value), EngineDeadError) and "node 1" in str(_cause(err.value))
    assert time.monotonic() - t0 < 15
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        ray.get(leader.generate_batch.remote([[1]], {"max_new_tokens": 1}), timeout=30)
    assert isinstance(_cause(err.value), EngineDeadError)
    assert "exited" in ray.get(host.status.remote())

    ray.get(leader.restart.remote(), timeout=120)
    (pid2,) = ray.get(host.child_pids.remote())
    assert pid2 != pid and ray.get(host.status.remote()) is None
    out = ray.get(leader.generate_batch.remote([[5]], {"max_new_tokens": 2}), timeout=30)
    assert out[0][0].output_ids == [6, 7]

    leader_pids = ray.get(leader.__ray_call__.remote(lambda self: self.engine._child_pids))
    ray.get(leader.shutdown.remote(), timeout=60)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(fakes.process_alive(p) for p in leader_pids + [pid2]):
        time.sleep(0.1)
    assert not any(fakes.process_alive(p) for p in leader_pids + [pid2])
    assert ray.get(host.status.remote()) == "stopped"


def test_a_host_is_never_node_zero_and_the_leader_wants_one_host_per_other_node(two_nodes):
    with pytest.raises(ValueError, match="node 0 is the leader"):
        NodeEngineHost(RolloutConfig(model_path="/fake").model_dump(), 0)
    layout = plan_replicas(2, 2, 1)[0]
    cfg = RolloutConfig(model_path="/fake", validate_sync=False, tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="3 node ids for a replica over 2 nodes"):
        launch_replica(cfg, layout, two_nodes + two_nodes[:1], host_cls=FakeHost)
    leader = ray.remote(FakeLeader).remote(cfg.model_dump())
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        ray.get(leader.start.remote(layout, []), timeout=30)
    assert isinstance(_cause(err.value), ValueError) and "0 node hosts" in str(_cause(err.value))
