"""A process that only hosts the engine (as the Ray server actor does: SGLang's schedulers hold the GPU
memory) never creates a CUDA context, through start, generate, sleep and wake up: one there would hold
GPU memory on its first GPU for the whole run, training included. (Importing SGLang initializes torch's
CUDA state, so ``torch.cuda.is_initialized()`` is True there all the same.)"""

import json
import os
import subprocess
import sys

from sgl_rollout.bench import LLAMA_TINY, make_llama_dir

HOST = r'''
import json, sys
import torch
from sgl_rollout.bench import gpu_engine_flags
from sgl_rollout.config import RolloutConfig
from sgl_rollout.memory import has_cuda_context, nvml_device_memory
from sgl_rollout.worker import RolloutWorker

if __name__ == "__main__":
    cfg = RolloutConfig(model_path=sys.argv[1], load_format="dummy", gpu_memory_utilization=0.1, enforce_eager=True,
                        sleep_level=1, engine_kwargs=gpu_engine_flags())
    worker = RolloutWorker(cfg)
    try:
        params = {"max_new_tokens": 4, "ignore_eos": True}
        n = [len(worker.generate([[1, 2, 3]], params)[0][0].output_ids)]
        worker.sleep()
        worker.wake_up()
        n.append(len(worker.generate([[1, 2, 3]], params)[0][0].output_ids))
        used = [r.used_bytes for r in worker.timeline.records]
        context = has_cuda_context(0)
        free0, _ = nvml_device_memory(0)
        torch.zeros(1, device="cuda")  # what the host would have paid: a CUDA context
        free1, _ = nvml_device_memory(0)
        print("RESULT " + json.dumps({"cuda_context": context, "tokens": n, "context_bytes": free0 - free1,
                                      "context_after": has_cuda_context(0),
                                      "phases": [r.phase for r in worker.timeline.records], "used": used}))
    finally:
        worker.shutdown()
'''


def test_engine_host_creates_no_cuda_context(tmp_path):
    make_llama_dir(str(tmp_path / "tiny"), LLAMA_TINY)
    run = subprocess.run([sys.executable, "-c", HOST, str(tmp_path / "tiny")], capture_output=True, text=True,
                         timeout=280, env=dict(os.environ))
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    print(f"\n{res}\na CUDA context in the host would take {res['context_bytes'] / 2**20:.0f} MiB")
    assert res["tokens"] == [4, 4]
    assert res["cuda_context"] is False and res["context_after"] is True  # the probe sees a context
    # the timeline still has the device's figures (from NVML): the sleep freed the KV cache
    used = dict(zip(res["phases"], res["used"]))
    assert used["engine_ready"] > used["sleep"] > 0
