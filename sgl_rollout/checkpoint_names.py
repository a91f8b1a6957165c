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

Mixture-of-experts models are also *fused* by transformers 5: Qwen3-MoE (``model_type`` ``qwen3_moe`` ->
the ``qwen2_moe`` entry of ``conversion_mapping.py``) holds each layer's experts as
``mlp.experts.gate_up_proj`` ``(E, 2*I, H)`` (every expert's ``gate_proj.weight`` stacked on dim 0, then
its ``up_proj.weight`` concatenated after it on dim 1) and ``mlp.experts.down_proj`` ``(E, H, I)``, where
the checkpoint and SGLang's ``Qwen3MoeForCausalLM.load_weights`` have ``mlp.experts.E.gate_proj.weight``
``(I, H)`` and so on. No name-to-name function can undo that; :func:`expert_splits` reads transformers'
``WeightConverter`` objects (``MergeModulelist`` then optionally ``Concatenate``,
``transformers/core_model_loading.py``) and :func:`checkpoint_mappings` gives a ``(name, tensor) ->
[(name, tensor), ...]`` function that splits them back into per-expert *views* (no copies).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

logger = logging.getLogger(__name__)

#: A load-time renaming transformers anchors at the start of a checkpoint name: ``^visual`` or
#: ``^model(?!\.(language_model|visual))`` (transformers 5.9; a negative look-ahead keeps names it already
#: renamed), or behind a negative look-behind instead of ``^``: ``(?<!_)model(?!\.(language_model|visual))``
#: (transformers 5.6.0, SGLang 0.5.12's pin). A plain pattern (``LayerNorm.gamma``) is not a prefix.
_PREFIX = re.compile(r"^(?:\^|\(\?<![^()]*\))([A-Za-z_][A-Za-z0-9_.]*)(\(\?!.*\))?$")
_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
#: A per-expert checkpoint pattern of a fusing ``WeightConverter``: ``mlp.experts.*.gate_proj.weight``.
_PER_EXPERT = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*\.\*\.[A-Za-z_][A-Za-z0-9_.]*$")

#: ``(name, tensor) -> [(checkpoint name, tensor), ...]``: what :func:`checkpoint_mappings` gives a sync.
TensorRenamer = Callable[[str, object], List[Tuple[str, object]]]


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


@dataclass(frozen=True)
class ExpertSplit:
    """The reverse of one fusing ``WeightConverter`` (``transformers/core_model_loading.py``:
    ``MergeModulelist(expert_dim)``, then ``Concatenate(concat_dim)`` when it fuses several sources).

    ``target`` is the runtime name's tail (``mlp.experts.gate_up_proj``), ``sources`` the checkpoint tails
    in concatenation order, ``*`` standing for the expert index (``mlp.experts.*.gate_proj.weight``,
    ``mlp.experts.*.up_proj.weight``), ``scope`` a sub-model's prefix the converter is confined to (None:
    the whole model)."""

    target: str
    sources: Tuple[str, ...]
    expert_dim: int
    concat_dim: Optional[int]
    scope: Optional[str] = None

    def prefix_of(self, name: str) -> Optional[str]:
        """What precedes ``target`` in ``name`` (``model.layers.3.``), ``""`` for ``target`` itself; None
        when ``name`` is not this converter's (another tail, or outside ``scope``)."""
        if name != self.target and not name.endswith("." + self.target):
            return None
        prefix = name[: len(name) - len(self.target)]
        if self.scope and not (prefix.startswith(self.scope + ".") or f".{self.scope}." in prefix):
            return None
        return prefix

    def views(self, prefix: str, tensor) -> List[Tuple[str, object]]:
        """``tensor`` (the fused parameter, any dtype and device) as per-expert checkpoint tensors, expert
        by expert and, per expert, in ``sources`` order: views of ``tensor`` (detached), no copies. For
        Qwen3-MoE ``gate_up_proj`` ``(E, 2*I, H)`` gives ``E.gate_proj.weight`` ``[e, :I]`` and
        ``E.up_proj.weight`` ``[e, I:]``, each ``(I, H)``; ``down_proj`` ``(E, H, I)`` gives ``[e]``.

        Raises:
            ValueError: ``tensor`` has too few dims, or its ``concat_dim`` does not split evenly into
                ``len(sources)`` parts (not the fused layout this converter makes).
        """
        shape = tuple(tensor.shape)
        dims = [self.expert_dim] + ([self.concat_dim] if self.concat_dim is not None else [])
        if len(shape) <= max(dims):
            raise ValueError(f"{prefix}{self.target}: shape {shape} has no dim {max(dims)} (fused experts)")
        t = tensor.detach()
        parts = [t]
        if self.concat_dim is not None:
            n = len(self.sources)
            if shape[self.concat_dim] % n:
                raise ValueError(f"{prefix}{self.target}: shape {shape}: dim {self.concat_dim} does not split "
                                 f"into {n} equal parts ({', '.join(self.sources)})")
            size = shape[self.concat_dim] // n
            parts = [t.narrow(self.concat_dim, k * size, size) for k in range(n)]
        return [(prefix + src.replace("*", str(e)), part.select(self.expert_dim, e))
                for e in range(shape[self.expert_dim]) for src, part in zip(self.sources, parts)]


