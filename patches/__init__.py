"""Version-gated fixes to SGLang or verl behaviour, one module each.

This folder sits at the repository's top level and is installed as ``sgl_rollout.patches``
(``pyproject.toml``, ``[tool.setuptools.package-dir]``). Each module names the upstream file it
targets and the versions it applies to, and has a test that runs against that upstream module.
"""

from typing import Dict, MutableMapping, Optional


def apply_env_updates(env: MutableMapping[str, str], updates: Dict[str, Optional[str]]) -> None:
    """Apply environment updates in place: a value sets the variable, None removes it."""
    for key, value in updates.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
