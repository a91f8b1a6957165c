"""The SGLang releases this package is built against, and the start-up refusal of any other.

Every call this package makes into SGLang (the tokenizer manager's coroutines, the request objects of
``sglang/srt/managers/io_struct.py``, the ``ServerArgs`` fields it sets, the in-scheduler loader hook of
``ModelRunner.update_weights_from_tensor``, ``FlattenedTensorMetadata``, the environment variables of
``sglang/srt/environ.py``) is listed in :mod:`sgl_rollout.engine.sglang_api` and checked against the real
source of each release in :data:`TESTED` by the CPU tests (``tests/test_sglang_versions.py``). An engine
refuses to start under a release outside :data:`SUPPORTED` with one line (:func:`check_sglang_version`),
unless ``SGLROLLOUT_ALLOW_UNTESTED_SGLANG=1``; ``python -m sgl_rollout doctor`` says the same.
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Dict, Optional

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

#: The releases checked, and how far (pyproject.toml's ``sglang`` requirement is :data:`SUPPORTED`).
TESTED: Dict[str, str] = {
    "0.5.10.post1": "GPU suite and bench verl on H100/H200; every touch point checked on CPU",
    "0.5.12": ("verl 0.9.1's pin; every touch point checked on CPU against its source; the GPU suite (one- and "
               "two-GPU tests, demo, piecewise) and bench verl on H100/H200 with transformers 5.9.0"),
}
#: The transformers releases each tested SGLang release ran GPU tests with, and what ran (:data:`TESTED`).
#: SGLang 0.5.12 pins transformers 5.6.0, so ``pip install sgl-rollout`` gets that one; verl 0.9.1 excludes
#: 5.6.0 and the GPU host's overlay carries 5.9.0 (``shared/gpu-overlay``). ``doctor`` says which one is here.
GPU_TRANSFORMERS: Dict[str, Dict[str, str]] = {
    "0.5.10.post1": {"5.17.0": "the GPU suite"},
    "0.5.12": {
        "5.9.0": "the GPU suite",
        "5.6.0": ("test_engine_gpu, test_fast_path_gpu (TP=1) and test_vlm_gpu, its vision-tower sync included "
                  "(2026-11-28, after the fix for 5.6.0's weight-name renaming)"),
    },
}
#: The releases an engine starts under: exactly :data:`TESTED` (the same string as pyproject.toml's
#: requirement, so pip resolves to a tested release: 0.5.11 and 0.5.12.post1 were never run).
SUPPORTED = SpecifierSet(">=0.5.10.post1,<=0.5.12,!=0.5.11.*")
#: Set to ``1`` to start an engine under a release outside :data:`SUPPORTED` anyway (at your own risk).
ALLOW_ENV = "SGLROLLOUT_ALLOW_UNTESTED_SGLANG"


class UnsupportedSGLangVersion(RuntimeError):
    """The installed SGLang is outside :data:`SUPPORTED`, or cannot serve the model with the installed
    transformers (``sgl_rollout.engine.core.check_model_for_sglang``); raised before an engine starts."""


def installed_sglang() -> Optional[str]:
    """The installed SGLang's version string (its distribution metadata), or None when none is installed."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def _inside(version: str) -> bool:
    try:
        return Version(version) in SUPPORTED
    except InvalidVersion:
        return False


def support_line(version: Optional[str]) -> str:
    """One line on ``version``: which tested release it is, or why it is outside :data:`SUPPORTED`."""
    if version is None:
        return "not installed"
    if version in TESTED:
        return f"{version} (tested: {TESTED[version]})"
    if _inside(version):
        return f"{version} (inside the supported range {SUPPORTED}, but not itself checked; checked: {', '.join(TESTED)})"
    return (f"{version} is outside the range sgl-rollout supports ({SUPPORTED}; checked: {', '.join(TESTED)}): "
            f"install sglang==0.5.12 (verl 0.9.1's pin) or 0.5.10.post1, or set {ALLOW_ENV}=1 to start anyway")


def transformers_line(sglang: Optional[str], transformers: Optional[str]) -> str:
    """One line on the installed transformers next to the installed SGLang: whether the GPU suite ran
    with that pair (:data:`GPU_TRANSFORMERS`)."""
    if transformers is None:
        return "not installed"
    ran = GPU_TRANSFORMERS.get(sglang or "")
    if ran is None:
        return f"{transformers} (no GPU run with sglang {sglang})"
    if transformers in ran:
        return f"{transformers} (ran with sglang {sglang} on a GPU: {ran[transformers]})"
    return (f"{transformers} (sglang {sglang} ran on a GPU with transformers {', '.join(ran)}, not this one: the "
            "vision-language patches have not run on a GPU with it)")


def check_sglang_version(version: Optional[str] = None) -> None:
    """Refuse to start an engine under an SGLang release outside :data:`SUPPORTED`.

    Args:
        version: the version to check; None: the installed one (a missing SGLang is left to the import
            that follows, which names it).

    Raises:
        UnsupportedSGLangVersion: outside the range and ``SGLROLLOUT_ALLOW_UNTESTED_SGLANG`` is not ``1``;
            one line naming the version, the range and what to install.
    """
    version = installed_sglang() if version is None else version
    if version is None or os.environ.get(ALLOW_ENV) == "1":
        return
    if not _inside(version):
        raise UnsupportedSGLangVersion("sglang " + support_line(version))
