"""verl's replica over two nodes through this package, on a CPU Ray cluster of two raylets (engine doubles).

``actor_rollout_ref.rollout.tensor_model_parallel_size=2`` with ``trainer.n_gpus_per_node=1``: verl's
``RolloutReplica`` computes ``nnodes == 2`` and places one trainer worker (TP rank) per node. Checked:
``launch_servers`` puts the leader (``VerlRolloutServer``) on node 0 and a ``VerlNodeHost`` on node 1,
in node-rank order in ``servers`` as verl's own replica does, with the leader's address; every engine is
started with its node rank; verl's replica calls (``sleep``, ``wake_up`` and the rest, sent to every
server) work, the other node answering as a no-op; a generate goes through the leader; the memory
timeline has both nodes; shutdown ends both nodes' processes.
"""

import asyncio
import sys
import types

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("verl")

import _sglang_cpu  # noqa: E402
import fakes  # noqa: E402
from test_verl_config import compose, make_tiny_model  # noqa: E402

from sgl_rollout.integrations.verl_server import SglRolloutReplica, VerlNodeHost, VerlRolloutServer  # noqa: E402


class LeaderServer(VerlRolloutServer):
    engine_factory = fakes.FakeSGLangEngine

    async def start(self, *args, **kwargs):
        _sglang_cpu.ensure_sglang_importable()
        sys.modules["sgl_rollout.engine.io_struct"].make = lambda name, **fields: types.SimpleNamespace(**fields)
        return await super().start(*args, **kwargs)

    async def engine_args(self):
        return dict(self._engine._engine.server_args)

    async def node_id(self):
        return ray.get_runtime_context().get_node_id()


class NodeHost(VerlNodeHost):
    engine_factory = fakes.FakeNodeEngine

    async def engine_args(self):
        return dict(self._procs.engine.server_args)

    async def node_id(self):
        return ray.get_runtime_context().get_node_id()


class Replica(SglRolloutReplica):
    server_class = LeaderServer
    node_host_class = NodeHost


class TrainerWorker:
    def ping(self):
        return True


@pytest.fixture(scope="module")
def two_nodes():
    with fakes.two_ray_nodes("sgl_rollout_verl_mn", modules=(sys.modules[__name__], _sglang_cpu,), num_cpus=2) as node_ids:
        yield node_ids


def test_verl_replica_over_two_nodes(two_nodes, tmp_path):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.replica import RolloutMode

    model = make_tiny_model(str(tmp_path / "tiny-llama"), hidden=128, intermediate=256, vocab=512)
    root = compose("actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=1",
                   "trainer.nnodes=2", "actor_rollout_ref.rollout.enforce_eager=true", model_path=model)
    cfg = omega_conf_to_dataclass(root.actor_rollout_ref.rollout)
    workers = [ray.remote(num_cpus=0)(TrainerWorker).options(
        runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": "0"}},
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote() for node in two_nodes]
    replica = Replica(replica_rank=0, config=cfg, model_config=root.actor_rollout_ref.model, gpus_per_node=1)
    assert replica.nnodes == 2
    replica.workers, replica.rollout_mode = workers, RolloutMode.HYBRID
    asyncio.run(replica.launch_servers())

    leader, host = replica.servers
    assert replica.server_handle == leader
    assert ray.get(leader.node_id.remote()) == two_nodes[0] and ray.get(host.node_id.remote()) == two_nodes[1]
    ip, port = ray.get(leader.get_server_address.remote())
    assert replica.server_address == f"{ip}:{port}"
    lead, other = ray.get(leader.engine_args.remote()), ray.get(host.engine_args.remote())
    assert (lead["node_rank"], other["node_rank"], lead["nnodes"], other["nnodes"]) == (0, 1, 2, 2)
    assert lead["dist_init_addr"] == other["dist_init_addr"] and lead["dist_init_addr"].startswith(f"{ip}:")
    assert lead["tp_size"] == other["tp_size"] == 2

    # verl's replica calls every server; the other node answers them without touching SGLang
    asyncio.run(replica.sleep())
    asyncio.run(replica.wake_up())
    asyncio.run(replica.clear_kv_cache())
    asyncio.run(replica.abort_all_requests())
    asyncio.run(replica.resume_generation())
    out = ray.get(leader.generate.remote([5, 6], {"max_new_tokens": 3}, "req0"))
    assert out.token_ids == [7, 8, 9]
    phases = ray.get(leader.__ray_call__.remote(lambda self: [(r["phase"], sorted(r["nodes"])) for r in self.node_timeline]))
    assert phases[0] == ("sleep", [0, 1]) and ("resume_weights", [0, 1]) in phases

    pids = ray.get(host.child_pids.remote())
    ray.get(leader.shutdown.remote())
    assert ray.get(host.status.remote()) == "stopped"
    assert all(not fakes.process_alive(p) for p in pids)

