"""What a LoRA adapter is to the engine: its normalized PEFT config, the checks of that config against the
engine's LoRA settings, and the serialized payload SGLang's ``load_lora_adapter_from_tensors`` takes.

Both :mod:`sgl_rollout.engine` (which refuses an adapter it cannot serve before SGLang sees it) and
:mod:`sgl_rollout.weight_sync.lora` (which builds and validates adapters against the weight manifest)
read these; neither owns them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional

from .config import ALL_LINEAR_MODULES, SGLANG_LORA_TARGET_MODULES

#: PEFT options that change what an adapter computes in ways SGLang 0.5.10 does not reproduce:
#: key -> why a value other than None/False/empty (``bias``: ``"none"``) is refused.
UNSUPPORTED_PEFT_OPTIONS = {
    "use_rslora": "SGLang scales by lora_alpha / r, rsLoRA by lora_alpha / sqrt(r)",
    "use_dora": "SGLang has no DoRA magnitude vectors",
    "rank_pattern": "SGLang serves one rank per adapter",
    "alpha_pattern": "SGLang serves one lora_alpha per adapter",
    "modules_to_save": "fully trained modules are not LoRA weights; SGLang would not load them",
    "bias": "SGLang loads no LoRA biases",
    "lora_bias": "SGLang loads no LoRA biases",
    "target_parameters": "LoRA on bare parameters (MoE experts) is not served",
    "trainable_token_indices": "trainable tokens change the embeddings, which SGLang would not load",
    "layer_replication": "replicated layers are not in the served model",
}


def adapter_config_dict(peft_config, modules: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """The adapter's PEFT config as SGLang's ``LoRAConfig.from_dict`` takes it.

    Args:
        peft_config: a ``peft.LoraConfig`` or its ``to_dict()`` (verl passes either).
        modules: the module names the adapter's tensors target; when given they replace a string
            ``target_modules`` (``"all-linear"``), so SGLang sees exactly what arrives.

    Returns:
        a JSON-plain dict: enums as their values (``peft_type="LORA"``), sets as sorted lists.

    Raises:
        TypeError: neither a mapping nor an object with ``to_dict()``.
    """
    if isinstance(peft_config, Mapping):
        d = dict(peft_config)
    elif hasattr(peft_config, "to_dict"):
        d = dict(peft_config.to_dict())
    else:
        raise TypeError(f"peft_config must be a dict or a peft.LoraConfig, got {type(peft_config).__name__}")
    out: Dict[str, Any] = {}
    for k, v in d.items():
        v = getattr(v, "value", v)  # PeftType / TaskType enums
        if isinstance(v, (set, frozenset)):
            v = sorted(v)
        out[k] = v
    out.setdefault("peft_type", "LORA")
    if modules is not None and (isinstance(out.get("target_modules"), str) or out.get("target_modules") is None):
        out["target_modules"] = sorted(set(modules))
    return out


def check_adapter_config(config: Mapping[str, Any], engine_config=None) -> List[str]:
    """Problems with serving an adapter of this (normalized) PEFT config; empty when none.

    Args:
        config: from :func:`adapter_config_dict`.
        engine_config: the engine's :class:`~sgl_rollout.config.RolloutConfig`; checks LoRA is on, the
            rank against ``lora_rank`` (SGLang's ``max_lora_rank``) and the target modules against
            ``lora_target_modules``.
    """
    problems: List[str] = []
    peft_type = str(config.get("peft_type", "LORA"))
    if peft_type.upper() != "LORA":
        problems.append(f"peft_type={peft_type!r}: only LORA adapters are served")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        problems.append(f"r={r!r}: the rank must be an int >= 1")
        r = None
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        problems.append(f"lora_alpha={alpha!r}: must be a number > 0")
    for key, why in UNSUPPORTED_PEFT_OPTIONS.items():
        value = config.get(key)
        bad = value not in (None, "none") if key == "bias" else value not in (None, False, {}, [], ())
        if bad:
            problems.append(f"{key}={value!r}: {why}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        if targets not in ("all-linear", "all"):
            problems.append(f"target_modules={targets!r}: SGLang takes a list of module names, 'all-linear' or 'all'")
        names: List[str] = list(ALL_LINEAR_MODULES)
    elif targets:
        names = [t.split(".")[-1] for t in targets]
        odd = sorted({t for t in names if t not in SGLANG_LORA_TARGET_MODULES})
        if odd:
            problems.append(f"target_modules {odd} are not served by SGLang ({list(SGLANG_LORA_TARGET_MODULES)})")
    else:
        problems.append("target_modules is empty")
        names = []
    if engine_config is not None:
        if not engine_config.lora_enabled:
            problems.append("the engine was started without LoRA (lora_rank=0 in the rollout config)")
        else:
            if r is not None and r > engine_config.lora_rank:
                problems.append(f"r={r} exceeds the engine's lora_rank={engine_config.lora_rank} (SGLang's "
                                "max_lora_rank, fixed at start-up)")
            served = engine_config.server_lora_target_modules()
            if served != ["all"]:
                extra = sorted(set(stacked_modules(names)) - set(stacked_modules(served)))
                if extra:
                    problems.append(f"target modules {extra} are not among the engine's lora_target_modules "
                                    f"{engine_config.lora_target_modules!r} (fixed at start-up)")
    return problems




def stacked_modules(names: Iterable[str]) -> List[str]:
    """SGLang's normalized (stacked) module names: q/k/v -> qkv_proj, gate/up -> gate_up_proj."""
    m = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}
    return [m.get(n, n) for n in names]




@dataclass
class AdapterPayload:
    """A checked adapter, serialized for SGLang's ``load_lora_adapter_from_tensors(load_format="flattened_bucket")``.

    Attributes:
        data: the serialized ``{"flattened_tensor", "metadata"}`` dict (bytes, by value).
        config: the normalized PEFT config SGLang gets (``target_modules`` as the modules sent).
        n_tensors: tensors in it.
        tensor_bytes: bytes of tensor data (no padding).
        modules: the target module kinds present (``["q_proj", "v_proj", ...]``).
        build_parts: seconds of building it, in three parts: ``check`` (:func:`validate_adapter`),
            ``flatten`` (one buffer on the tensors' device, then one copy to pinned host memory),
            ``serialize`` (pickling the bytes by value); :attr:`build_seconds` is their sum.
    """

    data: bytes
    config: Dict[str, Any]
    n_tensors: int
    tensor_bytes: int
    modules: List[str] = field(default_factory=list)
    build_parts: Dict[str, float] = field(default_factory=dict)

    @property
    def build_seconds(self) -> float:
        """Seconds to check, flatten and serialize (the sum of :attr:`build_parts`)."""
        return sum(self.build_parts.values())

    @property
    def nbytes(self) -> int:
        """Bytes of :attr:`data`."""
        return len(self.data)
