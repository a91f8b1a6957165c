"""The SGLang releases this package supports (issue 38 item 4, CPU part), checked against each release's
real source: the installed 0.5.10.post1 and verl 0.5.9.1's pin 0.5.12 (unpacked by ``make test`` into the
virtualenv, ``tests/sglang_sources.py``) hold every touch point of :mod:`sgl_rollout.engine.sglang_api`;
the imbalance-check patch works on both releases' real ``environ`` module; the newest release, 0.5.23,
breaks three touch points and is refused with one line before an engine starts."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_rollout.engine import sglang_api, sglang_version
from sgl_rollout.engine.sglang_version import SUPPORTED, TESTED, UnsupportedSGLangVersion, check_sglang_version
from sgl_rollout.patches import tp_memory_imbalance as patch

ROOT = Path(__file__).resolve().parent.parent
#: Where ``make test`` unpacks the other releases' source (``tests/sglang_sources.py``).
SOURCES = Path(os.environ.get("SGLROLLOUT_SGLANG_SOURCES", Path(sys.prefix) / "sglang-src"))
NEWEST = "0.5.23"


def _installed_root() -> Path:
    return Path(importlib.util.find_spec("sglang").origin).parent.parent


def _tree(version: str) -> Path:
    if version == sglang_version.installed_sglang():
        return _installed_root()
    path = SOURCES / version
    assert (path / ".complete").exists(), (
        f"SGLang {version}'s source is not unpacked at {path}: run `make setup` (it runs "
        f"`python tests/sglang_sources.py {SOURCES} {version}`)")
    return path


@pytest.mark.parametrize("version", sorted(TESTED))
def test_every_touch_point_holds_in_each_supported_release(version):
    assert sglang_api.check_source(_tree(version)) == []


def test_the_newest_release_breaks_the_weight_sync_lora_and_server_args_and_is_refused():
    problems = sglang_api.check_source(_tree(NEWEST))
    text = "\n".join(problems)
    assert "begin_weight_update/end_weight_update session" in text  # every sync would fail
    assert "LoadLoRAAdapterFromTensorsReqInput has no field ['serialized_tensors']" in text
    assert "ServerArgs has no field" in text and "disable_piecewise_cuda_graph" in text
    with pytest.raises(UnsupportedSGLangVersion) as e:
        check_sglang_version(NEWEST)
    msg = str(e.value)
    assert "\n" not in msg and NEWEST in msg and str(SUPPORTED) in msg and "sglang==0.5.12" in msg


def test_the_checker_reports_a_touch_point_a_release_drops(tmp_path):
    """A copy of the installed source with ``Engine.async_generate`` losing ``image_data`` and
    ``FlattenedTensorMetadata`` losing a field and ``SamplingParams`` renaming one: each is reported."""
    src = _installed_root() / "sglang"
    dst = tmp_path / "sglang"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.pyc", "*.json", "*.cu*"))
    engine = dst / "srt" / "entrypoints" / "engine.py"
    engine.write_text(engine.read_text().replace("image_data", "images_data"))
    bucket = dst / "srt" / "weight_sync" / "tensor_bucket.py"
    bucket.write_text(bucket.read_text().replace("    numel: int", "    count: int", 1))
    sampling = dst / "srt" / "sampling" / "sampling_params.py"
    sampling.write_text(sampling.read_text().replace("sampling_seed", "seed"))
    problems = sglang_api.check_source(tmp_path)
    assert any("SamplingParams takes no ['sampling_seed']" in p for p in problems), problems
    assert any("Engine.async_generate takes no ['image_data']" in p for p in problems), problems
    assert any("FlattenedTensorMetadata fields are" in p for p in problems), problems


def test_pyproject_states_the_supported_range_and_the_tested_releases_are_inside():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [d for d in deps if d.startswith("sglang")]
    from packaging.requirements import Requirement

    assert Requirement(req).specifier == SUPPORTED
    from packaging.version import Version

    assert all(Version(v) in SUPPORTED for v in TESTED) and Version(NEWEST) not in SUPPORTED
    # pip takes the newest release inside the range: it must be a tested one (0.5.12.post1 and 0.5.11 never ran)
    for untested in ("0.5.12.post1", "0.5.11", "0.5.10", "0.5.13"):
        assert Version(untested) not in SUPPORTED, untested
    assert set(sglang_version.GPU_TRANSFORMERS) == set(TESTED)


def test_doctor_says_whether_the_gpu_suite_ran_with_this_transformers():
    line = sglang_version.transformers_line
    assert "the GPU suite" in line("0.5.12", "5.9.0")
    assert "test_vlm_gpu, its vision-tower sync included" in line("0.5.12", "5.6.0")
    assert "not run on a GPU" in line("0.5.12", "5.10.4") and "5.9.0, 5.6.0" in line("0.5.12", "5.10.4")
    assert "no GPU run" in line("0.5.11", "5.6.0") and line("0.5.12", None) == "not installed"


def test_engine_refuses_to_start_under_an_unsupported_release_unless_allowed(monkeypatch):
    from sgl_rollout.config import RolloutConfig
    from sgl_rollout.engine import RolloutEngine

    monkeypatch.setattr(sglang_version, "installed_sglang", lambda: NEWEST)
    with pytest.raises(UnsupportedSGLangVersion, match="outside the range"):
        RolloutEngine(RolloutConfig(model_path="/fake"))  # the default factory: SGLang's Engine
    check_sglang_version("0.5.12")  # inside: nothing raised
    monkeypatch.setenv(sglang_version.ALLOW_ENV, "1")
    check_sglang_version(NEWEST)


def test_doctor_says_whether_the_installed_release_is_supported(monkeypatch):
    from sgl_rollout import doctor

    line, missing = doctor._sglang()
    assert line.startswith(sglang_version.installed_sglang()) and "tested" in line and missing is None
    monkeypatch.setattr(sglang_version, "installed_sglang", lambda: NEWEST)
    line, missing = doctor._sglang()
    assert "outside the range" in line and missing is not None and NEWEST in missing


def test_every_server_arg_this_package_sets_is_listed():
    from sgl_rollout.config import RolloutConfig
    from sgl_rollout.engine.layout import replica_layout

    keys = set()
    for cfg in (RolloutConfig(model_path="/m"), RolloutConfig(model_path="/m", lora_rank=8, max_num_seqs=4),
                RolloutConfig(model_path="/m", fast_sync=True, enforce_eager=True)):
        keys |= set(cfg.to_server_args())
    layout = replica_layout(0, 2, [[0], [0]])
    keys |= set(layout.engine_kwargs(1, leader_host="10.0.0.1"))
    keys.add("custom_sigquit_handler")  # engine/core.py, on the main thread
    assert keys <= set(sglang_api.SERVER_ARGS), sorted(keys - set(sglang_api.SERVER_ARGS))


_PROBE = ("import json, sys, warnings; warnings.simplefilter('ignore'); sys.path[:0] = [{tree!r}, {tests!r}];"
          "from _sglang_cpu import ensure_sglang_importable; ensure_sglang_importable();"
          "import sglang; assert sglang.__file__.startswith({tree!r}), sglang.__file__;"
          "from sglang.srt.environ import envs; print(json.dumps(envs.SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK.get()))")


def _check_enabled(version: str, env) -> bool:
    """Whether that release's own ``environ`` module turns the TP imbalance check on under ``env``."""
    probe = _PROBE.format(tree=str(_tree(version)), tests=str(ROOT / "tests"))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("version", sorted(TESTED))
