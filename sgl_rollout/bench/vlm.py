"""A tiny Qwen2.5-VL-shaped model folder with random weights, its tokenizer and its processor, made
offline (no hub): what the vision-language GPU tests and benchmarks load into SGLang and into Hugging
Face's ``Qwen2_5_VLForConditionalGeneration`` to compare them.

The folder is what a Qwen2.5-VL checkpoint on the hub holds, in its shape only:

* ``config.json`` in the hub's flat layout (text fields at the top level, ``vision_config``,
  ``rope_scaling = {"type": "mrope", "mrope_section": [...]}`` and the vision token ids), which both
  transformers 5 and SGLang's ``Qwen2_5_VLForConditionalGeneration`` (``sglang/srt/models/qwen2_5_vl.py``)
  read as they read the real checkpoints';
* ``model.safetensors`` under checkpoint names (``model.layers.*``, ``visual.*``; transformers 5 saves
  them so);
* the byte-level ChatML tokenizer of :mod:`.chat_tokenizer` with Qwen2-VL's vision tokens
  (``<|vision_start|>``, ``<|image_pad|>``, ``<|video_pad|>``, ...), and a ``Qwen2_5_VLProcessor``
  (image and video processors with Qwen2-VL's patch 14, merge 2, temporal patch 2). The processor
  needs torchvision (the GPU hosts have it).
"""

from __future__ import annotations

import json
import os
from typing import Dict

import torch

from .chat_tokenizer import build_chat_tokenizer
from .models import redraw  # noqa: F401 - also this module's name for it (the VLM GPU test's)

#: Qwen2-VL's vision tokens, in the order the tokenizer adds them after the chat tokens.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")

#: A small Qwen2.5-VL: 2 text layers (head_dim 64, mrope sections summing to 32), a 2-block vision tower
#: with one full-attention block and 4x4-patch windows (window_size 112 = 8 patches of 14).
QWEN2_5_VL_TINY = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=512, max_position_embeddings=4096, mrope_section=[8, 12, 12],
    vision=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2, fullatt_block_indexes=[1],
                window_size=112),
)

#: Pixel bounds of the tiny model's processor: 4 to 256 merged 28x28 patches per image or frame pair.
MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 256 * 28 * 28


