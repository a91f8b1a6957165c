"""Start a TP=2 engine while ~20 GB are held on GPU 0 only (a trainer worker that loaded first).

Usage: python tests/gpu/tp_start.py {package,sglang-default} MODEL_DIR
Prints GENERATED <ids> on success. Run as a script: SGLang spawns its scheduler.
"""

import sys

import torch

from sgl_rollout.bench import gpu_engine_flags
from sgl_rollout.config import RolloutConfig
from sgl_rollout.engine import RolloutEngine

if __name__ == "__main__":
    mode, model_dir = sys.argv[1], sys.argv[2]
    held = torch.empty(20 * 10**9, dtype=torch.uint8, device="cuda:0")
    free = [torch.cuda.mem_get_info(i)[0] / 1e9 for i in range(2)]
    print(f"free GB per GPU before engine start: {free}", flush=True)
    cfg = RolloutConfig(model_path=model_dir, tensor_model_parallel_size=2, gpu_memory_utilization=0.3,
                        enforce_eager=True, engine_kwargs=gpu_engine_flags())
    engine = RolloutEngine(cfg, disable_tp_imbalance_check=(mode == "package"))
    out = engine.generate([[1, 5, 9]], {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True})
    print("GENERATED", out[0][0].output_ids, flush=True)
    engine.shutdown()
