"""``sleep_level=1`` on a real engine: sleep releases the KV cache and keeps the weights; a fast-path weight
sync while asleep lands whole and frees its buffer before the KV cache comes back (``RolloutWorker.update_weights``),
so the buffer does not stay on the trainer's GPU while the trainer runs. One engine, its own file."""

import torch

from sgl_rollout.bench import LLAMA_TINY, gpu_engine_flags, make_llama_dir
from sgl_rollout.config import RolloutConfig
from sgl_rollout.worker import RolloutWorker

from .greedy import PROMPTS, assert_greedy_equal, engine_greedy, new_weights


def test_level1_sync_lands_and_frees_the_fast_path_buffer(tmp_path):
    model = make_llama_dir(str(tmp_path), LLAMA_TINY, dtype=torch.bfloat16, with_weights=True, init_std=0.15)
    cfg = RolloutConfig(model_path=str(tmp_path), dtype="bfloat16", gpu_memory_utilization=0.15, sleep_level=1,
                        fast_sync=True, enforce_eager=True, engine_kwargs=gpu_engine_flags())
    worker = RolloutWorker(cfg)
    try:
        model = model.cuda().eval()
        for seed in (1, 2):
            tags = worker.sleep()
            assert "kv_cache" in tags and "weights" not in tags  # level 1: the weights stay where they are
            new_weights(model, seed)
            torch.cuda.synchronize()
            trainer_bytes = torch.cuda.memory_allocated()
            stats = worker.update_weights(model.named_parameters())
            phases = worker.last_phase_seconds
            print(f"\nlevel 1, sync {seed}: {stats.bytes} bytes; phases {phases}")
            assert "sync.call" in phases  # the fast path carried it
            assert "release_sync_buffers" in phases and not worker._fast.holds_buffers
            # the buffer (one bucket: every weight of this model, stats.bytes) is gone from the trainer's process
            assert torch.cuda.memory_allocated() - trainer_bytes < stats.bytes // 2
            assert worker.engine.state.released == ()
            assert_greedy_equal(model, PROMPTS, engine_greedy(worker, PROMPTS, 10))
    finally:
        worker.shutdown()