def qwen2_5_vl_config(tokenizer, shape: Dict = QWEN2_5_VL_TINY) -> dict:
    """The ``config.json`` of a Qwen2.5-VL of ``shape`` in the hub's layout, with ``tokenizer``'s ids for
    the vision tokens, eos and pad (bf16, tied embeddings off)."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    v = shape["vision"]
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "hidden_act": "silu", "hidden_size": shape["hidden_size"], "intermediate_size": shape["intermediate_size"],
        "num_hidden_layers": shape["num_hidden_layers"], "num_attention_heads": shape["num_attention_heads"],
        "num_key_value_heads": shape["num_key_value_heads"], "vocab_size": shape["vocab_size"],
        "max_position_embeddings": shape["max_position_embeddings"], "max_window_layers": shape["num_hidden_layers"],
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": shape["max_position_embeddings"],
        "use_sliding_window": False, "attention_dropout": 0.0, "initializer_range": 0.02, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True,
        "bos_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"], "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "rope_scaling": {"type": "mrope", "mrope_section": list(shape["mrope_section"])},
        "vision_config": {
            "depth": v["depth"], "hidden_act": "silu", "hidden_size": v["hidden_size"],
            "intermediate_size": v["intermediate_size"], "num_heads": v["num_heads"], "in_chans": 3,
            "out_hidden_size": shape["hidden_size"], "patch_size": 14, "spatial_merge_size": 2,
            "spatial_patch_size": 14, "temporal_patch_size": 2, "window_size": v["window_size"],
            "fullatt_block_indexes": list(v["fullatt_block_indexes"]), "tokens_per_second": 2,
        },
    }


def build_vlm_processor(tokenizer):
    """A ``Qwen2_5_VLProcessor`` around ``tokenizer``: Qwen2-VL's image and video processors with
    :data:`MIN_PIXELS` / :data:`MAX_PIXELS` and no frame sampling (every frame given is used).

    Raises:
        ImportError: torchvision is missing (transformers' Qwen2-VL video processor needs it).
    """
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, patch_size=14, merge_size=2, temporal_patch_size=2),
        video_processor=Qwen2VLVideoProcessor(size=size, patch_size=14, merge_size=2, temporal_patch_size=2,
                                              do_sample_frames=False),
        tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def make_qwen2_5_vl_dir(path: str, shape: Dict = QWEN2_5_VL_TINY, seed: int = 0, init_std: float = 0.15,
                        with_processor: bool = True):
    """Write a Qwen2.5-VL model folder of ``shape`` with random bf16 weights (see the module docstring).

    Args:
        path: folder to write.
        shape: :data:`QWEN2_5_VL_TINY`'s fields.
        seed, init_std: every matrix drawn from N(0, ``init_std``), biases from N(0, 0.1) (zero in HF's
            own init, which would hide a bias the sync missed), norms from U(0.5, 1.5).
        with_processor: also save the processor (needs torchvision); the tokenizer is saved either way.

    Returns:
        the ``Qwen2_5_VLForConditionalGeneration`` (bf16, on CPU), loaded back from ``path`` so that its
        config is the one SGLang reads.
    """
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    os.makedirs(path, exist_ok=True)
    tok = build_chat_tokenizer(extra_special=VISION_TOKENS)
    tok.save_pretrained(path)
    if with_processor:
        build_vlm_processor(tok).save_pretrained(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(qwen2_5_vl_config(tok, shape), f, indent=1)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration._from_config(AutoConfig.from_pretrained(path),
                                                             torch_dtype=torch.bfloat16)
    redraw(model, seed, init_std)
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "config.json"), "w") as f:  # save_pretrained rewrote it in its own layout
        json.dump(qwen2_5_vl_config(tok, shape), f, indent=1)
    return model.eval()


# ------------------------------------------------------------------------------- the shapes task
#: verl's ``data_source`` of the shapes task (:func:`shapes_score` scores only it).
SHAPES_SOURCE = "sgl_rollout/shapes"
#: The colours a shape is drawn in (RGB); the answer is the colour's name.
COLORS = {"red": (220, 30, 30), "green": (30, 190, 30), "blue": (30, 30, 220)}
SHAPES = ("box", "disc")
#: The user turn; verl's ``RLHFDataset`` turns ``<image>`` into the image part the chat template renders.
SHAPES_PROMPT = "<image>What color is the shape in the picture? Answer with one word."


def draw_shape(shape: str, color: str, top: int, left: int, h: int = 84, w: int = 112):
    """An RGB uint8 picture ``(h, w, 3)``: a 32x40 box or a disc of radius 16 in ``color`` at
    (``top``, ``left``) on grey.

    Raises:
        KeyError: an unknown ``shape`` or ``color``.
    """
    import numpy as np

    img = np.full((h, w, 3), 128, np.uint8)
    rgb = COLORS[color]
    if shape == "box":
        img[top:top + 32, left:left + 40] = rgb
    elif shape == "disc":
        yy, xx = np.mgrid[:h, :w]
        img[(yy - top - 16) ** 2 + (xx - left - 16) ** 2 < 16 ** 2] = rgb
    else:
        raise KeyError(f"unknown shape {shape!r}; one of {SHAPES}")
    return img


def shapes_row(index: int, split: str, rng) -> dict:
    """One row of verl's RL dataset format with an image, as verl's geometry3k files have it
    (``examples/data_preprocess/geo3k.py``: ``images`` a list of ``{"bytes": PNG}``, read by
    ``verl/utils/dataset/rl_dataset.py`` with ``data.image_key=images``); ``rng`` a
    ``numpy.random.Generator`` picks shape, colour and place."""
    import io

    from PIL import Image

    shape, color = SHAPES[int(rng.integers(len(SHAPES)))], list(COLORS)[int(rng.integers(len(COLORS)))]
    picture = draw_shape(shape, color, top=int(rng.integers(0, 84 - 32)), left=int(rng.integers(0, 112 - 40)))
    buf = io.BytesIO()
    Image.fromarray(picture).save(buf, format="PNG")
    return {"data_source": SHAPES_SOURCE, "prompt": [{"role": "user", "content": SHAPES_PROMPT}],
            "images": [{"bytes": buf.getvalue()}], "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": color},
            "extra_info": {"split": split, "index": index, "shape": shape, "color": color}}


def write_shapes_parquet(data_dir: os.PathLike, n_train: int = 512, n_val: int = 64, seed: int = 0):
    """Write the shapes task's ``train.parquet`` and ``val.parquet`` into ``data_dir`` (created); the
    same seed gives the same files. Returns (train path, val path).

    Raises:
        ValueError: a row count < 1.
    """
    from pathlib import Path

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    if n_train < 1 or n_val < 1:
        raise ValueError(f"need at least one row per file, got n_train={n_train}, n_val={n_val}")
    out = Path(data_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n, offset in (("train", n_train, 0), ("val", n_val, 1)):
        rng = np.random.default_rng([seed, offset])
        path = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist([shapes_row(i, split, rng) for i in range(n)]), path)
        paths.append(path)
    return paths[0], paths[1]


#: Characters at the head of an answer that earn the shapes task's partial credit.
PARTIAL_HEAD = 8


def shapes_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> dict:
    """verl's custom reward function of the shapes task (``reward.custom_reward_function``).

    ``acc`` is 1 when the first colour name in the answer is the shape's colour, else 0. ``score`` (the
    reward) is ``acc`` where it is 1, else half the share of the colour name's distinct letters found
    among the answer's first :data:`PARTIAL_HEAD` characters: a model with random weights never names the
    colour, and with a 0/1 reward every GRPO advantage would be 0 and its weights would never move
    (seen: ``actor/grad_norm`` 0.0 at every step of the first GPU run); the partial credit differs from
    sample to sample, so training changes the weights, the vision tower's included, and the syncs after
    it carry new values.

    Returns:
        ``{"score": float in [0, 1], "acc": 0.0 or 1.0}``.

    Raises:
        ValueError: a row of another task (``data_source`` not :data:`SHAPES_SOURCE`).
    """
    import re

    if data_source != SHAPES_SOURCE:
        raise ValueError(f"shapes_score scores {SHAPES_SOURCE!r} rows, got {data_source!r}")
    answer, colour = solution_str.lower(), str(ground_truth).strip().lower()
    found = re.search("|".join(COLORS), answer)
    acc = float(found is not None and found.group(0) == colour)
    letters = set(colour)
    partial = len(letters & set(answer[:PARTIAL_HEAD])) / len(letters) if letters else 0.0
    return {"score": acc if acc else 0.5 * partial, "acc": acc}


#: The overrides the shapes task puts over the arithmetic task's (:func:`sgl_rollout.workloads.grpo_overrides`);
#: the vision tower's attention on torch's SDPA, as the VLM GPU test runs it (like the text attention's
#: ``triton`` there: kernels the GPU host has), on both sides.
SHAPES_OVERRIDES = ("data.image_key=images",
                    "reward.custom_reward_function.path=pkg://sgl_rollout.bench.vlm",
                    "reward.custom_reward_function.name=shapes_score",
                    "+actor_rollout_ref.rollout.engine_kwargs.sglang.mm_attention_backend=sdpa")

