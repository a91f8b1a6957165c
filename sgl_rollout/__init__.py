"""sgl-rollout: an SGLang rollout worker for RL trainers that share GPUs with training.

Parts, by floor (a module imports its own floor and those below, never one above; ``tests/test_shape.py``
checks it):

0. :mod:`.config` (settings), :mod:`.errors` (errors several floors raise), :mod:`.memory` (tag state,
   empty-cache, timeline), :mod:`.twin` (one call body, a blocking and an async face),
   :mod:`.lora_adapter` (a LoRA adapter's config checks and payload), :mod:`.trace` (the public tracing
   hook);
1. :mod:`.engine`: the SGLang engine, every call checked before SGLang sees it, in parts (core, generate,
   memory, weight and LoRA calls);
2. :mod:`.switch`: the train-to-rollout switch (stages, sleep levels, the staged wake with hooks);
3. :mod:`.weight_sync`: one sync protocol (bucket rounds), the choice of transport
   (:class:`~.weight_sync.path.SyncPath`), the transports (flattened buckets, the copy-plan fast path);
4. :mod:`.worker` (in process) and :mod:`.server` (a Ray actor): an engine and its switch;
5. :mod:`.integrations`: verl;
6. :mod:`.doctor` and :mod:`.workloads` (the models and tasks the demo and the benchmarks share).

:mod:`.demo` and :mod:`.bench` sit on top, beside each other; neither imports the other.
"""

import importlib.util as _ilu
import os as _os
import sys as _sys

__version__ = "0.1.0"

# Variables of the old spelling (before 2026-11-28) are not read: say so once per process rather than let a
# setting be ignored in silence (SGLang copies every SGL_* variable to SGLANG_* and warns, which is why they moved).
_OLD_PREFIX, _PREFIX = "SGL_ROLLOUT_", "SGLROLLOUT_"
_old_vars = sorted(k for k in _os.environ if k.startswith(_OLD_PREFIX))
if _old_vars:
    import warnings as _warnings

    _warnings.warn(f"{', '.join(_old_vars)} not read: sgl-rollout's environment variables are spelled {_PREFIX}* "
                   f"(SGLang renames every SGL_* variable); set {', '.join(_PREFIX + k[len(_OLD_PREFIX):] for k in _old_vars)}",
                   stacklevel=2)

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
