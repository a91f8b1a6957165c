"""Let SGLang's Qwen2.5-VL vision tower run with the transformers that verl 0.9.1 installs.

Why: SGLang's ``Qwen2_5_VisionTransformer.rot_pos_emb`` (``sglang/srt/models/qwen2_5_vl.py``, 0.5.10.post1
and 0.5.12) builds its rotary table by calling transformers' ``Qwen2_5_VisionRotaryEmbedding`` with the
largest grid side, ``grid_thw[:, 1:].max()`` (a 0-d CPU tensor), expecting the table of every position
below it: ``(max_side, head_dim / 4)``. transformers 5.9 (``models/qwen2_5_vl/modeling_qwen2_5_vl.py``;
verl 0.9.1 pins ``>=5.5.3,<5.11``) changed that module's ``forward`` to take the positions themselves
(``position_ids.unsqueeze(-1) * inv_freq``). SGLang's call then multiplies a CPU scalar with the CUDA
``inv_freq``: "Expected all tensors to be on the same device", raised inside the scheduler on the first
image or video, which kills it (and, through SIGQUIT, the trainer). Seen on an H100 with SGLang 0.5.12
and transformers 5.9.0; SGLang 0.5.12 itself pins transformers 5.6.0, which verl excludes.

The fix: where ``forward`` takes ``position_ids``, a call with a Python int or a 0-d tensor ``n`` gets the
old table, ``outer(arange(n), inv_freq)`` on ``inv_freq``'s device (fp32, shape ``(n, dim / 2)``); any
other call (transformers' own model passes position tensors of one or more dimensions) is the current
``forward`` unchanged.

Where it runs: inside SGLang's scheduler, through SGLang's general-plugin entry point
(``[project.entry-points."sglang.srt.plugins"]`` in ``pyproject.toml``; ``sglang/srt/plugins/__init__.py``,
``load_plugins``, which the scheduler calls at start from 0.5.12 on). ``SGLANG_PLUGINS``, when set, must
name ``sgl_rollout_qwen2_5_vl_vision_rope``. SGLang 0.5.10.post1 has no plugins; with transformers 5.17
it cannot import its Qwen2.5-VL model at all (``Qwen2_5_VisionRotaryEmbedding`` is gone there), so no
patch helps it.
"""

from __future__ import annotations

import inspect
import json
import logging
import numbers
import os
from typing import Optional

logger = logging.getLogger(__name__)

#: Set on the patched ``forward``, so that a second :func:`apply` changes nothing.
_MARK = "_sgl_rollout_size_call"
#: This patch's name among SGLang's general plugins (``pyproject.toml``).
PLUGIN = "sgl_rollout_qwen2_5_vl_vision_rope"
#: The first SGLang that loads general plugins in its scheduler.
FIRST_WITH_PLUGINS = "0.5.12"
ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"


def needs_patch(cls) -> bool:
    """Whether ``cls.forward`` takes positions (transformers >= 5.9) and is not patched yet."""
    forward = getattr(cls, "forward", None)
    if forward is None or getattr(forward, _MARK, False):
        return False
    params = list(inspect.signature(forward).parameters)
    return params[1:2] == ["position_ids"]


def patch_class(cls) -> bool:
    """Make ``cls.forward`` also answer a size call (see the module docstring). Returns whether it changed
    anything: False where ``forward`` already takes a size, or was patched before."""
    if not needs_patch(cls):
        return False
    import torch

    positions_forward = cls.forward

    def forward(self, position_ids):
        if isinstance(position_ids, numbers.Integral) or (torch.is_tensor(position_ids) and position_ids.dim() == 0):
            seq = torch.arange(int(position_ids), device=self.inv_freq.device, dtype=self.inv_freq.dtype)
            return torch.outer(seq, self.inv_freq)
        return positions_forward(self, position_ids)

    setattr(forward, _MARK, True)
    forward.__doc__ = positions_forward.__doc__
    cls.forward = forward
    return True


def apply() -> None:
    """SGLang general-plugin entry point: patch transformers' ``Qwen2_5_VisionRotaryEmbedding`` where it
    needs it. Never raises (SGLang logs a plugin's exception, but nothing here may stop a scheduler)."""
    try:
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    except Exception:  # noqa: BLE001 - no transformers or no Qwen2.5-VL: nothing to patch
        return
    cls = getattr(modeling_qwen2_5_vl, "Qwen2_5_VisionRotaryEmbedding", None)
    try:
        if cls is not None and patch_class(cls):
            logger.info("sgl-rollout: Qwen2_5_VisionRotaryEmbedding answers SGLang's size call "
                        "(patches/qwen2_5_vl_vision_rope.py)")
    except Exception as exc:  # noqa: BLE001
        logger.warning("sgl-rollout: Qwen2.5-VL vision rope patch not applied: %r", exc)


def _transformers_class():
    try:
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    except Exception:  # noqa: BLE001
        return None
    return getattr(modeling_qwen2_5_vl, "Qwen2_5_VisionRotaryEmbedding", None)


def plugin_loaded_by_sglang(environ=None) -> bool:
    """Whether SGLang's schedulers will run :func:`apply` (:func:`sgl_rollout.patches.sglang_plugin_state`)."""
    from . import sglang_plugin_state

    return sglang_plugin_state(PLUGIN, environ) == "loaded"


def refusal(model_path: str, sglang_version: Optional[str], environ=None) -> Optional[str]:
    """Why an engine for ``model_path`` must not start, in one line, or None. Only a Qwen2.5-VL
    (``architectures`` of its ``config.json``) with a transformers whose vision rotary embedding takes
    positions is concerned: its scheduler would die on the first image (see the module docstring)
    unless SGLang (``>= FIRST_WITH_PLUGINS``) loads :func:`apply`; SGLang 0.5.10.post1 cannot, and with a
    transformers that has no such class it does not load the model at all.

    Args:
        model_path: the model folder (no ``config.json`` there: None).
        sglang_version: the installed SGLang (None: None).
        environ: for ``SGLANG_PLUGINS``; ``os.environ`` by default.
    """
    from packaging.version import Version

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            architectures = json.load(f).get("architectures") or []
    except (OSError, ValueError):
        return None
    if ARCHITECTURE not in architectures or sglang_version is None:
        return None
    cls = _transformers_class()
    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = "not installed"
    old = Version(sglang_version) < Version(FIRST_WITH_PLUGINS)
    if cls is None and old:
        return (f"SGLang {sglang_version} cannot load Qwen2.5-VL with transformers {tf} (no "
                f"Qwen2_5_VisionRotaryEmbedding): use SGLang {FIRST_WITH_PLUGINS} with sgl-rollout pip-installed")
    if cls is None or (not needs_patch(cls) and not getattr(cls.forward, _MARK, False)):  # takes a size: fine
        return None
    if old:
        return (f"SGLang {sglang_version}'s scheduler dies on the first image of a Qwen2.5-VL with transformers "
                f"{tf} (its vision rotary embedding changed): use SGLang {FIRST_WITH_PLUGINS} with sgl-rollout "
                "pip-installed (patches/qwen2_5_vl_vision_rope.py)")
    if not plugin_loaded_by_sglang(environ):
        return (f"SGLang's scheduler dies on the first image of a Qwen2.5-VL with transformers {tf} unless it loads "
                f"sgl-rollout's plugin {PLUGIN}: pip-install sgl-rollout (a PYTHONPATH registers no plugin) and "
                "leave it in SGLANG_PLUGINS if you set that")
    return None
