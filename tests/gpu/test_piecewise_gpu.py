"""Piecewise CUDA graphs on (``RolloutConfig.piecewise_cuda_graph``, on through verl): SGLang keeps them,
greedy output equals Hugging Face's before and after a sleep and a weight sync, and sleep still frees the
weights and the KV cache (the graphs' own memory stays held: it lies outside torch-memory-saver's regions)."""

import pytest
import torch

from sgl_rollout.bench import LLAMA_TINY, gpu_engine_flags, make_llama_dir
from sgl_rollout.config import RolloutConfig
from sgl_rollout.memory import device_memory
from sgl_rollout.worker import RolloutWorker

from .greedy import PROMPTS, assert_greedy_equal, engine_greedy, new_weights


@pytest.fixture(scope="module")
def piecewise(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-piecewise"))
    model = make_llama_dir(path, LLAMA_TINY, dtype=torch.bfloat16, with_weights=True, init_std=0.15)
    # a few token sizes keep the capture short; the prompts' prefill batches (3-28 tokens) use them
    cfg = RolloutConfig(model_path=path, dtype="bfloat16", gpu_memory_utilization=0.15, piecewise_cuda_graph=True,
                        update_weights_bucket_megabytes=1,
                        engine_kwargs=dict(gpu_engine_flags(), cuda_graph_max_bs=8,
                                           piecewise_cuda_graph_tokens=[8, 16, 32, 64]))
    worker = RolloutWorker(cfg)
    yield worker, model.cuda().eval()
    worker.shutdown()


def greedy(worker, n=12):
    return engine_greedy(worker, PROMPTS, n)


def test_piecewise_graphs_kept_and_greedy_matches_hf_across_sleep_and_sync(piecewise):
    worker, model = piecewise
    args = worker.engine.server_info()
    assert args["disable_piecewise_cuda_graph"] is False  # SGLang's own checks kept them on
    assert_greedy_equal(model, PROMPTS, greedy(worker))
    awake, _ = device_memory()
    worker.sleep()
    asleep, _ = device_memory()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"\nsleep freed {(asleep - awake) / 2**20:.0f} MiB (weights {weight_bytes / 2**20:.0f} MiB)")
    assert asleep - awake > weight_bytes
    new_weights(model, 3)
    worker.update_weights(model.named_parameters())
    assert_greedy_equal(model, PROMPTS, greedy(worker))