def _split_of(converter) -> Optional[ExpertSplit]:
    """The :class:`ExpertSplit` reversing ``converter``, or None when it is not a plain expert fusion."""
    ops = list(getattr(converter, "operations", None) or ())
    kinds = [type(op).__name__ for op in ops]
    sources = list(getattr(converter, "_original_source_patterns", None) or converter.source_patterns)
    targets = list(getattr(converter, "_original_target_patterns", None) or converter.target_patterns)
    if kinds not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]) or len(targets) != 1:
        return None
    if not _PLAIN.match(targets[0]) or not sources or not all(_PER_EXPERT.match(s) for s in sources):
        return None
    if len(ops) == 1 and len(sources) != 1:  # several sources are fused by the Concatenate only
        return None
    concat = ops[1].dim if len(ops) == 2 else None
    if not isinstance(ops[0].dim, int) or (concat is not None and not isinstance(concat, int)):
        return None
    return ExpertSplit(targets[0], tuple(sources), ops[0].dim, concat, getattr(converter, "scope_prefix", None))


def expert_splits(conversions) -> List[ExpertSplit]:
    """The :class:`ExpertSplit` of each plain expert-fusing ``WeightConverter`` among transformers'
    conversions (``get_model_conversion_mapping``, ``transformers/conversion_mapping.py``; for Qwen3-MoE
    its ``qwen2_moe`` entry): per-expert sources (one ``*``), one plain target, operations
    ``MergeModulelist`` and optionally ``Concatenate`` (one source without it). Other converters
    (``Transpose``, quantizers' ...) are left out: :func:`unsplit_targets` names them."""
    splits = []
    for c in conversions or ():
        if type(c).__name__ == "WeightConverter":
            split = _split_of(c)
            if split is not None:
                splits.append(split)
    return splits


def unsplit_targets(conversions) -> List[str]:
    """The target patterns of ``WeightConverter`` objects :func:`expert_splits` cannot reverse."""
    out = []
    for c in conversions or ():
        if type(c).__name__ == "WeightConverter" and _split_of(c) is None:
            out += [str(t) for t in c.target_patterns]
    return out


def tensor_renamer(pairs: List[Tuple[str, str]], splits: List[ExpertSplit]) -> Optional[TensorRenamer]:
    """``(name, tensor) -> [(checkpoint name, tensor), ...]``: a fused expert parameter split into its
    per-expert views (:meth:`ExpertSplit.views`), then every name's runtime prefix renamed
    (:func:`renamer_from_pairs`); any other pair comes back alone, its tensor the same object. None when
    there is nothing to undo.

    Raises (the function returned):
        ValueError: a fused parameter whose shape does not fit its converter (:meth:`ExpertSplit.views`).
    """
    if not pairs and not splits:
        return None
    rename = renamer_from_pairs(pairs) or (lambda n: n)

    def renamed(name: str, tensor) -> List[Tuple[str, object]]:
        for split in splits:
            prefix = split.prefix_of(name)
            if prefix is not None:
                return [(rename(n), t) for n, t in split.views(prefix, tensor)]
        return [(rename(name), tensor)]

    return renamed


def _conversions_for_config(config):
    """transformers' conversions of a model of ``config`` (built on the meta device) and its parameter
    names; None when transformers (before 5) or the architecture offers none."""
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
    return get_model_conversion_mapping(model), [n for n, _ in model.named_parameters()]


def renamer_for_config(config) -> Optional[Callable[[str], str]]:
    """The ``runtime name -> checkpoint name`` function of a model of transformers ``config`` (its
    ``architectures[0]`` built on the meta device: no memory, no weights); None when its names need no
    change, or when transformers (before 5) or the architecture offers no mapping. Fused experts are not
    names: :func:`mappings_for_config` splits them.

    Raises:
        whatever transformers raises building the model (callers decide what a failure means).
    """
    return mappings_for_config(config)[0]


def mappings_for_config(config) -> Tuple[Optional[Callable[[str], str]], Optional[TensorRenamer]]:
    """``(name renamer, tensor renamer)`` of a model of transformers ``config``: :func:`renamer_from_pairs`
    and :func:`tensor_renamer` of transformers' own conversions (``transformers/conversion_mapping.py``),
    each None when it has nothing to do. A fusing converter it cannot reverse that matches one of the
    model's parameters is logged (those are sent fused; the manifest refuses them).

    Raises:
        whatever transformers raises building the model on the meta device.
    """
    found = _conversions_for_config(config)
    if found is None:
        return None, None
    conversions, names = found
    pairs, splits = prefix_pairs(conversions), expert_splits(conversions)
    stuck = [t for t in unsplit_targets(conversions) if _PLAIN.match(t)
             and any(n == t or n.endswith("." + t) for n in names)]
    if stuck:
        logger.warning("fused parameters %s of %s are not split back into checkpoint tensors (a converter "
                       "other than MergeModulelist/Concatenate)", stuck, type(config).__name__)
    return renamer_from_pairs(pairs), tensor_renamer(pairs, splits)


def checkpoint_mappings(model_path: str, trust_remote_code: bool = False
                        ) -> Tuple[Optional[Callable[[str], str]], Optional[TensorRenamer]]:
    """:func:`mappings_for_config` of the model in ``model_path``. Never raises: a model it cannot build
    gets ``(None, None)``, logged."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return None, None
    try:
        return mappings_for_config(AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code))
    except Exception as exc:  # noqa: BLE001 - no renaming beats no sync; the manifest still checks names
        logger.warning("no checkpoint-name mapping for %s (%r): weights are sent under the trainer's names",
                       model_path, exc)
        return None, None


def checkpoint_renamer(model_path: str, trust_remote_code: bool = False) -> Optional[Callable[[str], str]]:
    """:func:`renamer_for_config` of the model in ``model_path`` (the name renamer of
    :func:`checkpoint_mappings`). Never raises: a model it cannot build gets None, logged."""
    return checkpoint_mappings(model_path, trust_remote_code)[0]
