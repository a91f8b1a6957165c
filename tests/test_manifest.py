import json
import pickle
import struct

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from sgl_rollout.weight_sync.manifest import (
    MAX_LISTED,
    MAX_SUGGESTED,
    ParamSpec,
    SyncValidationError,
    SyncValidator,
    WeightManifest,
)

H, INTER, LAYERS, VOCAB, HEADS, KV_HEADS = 64, 128, 2, 128, 4, 2
KV = KV_HEADS * (H // HEADS)
PER_LAYER = 9  # q k v o gate up down, 2 norms


def _llama(**kw):
    return LlamaConfig(hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       num_key_value_heads=KV_HEADS, vocab_size=VOCAB, dtype="bfloat16", **kw)


def _qwen2(tie):
    return Qwen2Config(hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       num_key_value_heads=KV_HEADS, vocab_size=VOCAB, tie_word_embeddings=tie, dtype="bfloat16")


def _model(config):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16)


@pytest.fixture(scope="module")
def llama_manifest():
    return WeightManifest.from_config(_llama())


def _full_sync(manifest, dtype=torch.float32):
    """Tensors for every required weight, as a trainer would send them (float32 master weights)."""
    return [(n, torch.zeros(manifest[n].shape, dtype=dtype)) for n in manifest.names() if n not in manifest.optional]


# ---------------------------------------------------------------- building manifests


def test_from_config_llama_names_shapes_dtypes(tmp_path, llama_manifest):
    _llama().save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    m = WeightManifest.from_config(str(tmp_path))
    assert m.specs == llama_manifest.specs
    assert len(m) == 1 + LAYERS * PER_LAYER + 1 + 1  # embed, layers, final norm, lm_head
    assert m["model.embed_tokens.weight"] == ParamSpec((VOCAB, H), torch.bfloat16)
    assert m["model.layers.1.self_attn.q_proj.weight"].shape == (H, H)
    assert m["model.layers.1.self_attn.k_proj.weight"].shape == (KV, H)
    assert m["model.layers.0.mlp.down_proj.weight"].shape == (H, INTER)
    assert m["lm_head.weight"].shape == (VOCAB, H)
    assert "model.layers.0.self_attn.q_proj.bias" not in m
    assert not any("inv_freq" in n for n in m.names())  # non-persistent buffers are not weights
    assert m.optional == frozenset()  # untied: lm_head is required
    assert m.missing([]) == m.names()
    assert {s.dtype for s in m.specs.values()} == {torch.bfloat16}


def test_from_config_dtype_falls_back_to_parameters():
    cfg = _llama()
    cfg.dtype = None
    m = WeightManifest.from_config(cfg)
    assert m["model.norm.weight"].dtype == torch.get_default_dtype()


@pytest.mark.parametrize("tie", [True, False])
def test_from_config_qwen2_bias_and_tied_lm_head(tie):
    m = WeightManifest.from_config(_qwen2(tie))
    assert m["model.layers.0.self_attn.q_proj.bias"] == ParamSpec((H,), torch.bfloat16)
    assert m["model.layers.1.self_attn.v_proj.bias"].shape == (KV,)
    assert "model.layers.0.self_attn.o_proj.bias" not in m
    assert "lm_head.weight" in m  # listed even when tied (remove_duplicate=False)
    assert ("lm_head.weight" in m.optional) is tie
    assert ("lm_head.weight" in m.missing(["model.embed_tokens.weight"])) is (not tie)


@pytest.mark.parametrize("tie", [True, False])
def test_from_pretrained_sharded_headers_agree_with_config(tmp_path, tie):
    _model(_qwen2(tie)).save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    from_ckpt = WeightManifest.from_pretrained(str(tmp_path))
    from_cfg = WeightManifest.from_config(str(tmp_path))
    assert set(from_ckpt.names()) == set(from_cfg.names())
    assert from_ckpt.specs == from_cfg.specs
    assert from_ckpt.optional == from_cfg.optional
    stored = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("lm_head.weight" in stored) is (not tie)  # a tied checkpoint omits it; the manifest adds it


def test_from_pretrained_reads_only_headers(tmp_path):
    _model(_llama()).save_pretrained(tmp_path, max_shard_size="20KB")
    want = WeightManifest.from_pretrained(str(tmp_path))
    for shard in tmp_path.glob("*.safetensors"):  # cut every shard to its header: no tensor data left
        with open(shard, "r+b") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            f.truncate(8 + n)
    got = WeightManifest.from_pretrained(str(tmp_path))
    assert got.specs == want.specs and len(got) == len(WeightManifest.from_config(_llama()))
    assert got["model.layers.1.mlp.up_proj.weight"] == ParamSpec((INTER, H), torch.bfloat16)


