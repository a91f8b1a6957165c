"""``python -m sgl_rollout doctor``: what this machine has, and whether verl resolves "sglang" to us.

Each check runs on its own and reports its failure instead of raising, so one missing piece does not
hide the others. After the checks, one ``missing`` line names each thing this package needs and the
machine lacks (SGLang in the supported range, torch, a CUDA GPU, torch-memory-saver's preload hook), and the
exit status is then
1: without them no engine can start, or release and resume its GPU memory.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from typing import Callable, List, Optional, Tuple

#: What a check gives: the text of its line, and what is missing (None: nothing this package needs).
Result = Tuple[str, Optional[str]]

#: Why a missing piece matters, at the end of its ``missing`` line.
CONSEQUENCE = "sgl-rollout cannot run an engine or release/resume its memory here"


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _required_version(pkg: str) -> Result:
    v = _version(pkg)
    return v, (f"{pkg} (not installed)" if v == "not installed" else None)


def _sglang() -> Result:
    """The installed SGLang and whether it is a release this package checked, inside its supported range
    (:mod:`sgl_rollout.engine.sglang_version`); outside the range an engine refuses to start."""
    from .engine import sglang_version

    version = sglang_version.installed_sglang()
    line = sglang_version.support_line(version)
    if version is None:
        return line, "sglang (not installed)"
    try:
        sglang_version.check_sglang_version(version)
    except sglang_version.UnsupportedSGLangVersion:
        return line, f"a supported sglang ({version} installed; supported {sglang_version.SUPPORTED})"
    return line, None


def _transformers() -> str:
    """The installed transformers, and whether the GPU suite ran with it under the installed SGLang
    (:func:`~.engine.sglang_version.transformers_line`)."""
    from .engine import sglang_version

    try:
        import importlib.metadata

        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return sglang_version.transformers_line(sglang_version.installed_sglang(), version)


def _memory_saver_hook() -> Result:
    # SGLang puts this library in LD_PRELOAD of its scheduler processes (enable_memory_saver): it is
    # what lets sleep/wake release and resume the engine's GPU memory.
    what = "torch-memory-saver's preload hook, which SGLang LD_PRELOADs into its engines"
    spec = importlib.util.find_spec("torch_memory_saver")
    if spec is None:
        return "torch-memory-saver not installed", f"{what} (torch-memory-saver not installed)"
    import glob

    libs = glob.glob(os.path.join(os.path.dirname(spec.origin), "..", "torch_memory_saver_hook_mode_preload*.so"))
    if not libs:
        return "preload hook library not found", f"{what} (no torch_memory_saver_hook_mode_preload*.so)"
    import ctypes

    try:
        ctypes.CDLL(sorted(libs)[0])
        return f"loads ({os.path.basename(sorted(libs)[0])})", None
    except OSError as e:
        return f"does not load: {e}", f"{what} (does not load: {e})"


def _imbalance_vars() -> str:
    from .engine import engine_env_updates
    from .patches import apply_env_updates

    env = dict(os.environ)
    apply_env_updates(env, engine_env_updates(base=env))
    probe = ("import json, warnings; warnings.simplefilter('ignore'); from sglang.srt.environ import envs;"
             "print(envs.SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK.get())")
    try:
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        effective = out.stdout.strip().splitlines()[-1] if out.returncode == 0 else f"probe failed: {out.stderr.strip()[-200:]}"
    except Exception as e:  # noqa: BLE001
        effective = f"probe failed: {e!r}"
    names = ("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", "SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK")
    now = ", ".join(f"{k}={os.environ.get(k, '<unset>')}" for k in names)
    engine = ", ".join(f"{k}={env.get(k, '<unset>')}" for k in names)
    return f"here: {now}; engine processes: {engine}; SGLang check enabled in engine: {effective}"


def _gpus() -> Result:
    import torch

    if not torch.cuda.is_available():
        return "none (torch.cuda.is_available() is False)", "a CUDA GPU (torch sees none)"
    return "; ".join(f"{i}: {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())), None


def _verl() -> str:
    if importlib.util.find_spec("verl") is None:
        return "verl not installed"
    # verl's registries as `import verl` leaves them (importing this package's plugin module here would
    # register it, whatever VERL_USE_EXTERNAL_PLUGINS says)
    probe = ("import verl; from verl.workers.rollout.base import _ROLLOUT_REGISTRY as A;"
             "from verl.checkpoint_engine.base import CheckpointEngineRegistry as R;"
             "print(A.get(('sglang', 'async'), '<none>'), 'sgl_rollout' in R._registry)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return f"import failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}"
    impl, backend = out.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    ours = impl.startswith("sgl_rollout.")
    return (f"{impl} ({'this package' if ours else 'NOT this package'}; VERL_USE_EXTERNAL_PLUGINS="
            f"{os.environ.get('VERL_USE_EXTERNAL_PLUGINS', '<unset>')}); checkpoint_engine.backend=sgl_rollout "
            f"{'registered' if backend == 'True' else 'not registered'}")


def _verl_with_trl() -> Result:
    """Whether the installed TRL breaks verl's FSDP workers (:func:`~.integrations.verl.trl_conflict`);
    only information when verl is absent."""
    if importlib.util.find_spec("verl") is None:
        return "verl not installed", None
    from .integrations.verl import trl_conflict

    why = trl_conflict()
    return (why or "no conflict (trl absent, or it still has what verl imports)"), None


def _sglang_plugin() -> str:
    """Whether SGLang's schedulers will load this package's plugins (``patches/qwen2_5_vl_vision_rope.py``,
    needed for Qwen2.5-VL images with transformers >= 5.9; ``patches/qwen_vl_weight_names.py``, needed by
    senders of transformers 5's Qwen-VL names such as verl's built-in): registered only by a pip install
    of this package (an entry point; a bare ``PYTHONPATH`` has none), loaded by SGLang from 0.5.12 on, and
    only when ``SGLANG_PLUGINS``, if set, names them."""
    from .patches import SGLANG_PLUGINS, sglang_plugin_state

    states = {name: sglang_plugin_state(name) for name in SGLANG_PLUGINS}
    if all(v == "loaded" for v in states.values()):
        return (f"{len(states)} registered (Qwen2.5-VL vision rope, Qwen-VL transformers-5 weight names; SGLang "
                ">= 0.5.12 loads them in its schedulers)")
    if all(v == "unregistered" for v in states.values()):
        return "not registered (install this package with pip; needed for Qwen2.5-VL on SGLang 0.5.12)"
    excluded = f"registered, but SGLANG_PLUGINS={os.environ.get('SGLANG_PLUGINS')!r} leaves it out"
    return "; ".join(f"{name}: {excluded if state == 'excluded' else state}" for name, state in states.items())


def _info(fn: Callable[[], str]) -> Callable[[], Result]:
    """A check whose result is for information only (nothing it reports stops this package)."""
    return lambda: (fn(), None)


#: (label, check, what a check that raises leaves missing: None for a check that is information only).
#: The lambdas look the probes up when called, so tests can replace them.
CHECKS: List[Tuple[str, Callable[[], Result], Optional[str]]] = [
    ("sglang", lambda: _sglang(), "sglang"),
    ("torch", lambda: _required_version("torch"), "torch"),
    ("transformers", _info(lambda: _transformers()), None),
    ("torch-memory-saver", _info(lambda: _version("torch-memory-saver")), None),  # the hook line says it
    ("verl", _info(lambda: _version("verl")), None),
    ("memory-saver hook", lambda: _memory_saver_hook(), "torch-memory-saver's preload hook"),
    ("TP imbalance check", _info(lambda: _imbalance_vars()), None),
    ("SGLang plugin", _info(lambda: _sglang_plugin()), None),
    ("GPUs", lambda: _gpus(), "a CUDA GPU"),
    ('verl resolves "sglang" to', _info(lambda: _verl()), None),
    ("verl with trl", lambda: _verl_with_trl(), None),
]


def main(argv=None) -> int:
    """Print one line per check, then one ``missing`` line per thing this package needs and lacks.

    Args:
        argv: command-line arguments after ``doctor`` (none are taken; ignored).

    Returns:
        The exit status: 0 when nothing is missing, 1 when something is (no CUDA GPU, no loadable
        torch-memory-saver preload hook, no SGLang or torch). Never raises for a failed check: its
        error is printed on its line, and a required check that fails counts as missing.
    """
    missing: List[str] = []
    for name, fn, needed in CHECKS:
        try:
            value, lacks = fn()
        except Exception as e:  # noqa: BLE001 - a check's failure is part of the report
            value = f"error: {e!r}"
            lacks = None if needed is None else f"{needed} (its check failed: {e!r})"
        print(f"{name:<28}{value}")
        if lacks is not None:
            missing.append(lacks)
    for lacks in missing:
        print(f"{'missing':<28}{lacks}: {CONSEQUENCE}")
    return 1 if missing else 0
