"""The weights a model expects, and checks of a weight sync against them before SGLang sees a byte.

Why check on the sending side (SGLang 0.5.10): ``update_weights_from_tensor`` ends in the model's
``load_weights`` (``LlamaForCausalLM.load_weights``, ``sglang/srt/models/llama.py``), which skips a
name it does not know (q/k/v/gate/up names silently, others with one warning in the scheduler's log),
so a typo such as ``model.layers.9...`` in a 4-layer model leaves the old weight in place. A wrong
shape fails ``assert param_data.shape == loaded_weight.shape`` in a weight loader
(``sglang/srt/layers/linear.py``, or ``default_weight_loader`` in
``sglang/srt/model_loader/weight_utils.py``) inside the scheduler; nothing catches it on the
flattened-bucket path, and ``run_scheduler_process`` (``sglang/srt/managers/scheduler.py``) then sends
SIGQUIT to the host process, the trainer. An integer tensor is cast by ``param.data.copy_`` into
garbage weights. Float dtypes may differ (float32 into a bf16 model): the same ``copy_`` casts.

A :class:`WeightManifest` is a plain mapping of Hugging Face names to :class:`ParamSpec`; a
:class:`SyncValidator` checks one sync item by item and reports every problem in one
:class:`SyncValidationError`.
"""

from __future__ import annotations

import difflib
import json
import os
import struct
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Mapping, Set, Tuple, Union

import torch

from ..errors import MAX_LISTED, SyncValidationError  # noqa: F401 - re-exported

#: Unknown names per sync that get difflib suggestions (each can cost milliseconds on a big model).
MAX_SUGGESTED = 10
#: Largest safetensors JSON header read, in bytes (the format's own readers refuse larger ones).
MAX_HEADER_BYTES = 100 * 1024 * 1024
#: Checkpoint entries that are buffers, not weights; SGLang's ``load_weights`` skips them.
_BUFFER_MARKERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
#: Names of input embeddings that a tied ``lm_head.weight`` shares.
_EMBED_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
_HINT = "pass model.named_parameters() or dict.items(), not a dict"
_ST_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
              "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16",
              "BF16": "bfloat16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
              "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "C64": "complex64"}


