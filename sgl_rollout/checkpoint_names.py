"""Checkpoint names for a trainer's parameter names, where transformers >= 5 names them differently.

transformers 5 renames some models' parameters when it loads a checkpoint and back when it saves one
(``transformers/conversion_mapping.py``: ``get_model_conversion_mapping``). Qwen2-VL and Qwen2.5-VL, for
example, hold ``model.language_model.layers.*`` and ``model.visual.*`` while their checkpoints, the weight
manifest (read from the checkpoint) and SGLang's loader use ``model.layers.*`` and ``visual.*``. A trainer
on transformers 5 (verl 0.9.1 pins >= 5.5.3) sends its own names; SGLang 0.5.10's
``Qwen2_5_VLForConditionalGeneration.load_weights`` (``sglang/srt/models/qwen2_5_vl.py``) then skips the
unknown non-stacked ones silently (the vision tower keeps its old weights) and fails a KeyError in the
scheduler on the stacked q/k/v/gate/up ones. :func:`checkpoint_renamer` reverses transformers' own
prefix renamings so every sync carries checkpoint names.
"""

from __future__ import annotations

import logging
import re
from typing import Callable, List, Optional, Tuple

logger = logging.getLogger(__name__)

#: A load-time renaming transformers anchors at the start of a checkpoint name: ``^visual`` or
#: ``^model(?!\.(language_model|visual))`` (transformers 5.9; a negative look-ahead keeps names it already
#: renamed), or behind a negative look-behind instead of ``^``: ``(?<!_)model(?!\.(language_model|visual))``
#: (transformers 5.6.0, SGLang 0.5.12's pin). A plain pattern (``LayerNorm.gamma``) is not a prefix.
_PREFIX = re.compile(r"^(?:\^|\(\?<![^()]*\))([A-Za-z_][A-Za-z0-9_.]*)(\(\?!.*\))?$")
_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


def prefix_pairs(renamings) -> List[Tuple[str, str]]:
    """``(runtime prefix, checkpoint prefix)`` for each prefix renaming among transformers'
    ``WeightRenaming`` objects (``source_patterns`` checkpoint -> ``target_patterns`` model), longest
    runtime prefix first; other renamings (suffixes such as ``LayerNorm.gamma``) are not reversed."""
    pairs = []
    for r in renamings:
        if type(r).__name__ != "WeightRenaming":
            continue
        for src, tgt in zip(getattr(r, "source_patterns", ()), getattr(r, "target_patterns", ())):
            m = _PREFIX.match(src)
            if m and _PLAIN.match(tgt) and tgt != m.group(1):
                pairs.append((tgt, m.group(1)))
    return sorted(set(pairs), key=lambda p: -len(p[0]))


def renamer_from_pairs(pairs: List[Tuple[str, str]]) -> Optional[Callable[[str], str]]:
    """``name -> checkpoint name`` replacing the first matching runtime prefix (a whole dotted segment);
    None when ``pairs`` is empty."""
    if not pairs:
        return None

    def rename(name: str) -> str:
        for runtime, checkpoint in pairs:
            if name == runtime or name.startswith(runtime + "."):
                return checkpoint + name[len(runtime):]
        return name

    return rename


def renamer_for_config(config) -> Optional[Callable[[str], str]]:
    """The ``runtime name -> checkpoint name`` function of a model of transformers ``config`` (its
    ``architectures[0]`` built on the meta device: no memory, no weights); None when its names need no
    change, or when transformers (before 5) or the architecture offers no mapping.

    Raises:
        whatever transformers raises building the model (callers decide what a failure means).
    """
    try:
        import torch
        import transformers
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return None
    cls = getattr(transformers, (getattr(config, "architectures", None) or [""])[0], None)
    if cls is None:
        return None
    with torch.device("meta"):
        model = cls._from_config(config)
    return renamer_from_pairs(prefix_pairs(get_model_conversion_mapping(model)))


def checkpoint_renamer(model_path: str, trust_remote_code: bool = False) -> Optional[Callable[[str], str]]:
    """:func:`renamer_for_config` of the model in ``model_path``. Never raises: a model it cannot build
    gets None, logged."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return None
    try:
        return renamer_for_config(AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code))
    except Exception as exc:  # noqa: BLE001 - no renaming beats no sync; the manifest still checks names
        logger.warning("no checkpoint-name mapping for %s (%r): weights are sent under the trainer's names",
                       model_path, exc)
        return None
