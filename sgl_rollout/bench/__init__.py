"""Benchmarks, ``python -m sgl_rollout.bench <command>`` (:mod:`.__main__`):

* ``verl``: verl's built-in SGLang rollout against this package in verl's own trainer, with verl's
  metrics and the weight update split into phases (:mod:`.verl_compare`, :mod:`.verl_report`,
  :mod:`.verl_probe`);
* ``sync``, ``lora``, ``gather``: the weight sync into one SGLang engine, an adapter sync against a full
  sync, the sender's copy primitives (:mod:`.sync`);
* ``requests``: what the guarded engine adds per generate request, on the CPU with an engine double
  (:mod:`.requests`);
* ``scale``: sync and switch cost at 8, 64 and 1,000 GPUs, on paper (:mod:`.scale`).

:mod:`.models` makes the Llama-shaped model folders they (and the GPU tests) use; :mod:`.vlm` a tiny
Qwen2.5-VL folder (random weights, processor built from its config) and :mod:`.chat_tokenizer` the offline
byte-level ChatML tokenizer (tools, vision placeholders) it and the agent-loop tests use.
"""

from .models import LLAMA_1B, LLAMA_TINY, LORA_TARGETS, SMOLLM2_135M, gpu_engine_flags, llama_named_tensors, \
    lora_named_tensors, make_llama_dir

__all__ = ["LLAMA_1B", "LLAMA_TINY", "LORA_TARGETS", "SMOLLM2_135M", "gpu_engine_flags", "llama_named_tensors",
           "lora_named_tensors", "make_llama_dir", "write_result"]


def write_result(res, out: str, default_name: str) -> str:
    """Write a benchmark's result ``res`` (JSON-able) as JSON to ``out`` and return the file's path: ``out`` itself, or
    ``out/default_name`` when ``out`` is a folder (one that exists, or a path ending in ``/``; ``bench verl``'s
    ``--out`` is a folder, and a sweep given one used to end in ``IsADirectoryError`` after its whole run).
    Missing parent folders are made.

    Raises:
        OSError: the file cannot be written.
    """
    import json
    import os

    path = os.path.join(out, default_name) if os.path.isdir(out) or out.endswith(("/", os.sep)) else out
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    return path
