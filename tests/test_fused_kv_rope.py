"""A Qwen3-MoE whose head size SGLang's fused rotary kernel does not take is refused before its engine starts
(:func:`sgl_rollout.engine.core.fused_kv_rope_problem`): on an H200 with SGLang 0.5.12 the tiny MoE of
``bench.models`` (head_dim 32 then) killed the scheduler on its first request. The sizes and the model's
unchecked request are read from each supported release's real source."""

import json
import re

import pytest

from sgl_rollout.config import RolloutConfig
from sgl_rollout.engine import core
from sgl_rollout.engine.sglang_version import TESTED, UnsupportedSGLangVersion

from test_sglang_versions import _tree  # noqa: E402


def _moe_dir(tmp_path, head_dim=32, dtype="bfloat16", model_type="qwen3_moe"):
    cfg = dict(model_type=model_type, hidden_size=256, num_attention_heads=8, num_key_value_heads=4, dtype=dtype)
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_a_head_size_the_kernel_does_not_take_with_a_bf16_kv_cache_is_refused_in_one_line(tmp_path):
    why = core.fused_kv_rope_problem(RolloutConfig(model_path=_moe_dir(tmp_path)))
    assert why and "\n" not in why and "head_dim 32" in why and "qwen3_moe" in why
    with pytest.raises(UnsupportedSGLangVersion, match="head_dim 32"):
        core.check_model_for_sglang(RolloutConfig(model_path=_moe_dir(tmp_path)))
    # head_dim from hidden_size / heads when the config has none: 256 / 8 = 32
    assert core.fused_kv_rope_problem(RolloutConfig(model_path=_moe_dir(tmp_path, head_dim=None)))
    # "auto" follows the model's own dtype
    assert core.fused_kv_rope_problem(RolloutConfig(model_path=_moe_dir(tmp_path), dtype="auto"))


@pytest.mark.parametrize("case", ["head_dim 64", "head_dim 128", "float32", "fp8 kv", "auto fp16", "dense qwen3",
                                  "no config"])
def test_what_the_kernel_takes_or_no_bf16_kv_cache_starts(tmp_path, case):
    kw = dict(model_path=_moe_dir(tmp_path))
    if case.startswith("head_dim"):
        kw["model_path"] = _moe_dir(tmp_path, head_dim=int(case.split()[1]))
    elif case == "float32":
        kw["dtype"] = "float32"
    elif case == "fp8 kv":
        kw["engine_kwargs"] = {"kv_cache_dtype": "fp8_e4m3"}
    elif case == "auto fp16":
        kw.update(model_path=_moe_dir(tmp_path, dtype="float16"), dtype="auto")
    elif case == "dense qwen3":
        kw["model_path"] = _moe_dir(tmp_path, model_type="qwen3")
    else:
        kw["model_path"] = str(tmp_path / "nowhere")
    assert core.fused_kv_rope_problem(RolloutConfig(**kw)) is None


def test_the_bench_moe_passes_the_check(tmp_path):
    from sgl_rollout.bench.models import QWEN3_MOE_TINY

    cfg = dict(QWEN3_MOE_TINY, model_type="qwen3_moe", dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert core.fused_kv_rope_problem(RolloutConfig(model_path=str(tmp_path))) is None


@pytest.mark.parametrize("version", sorted(TESTED))
def test_the_sizes_and_the_unchecked_request_are_upstreams(version):
    root = _tree(version) / "sglang" / "srt"
    rope = (root / "layers" / "rotary_embedding" / "base.py").read_text()
    sizes = re.search(r"self\.head_size not in \[([0-9, ]+)\]", rope)
    assert sizes and tuple(int(x) for x in sizes.group(1).split(",")) == core.FUSED_ROPE_HEAD_SIZES
    assert "save kv cache is not supported for fallback_rotary_embedding" in rope
    moe = (root / "models" / "qwen3_moe.py").read_text()
    # the request is made on the model's own flag, which looks at the rope's class and not its kernel
    flag = re.search(r"self\.compatible_with_fused_kv_buffer = \((.*?)\)\n", moe, re.S)
    assert flag and "MRotaryEmbedding" in flag.group(1) and "head" not in flag.group(1)
    assert "enable_fused_set_kv_buffer(forward_batch)" in moe
