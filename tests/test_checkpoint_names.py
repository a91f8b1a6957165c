"""transformers >= 5 names a vision-language model's parameters differently from its checkpoint
(Qwen2.5-VL: ``model.language_model.*`` / ``model.visual.*`` against ``model.*`` / ``visual.*``, which the
weight manifest and SGLang 0.5.10's loader use): a sync of ``model.named_parameters()`` is renamed back
before validation and before SGLang, by reversing transformers' own conversion mapping."""

import pytest
import torch

from sgl_rollout.config import RolloutConfig
from sgl_rollout.errors import SyncValidationError
from sgl_rollout.checkpoint_names import checkpoint_renamer, prefix_pairs, renamer_from_pairs
from sgl_rollout.weight_sync.manifest import SyncValidator, WeightManifest
from sgl_rollout.weight_sync.path import SyncPath

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    """A tiny random Qwen2.5-VL saved as transformers saves it (checkpoint names), and the model."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=320, max_position_embeddings=1024,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
        image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303,
        bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    model.save_pretrained(path)
    return str(path), model


def test_runtime_names_of_a_vlm_map_onto_its_checkpoint(tiny_vl):
    path, model = tiny_vl
    manifest = WeightManifest.from_pretrained(path)
    names = [n for n, _ in model.named_parameters()]
    assert any(n.startswith("model.language_model.") for n in names)
    assert any(n.startswith("model.visual.") for n in names)
    assert not any(n.startswith("model.visual.") for n in manifest.names())  # the checkpoint says visual.*
    # as the trainer names them, the manifest refuses them (the vision tower's names are unknown to it)
    with pytest.raises(SyncValidationError, match=r"model\.visual\.patch_embed\.proj\.weight: not a weight of this model"):
        SyncValidator(manifest).validate_all(model.named_parameters())
    rename = checkpoint_renamer(path)
    renamed = [(rename(n), t) for n, t in model.named_parameters()]
    SyncValidator(manifest).validate_all(renamed)  # every weight, the vision tower's included
    assert {n for n, _ in renamed} == set(manifest.names()) - set(getattr(manifest, "optional", ()))
    assert rename("model.visual.blocks.0.attn.qkv.weight") == "visual.blocks.0.attn.qkv.weight"
    assert rename("model.language_model.layers.1.mlp.up_proj.weight") == "model.layers.1.mlp.up_proj.weight"
    assert rename("visual.blocks.0.attn.qkv.weight") == "visual.blocks.0.attn.qkv.weight"  # already right
    assert rename("lm_head.weight") == "lm_head.weight"


def test_a_text_model_keeps_its_names(tiny_dir):
    assert checkpoint_renamer(tiny_dir) is None
    assert checkpoint_renamer("/no/such/model") is None  # logged, never raised


def test_only_prefix_renamings_are_reversed():
    from transformers.conversion_mapping import WeightRenaming

    pairs = prefix_pairs([WeightRenaming(r"^visual", "model.visual"),
                          WeightRenaming(r"^model(?!\.(language_model|visual))", "model.language_model"),
                          WeightRenaming("LayerNorm.gamma", "LayerNorm.weight")])
    assert pairs == [("model.language_model", "model"), ("model.visual", "visual")]


def test_transformers_5_6_look_behind_prefix_is_reversed():
    """transformers 5.6.0 (SGLang 0.5.12's pin) writes Qwen2.5-VL's text renaming behind a look-behind, not
    ``^``: on a GPU with 5.6.0 the language model's 52 weights were refused as unknown names."""
    from transformers.conversion_mapping import WeightRenaming

    pairs = prefix_pairs([WeightRenaming(r"(?<!_)model(?!\.(language_model|visual))", "model.language_model"),
                          WeightRenaming(r"^visual", "model.visual"),
                          WeightRenaming(r"LayerNorm.gamma", "LayerNorm.weight"),
                          WeightRenaming(r".weight_g$", ".parametrizations.weight.original0")])
    assert pairs == [("model.language_model", "model"), ("model.visual", "visual")]
    rename = renamer_from_pairs(pairs)
    assert rename("model.language_model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert rename("model.visual.blocks.0.attn.qkv.weight") == "visual.blocks.0.attn.qkv.weight"
    assert rename("lm_head.weight") == "lm_head.weight"


def test_sync_path_renames_once_for_every_caller(tiny_vl):
    path, _ = tiny_vl
    sp = SyncPath(RolloutConfig(model_path=path))
    assert sp.checkpoint_name("model.visual.merger.mlp.0.weight") == "visual.merger.mlp.0.weight"
    assert sp._renamer_read and sp.checkpoint_name("model.embed_tokens.weight") == "model.embed_tokens.weight"
