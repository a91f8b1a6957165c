"""``patches/qwen_vl_weight_names.py`` against the real upstream modules: SGLang 0.5.10.post1's and
0.5.12's Qwen-VL ``load_weights`` index their parameters by checkpoint name with no transformers-5
prefix mapping (so verl's built-in, which sends transformers 5's names, kills the scheduler); wrapped, a
loader that knows only checkpoint names receives every transformers-5 name of a real transformers
Qwen2.5-VL config renamed, checkpoint names unchanged; ``apply`` is idempotent and never raises;
``pyproject.toml`` registers it as an SGLang general plugin."""

import ast
import tomllib

import pytest
import torch

from sgl_rollout.patches import qwen_vl_weight_names as patch

from test_sglang_versions import ROOT, _tree  # noqa: E402

transformers = pytest.importorskip("transformers")


def _load_weights_source(version: str, module: str, cls: str) -> str:
    path = _tree(version) / (module.replace(".", "/") + ".py")
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "load_weights":
                    return ast.get_source_segment(source, fn)
    raise AssertionError(f"{cls}.load_weights not in {path}")


@pytest.mark.parametrize("version", ["0.5.10.post1", "0.5.12"])
@pytest.mark.parametrize("module,cls", patch.TARGETS)
def test_sglangs_qwen_vl_loaders_know_only_checkpoint_names(version, module, cls):
    body = _load_weights_source(version, module, cls)
    assert "params_dict[name]" in body  # a stacked name it does not know: KeyError in the scheduler
    assert "language_model" not in body and "model.visual" not in body  # no transformers-5 mapping


def _config():
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=320, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
        architectures=["Qwen2_5_VLForConditionalGeneration"])


class CheckpointNamesOnly:
    """SGLang's loader in miniature: knows checkpoint names, raises KeyError on any other (as SGLang's
    stacked-parameter branch does)."""

    KNOWN = {"visual.blocks.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight",
             "visual.merger.mlp.0.weight", "model.embed_tokens.weight"}

    def __init__(self):
        self.config, self.got = _config(), []

    def load_weights(self, weights):
        for name, tensor in weights:
            if name not in self.KNOWN:
                raise KeyError(name)
            self.got.append(name)
        return "done"


def test_wrapped_loader_receives_checkpoint_names():
    cls = type("Model", (CheckpointNamesOnly,), {})
    t = torch.zeros(1)
    sent = ["model.visual.blocks.0.mlp.gate_proj.weight", "model.language_model.layers.0.self_attn.q_proj.weight",
            "lm_head.weight", "visual.merger.mlp.0.weight", "model.embed_tokens.weight"]
    with pytest.raises(KeyError, match="model.visual"):
        cls().load_weights([(n, t) for n in sent])  # unpatched: what kills SGLang's scheduler
    assert patch.patch_class(cls) and not patch.patch_class(cls)  # idempotent
    model = cls()
    assert model.load_weights([(n, t) for n in sent]) == "done"
    assert model.got == ["visual.blocks.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_proj.weight",
                         "lm_head.weight", "visual.merger.mlp.0.weight", "model.embed_tokens.weight"]
    model.load_weights([("model.language_model.embed_tokens.weight", t)])  # the renamer is kept on the model
    assert model.got[-1] == "model.embed_tokens.weight" and model._sgl_rollout_renamer is not None


def test_a_model_without_a_mapping_loads_as_before():
    cls = type("Model", (CheckpointNamesOnly,), {})
    patch.patch_class(cls)
    model = cls()
    model.config = transformers.LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=4, vocab_size=64)
    model.load_weights([("lm_head.weight", torch.zeros(1))])
    assert model.got == ["lm_head.weight"] and model._sgl_rollout_renamer is None


def test_apply_never_raises_and_patches_what_it_can_import(monkeypatch):
    import sys
    import types

    cls = type("Qwen2_5_VLForConditionalGeneration", (CheckpointNamesOnly,), {})
    monkeypatch.setitem(sys.modules, "fake_sglang_qwen", types.SimpleNamespace(Qwen2_5_VLForConditionalGeneration=cls))
    monkeypatch.setattr(patch, "TARGETS", (("no.such.module", "X"), ("fake_sglang_qwen", "Qwen2_5_VLForConditionalGeneration")))
    patch.apply()
    patch.apply()
    assert getattr(cls.load_weights, patch._MARK, False)


def test_pyproject_registers_the_sglang_plugin():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    plugins = meta["project"]["entry-points"]["sglang.srt.plugins"]
    assert plugins["sgl_rollout_qwen_vl_weight_names"] == "sgl_rollout.patches.qwen_vl_weight_names:apply"
