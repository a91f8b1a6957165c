import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _sglang_cpu import ensure_sglang_importable  # noqa: E402

ensure_sglang_importable()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (``bench.LLAMA_TINY``, bf16, weights saved) with the demo's byte-level
    tokenizer, as a Hugging Face folder: one per test module."""
    import torch

    from sgl_rollout.bench import LLAMA_TINY, make_llama_dir
    from sgl_rollout.demo.model import save_byte_level_tokenizer

    path = tmp_path_factory.mktemp("tiny")
    make_llama_dir(str(path), LLAMA_TINY, dtype=torch.bfloat16, with_weights=True, init_std=0.15)
    save_byte_level_tokenizer(path, LLAMA_TINY["vocab_size"])
    return str(path)
