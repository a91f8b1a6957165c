"""A trainer worker for the Ray GPU tests: the HF model on its one GPU, sending its weights bucket by bucket
(each TP rank's payload from its own GPU, ``sgl_rollout.server.sync_weights_from_workers``)."""

import os
import sys

import torch


class Trainer:
    """The HF model on this actor's GPU; ``hold_bytes`` more are allocated first (an uneven GPU)."""

    def __init__(self, model_dir, hold_bytes=0):
        from transformers import AutoModelForCausalLM

        self.hold = torch.empty(hold_bytes, dtype=torch.uint8, device="cuda") if hold_bytes else None
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).cuda().eval()
        self.stream = None
        self.saved = None

    def info(self):
        """``(Ray node id, CUDA_VISIBLE_DEVICES, free bytes on the GPU)``."""
        import ray

        return (ray.get_runtime_context().get_node_id(), os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                torch.cuda.mem_get_info()[0])

    def perturb(self, on: bool):
        """Scale the first MLP's down projection by 3 (on) or put the saved weights back (off)."""
        w = self.model.model.layers[0].mlp.down_proj.weight
        with torch.no_grad():
            if on:
                self.saved = w.detach().clone()
                w.mul_(3.0)
            else:
                w.copy_(self.saved)

    def start_sync(self, bucket_bytes):
        from sgl_rollout.weight_sync import BucketStream

        self.stream = BucketStream(self.model.named_parameters(), bucket_bytes)

    def next_weight_payload(self):
        return self.stream.next_payload()

    def release_weight_payload(self):
        self.stream.release()

    def check_greedy(self, prompts, got):
        sys.path.insert(0, os.path.dirname(__file__))
        from greedy import assert_greedy_equal

        assert_greedy_equal(self.model, prompts, got)
        return True
