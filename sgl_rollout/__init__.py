"""sgl-rollout: an SGLang rollout worker for RL trainers that share GPUs with training.

Modules: :mod:`.config` (settings), :mod:`.engine` (the SGLang engine, guarded),
:mod:`.memory` (tag state, empty-cache, timeline), :mod:`.weight_sync` (bucketed CUDA-IPC sync),
:mod:`.worker` (sleep and staged wake), :mod:`.bench` (benchmarks).
"""

import importlib.util as _ilu
import os as _os
import sys as _sys

__version__ = "0.1.0"

# ``patches/`` lives at the repository's top level and is installed as ``sgl_rollout.patches``
# (pyproject.toml). When the package runs from a source checkout without installation
# (PYTHONPATH=repo), load that folder under the same name.
if _ilu.find_spec(__name__ + ".patches") is None:  # pragma: no cover - depends on install mode
    _src = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "patches")
    _spec = _ilu.spec_from_file_location(
        __name__ + ".patches", _os.path.join(_src, "__init__.py"), submodule_search_locations=[_src]
    )
    if _spec is not None and _spec.loader is not None:
        _mod = _ilu.module_from_spec(_spec)
        _sys.modules[_spec.name] = _mod
        _spec.loader.exec_module(_mod)
