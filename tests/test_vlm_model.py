"""The tiny Qwen2.5-VL folder the VLM GPU tests load (``sgl_rollout.bench.vlm``), checked on CPU: the
hub's config layout that transformers 5 reads back (mrope sections, vision token ids inside the
tokenizer), checkpoint names on disk, the chat template's placeholder runs, and a redraw that changes
every parameter."""

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from sgl_rollout.bench.vlm import VISION_TOKENS, make_qwen2_5_vl_dir, redraw  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("vlm"))
    return path, make_qwen2_5_vl_dir(path, with_processor=False)


def test_config_is_the_hubs_layout_and_reads_back(folder):
    from transformers import AutoConfig, AutoTokenizer

    path, _ = folder
    raw = json.load(open(os.path.join(path, "config.json")))
    assert raw["rope_scaling"] == {"type": "mrope", "mrope_section": [8, 12, 12]} and "text_config" not in raw
    cfg = AutoConfig.from_pretrained(path)
    head_dim = cfg.text_config.hidden_size // cfg.text_config.num_attention_heads
    assert sum(cfg.text_config.rope_parameters["mrope_section"]) == head_dim // 2
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.convert_tokens_to_ids(list(VISION_TOKENS))
    assert [cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id, cfg.video_token_id] == \
        [ids[0], ids[1], ids[3], ids[4]]
    assert max(ids) < cfg.text_config.vocab_size and len(set(ids)) == 5


def test_weights_saved_under_checkpoint_names(folder):
    from safetensors import safe_open

    path, model = folder
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert any(k.startswith("visual.blocks.") for k in saved) and any(k.startswith("model.layers.") for k in saved)
    assert not any(k.startswith(("model.language_model.", "model.visual.")) for k in saved)
    assert len(saved) == len(list(model.named_parameters()))


def test_chat_template_renders_placeholder_runs():
    from sgl_rollout.bench.chat_tokenizer import build_chat_tokenizer

    tok = build_chat_tokenizer(extra_special=VISION_TOKENS)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}, {"type": "video"}]}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi"
                    "<|vision_start|><|video_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|image_pad|>")) == 1  # one token each, not bytes


def test_redraw_changes_every_parameter(folder):
    _, model = folder
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    redraw(model, seed=3)
    same = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert not same
    redraw(model, seed=0)  # the module fixture's other tests see the saved weights' draw again
