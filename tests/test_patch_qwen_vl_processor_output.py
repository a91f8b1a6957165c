"""``patches/qwen_vl_processor_output.py``: the grids of processor-output items reach ``ret``, where SGLang
0.5.10.post1 and 0.5.12 read the grids for the rotary positions; ``ret``'s own grids win; the engine's
host applies it once SGLang loaded the Qwen-VL processor. SGLang's Qwen-VL module needs torchvision (not
on the CPU machines), so its call sites are checked in the releases' source and the wrapper on a class of
the same method shape; the GPU test (``tests/gpu/test_vlm_gpu.py``) runs the real one."""

import ast
import sys
import types

import pytest
import torch

from fakes import FakeSGLangEngine
from sgl_rollout.config import RolloutConfig
from sgl_rollout.engine import RolloutEngine
from sgl_rollout.patches import qwen_vl_processor_output as patch
from test_sglang_versions import _tree

VIDEO = {"format": "processor_output", "pixel_values_videos": torch.zeros(48, 8),
         "video_grid_thw": torch.tensor([[2, 4, 6]]), "second_per_grid_ts": torch.tensor([1.0])}


def _loaded(images=(), videos=()):
    return types.SimpleNamespace(images=list(images), videos=list(videos))


def test_missing_grids_come_from_the_processor_output_dicts():
    second = dict(VIDEO, video_grid_thw=[[1, 2, 2]], second_per_grid_ts=[0.5])  # lists, as JSON would give
    ret = patch.with_grids(None, _loaded(videos=[VIDEO, second]))
    assert torch.equal(ret.video_grid_thw, torch.tensor([[2, 4, 6], [1, 2, 2]]))
    assert torch.equal(ret.second_per_grid_ts, torch.tensor([1.0, 0.5]))
    assert not hasattr(ret, "image_grid_thw")
    plain = patch.with_grids({"other": 1}, _loaded(videos=[VIDEO]))  # SGLang's empty-input path returns {}
    assert plain.other == 1 and torch.equal(plain.video_grid_thw, VIDEO["video_grid_thw"])


def test_grids_of_raw_items_stay_and_are_completed():
    from transformers import BatchFeature

    raw = BatchFeature({"image_grid_thw": torch.tensor([[1, 6, 8]])})  # a raw image the HF processor saw
    ret = patch.with_grids(raw, _loaded(images=["<PIL image>"], videos=[VIDEO]))
    assert ret is raw and torch.equal(ret.image_grid_thw, torch.tensor([[1, 6, 8]]))
    assert torch.equal(ret.video_grid_thw, VIDEO["video_grid_thw"]) and hasattr(ret, "second_per_grid_ts")
    own = BatchFeature({"video_grid_thw": torch.tensor([[4, 2, 2]])})  # raw and dict videos mixed: SGLang's
    assert torch.equal(patch.with_grids(own, _loaded(videos=["raw", VIDEO])).video_grid_thw, torch.tensor([[4, 2, 2]]))
    untouched = object()
    assert patch.with_grids(untouched, _loaded(images=["<PIL image>"])) is untouched


class _Processor:
    """The method shape of SGLang's ``BaseMultimodalProcessor.process_and_combine_mm_data``."""

    def process_and_combine_mm_data(self, base_output, mm_tokens, **kwargs):
        return ["items"], [1, 2, 3], None


def test_wrapper_is_applied_once_and_passes_everything_else_through(monkeypatch):
    cls = type("QwenVLImageProcessor", (_Processor,), {})
    assert patch.patch_class(cls) and not patch.patch_class(cls)
    items, ids, ret = cls().process_and_combine_mm_data(_loaded(videos=[VIDEO]), "tokens", extra=1)
    assert items == ["items"] and ids == [1, 2, 3] and torch.equal(ret.video_grid_thw, VIDEO["video_grid_thw"])
    assert cls().process_and_combine_mm_data(_loaded(), "tokens")[2] is None


def test_the_engine_host_patches_the_class_sglang_loaded(monkeypatch):
    cls = type("QwenVLImageProcessor", (_Processor,), {})
    monkeypatch.setitem(sys.modules, patch.MODULE, types.SimpleNamespace(QwenVLImageProcessor=cls))
    eng = RolloutEngine(RolloutConfig(model_path="/fake", enforce_eager=True), engine_factory=FakeSGLangEngine)
    try:
        assert getattr(cls.process_and_combine_mm_data, patch._MARK, False)
    finally:
        eng.shutdown()
    monkeypatch.delitem(sys.modules, patch.MODULE)
    assert patch.apply() is False  # a text model: SGLang never loaded the module, nothing happens


def _function(path, name):
    tree = ast.parse(path.read_text())
    return ast.unparse(next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef)
                            and n.name == name))


@pytest.mark.parametrize("version", ["0.5.10.post1", "0.5.12"])
def test_sglang_reads_the_grids_from_ret_and_ret_is_none_without_raw_items(version):
    procs = _tree(version) / "sglang" / "srt" / "multimodal" / "processors"
    qwen = _function(procs / "qwen_vl.py", "process_mm_data_async")
    assert "self.process_and_combine_mm_data(base_output, self.mm_tokens)" in qwen
    assert "video_grid_thw=getattr(ret, 'video_grid_thw', None)" in qwen
    assert "getattr(ret, 'second_per_grid_ts', None)" in qwen
    combine = _function(procs / "base_processor.py", "process_and_combine_mm_data")
    assert "ret = None" in combine and "processor_output" in combine


@pytest.mark.parametrize("version, passes", [("0.5.10.post1", False), ("0.5.12", True)])
def test_only_0_5_12_lets_a_processor_output_video_through_preprocess_video(version, passes):
    """``process_mm_data_async`` unpacks ``(video, metadata)`` pairs from ``preprocess_video``; for an item
    that is no decoder (verl's processor-output dict) 0.5.12 returns ``(vr, None)``, 0.5.10.post1 the item
    alone, which the unpacking takes apart (a ValueError in the request): the feature matrix's note."""
    procs = _tree(version) / "sglang" / "srt" / "multimodal" / "processors"
    pre = _function(procs / "qwen_vl.py", "preprocess_video")
    assert ("return (vr, None)" in pre) is passes
    assert ("return vr\n" in pre + "\n") is not passes
    assert "base_output.videos, video_metadata = map(list, zip(*videos_processed))" in _function(
        procs / "qwen_vl.py", "process_mm_data_async")


def test_a_grid_that_is_not_n_by_3_is_refused_naming_the_field():
    bad = dict(VIDEO, video_grid_thw=[1, 2, 2, 2])
    with pytest.raises(ValueError, match=r"video_grid_thw of a processor-output item must be N x 3 .*\(4,\)"):
        patch.with_grids(None, _loaded(videos=[bad]))