@dataclass(frozen=True)
class ParamSpec:
    """Expected shape and dtype of one weight.

    Attributes:
        shape: the full (unsharded) Hugging Face shape, a tuple of ints (a ``torch.Size`` is converted).
        dtype: the model's dtype for it (the checkpoint's, or the config's ``dtype``).
    """

    shape: Tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes in ``dtype`` (``numel * itemsize``)."""
        return self.numel * self.dtype.itemsize


class WeightManifest:
    """Hugging Face weight names of a model with their :class:`ParamSpec`, in the model's order.

    Args:
        specs: name -> spec, e.g. ``"model.layers.0.self_attn.q_proj.weight" -> ParamSpec((64, 64), torch.bfloat16)``.
        optional: names a full sync need not contain, though it may (a tied ``lm_head.weight``, which
            ``named_parameters()`` leaves out and SGLang skips; rotary buffers stored in old checkpoints).

    Raises:
        ValueError: an optional name is not in ``specs``, or a spec is not a :class:`ParamSpec`.
    """

    def __init__(self, specs: Mapping[str, ParamSpec], optional: Iterable[str] = ()):
        self.specs: Dict[str, ParamSpec] = dict(specs)
        self.optional: FrozenSet[str] = frozenset(optional)
        bad = [n for n, s in self.specs.items() if not isinstance(s, ParamSpec)]
        if bad:
            raise ValueError(f"specs must be ParamSpec values; not for {bad[:5]}")
        unknown = sorted(self.optional - self.specs.keys())
        if unknown:
            raise ValueError(f"optional names not in the manifest: {unknown[:5]}")

    def __len__(self) -> int:
        return len(self.specs)

    def __contains__(self, name) -> bool:
        return name in self.specs

    def __getitem__(self, name: str) -> ParamSpec:
        return self.specs[name]

    def __repr__(self) -> str:
        return f"WeightManifest({len(self)} weights, {len(self.optional)} optional)"

    def names(self) -> List[str]:
        """All names, required and optional, in manifest order."""
        return list(self.specs)

    @classmethod
    def from_pretrained(cls, model_path: str, trust_remote_code: bool = False) -> "WeightManifest":
        """Manifest of a local Hugging Face folder, from its safetensors headers when it has any.

        Reads only each file's header (8-byte little-endian length, then that many bytes of JSON with
        every tensor's dtype and shape), never tensor data: one small read per file, whatever the model size.
        Files: those of ``model.safetensors.index.json``, else ``model.safetensors``, else every
        ``*.safetensors``. A checkpoint without ``lm_head.weight`` but with an input embedding is tied:
        ``lm_head.weight`` is added, optional, with the embedding's spec; with ``tie_word_embeddings``
        in ``config.json`` a stored ``lm_head.weight`` is optional too. Without safetensors (``.bin``
        only): :meth:`from_config`. Names are taken as stored; where a checkpoint's differ from the
        trainer's parameter names (checkpoints transformers renames on load), use :meth:`from_config`.

        Raises:
            FileNotFoundError: ``model_path`` is not a folder, or holds neither safetensors nor config.json.
            ValueError: a malformed header or index, or a name stored twice with different specs.
        """
        if not os.path.isdir(model_path):
            raise FileNotFoundError(f"{model_path}: not a folder (from_pretrained needs a local Hugging Face model folder)")
        files = _safetensors_files(model_path)
        if not files:
            if not os.path.isfile(os.path.join(model_path, "config.json")):
                raise FileNotFoundError(f"{model_path}: no *.safetensors and no config.json, so no weight manifest")
            return cls.from_config(model_path, trust_remote_code=trust_remote_code)
        specs: Dict[str, ParamSpec] = {}
        for path in files:
            for name, spec in _read_header(path).items():
                if specs.setdefault(name, spec) != spec:
                    raise ValueError(f"{name}: stored twice with different specs ({specs[name]} and {spec})")
        index = os.path.join(model_path, "model.safetensors.index.json")
        if os.path.isfile(index):
            absent = sorted(set(_load_json(index)["weight_map"]) - specs.keys())
            if absent:
                raise ValueError(f"{index} lists {len(absent)} names its files lack, e.g. {absent[:3]}")
        cfg_path = os.path.join(model_path, "config.json")
        cfg = _load_json(cfg_path) if os.path.isfile(cfg_path) else {}
        tied = bool(cfg.get("tie_word_embeddings", (cfg.get("text_config") or {}).get("tie_word_embeddings", False)))
        optional = {n for n in specs if any(m in n for m in _BUFFER_MARKERS)}
        if "lm_head.weight" in specs:
            if tied:
                optional.add("lm_head.weight")
        else:
            embed = next((n for n in specs if n.endswith(_EMBED_SUFFIXES)), None)
            if embed is not None:
                specs["lm_head.weight"] = specs[embed]
                optional.add("lm_head.weight")
        return cls(specs, optional)

    @classmethod
    def from_config(cls, config_or_path, trust_remote_code: bool = False) -> "WeightManifest":
        """Manifest of the model ``AutoModelForCausalLM.from_config`` builds, on the meta device.

        Lists ``named_parameters(remove_duplicate=False)``, so a tied ``lm_head.weight`` is there,
        optional when ``config.tie_word_embeddings`` (and any name sharing an earlier parameter).
        No memory is allocated. dtype: the config's ``dtype`` (``torch_dtype`` before transformers 5)
        for floating weights when set, else the parameter's. Buffers are not listed.

        Args:
            config_or_path: a transformers ``PretrainedConfig``, or a folder (or hub id) with config.json.

        Raises:
            FileNotFoundError: a folder without config.json.
            ValueError / OSError: from transformers, for a config it cannot read or build.
        """
        from transformers import AutoConfig, AutoModelForCausalLM

        config = config_or_path
        if isinstance(config_or_path, (str, os.PathLike)):
            if os.path.isdir(config_or_path) and not os.path.isfile(os.path.join(config_or_path, "config.json")):
                raise FileNotFoundError(f"{config_or_path}: no config.json, so no weight manifest")
            config = AutoConfig.from_pretrained(config_or_path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        manifest = cls.from_named_tensors(model)
        dtype = _config_dtype(config)
        specs = {n: ParamSpec(s.shape, dtype) if dtype is not None and s.dtype.is_floating_point else s
                 for n, s in manifest.specs.items()}
        optional = set(manifest.optional)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text_config, "tie_word_embeddings", False) and "lm_head.weight" in specs:
            optional.add("lm_head.weight")
        return cls(specs, optional)

    @classmethod
    def from_named_tensors(cls, items) -> "WeightManifest":
        """Manifest of (name, tensor) pairs, a ``{name: tensor}`` dict, or a ``torch.nn.Module``.

        A Module gives ``named_parameters(remove_duplicate=False)``. A name whose tensor is the very
        object of an earlier name (a tied ``lm_head.weight``) is optional. Shapes and dtypes are the
        tensors' (meta tensors work).

        Raises:
            ValueError: an item is not a (str, Tensor) pair, or a name repeats with a different spec.
        """
        if isinstance(items, torch.nn.Module):
            items = items.named_parameters(remove_duplicate=False)
        elif isinstance(items, Mapping):
            items = items.items()
        specs: Dict[str, ParamSpec] = {}
        optional, owners = set(), {}
        for item in items:
            if not (isinstance(item, (tuple, list)) and len(item) == 2
                    and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)):
                raise ValueError(f"expected (str, torch.Tensor) pairs, got {type(item).__name__}; {_HINT}")
            name, tensor = item
            spec = ParamSpec(tuple(tensor.shape), tensor.dtype)
            if specs.setdefault(name, spec) != spec:
                raise ValueError(f"{name}: given twice with different specs ({specs[name]} and {spec})")
            if owners.setdefault(id(tensor), (name, tensor))[0] != name:
                optional.add(name)
        return cls(specs, optional)

    def check_tensor(self, name: str, tensor, suggest: bool = True) -> List[str]:
        """Problems of one item against the manifest; ``[]`` when it may be sent.

        Reports: not a (str, Tensor) pair (nothing else is checked then); a name the model lacks, with
        up to 3 close known names when ``suggest`` (a known name under an extra or a missing prefix such
        as ``module.``, else ``difflib.get_close_matches``); a shape other than the spec's, e.g.
        ``"model.layers.0.mlp.down_proj.weight: shape (100, 1408), expected (512, 1408)"``; a
        non-floating tensor for a floating weight (int, bool), or any other dtype for a non-floating
        one. Other float dtypes pass: SGLang casts them on copy. Never raises.
        """
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            return [f"{str(name)[:80]}: expected a (str, torch.Tensor) pair, got "
                    f"({type(name).__name__}, {type(tensor).__name__}); {_HINT}"]
        spec = self.specs.get(name)
        if spec is None:
            close = self._suggest(name) if suggest else None
            hint = "" if close is None else f"; did you mean {', '.join(close)}?" if close else "; no close match"
            return [f"{name}: not a weight of this model ({len(self)} weights; SGLang would skip it "
                    f"and keep the old value){hint}"]
        problems = []
        if tuple(tensor.shape) != spec.shape:
            problems.append(f"{name}: shape {tuple(tensor.shape)}, expected {spec.shape}")
        if spec.dtype.is_floating_point and not tensor.dtype.is_floating_point:
            problems.append(f"{name}: dtype {tensor.dtype} is not floating-point, expected {spec.dtype}")
        elif not spec.dtype.is_floating_point and tensor.dtype != spec.dtype:
            problems.append(f"{name}: dtype {tensor.dtype}, expected {spec.dtype}")
        return problems

    def missing(self, seen: Iterable[str]) -> List[str]:
        """Required (not optional) names absent from ``seen``, in manifest order."""
        seen = set(seen)
        return [n for n in self.specs if n not in seen and n not in self.optional]

    def _suggest(self, name: str) -> List[str]:
        parts = name.split(".")
        for i in range(1, len(parts)):  # a prefix too many ("module.", "_orig_mod.")
            if ".".join(parts[i:]) in self.specs:
                return [".".join(parts[i:])]
        # Names of the same kind (same last two parts, e.g. "q_proj.weight") first: fewer to compare.
        pool = [n for n in self.specs if n.endswith(".".join(parts[-2:]))]
        return ([n for n in pool if n.endswith("." + name)][:3]  # a prefix too few
                or difflib.get_close_matches(name, pool, n=3, cutoff=0.6)
                or difflib.get_close_matches(name, list(self.specs), n=3, cutoff=0.6))


class SyncValidator:
    """Stateful check of one sync, fed tensor by tensor as they are bucketed.

    Args:
        manifest: the model's expected weights.
        partial: True when the sync may send a subset (then :meth:`finish` skips the missing-name check).

    Attributes:
        seen: names checked so far.

    Only the first :data:`MAX_SUGGESTED` unknown names get suggestions, so a sync whose every name is
    wrong (Megatron names, say) is reported in milliseconds.
    """

    def __init__(self, manifest: WeightManifest, partial: bool = False):
        self.manifest = manifest
        self.partial = partial
        self.seen: Set[str] = set()
        self._problems: List[str] = []
        self._finished = False
        self._unknown = 0

    @property
    def problems(self) -> List[str]:
        """Every problem recorded so far (a copy)."""
        return list(self._problems)

    @property
    def ok(self) -> bool:
        """True while no problem was recorded."""
        return not self._problems

    def check(self, name, tensor) -> List[str]:
        """Check one item (:meth:`WeightManifest.check_tensor`, plus a name sent twice); record and return its problems."""
        spec = self.manifest.specs.get(name) if type(name) is str else None
        if (spec is not None and isinstance(tensor, torch.Tensor) and tensor.shape == spec.shape
                and (tensor.dtype.is_floating_point if spec.dtype.is_floating_point else tensor.dtype == spec.dtype)
                and name not in self.seen):  # the common case, in a few hundred nanoseconds
            self.seen.add(name)
            return []
        problems = self.manifest.check_tensor(name, tensor, suggest=self._unknown < MAX_SUGGESTED)
        if isinstance(name, str):
            self._unknown += name not in self.manifest
            if name in self.seen:
                problems.append(f"{name}: sent twice in one sync")
            self.seen.add(name)
        self._problems.extend(problems)
        return problems

    def raise_if_failed(self, context: str = "") -> None:
        """Raises :class:`SyncValidationError` with all problems so far, if there are any."""
        if self._problems:
            raise SyncValidationError(self._problems, context)

    def finish(self, context: str = "") -> None:
        """End the sync: a full one records every required name never sent; then raise if anything is wrong.

        An empty partial sync passes (the caller decides about empty syncs). Calling it again adds
        nothing new.

        Raises:
            SyncValidationError: any problem recorded.
        """
        if not self.partial and not self._finished:
            self._problems.extend(f"{n}: never sent (a full sync needs every weight; use partial=True "
                                  f"for a subset)" for n in self.manifest.missing(self.seen))
        self._finished = True
        self.raise_if_failed(context)

    def validate_all(self, items, context: str = "") -> None:
        """Check every (name, tensor) of ``items`` (consumed once), then :meth:`finish`.

        A dict or a Module instead of pairs is one problem, raised at once (its names would all be
        missing otherwise).

        Raises:
            SyncValidationError: any problem, all of them listed.
        """
        if isinstance(items, (Mapping, torch.nn.Module)):
            self._problems.append(f"got a {type(items).__name__} instead of (name, tensor) pairs; {_HINT}")
            self.raise_if_failed(context)
        for i, item in enumerate(items):
            if isinstance(item, (tuple, list)) and len(item) == 2:
                self.check(*item)
            else:
                self._problems.append(f"item {i}: expected a (name, tensor) pair, got {type(item).__name__} "
                                      f"{str(item)[:80]!r}; {_HINT}")
        self.finish(context)


def _load_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _safetensors_files(folder: str) -> List[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _load_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no weight_map")
        return [os.path.join(folder, f) for f in sorted(set(weight_map.values()))]
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return [os.path.join(folder, "model.safetensors")]
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))


def _read_header(path: str) -> Dict[str, ParamSpec]:
    """Specs in one safetensors file's header: u64 little-endian N, then N bytes of JSON."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path}: not a safetensors file (header length {n}, file {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is a {type(header).__name__}, not a JSON object")
    specs = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = getattr(torch, _ST_DTYPES.get(info["dtype"], "?"), None), tuple(info["shape"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: malformed header entry for {name} ({e!r})") from None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{path}: {name} has dtype {info['dtype']!r}, which torch lacks")
        specs[name] = ParamSpec(shape, dtype)
    return specs


def _config_dtype(config) -> Union[torch.dtype, None]:
    # transformers 5 has ``dtype``; 4.x ``torch_dtype`` (which 5 still answers, with a warning)
    dtype = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None
