"""Version-gated fixes to SGLang or verl behaviour, one module each.

This folder sits at the repository's top level and is installed as ``sgl_rollout.patches``
(``pyproject.toml``, ``[tool.setuptools.package-dir]``). Each module names the upstream file it
targets and the versions it applies to, and has a test that runs against that upstream module.
"""

import importlib.metadata
import os
from typing import Dict, Mapping, MutableMapping, Optional

#: This package's SGLang general plugins (``[project.entry-points."sglang.srt.plugins"]``), each a module here.
SGLANG_PLUGINS = ("sgl_rollout_qwen2_5_vl_vision_rope", "sgl_rollout_qwen_vl_weight_names")


def apply_env_updates(env: MutableMapping[str, str], updates: Dict[str, Optional[str]]) -> None:
    """Apply environment updates in place: a value sets the variable, None removes it."""
    for key, value in updates.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value


def sglang_plugin_state(name: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """Whether SGLang's schedulers will run this package's general plugin ``name``: ``"loaded"`` (its
    entry point is registered, which only a pip install of this package does, and ``SGLANG_PLUGINS``,
    when set, names it; ``sglang/srt/plugins/__init__.py``, ``load_plugins``), ``"excluded"`` (registered,
    left out by ``SGLANG_PLUGINS``) or ``"unregistered"``."""
    environ = os.environ if environ is None else environ
    if not any(ep.name == name for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")):
        return "unregistered"
    allowed = environ.get("SGLANG_PLUGINS")
    return "loaded" if not allowed or name in {x.strip() for x in allowed.split(",")} else "excluded"