def test_the_imbalance_check_patch_works_on_each_supported_releases_environ(version):
    env = {k: v for k, v in os.environ.items() if k not in (patch.LEGACY_VAR, patch.NEW_VAR)}
    assert _check_enabled(version, env) is True  # on by default
    env[patch.LEGACY_VAR] = "true"  # the commonly documented "disable" switch
    assert _check_enabled(version, env) is True  # turns it on
    patch.apply(env, sglang_version=version)
    assert patch.LEGACY_VAR not in env
    assert _check_enabled(version, env) is False


@pytest.mark.parametrize("version", sorted(TESTED))
def test_the_timing_probe_finds_sglangs_methods_in_each_supported_release(version):
    """``bench verl``'s probe wraps SGLang's methods by module and name (a post-import hook that never
    fires for a module that is gone): each wrapped SGLang method exists in each supported release under
    at least one of the names the probe lists (0.5.12 moved the control calls to tokenizer_control_mixin)."""
    import ast

    from sgl_rollout.bench import verl_probe

    tree = _tree(version)
    by_method = {}
    for module, qualname, _how in verl_probe.TARGETS:
        if not module.startswith("sglang."):
            continue
        path = tree / (module.replace(".", "/") + ".py")
        cls_name, method = qualname.split(".")
        found = path.is_file() and any(
            isinstance(c, ast.ClassDef) and c.name == cls_name
            and any(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == method for f in c.body)
            for c in ast.walk(ast.parse(path.read_text())))
        by_method.setdefault(method, []).append(found)
    assert by_method and all(any(v) for v in by_method.values()), by_method