def test_from_pretrained_single_file_and_tied_stored_lm_head(tmp_path):
    from safetensors.torch import save_file

    _qwen2(True).save_pretrained(tmp_path)
    tensors = {"model.embed_tokens.weight": torch.zeros(VOCAB, H, dtype=torch.float16),
               "lm_head.weight": torch.zeros(VOCAB, H, dtype=torch.float16),
               "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8),
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(H, H, dtype=torch.float16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    m = WeightManifest.from_pretrained(str(tmp_path))
    assert set(m.names()) == set(tensors)
    assert m["model.layers.0.self_attn.q_proj.weight"] == ParamSpec((H, H), torch.float16)
    assert m.optional == {"lm_head.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"}
    assert m.missing(["model.embed_tokens.weight"]) == ["model.layers.0.self_attn.q_proj.weight"]


def test_from_pretrained_without_checkpoint_uses_config(tmp_path):
    _llama().save_pretrained(tmp_path)
    assert WeightManifest.from_pretrained(str(tmp_path)).specs == WeightManifest.from_config(_llama()).specs


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        WeightManifest.from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        WeightManifest.from_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        WeightManifest.from_config(str(tmp_path))
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(ValueError, match="not a safetensors file"):
        WeightManifest.from_pretrained(str(tmp_path))
    bad.write_bytes(struct.pack("<Q", 5) + b"{oops")
    with pytest.raises(ValueError, match="unreadable safetensors header"):
        WeightManifest.from_pretrained(str(tmp_path))
    bad.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(ValueError, match="not a JSON object"):
        WeightManifest.from_pretrained(str(tmp_path))
    header = json.dumps({"w": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}).encode()
    bad.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ValueError, match="which torch lacks"):
        WeightManifest.from_pretrained(str(tmp_path))
    header = json.dumps({"w": {"shape": [2]}}).encode()
    bad.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ValueError, match="malformed header entry"):
        WeightManifest.from_pretrained(str(tmp_path))
    bad.unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-1.safetensors"}}))
    header = json.dumps({"v": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "model-1.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ValueError, match="lists 1 names its files lack"):
        WeightManifest.from_pretrained(str(tmp_path))


def test_from_named_tensors_module_dict_and_pairs():
    model = _model(_qwen2(True))
    from_module = WeightManifest.from_named_tensors(model)
    assert from_module.specs == WeightManifest.from_config(_qwen2(True)).specs
    assert from_module.optional == {"lm_head.weight"}  # same Parameter object as the embedding
    pairs = [("a", torch.zeros(2, 3)), ("b", torch.zeros(4, dtype=torch.int64))]
    assert WeightManifest.from_named_tensors(pairs).specs == WeightManifest.from_named_tensors(dict(pairs)).specs
    assert WeightManifest.from_named_tensors(pairs)["b"] == ParamSpec((4,), torch.int64)
    with pytest.raises(ValueError, match="dict.items"):
        WeightManifest.from_named_tensors(["a", "b"])
    with pytest.raises(ValueError, match="different specs"):
        WeightManifest.from_named_tensors([("a", torch.zeros(2)), ("a", torch.zeros(3))])


def test_manifest_basics():
    m = WeightManifest({"x": ParamSpec(torch.Size([2, 3]), torch.float32), "y": ParamSpec((5,), torch.bfloat16)},
                       optional=["y"])
    assert len(m) == 2 and "x" in m and "z" not in m and m.names() == ["x", "y"]
    assert m["x"].shape == (2, 3) and type(m["x"].shape) is tuple and m["x"].nbytes == 24 and m["y"].nbytes == 10
    assert m.missing(["y"]) == ["x"] and m.missing(["x"]) == []
    with pytest.raises(ValueError, match="optional names not in the manifest"):
        WeightManifest({"x": ParamSpec((1,), torch.float32)}, optional=["lm_head.weight"])


# ---------------------------------------------------------------- checking items


def test_check_tensor_accepts_good_items_and_float_casts(llama_manifest):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert llama_manifest.check_tensor("model.layers.0.mlp.down_proj.weight", torch.zeros(H, INTER, dtype=dtype)) == []
    assert llama_manifest.check_tensor("model.norm.weight", torch.zeros(H, device="meta")) == []


def test_check_tensor_wrong_shape(llama_manifest):
    problems = llama_manifest.check_tensor("model.layers.0.mlp.down_proj.weight", torch.zeros(100, INTER))
    assert problems == [f"model.layers.0.mlp.down_proj.weight: shape (100, {INTER}), expected ({H}, {INTER})"]
    assert llama_manifest.check_tensor("model.norm.weight", torch.zeros(1, H)) == [
        f"model.norm.weight: shape (1, {H}), expected ({H},)"]


def test_check_tensor_unknown_name_suggests_closest(llama_manifest):
    (p,) = llama_manifest.check_tensor("model.layers.9.self_attn.q_proj.weight", torch.zeros(H, H))
    assert p.startswith("model.layers.9.self_attn.q_proj.weight: not a weight of this model")
    assert "model.layers.0.self_attn.q_proj.weight" in p and "model.layers.1.self_attn.q_proj.weight" in p
    (p,) = llama_manifest.check_tensor("model.layers.0.self_attn.q_prj.weight", torch.zeros(H, H))
    assert "did you mean model.layers.0.self_attn.q_proj.weight" in p
    (p,) = llama_manifest.check_tensor("module.model.norm.weight", torch.zeros(H))  # a DDP-style prefix
    assert p.endswith("did you mean model.norm.weight?")
    (p,) = llama_manifest.check_tensor("_fsdp_wrapped_module._orig_mod.model.layers.1.mlp.up_proj.weight", torch.zeros(1))
    assert p.endswith("did you mean model.layers.1.mlp.up_proj.weight?")
    (p,) = llama_manifest.check_tensor("layers.1.mlp.up_proj.weight", torch.zeros(INTER, H))  # a prefix too few
    assert p.endswith("did you mean model.layers.1.mlp.up_proj.weight?")
    (p,) = llama_manifest.check_tensor("zzz", torch.zeros(1))
    assert p.endswith("no close match")
    (p,) = llama_manifest.check_tensor("zzz", torch.zeros(1), suggest=False)
    assert p.endswith("keep the old value)")


def test_check_tensor_non_floating_dtype(llama_manifest):
    for dtype in (torch.int64, torch.int32, torch.bool, torch.uint8):
        (p,) = llama_manifest.check_tensor("model.norm.weight", torch.zeros(H, dtype=dtype))
        assert p == f"model.norm.weight: dtype {dtype} is not floating-point, expected torch.bfloat16"
    both = llama_manifest.check_tensor("model.norm.weight", torch.zeros(3, dtype=torch.int8))
    assert len(both) == 2 and "shape" in both[0] and "dtype" in both[1]
    ints = WeightManifest({"q": ParamSpec((4,), torch.int8)})
    assert ints.check_tensor("q", torch.zeros(4, dtype=torch.int8)) == []
    assert ints.check_tensor("q", torch.zeros(4)) == ["q: dtype torch.float32, expected torch.int8"]


def test_check_tensor_not_a_pair(llama_manifest):
    sd = {"model.norm.weight": torch.zeros(H)}
    (p,) = llama_manifest.check_tensor(sd, None)
    assert "got (dict, NoneType)" in p and "pass model.named_parameters() or dict.items(), not a dict" in p
    (p,) = llama_manifest.check_tensor("model.norm.weight", [0.0] * H)
    assert "got (str, list)" in p


# ---------------------------------------------------------------- validating syncs


def test_full_sync_passes_and_partial_sync_may_send_a_subset(llama_manifest):
    v = SyncValidator(llama_manifest)
    v.validate_all(_full_sync(llama_manifest))
    assert v.ok and v.problems == [] and v.seen == set(llama_manifest.names())
    p = SyncValidator(llama_manifest, partial=True)
    p.validate_all([("model.norm.weight", torch.zeros(H))])
    assert p.ok and p.seen == {"model.norm.weight"}
    SyncValidator(llama_manifest, partial=True).finish()  # an empty partial sync is the caller's call


def test_full_sync_reports_missing_names_in_manifest_order(llama_manifest):
    items = _full_sync(llama_manifest)
    dropped = [items[3][0], items[-1][0]]
    v = SyncValidator(llama_manifest)
    for name, t in items[:3] + items[4:-1]:
        assert v.check(name, t) == []
    with pytest.raises(SyncValidationError) as e:
        v.finish(context="sync 7")
    assert e.value.problems == [f"{n}: never sent (a full sync needs every weight; use partial=True for a subset)"
                                for n in dropped]
    assert str(e.value).startswith("sync 7: 2 problems in the weight sync:")
    with pytest.raises(SyncValidationError) as again:
        v.finish()
    assert again.value.problems == e.value.problems  # finish() twice adds nothing


def test_empty_full_sync_lists_every_weight(llama_manifest):
    with pytest.raises(SyncValidationError) as e:
        SyncValidator(llama_manifest).validate_all([])
    assert len(e.value.problems) == len(llama_manifest)


def test_tied_model_default_named_parameters_is_a_full_sync():
    model = _model(_qwen2(True))
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # remove_duplicate=True drops the tied copy
    manifest = WeightManifest.from_config(_qwen2(True))
    SyncValidator(manifest).validate_all(list(model.named_parameters()))
    SyncValidator(manifest).validate_all(list(model.named_parameters(remove_duplicate=False)))
    untied = WeightManifest.from_config(_qwen2(False))
    with pytest.raises(SyncValidationError, match="lm_head.weight: never sent"):
        SyncValidator(untied).validate_all(list(model.named_parameters()))


def test_duplicate_name_flagged(llama_manifest):
    v = SyncValidator(llama_manifest, partial=True)
    assert v.check("model.norm.weight", torch.zeros(H)) == []
    assert v.check("model.norm.weight", torch.zeros(H)) == ["model.norm.weight: sent twice in one sync"]
    assert not v.ok
    with pytest.raises(SyncValidationError, match="sent twice"):
        v.finish()


def test_all_problems_in_one_error(llama_manifest):
    items = _full_sync(llama_manifest)
    items[0] = (items[0][0], torch.zeros(VOCAB + 1, H))                                # wrong shape
    items[1] = ("model.layers.7.self_attn.k_proj.weight", torch.zeros(KV, H))          # unknown (replaces one)
    items[2] = (items[2][0], torch.zeros(llama_manifest[items[2][0]].shape, dtype=torch.int64))  # int dtype
    items.append(("model.norm.weight", torch.zeros(H)))                                # duplicate
    dropped = llama_manifest.names()[1]
    v = SyncValidator(llama_manifest)
    with pytest.raises(SyncValidationError) as e:
        v.validate_all(items, context="step 3")
    probs = e.value.problems
    assert len(probs) == 5, probs
    assert probs[0] == f"model.embed_tokens.weight: shape ({VOCAB + 1}, {H}), expected ({VOCAB}, {H})"
    assert probs[1].startswith("model.layers.7.self_attn.k_proj.weight: not a weight") and "layers.1.self_attn.k_proj" in probs[1]
    assert "is not floating-point" in probs[2]
    assert probs[3] == "model.norm.weight: sent twice in one sync"
    assert probs[4].startswith(f"{dropped}: never sent")
    text = str(e.value)
    assert text.startswith("step 3: 5 problems in the weight sync:\n") and all(p in text for p in probs)
    assert isinstance(e.value, ValueError)
    assert v.problems == probs and not v.ok


def test_raise_if_failed_midway_and_ok_validator_does_not_raise(llama_manifest):
    v = SyncValidator(llama_manifest)
    v.raise_if_failed()
    v.check("model.norm.weight", torch.zeros(2))
    with pytest.raises(SyncValidationError) as e:
        v.raise_if_failed("bucket 0")
    assert e.value.problems == [f"model.norm.weight: shape (2,), expected ({H},)"] and e.value.context == "bucket 0"


def test_dict_or_module_instead_of_items(llama_manifest):
    sd = dict(_full_sync(llama_manifest))
    with pytest.raises(SyncValidationError) as e:
        SyncValidator(llama_manifest).validate_all(sd)
    (p,) = e.value.problems
    assert p.startswith("got a dict instead of (name, tensor) pairs") and "dict.items()" in p
    with pytest.raises(SyncValidationError, match="got a LlamaForCausalLM"):
        SyncValidator(llama_manifest).validate_all(_model(_llama()))
    with pytest.raises(SyncValidationError) as e:  # iter(dict) gives bare names
        SyncValidator(llama_manifest, partial=True).validate_all(iter(sd))
    assert len(e.value.problems) == len(sd) and "item 0: expected a (name, tensor) pair, got str" in e.value.problems[0]
    assert "not a dict" in e.value.problems[0]


def test_error_message_capped_and_picklable():
    problems = [f"w{i}: shape (1,), expected (2,)" for i in range(MAX_LISTED + 7)]
    err = SyncValidationError(problems, context="ctx")
    lines = str(err).splitlines()
    assert lines[0] == f"ctx: {MAX_LISTED + 7} problems in the weight sync:"
    assert len(lines) == 1 + MAX_LISTED + 1 and lines[-1] == "  ... and 7 more"
    assert err.problems == problems
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is SyncValidationError and back.problems == problems and str(back) == str(err)
    assert str(SyncValidationError(["one"])) == "1 problem in the weight sync:\n  one"


def test_suggestions_capped_per_sync():
    kinds = ["self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"]
    manifest = WeightManifest({f"model.layers.{i}.{k}": ParamSpec((1,), torch.float32) for i in range(300) for k in kinds})
    items = [(f"decoder.blocks.{i}.{k.replace('_', '')}", torch.zeros(1)) for i in range(300) for k in kinds]
    v = SyncValidator(manifest, partial=True)
    with pytest.raises(SyncValidationError) as e:  # 900 full difflib scans of 900 names would take minutes
        v.validate_all(items)
    probs = e.value.problems
    assert len(probs) == len(items)
    assert all(("did you mean" in p or "no close match" in p) for p in probs[:MAX_SUGGESTED])
    assert not any(("did you mean" in p or "no close match" in p) for p in probs[MAX_SUGGESTED:])
    assert "did you mean model.layers.0.self_attn.q_proj.weight" in probs[0]
