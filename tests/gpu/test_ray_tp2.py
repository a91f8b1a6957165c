"""2 GPUs, Ray: two trainer workers (one per GPU, the first holding ~20 GB before the second starts),
then a TP=2 engine hosted through sgl_rollout.server starts, generates, sleeps, takes a weight sync from
both workers (each sending its TP rank's payload from its own GPU), wakes and generates HF's greedy output."""

import os
import sys

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
def cluster(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    path = str(tmp_path_factory.mktemp("tiny_ray"))
    make_llama_dir(path, LLAMA_TINY, with_weights=True, init_std=0.15)
    ray.init(num_gpus=2, num_cpus=8, include_dashboard=False, log_to_driver=True)
    yield path
    ray.shutdown()


def test_tp2_engine_through_ray_syncs_from_two_workers(cluster):
    from sgl_rollout.server import RolloutServer, launch_rollout_server, merge_visible_devices, sync_weights_from_workers

    model_dir = cluster
    for mod in (sys.modules[__name__], trainers):
        ray.cloudpickle.register_pickle_by_value(mod)  # workers cannot import the test modules
    TrainerActor = ray.remote(num_gpus=1)(Trainer)
    first = TrainerActor.remote(model_dir, hold_bytes=20 * 10**9)  # loads first, fills its GPU unevenly
    info_first = ray.get(first.info.remote())
    second = TrainerActor.remote(model_dir)
    info_second = ray.get(second.info.remote())
    print(f"\ntrainer workers: {info_first}, {info_second}")
    assert info_first[1] != info_second[1]
    workers = [first, second] if int(info_first[1]) < int(info_second[1]) else [second, first]  # TP rank = GPU order

    cfg = RolloutConfig(model_path=model_dir, tensor_model_parallel_size=2, gpu_memory_utilization=0.3,
                        load_format="dummy", update_weights_bucket_megabytes=1, engine_kwargs=gpu_engine_flags())
    devices = merge_visible_devices([info_first[1], info_second[1]])
    server = launch_rollout_server(cfg, devices, actor_cls=RolloutServer)
    ray.get(server.start.remote())
    # SGLang's tokenizer manager runs on the actor's own loop (RolloutServer.engine_loop), not a thread of the engine
    assert ray.get(server.__ray_call__.remote(lambda self: self.engine._loop_thread is None))
    env = ray.get(server.env.remote())
    assert env["CUDA_VISIBLE_DEVICES"] == devices and env["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] == "0"

    dummy = [g[0].output_ids for g in ray.get(server.generate_batch.remote(PROMPTS, GREEDY))]
    assert ray.get(server.sleep.remote()) == ["weights", "kv_cache", "cuda_graph"]
    ray.get(server.resume_stage.remote("weights"))
    ray.get([w.start_sync.remote(cfg.bucket_bytes) for w in workers])
    n = sync_weights_from_workers(server, workers)
    assert n > 1
    ray.get(server.resume_stage.remote("kv_cache"))
    got = [g[0].output_ids for g in ray.get(server.generate_batch.remote(PROMPTS, GREEDY))]
    print(f"dummy weights: {dummy}\nsynced weights: {got}")
    assert got != dummy
    assert ray.get(workers[0].check_greedy.remote(PROMPTS, got))
    ray.get(server.shutdown.remote())
