"""Give SGLang's Qwen-VL processor the grids of images and videos sent as processor output.

Why: verl 0.9.1 sends a request's video as one ``{"format": "processor_output", "pixel_values_videos",
"video_grid_thw", "second_per_grid_ts"}`` dict (``build_sglang_video_payload``,
``verl/experimental/agent_loop/agent_loop.py``). SGLang's ``QwenVLImageProcessor.process_mm_data_async``
(``sglang/srt/multimodal/processors/qwen_vl.py``, 0.5.10.post1 and 0.5.12) takes the features of such a
dict as they are, but computes the multimodal rotary positions (``MRotaryEmbedding.get_rope_index``) from
the grids of ``ret``, the Hugging Face processor's output for the *raw* items only
(``BaseMultimodalProcessor.process_and_combine_mm_data``, ``base_processor.py``): with no raw item ``ret``
is None, so the video's tokens get the positions of text. The model then sees the frames in the wrong
places; seen on an H100 with SGLang 0.5.12, a tiny Qwen2.5-VL's greedy answer to a video differed from
Hugging Face's from the first token.

The fix: after ``process_and_combine_mm_data``, where ``ret`` lacks ``image_grid_thw``,
``video_grid_thw`` or ``second_per_grid_ts`` and processor-output dicts of that modality carry them, the
dicts' values (concatenated in request order) are put on ``ret`` (a fresh namespace where ``ret`` is None
or a plain dict). Grids that ``ret`` has are left alone: a request that mixes raw and processor-output
items of one modality keeps SGLang's behaviour.

Where it runs: in the process that holds SGLang's tokenizer manager (the engine's host, this package's
:class:`sgl_rollout.engine.lifecycle.EngineProcesses`), after the engine started, on the class SGLang
loaded; nothing is imported here that SGLang did not import.
"""

from __future__ import annotations

import logging
import sys
import types
from typing import Any, Iterable, List

logger = logging.getLogger(__name__)

MODULE = "sglang.srt.multimodal.processors.qwen_vl"
CLASS = "QwenVLImageProcessor"
#: (field, modality list of ``base_output`` whose processor-output dicts carry it)
FIELDS = (("image_grid_thw", "images"), ("video_grid_thw", "videos"), ("second_per_grid_ts", "videos"))
_MARK = "_sgl_rollout_grids"


def _field(ret: Any, key: str):
    if ret is None:
        return None
    if isinstance(ret, dict):
        return ret.get(key)
    return getattr(ret, key, None)


def _processor_outputs(items: Iterable) -> List[dict]:
    return [d for d in (items or ()) if isinstance(d, dict) and d.get("format") == "processor_output"]


def with_grids(ret: Any, base_output: Any) -> Any:
    """``ret`` with the grids (and video seconds per grid) of ``base_output``'s processor-output dicts
    where ``ret`` has none; ``ret`` itself when nothing is missing.

    Args:
        ret: the Hugging Face processor's output for the raw items (a ``BatchFeature``), a dict, or None.
        base_output: SGLang's loaded multimodal data, with ``images`` and ``videos`` lists.

    Returns:
        ``ret`` (a ``BatchFeature`` gets the values as items), or a ``types.SimpleNamespace`` of ``ret``'s
        items and the values where ``ret`` is None or a plain dict. Grids are ``(N, 3)`` int64 tensors,
        seconds per grid a ``(N,)`` float tensor, N the number of items over the dicts.
    """
    import torch

    found = {}
    for key, modality in FIELDS:
        if _field(ret, key) is not None:
            continue
        values = [d[key] for d in _processor_outputs(getattr(base_output, modality, None)) if d.get(key) is not None]
        if values:
            parts = [torch.as_tensor(v) for v in values]
            bad = [tuple(p.shape) for p in parts if key.endswith("grid_thw") and p.numel() % 3]
            if bad:
                raise ValueError(f"{key} of a processor-output item must be N x 3 (t, h, w per item), got shape {bad[0]}")
            found[key] = torch.cat([p.reshape(-1, 3) if key.endswith("grid_thw") else p.reshape(-1) for p in parts])
    if not found:
        return ret
    if ret is None or type(ret) is dict:
        return types.SimpleNamespace(**dict(ret or {}), **found)
    for key, value in found.items():
        ret[key] = value
    return ret


def patch_class(cls) -> bool:
    """Wrap ``cls.process_and_combine_mm_data`` so that its ``ret`` passes through :func:`with_grids`;
    False when it was wrapped before."""
    combine = cls.process_and_combine_mm_data
    if getattr(combine, _MARK, False):
        return False

    def process_and_combine_mm_data(self, base_output, *args, **kwargs):
        items, input_ids, ret = combine(self, base_output, *args, **kwargs)
        return items, input_ids, with_grids(ret, base_output)

    setattr(process_and_combine_mm_data, _MARK, True)
    process_and_combine_mm_data.__doc__ = combine.__doc__
    cls.process_and_combine_mm_data = process_and_combine_mm_data
    return True


def apply() -> bool:
    """Patch SGLang's Qwen-VL processor class if SGLang loaded it in this process (it does when the
    engine serves a Qwen-VL model). Returns whether it changed anything; never raises."""
    cls = getattr(sys.modules.get(MODULE), CLASS, None)
    if cls is None:
        return False
    try:
        changed = patch_class(cls)
    except Exception as exc:  # noqa: BLE001 - the engine serves without it, as SGLang does
        logger.warning("sgl-rollout: Qwen-VL processor-output patch not applied: %r", exc)
        return False
    if changed:
        logger.info("sgl-rollout: Qwen-VL processor-output items get their grids (patches/qwen_vl_processor_output.py)")
    return changed
