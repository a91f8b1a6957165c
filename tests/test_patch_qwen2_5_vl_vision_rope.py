"""``patches/qwen2_5_vl_vision_rope.py`` against the real upstream modules: transformers' current
``Qwen2_5_VisionRotaryEmbedding`` (positions API) fails SGLang's size call and answers it once patched,
its own position calls unchanged; SGLang 0.5.10.post1 and 0.5.12 make that size call; 0.5.12 runs
general plugins in the scheduler; ``pyproject.toml`` registers the patch there."""

import ast
import sys
from pathlib import Path

import pytest
import torch

from sgl_rollout.patches import qwen2_5_vl_vision_rope as patch

from test_sglang_versions import ROOT, _tree  # noqa: E402

rope_mod = pytest.importorskip("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
Upstream = rope_mod.Qwen2_5_VisionRotaryEmbedding


def _fresh():
    """A subclass, so that patching it leaves transformers' class (other tests use it) alone."""
    return type("Rope", (Upstream,), {})


def test_upstream_forward_takes_positions_and_breaks_on_sglangs_size_call():
    assert patch.needs_patch(Upstream)
    with pytest.raises(IndexError):  # (1,) * (8,) -> (8,), then flatten(1) of a 1-D tensor
        Upstream(16)(torch.tensor(5))


def test_patched_class_answers_the_size_call_and_keeps_position_calls():
    cls = _fresh()
    positions = torch.tensor([[0, 1], [2, 3], [4, 0]])
    before = cls(16)(positions)
    assert patch.patch_class(cls) and not patch.patch_class(cls)  # idempotent
    rope = cls(16)
    want = torch.outer(torch.arange(5, dtype=torch.float32), rope.inv_freq)
    for size in (torch.tensor(5), 5, torch.tensor([[3, 5]])[:, 1:].max()):
        got = rope(size)
        assert got.shape == (5, 8) and torch.equal(got, want)
    assert torch.equal(rope(positions), before)
    table = rope(torch.tensor(5))
    assert torch.equal(table[positions].flatten(1), before)  # SGLang's indexing gives transformers' answer


def test_old_size_api_is_left_alone():
    class Old(torch.nn.Module):
        def forward(self, seqlen: int):
            return seqlen

    assert not patch.needs_patch(Old) and not patch.patch_class(Old)


def test_apply_patches_the_real_class_and_never_raises(monkeypatch):
    cls = _fresh()
    monkeypatch.setattr(rope_mod, "Qwen2_5_VisionRotaryEmbedding", cls)
    patch.apply()
    assert getattr(cls.forward, patch._MARK, False)
    patch.apply()  # twice: nothing more
    monkeypatch.setitem(sys.modules, "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", None)
    patch.apply()  # transformers without Qwen2.5-VL: nothing, no error


def _call_sites(tree: Path):
    src = (tree / "sglang" / "srt" / "models" / "qwen2_5_vl.py").read_text()
    return src, ast.parse(src)


@pytest.mark.parametrize("version", ["0.5.10.post1", "0.5.12"])
def test_sglang_makes_the_size_call(version):
    src, mod = _call_sites(_tree(version))
    assert "from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import" in src and "Qwen2_5_VisionRotaryEmbedding" in src
    rot = next(n for n in ast.walk(mod) if isinstance(n, ast.FunctionDef) and n.name == "rot_pos_emb")
    text = ast.unparse(rot)
    assert "grid_thw[:, 1:].max()" in text and "self.rotary_pos_emb(max_grid_size)" in text


def test_sglang_0_5_12_runs_general_plugins_in_the_scheduler():
    tree = _tree("0.5.12") / "sglang" / "srt"
    assert 'GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"' in (tree / "plugins" / "__init__.py").read_text()
    sched = ast.parse((tree / "managers" / "scheduler.py").read_text())
    run = next(n for n in ast.walk(sched) if isinstance(n, ast.FunctionDef) and n.name == "run_scheduler_process")
    assert "load_plugins()" in ast.unparse(run)


def test_pyproject_registers_the_plugin():
    import tomllib

    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["sglang.srt.plugins"]
    assert eps["sgl_rollout_qwen2_5_vl_vision_rope"] == "sgl_rollout.patches.qwen2_5_vl_vision_rope:apply"


def _model_dir(folder, arch="Qwen2_5_VLForConditionalGeneration"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"architectures": ["%s"]}' % arch)
    return str(folder)


class _EntryPoint:
    name = patch.PLUGIN


def test_an_engine_that_would_die_on_its_first_image_is_refused_before_it_starts(tmp_path, monkeypatch):
    import importlib.metadata

    path = _model_dir(tmp_path)
    registered = {"eps": [_EntryPoint()]}
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: registered["eps"])
    monkeypatch.setattr(patch, "_transformers_class", lambda: Upstream)  # the positions API (5.9 and later)
    assert patch.refusal(path, "0.5.12", environ={}) is None  # the plugin patches the scheduler
    why = patch.refusal(path, "0.5.10.post1", environ={})
    assert "dies on the first image" in why and "0.5.12" in why and "\n" not in why
    assert "SGLANG_PLUGINS" in patch.refusal(path, "0.5.12", environ={"SGLANG_PLUGINS": "other"})
    registered["eps"] = []
    assert "pip-install sgl-rollout" in patch.refusal(path, "0.5.12", environ={})
    # a transformers whose class still takes a size: both releases serve it
    old = type("Old", (torch.nn.Module,), {"forward": lambda self, seqlen: seqlen})
    monkeypatch.setattr(patch, "_transformers_class", lambda: old)
    assert patch.refusal(path, "0.5.10.post1", environ={}) is None
    # a transformers without the class: 0.5.10.post1 cannot load the model
    monkeypatch.setattr(patch, "_transformers_class", lambda: None)
    assert "cannot load Qwen2.5-VL" in patch.refusal(path, "0.5.10.post1", environ={})
    assert patch.refusal(path, "0.5.12", environ={}) is None
    # other models, no config, no SGLang: nothing to say
    assert patch.refusal(_model_dir(tmp_path / "llama", "LlamaForCausalLM"), "0.5.10.post1") is None
    assert patch.refusal(str(tmp_path / "nowhere"), "0.5.10.post1") is None
    assert patch.refusal(path, None) is None


def test_the_engine_start_asks_for_the_refusal(tmp_path, monkeypatch):
    from sgl_rollout.config import RolloutConfig
    from sgl_rollout.engine import core
    from sgl_rollout.engine.sglang_version import UnsupportedSGLangVersion

    monkeypatch.setattr(core, "installed_sglang", lambda: "0.5.10.post1")
    monkeypatch.setattr(patch, "_transformers_class", lambda: Upstream)
    with pytest.raises(UnsupportedSGLangVersion, match="dies on the first image"):
        core.check_model_for_sglang(RolloutConfig(model_path=_model_dir(tmp_path)))
    monkeypatch.setattr(core, "installed_sglang", lambda: "0.5.12")
    monkeypatch.setattr(patch, "plugin_loaded_by_sglang", lambda environ=None: True)
    core.check_model_for_sglang(RolloutConfig(model_path=_model_dir(tmp_path)))
