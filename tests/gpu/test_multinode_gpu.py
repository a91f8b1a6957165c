"""2 GPUs as two Ray nodes: one TP=2 replica across both (``sgl_rollout.server.launch_replica``).

Two raylets of ``ray.cluster_utils.Cluster`` (``num_gpus=1`` each, ``CUDA_VISIBLE_DEVICES`` 0 and 1 in the
raylets' environments, ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` so that actors keep them) stand
for two nodes of one GPU. One trainer worker per node holds the HF model on its node's GPU. The replica's
leader (node rank 0) and the other node's ``NodeEngineHost`` start SGLang with ``nnodes=2``.

Checked: greedy outputs after a sync from the two workers (each sends its TP rank's payload from its own
node) equal HF's and a single-node TP=2 engine's on the same weights; sleep level 2 frees memory on both
GPUs (NVML, per node); a sync of other weights changes the outputs and a sync of the old ones brings
them back token for token; killing node 1's scheduler makes the leader raise ``EngineDeadError`` (this
process lives on); ``restart()`` and a sync restore the outputs; shutdown leaves no engine process.
Figures (start, sleep/wake per node, sync, restart seconds) are printed.

Needs 2 GPUs (``nvidia-h200-x2``); skipped with fewer.
"""

import os
import sys
import time

import pytest
import torch

from sgl_rollout.bench import LLAMA_TINY, gpu_engine_flags, make_llama_dir
from sgl_rollout.config import RolloutConfig

ray = pytest.importorskip("ray")

sys.path.insert(0, os.path.dirname(__file__))
import trainers  # noqa: E402
from trainers import Trainer  # noqa: E402

PROMPTS = [[1, 17, 42, 99, 7], [1, 500, 3, 3, 3, 8], [1, 1000, 256]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (two simulated nodes)")
    from ray.cluster_utils import Cluster

    path = str(tmp_path_factory.mktemp("tiny_mn"))
    make_llama_dir(path, LLAMA_TINY, with_weights=True, init_std=0.15)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 8, "num_gpus": 1, "resources": {"node0": 1}, "env_vars": {"CUDA_VISIBLE_DEVICES": "0"}})
    cluster.add_node(num_cpus=8, num_gpus=1, resources={"node1": 1}, env_vars={"CUDA_VISIBLE_DEVICES": "1"})
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}})
    for mod in (sys.modules[__name__], trainers):
        ray.cloudpickle.register_pickle_by_value(mod)  # workers cannot import the test modules
    cluster.wait_for_nodes()
    yield path
    ray.shutdown()
    cluster.shutdown()


def _sync(leader, workers, bucket_bytes) -> float:
    from sgl_rollout.server import sync_weights_from_workers

    t0 = time.perf_counter()
    ray.get([w.start_sync.remote(bucket_bytes) for w in workers])
    sync_weights_from_workers(leader, workers)
    return time.perf_counter() - t0


def _greedy(server):
    return [g[0].output_ids for g in ray.get(server.generate_batch.remote(PROMPTS, GREEDY), timeout=120)]


def test_tp2_replica_over_two_nodes(two_nodes):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from sgl_rollout.engine import EngineDeadError
    from sgl_rollout.engine.layout import replica_layout
    from sgl_rollout.server import launch_replica, launch_rollout_server

    model_dir = two_nodes
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: "node1" in n["Resources"])
    node_ids = [n["NodeID"] for n in nodes]
    workers = [ray.remote(num_gpus=1)(Trainer).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=nid, soft=False)).remote(model_dir) for nid in node_ids]
    infos = ray.get([w.info.remote() for w in workers])
    assert [i[0] for i in infos] == node_ids and infos[0][1] != infos[1][1], infos  # one GPU per node, distinct
    layout = replica_layout(0, 2, [[int(cvd)] for _node, cvd, _free in infos])

    cfg = RolloutConfig(model_path=model_dir, tensor_model_parallel_size=2, gpu_memory_utilization=0.5,
                        load_format="dummy", update_weights_bucket_megabytes=1, engine_kwargs=gpu_engine_flags())
    leader, hosts = launch_replica(cfg, layout, node_ids, name="mn_gpu")
    t0 = time.perf_counter()
    ray.get(leader.start.remote(layout, hosts), timeout=600)
    start_s = time.perf_counter() - t0

    sync_s = _sync(leader, workers, cfg.bucket_bytes)
    synced = _greedy(leader)
    assert ray.get(workers[0].check_greedy.remote(PROMPTS, synced))

    before = ray.get(leader.memory_by_node.remote())
    t0 = time.perf_counter()
    assert ray.get(leader.sleep.remote()) == ["weights", "kv_cache", "cuda_graph"]
    sleep_s = time.perf_counter() - t0
    slept = ray.get(leader.memory_by_node.remote())
    freed = {rank: {g: (before[rank][g] - slept[rank][g]) / 1e9 for g in before[rank]} for rank in before}
    assert all(gb > 1.0 for per_gpu in freed.values() for gb in per_gpu.values()), freed  # both nodes' GPUs
    t0 = time.perf_counter()
    ray.get(leader.resume_stage.remote("weights"))
    wake_w_s = time.perf_counter() - t0
    ray.get([w.perturb.remote(True) for w in workers])
    _sync(leader, workers, cfg.bucket_bytes)
    t0 = time.perf_counter()
    ray.get(leader.resume_stage.remote("kv_cache"))
    wake_kv_s = time.perf_counter() - t0
    changed = _greedy(leader)
    assert changed != synced
    ray.get([w.perturb.remote(False) for w in workers])
    _sync(leader, workers, cfg.bucket_bytes)
    assert _greedy(leader) == synced  # the old weights back: token for token
    timeline = ray.get(leader.__ray_call__.remote(lambda self: self.node_timeline))
    assert all(sorted(r["nodes"]) == [0, 1] for r in timeline)

    # node 1's scheduler dies: the leader raises, this process lives, restart + sync restore the outputs
    (sched, *_rest) = ray.get(hosts[0].child_pids.remote())
    os.kill(sched, 9)
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        ray.get(leader.generate_batch.remote(PROMPTS, GREEDY), timeout=120)
    assert isinstance(getattr(err.value, "cause", err.value), EngineDeadError)
    t0 = time.perf_counter()
    ray.get(leader.restart.remote(), timeout=600)
    restart_s = time.perf_counter() - t0
    _sync(leader, workers, cfg.bucket_bytes)
    assert _greedy(leader) == synced
    pids = ray.get(hosts[0].child_pids.remote()) + ray.get(leader.__ray_call__.remote(
        lambda self: self.engine._child_pids))
    ray.get(leader.shutdown.remote(), timeout=120)
    time.sleep(2)
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]

    # the same weights in a single-node TP=2 engine over both GPUs: the same greedy outputs
    single = launch_rollout_server(cfg, ",".join(str(g) for s in layout.nodes for g in s.gpu_ids), node_id=node_ids[0])
    ray.get(single.start.remote(), timeout=600)
    _sync(single, workers, cfg.bucket_bytes)
    assert _greedy(single) == synced
    ray.get(single.shutdown.remote())
    print(f"\ntwo-node TP=2 replica: start {start_s:.1f} s, first sync {sync_s * 1e3:.0f} ms, sleep {sleep_s * 1e3:.0f} ms "
          f"(freed GB per node/GPU {freed}), wake weights {wake_w_s * 1e3:.0f} ms, wake KV {wake_kv_s * 1e3:.0f} ms, "
          f"restart {restart_s:.1f} s")
