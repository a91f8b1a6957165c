"""Model shapes and model folders for the benchmarks and the GPU tests (Llama-shaped, random weights)."""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

import torch

from ..workloads import gpu_engine_flags  # noqa: F401 - the benchmarks' and the GPU tests' name for it

# TinyLlama-1.1B's shape.
LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
    num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
)
# Llama-3-8B's shape (7.0B parameters in its decoder layers; the embeddings follow the tokenizer's vocabulary).
LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
)
# SmolLM2-135M's shape (the demo's model; tied embeddings).
SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True,
)
# Tiny Llama for exact comparisons against Hugging Face.
LLAMA_TINY = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, vocab_size=1024, max_position_embeddings=1024,
)


def make_llama_dir(path: str, shape: Dict, dtype: torch.dtype = torch.bfloat16, with_weights: bool = False,
                   seed: int = 0, init_std: float = 0.02, device: str = "cpu"):
    """Write a Llama-shaped Hugging Face model folder (config, and weights when asked).

    Args:
        path: folder to write.
        shape: LlamaConfig fields (``LLAMA_1B``, ``LLAMA_TINY``).
        dtype: ``torch_dtype`` of the config and of the saved weights.
        with_weights: save random weights (safetensors); else only config.json, for
            ``load_format="dummy"``.
        seed, init_std: random init of the weights (normal with this std).
        device: where the weights are initialised (``"cuda"`` makes a 1.1B model in seconds).

    Returns:
        the ``LlamaForCausalLM`` (on CPU) when ``with_weights``, else None.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {k: v for k, v in shape.items() if k != "tie_word_embeddings"}
    cfg = LlamaConfig(**fields, architectures=["LlamaForCausalLM"], tie_word_embeddings=bool(shape.get("tie_word_embeddings")),
                      initializer_range=init_std, torch_dtype=dtype, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    os.makedirs(path, exist_ok=True)
    if not with_weights:
        cfg.save_pretrained(path)
        return None
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    model = model.to("cpu")
    model.save_pretrained(path, safe_serialization=True)
    return model


def llama_named_tensors(shape: Dict, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                        seed: int = 0) -> List[Tuple[str, torch.Tensor]]:
    """Random (name, tensor) pairs with Hugging Face Llama names and shapes, as a trainer sends them."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    hd = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd

    def rnd(*s):
        return (torch.randn(*s, device=device, dtype=torch.float32, generator=g) * 0.02).to(dtype)

    out = [("model.embed_tokens.weight", rnd(v, h))]
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [
            (p + "self_attn.q_proj.weight", rnd(h, h)),
            (p + "self_attn.k_proj.weight", rnd(kv, h)),
            (p + "self_attn.v_proj.weight", rnd(kv, h)),
            (p + "self_attn.o_proj.weight", rnd(h, h)),
            (p + "mlp.gate_proj.weight", rnd(i, h)),
            (p + "mlp.up_proj.weight", rnd(i, h)),
            (p + "mlp.down_proj.weight", rnd(h, i)),
            (p + "input_layernorm.weight", torch.ones(h, device=device, dtype=dtype)),
            (p + "post_attention_layernorm.weight", torch.ones(h, device=device, dtype=dtype)),
        ]
    out.append(("model.norm.weight", torch.ones(h, device=device, dtype=dtype)))
    if not shape.get("tie_word_embeddings"):
        out.append(("lm_head.weight", rnd(v, h)))
    return out


#: Modules a LoRA adapter wraps in ``bench lora`` (PEFT's all-linear for Llama).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_named_tensors(shape: Dict, rank: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                       seed: int = 0) -> List[Tuple[str, torch.Tensor]]:
    """Random adapter tensors with PEFT's names (``base_model.model.<module>.lora_A.weight``: ``(rank, in)``,
    ``lora_B.weight``: ``(out, rank)``) on every :data:`LORA_TARGETS` module of a Llama of ``shape``."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # (in, out)
    out = []
    for layer in range(shape["num_hidden_layers"]):
        for m in LORA_TARGETS:
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            p = f"base_model.model.model.layers.{layer}.{part}.{m}."
            fan_in, fan_out = dims[m]
            out.append((p + "lora_A.weight", (torch.randn(rank, fan_in, device=device, generator=g) * 0.01).to(dtype)))
            out.append((p + "lora_B.weight", (torch.randn(fan_out, rank, device=device, generator=g) * 0.01).to(dtype)))
    return out


def redraw(model, seed: int, init_std: float = 0.15) -> None:
    """Redraw every parameter of ``model`` in place from ``seed``: matrices N(0, ``init_std``), biases
    N(0, 0.1), 1-D norm weights U(0.5, 1.5). A trainer step's stand-in that changes greedy output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                new = torch.randn(p.shape, generator=g) * init_std
            elif name.endswith("bias"):
                new = torch.randn(p.shape, generator=g) * 0.1
            else:
                new = torch.rand(p.shape, generator=g) + 0.5
            p.copy_(new.to(p.dtype))
