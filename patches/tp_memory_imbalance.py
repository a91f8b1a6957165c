"""Disable SGLang's TP memory-imbalance start-up check, the right way for each SGLang version.

Why: when Ray starts trainer workers out of order, the GPUs of one TP group hold different
amounts of memory when the rollout engine starts. ``ModelRunner.init_torch_distributed``
(``sglang/srt/model_executor/model_runner.py``) compares the smallest free memory across TP ranks
with the local one and raises "The memory capacity is unbalanced" when it is under 90 %.

How the switch works, by version:

* up to 0.5.6: ``SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK=true`` turns the check off.
* from 0.5.7: the switch is ``SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK`` (default true), and
  ``sglang/srt/environ.py`` (``_convert_SGL_to_SGLANG``) copies the legacy variable's *value* into
  it. So the commonly documented ``SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK=true`` turns the check
  ON. The fix sets ``SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0`` and removes the legacy name.

SGLang only warns when the check is off; the engine then sizes its memory pool from the smallest
free memory across ranks, which is what out-of-order colocated workers need.
"""

from __future__ import annotations

import os
from typing import Dict, MutableMapping, Optional

from packaging.version import Version

LEGACY_VAR = "SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK"
NEW_VAR = "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"
# The first SGLang release whose environ.py copies the legacy value into NEW_VAR.
FIRST_NEW_STYLE = Version("0.5.7")


def installed_sglang_version() -> str:
    """Version string of the installed SGLang, from package metadata (nothing is imported).

    Raises:
        importlib.metadata.PackageNotFoundError: SGLang is not installed.
    """
    from importlib.metadata import version

    return version("sglang")


def env_updates(sglang_version: Optional[str] = None) -> Dict[str, Optional[str]]:
    """Environment changes that turn the check off for ``sglang_version``.

    Args:
        sglang_version: e.g. ``"0.5.10.post1"``; None reads the installed version.

    Returns:
        dict mapping a variable name to its value, or to None where the variable must be removed.
    """
    v = Version(sglang_version or installed_sglang_version())
    if v.release[:3] >= FIRST_NEW_STYLE.release:
        return {NEW_VAR: "0", LEGACY_VAR: None}
    return {LEGACY_VAR: "true"}


def apply(env: MutableMapping[str, str] = os.environ, sglang_version: Optional[str] = None) -> Dict[str, Optional[str]]:
    """Apply :func:`env_updates` to ``env`` in place (``os.environ`` by default).

    Returns:
        the updates applied, as :func:`env_updates` gives them.
    """
    from . import apply_env_updates

    updates = env_updates(sglang_version)
    apply_env_updates(env, updates)
    return updates
