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


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A tiny random Qwen3-MoE (2 layers, 4 experts, bf16, CPU) saved by transformers' own
    ``save_pretrained`` (per-expert checkpoint names), the model (fused experts under transformers 5) and
    the saved tensors."""
    import glob

    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                         architectures=["Qwen3MoeForCausalLM"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(path)
    saved = {}
    for f in sorted(glob.glob(str(path / "*.safetensors"))):
        saved.update(load_file(f))
    return str(path), model, saved


def test_fused_experts_are_split_into_checkpoint_views(tiny_moe):
    path, model, saved = tiny_moe
    params = dict(model.named_parameters())
    fused = params.get("model.layers.0.mlp.experts.gate_up_proj")
    if fused is None:
        pytest.skip("this transformers keeps Qwen3-MoE's experts per expert")
    assert tuple(fused.shape) == (4, 2 * 16, 32)  # (E, 2*I, H)
    assert tuple(params["model.layers.0.mlp.experts.down_proj"].shape) == (4, 32, 16)  # (E, H, I)
    manifest = WeightManifest.from_pretrained(path)
    with pytest.raises(SyncValidationError, match="gate_up_proj"):
        SyncValidator(manifest).validate_all(model.named_parameters())
    renamed = list(SyncPath(RolloutConfig(model_path=path)).renamed(model.named_parameters()))
    names = [n for n, _ in renamed]
    # (a) the checkpoint's names, each once
    assert len(names) == len(set(names)) and set(names) == set(saved)
    assert names.index("model.layers.0.mlp.experts.3.down_proj.weight") < names.index(
        "model.layers.1.self_attn.q_proj.weight")  # per-layer order kept
    assert names[names.index("model.layers.1.mlp.experts.2.gate_proj.weight") + 1] == \
        "model.layers.1.mlp.experts.2.up_proj.weight"
    # (b) the checkpoint's bits
    for n, t in renamed:
        assert t.dtype == saved[n].dtype and torch.equal(t, saved[n]), n
    # (c) views of the parameters: no copies
    ptrs = {p.untyped_storage().data_ptr() for p in params.values()}
    assert all(t.untyped_storage().data_ptr() in ptrs for _, t in renamed)
    up = dict(renamed)["model.layers.1.mlp.experts.2.up_proj.weight"]
    assert up.data_ptr() == params["model.layers.1.mlp.experts.gate_up_proj"][2, 16:].data_ptr()
    SyncValidator(manifest).validate_all(renamed)


def test_expert_splits_come_from_transformers_conversion_mapping(tiny_moe):
    from transformers.conversion_mapping import get_model_conversion_mapping

    from sgl_rollout.checkpoint_names import ExpertSplit, expert_splits, mappings_for_config, unsplit_targets

    _, model, _ = tiny_moe
    splits = expert_splits(get_model_conversion_mapping(model))
    if not splits:
        pytest.skip("this transformers keeps Qwen3-MoE's experts per expert")
    assert ExpertSplit("mlp.experts.gate_up_proj", ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"),
                       0, 1) in splits
    assert ExpertSplit("mlp.experts.down_proj", ("mlp.experts.*.down_proj.weight",), 0, None) in splits
    assert unsplit_targets(get_model_conversion_mapping(model)) == []
    rename, split = mappings_for_config(model.config)
    assert rename is None and split is not None
    with pytest.raises(ValueError, match="does not split into 2 equal parts"):
        split("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(4, 31, 32))
    with pytest.raises(ValueError, match="has no dim 1"):
        split("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(4))
    t = torch.zeros(2, 3)
    assert split("model.layers.0.mlp.gate.weight", t)[0][1] is t
    assert split("model.layers.0.mlp.experts.gate_up_projx", t) == [("model.layers.0.mlp.experts.gate_up_projx", t)]


def test_a_dense_models_stream_is_unchanged(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    named = list(model.named_parameters())
    sp = SyncPath(RolloutConfig(model_path=tiny_dir))
    renamed = list(sp.renamed(iter(named)))
    assert len(renamed) == len(named) and all(a[0] == b[0] and a[1] is b[1] for a, b in zip(named, renamed))
    assert sp._tensor_renamer is None
    assert list(sp.renamed([("x", torch.zeros(1)), 3]))[1] == 3  # anything else passes for the bucketing


def test_verls_ways_in_split_fused_experts_too(tiny_moe):
    """verl's colocated rollout (``SglRollout._named_tensors``'s sync and async streams) and the ``sgl_rollout``
    checkpoint engine's packer (``PlanPacker``'s ``rename``) send a transformers-5 MoE's fused experts as the
    checkpoint's per-expert tensors, as the worker does."""
    import asyncio

    pytest.importorskip("verl")
    from sgl_rollout.integrations import verl_checkpoint_engine, verl_rollout

    path, model, saved = tiny_moe
    if "model.layers.0.mlp.experts.gate_up_proj" not in dict(model.named_parameters()):
        pytest.skip("this transformers keeps Qwen3-MoE's experts per expert")
    sync_path = SyncPath(RolloutConfig(model_path=path))
    named = list(model.named_parameters())
    got = list(verl_rollout._renamed_sync(iter(named), sync_path))
    assert {n for n, _ in got} == set(saved) and all(torch.equal(t, saved[n]) for n, t in got)

    async def stream():
        for item in named:
            yield item

    async def read():
        return [item async for item in verl_rollout._renamed_async(stream(), sync_path)]

    assert [n for n, _ in asyncio.run(read())] == [n for n, _ in got]
    rename = verl_checkpoint_engine._renamer({"model_path": path})
    packed = [p for n, t in named for p in rename(n, t)]
    assert [n for n, _ in packed] == [n for n, _ in got]
