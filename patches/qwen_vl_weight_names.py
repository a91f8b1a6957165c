"""Let SGLang's Qwen-VL models take a weight sync under transformers 5's parameter names.

Why: transformers 5 renames Qwen2-VL's and Qwen2.5-VL's parameters when it builds the model
(``model.language_model.*``, ``model.visual.*``; ``transformers/conversion_mapping.py``) and dropped the
``_checkpoint_conversion_mapping`` attribute that verl 0.9.1's ``convert_weight_keys``
(``verl/utils/model.py``) reverses. verl's built-in SGLang rollout therefore sends those names to
``update_weights_from_tensor``, and SGLang's ``load_weights`` (``sglang/srt/models/qwen2_5_vl.py`` and
``qwen2_vl.py``, 0.5.10.post1 and 0.5.12) knows only the checkpoint's (``model.*``, ``visual.*``): it skips
unknown non-stacked names silently and raises ``KeyError`` on the stacked q/k/v/gate/up ones, inside the
scheduler, which then dies. Seen on an H200 with SGLang 0.5.12, transformers 5.9.0 and verl 0.9.1: the
built-in's first weight sync of a Qwen2.5-VL, ``KeyError: 'model.visual.blocks.0.mlp.gate_up_proj.weight'``,
then "Failed to complete async request to update_weights_from_tensor after 3 attempts". This package's
own syncs rename before they send (:mod:`sgl_rollout.checkpoint_names`); this plugin gives any sender
(verl's built-in included) the same renaming where SGLang receives.

The fix: ``load_weights`` of those classes renames each incoming name with
:func:`sgl_rollout.checkpoint_names.renamer_for_config` of the model's own config (worked out once per
model, on the meta device) before SGLang's loader sees it; checkpoint names pass unchanged.

Where it runs: inside SGLang's scheduler, as a general plugin (``[project.entry-points."sglang.srt.plugins"]``
in ``pyproject.toml``; SGLang >= 0.5.12 loads them there, ``SGLANG_PLUGINS`` must name
``sgl_rollout_qwen_vl_weight_names`` when set). SGLang 0.5.10.post1 has no plugins: there this package's
own syncs rename, verl's built-in does not.
"""

from __future__ import annotations

import importlib
import logging

from ..checkpoint_names import renamer_for_config

logger = logging.getLogger(__name__)

#: SGLang's Qwen-VL model classes: (module, class).
TARGETS = (("sglang.srt.models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
           ("sglang.srt.models.qwen2_vl", "Qwen2VLForConditionalGeneration"))
#: Set on the wrapped ``load_weights``, so that a second :func:`apply` changes nothing.
_MARK = "_sgl_rollout_checkpoint_names"
_UNSET = object()


def _renamer(model):
    """The model's renamer, worked out on first use and kept on the model (None: names pass unchanged)."""
    rename = getattr(model, "_sgl_rollout_renamer", _UNSET)
    if rename is _UNSET:
        try:
            rename = renamer_for_config(model.config)
        except Exception as exc:  # noqa: BLE001 - SGLang's own loader then answers as before
            logger.warning("sgl-rollout: no transformers-5 name mapping for %s: %r", type(model).__name__, exc)
            rename = None
        model._sgl_rollout_renamer = rename
    return rename


def patch_class(cls) -> bool:
    """Wrap ``cls.load_weights(self, weights)`` so that each ``(name, tensor)`` of ``weights`` reaches it
    under its checkpoint name. Returns whether it changed anything (False: wrapped before)."""
    load = cls.load_weights
    if getattr(load, _MARK, False):
        return False

    def load_weights(self, weights, *args, **kwargs):
        rename = _renamer(self)
        if rename is not None:
            weights = ((rename(name), tensor) for name, tensor in weights)
        return load(self, weights, *args, **kwargs)

    setattr(load_weights, _MARK, True)
    load_weights.__doc__ = load.__doc__
    cls.load_weights = load_weights
    return True


def apply() -> None:
    """SGLang general-plugin entry point: wrap the Qwen-VL classes' ``load_weights``. Never raises (an
    exception here would stop the scheduler); a class SGLang cannot import is left alone."""
    for module, name in TARGETS:
        try:
            cls = getattr(importlib.import_module(module), name, None)
            if cls is not None and patch_class(cls):
                logger.info("sgl-rollout: %s.load_weights takes transformers 5's names "
                            "(patches/qwen_vl_weight_names.py)", name)
        except Exception as exc:  # noqa: BLE001
            logger.warning("sgl-rollout: %s weight-name patch not applied: %r", name, exc)
