"""Model shapes and model folders for the benchmarks and the GPU tests (random weights): Llama-shaped, and a
tiny Qwen3-MoE (:data:`QWEN3_MOE_TINY`, :func:`make_qwen3_moe_dir`) for mixture-of-experts syncs."""

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

# A tiny Qwen3-MoE for the fast path's mixture-of-experts tests (issue 47, goal 4): 8 experts, 2 active, every
# layer sparse (SGLang's Qwen3MoeDecoderLayer makes every layer a Qwen3MoeSparseMoeBlock,
# ``sglang/srt/models/qwen3_moe.py``); 8 query and 4 key/value heads and a per-rank expert width of 64 at TP=2;
# a vocabulary that is not a multiple of 64 (SGLang pads it); head_dim 64, a size SGLang's fused rotary kernel takes
# (with 32 its scheduler died on the first request: ``sgl_rollout.engine.core.fused_kv_rope_problem``).
QWEN3_MOE_TINY = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
    vocab_size=1000, max_position_embeddings=512,
)
# ``bench verl --random-model moe`` (issue 47, goal 4): a Qwen3-MoE of 8 experts, 2 active, 16 layers, with
# Qwen3-30B-A3B's expert width (768) and head size (128); about 0.4B parameters besides the embeddings
# (0.5B with SmolLM2's vocabulary, 1 GB in bf16): one GPU, TP=2 too (16 query and 4 key/value heads).
QWEN3_MOE_BENCH = dict(
    hidden_size=1024, intermediate_size=3072, moe_intermediate_size=768, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=4, head_dim=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
    max_position_embeddings=4096,
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
    return _save_random(LlamaForCausalLM, cfg, path, dtype, seed, device)


def _save_random(model_cls, cfg, path: str, dtype: torch.dtype, seed: int, device: str):
    """``model_cls(cfg)`` drawn on ``device`` under ``seed`` by transformers' own init, cast to ``dtype``,
    moved to the CPU and saved as safetensors in ``path``; returns it."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(cfg).to(dtype)
    model = model.to("cpu")
    model.save_pretrained(path, safe_serialization=True)
    return model


def make_qwen3_moe_dir(path: str, shape: Dict = QWEN3_MOE_TINY, dtype: torch.dtype = torch.bfloat16,
                       seed: int = 0, init_std: float = 0.15, device: str = "cpu"):
    """Write a Qwen3-MoE Hugging Face model folder of ``shape`` with random weights (config and safetensors).

    Every matrix (experts and router included) is drawn from N(0, ``init_std``) by transformers' own init
    (``initializer_range``); norms are ones. The checkpoint holds one tensor per expert and projection,
    ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`` (``(moe_intermediate_size, hidden_size)``,
    the same, ``(hidden_size, moe_intermediate_size)``), as Qwen3-30B-A3B's does and as SGLang's
    ``Qwen3MoeForCausalLM.load_weights`` reads it, also where transformers >= 5 holds the experts fused in
    memory (:func:`qwen3_moe_checkpoint_tensors`).

    Args:
        path: folder to write.
        shape: ``Qwen3MoeConfig`` fields (:data:`QWEN3_MOE_TINY`); ``tie_word_embeddings`` optional.
        dtype: ``torch_dtype`` of the config and of the saved weights.
        seed, init_std: random init of the matrices.
        device: where the weights are initialised (``"cuda"`` for :data:`QWEN3_MOE_BENCH`'s size).

    Returns:
        the ``Qwen3MoeForCausalLM`` (``dtype``, on CPU) whose weights were saved.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fields = {k: v for k, v in shape.items() if k != "tie_word_embeddings"}
    cfg = Qwen3MoeConfig(**fields, architectures=["Qwen3MoeForCausalLM"],
                         tie_word_embeddings=bool(shape.get("tie_word_embeddings")), initializer_range=init_std,
                         torch_dtype=dtype, bos_token_id=1, eos_token_id=2, decoder_sparse_step=1, mlp_only_layers=[])
    os.makedirs(path, exist_ok=True)
    return _save_random(Qwen3MoeForCausalLM, cfg, path, dtype, seed, device)


def qwen3_moe_checkpoint_tensors(model) -> List[Tuple[str, torch.Tensor]]:
    """A Qwen3-MoE's ``named_parameters()`` under its checkpoint names, as SGLang's loader and the weight
    manifest name them: views, no copies, on the model's device, in the model's order.

    transformers >= 5 holds each layer's experts fused, ``mlp.experts.gate_up_proj`` ``(E, 2*I, H)`` (gate
    rows first) and ``mlp.experts.down_proj`` ``(E, H, I)`` (``transformers/models/qwen3_moe/modeling_qwen3_moe.py``,
    ``Qwen3MoeExperts``; ``conversion_mapping.py`` merges the checkpoint's per-expert tensors into them on
    load and splits them on save); each becomes ``mlp.experts.E.gate_proj.weight`` ``(I, H)``, ``up_proj``
    ``(I, H)`` and ``down_proj`` ``(H, I)``, by the split every weight sync uses
    (:func:`sgl_rollout.checkpoint_names.mappings_for_config`). Per-expert names (transformers 4) pass unchanged.

    Raises:
        ValueError: a fused expert tensor whose shape is not ``(E, 2*I, H)`` / ``(E, H, I)`` of the config.
    """
    from ..checkpoint_names import mappings_for_config

    cfg = model.config
    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    expected = {"gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}
    split = mappings_for_config(cfg)[1]  # transformers' own fusion, reversed (sgl_rollout.checkpoint_names)
    out: List[Tuple[str, torch.Tensor]] = []
    for name, p in model.named_parameters():
        base, _, last = name.rpartition(".")
        if base.endswith("mlp.experts") and last in expected and tuple(p.shape) != expected[last]:
            raise ValueError(f"{name}: shape {tuple(p.shape)}, expected {expected[last]}")
        out += split(name, p.detach()) if split is not None else [(name, p.detach())]
    return out


def route_by_token(model, spike: float = 4.0, step: float = 1.0) -> None:
    """Make a Qwen3-MoE's routing a function of the token id, with wide margins, in place (random elsewhere).

    With random routers, the second and third of 8 router logits often lie within bf16 rounding of each
    other, and SGLang and Hugging Face (different attention and norm kernels) then pick different experts:
    a whole expert's output apart, not a near-tie in the logits. Here residual dims ``0..E-1`` carry
    ``spike`` at dim ``token id mod E`` (the embedding) and nothing writes them later (those rows of every
    ``o_proj`` and expert ``down_proj`` are zero), and each router reads only them: layer ``L``'s logit of
    expert ``e`` for token ``t`` is ``step * (E - 1 - (e - t - L) mod E) * x``, ``x`` the normalized spike
    (post-attention norm). Experts ``(t + L) mod E`` and ``(t + L + 1) mod E`` are chosen (their reverse
    order where the norm weight is negative) by a margin of ``step * |x|``: the logits are one product each,
    so kernels that scale ``x`` a little differently still rank them alike. Every expert serves some token.

    Args:
        model: a ``Qwen3MoeForCausalLM`` (fused or per-expert experts: :func:`qwen3_moe_checkpoint_tensors`).
        spike: the embedding's value at the token's routing dim.
        step: the router's weight step between consecutive experts' ranks.

    Raises:
        ValueError: ``hidden_size`` is smaller than ``num_experts``.
    """
    e_count = model.config.num_experts
    if model.config.hidden_size < e_count:
        raise ValueError(f"hidden_size {model.config.hidden_size} < num_experts {e_count}")
    with torch.no_grad():
        for name, t in qwen3_moe_checkpoint_tensors(model):
            writes_residual = name.endswith("self_attn.o_proj.weight") or (
                ".mlp.experts." in name and name.endswith("down_proj.weight"))
            if writes_residual:
                t[:e_count].zero_()
            elif name.endswith("mlp.gate.weight"):
                layer = int(name.split(".")[2])
                e = torch.arange(e_count, device=t.device)[:, None]
                tok = torch.arange(e_count, device=t.device)[None, :]
                t.zero_()
                t[:, :e_count] = ((e_count - 1 - (e - tok - layer) % e_count) * step).to(t.dtype)
            elif name == "model.embed_tokens.weight":
                ids = torch.arange(t.shape[0], device=t.device)
                t[:, :e_count] = 0
                t[ids, ids % e_count] = spike


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
