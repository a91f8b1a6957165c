"""``python -m sgl_rollout doctor``: what this machine has, and whether verl resolves "sglang" to us.

Each check runs on its own and reports its failure instead of raising, so one missing piece does not
hide the others.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from typing import Callable, List, Tuple


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _memory_saver_hook() -> str:
    spec = importlib.util.find_spec("torch_memory_saver")
    if spec is None:
        return "torch-memory-saver not installed"
    import glob

    libs = glob.glob(os.path.join(os.path.dirname(spec.origin), "..", "torch_memory_saver_hook_mode_preload*.so"))
    if not libs:
        return "preload hook library not found"
    import ctypes

    try:
        ctypes.CDLL(sorted(libs)[0])
        return f"loads ({os.path.basename(sorted(libs)[0])})"
    except OSError as e:
        return f"does not load: {e}"


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


def _gpus() -> str:
    import torch

    if not torch.cuda.is_available():
        return "none (torch.cuda.is_available() is False)"
    return "; ".join(f"{i}: {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count()))


def _verl() -> str:
    if importlib.util.find_spec("verl") is None:
        return "verl not installed"
    probe = ("import verl; from sgl_rollout.integrations.verl import resolved_implementation;"
             "print(resolved_implementation())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return f"import failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}"
    impl = out.stdout.strip().splitlines()[-1]
    ours = impl.startswith("sgl_rollout.")
    return f"{impl} ({'this package' if ours else 'NOT this package'}; VERL_USE_EXTERNAL_PLUGINS={os.environ.get('VERL_USE_EXTERNAL_PLUGINS', '<unset>')})"


CHECKS: List[Tuple[str, Callable[[], str]]] = [
    ("sglang", lambda: _version("sglang")),
    ("torch", lambda: _version("torch")),
    ("torch-memory-saver", lambda: _version("torch-memory-saver")),
    ("verl", lambda: _version("verl")),
    ("memory-saver hook", _memory_saver_hook),
    ("TP imbalance check", _imbalance_vars),
    ("GPUs", _gpus),
    ('verl resolves "sglang" to', _verl),
]


def main(argv=None) -> int:
    """Print one line per check; exit status 0 (the report itself is the result)."""
    for name, fn in CHECKS:
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - a check's failure is part of the report
            value = f"error: {e!r}"
        print(f"{name:<28}{value}")
    return 0
