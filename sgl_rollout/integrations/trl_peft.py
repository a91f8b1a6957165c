"""A PEFT (LoRA) policy's weights as the engine is to hold them, for :mod:`sgl_rollout.integrations.trl`: its
active adapters merged in, out of place, under the base model's names (TRL's vLLM sync's naming rules,
``trl/generation/vllm_generation.py``; PEFT's merge arithmetic, ``peft/tuners/lora/layer.py``).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Tuple

__all__ = ["merged_adapter_weights", "policy_weights"]


def _base_name(name: str, prefix: str) -> Optional[str]:
    """A PEFT model's parameter name as the base model (and the engine) spell it, or None for a parameter the
    engine has no place for: the adapter's own (``prefix``, ``lora_``) and a ``modules_to_save`` copy's
    ``original_module``. The rules of TRL's vLLM sync (``trl/generation/vllm_generation.py``): drop
    ``base_model.model.``, ``.base_layer`` and ``modules_to_save.default.``."""
    if prefix in name or "original_module" in name:
        return None
    return name.removeprefix("base_model.model.").replace(".base_layer", "").replace("modules_to_save.default.", "")


def _lora_variant(layer) -> Optional[str]:
    """The name of the first LoRA variant (DoRA and the like: PEFT's ``lora_variant``) of ``layer``'s adapters."""
    variants = getattr(layer, "lora_variant", None) or {}
    return type(next(iter(variants.values()))).__name__ if variants else None


def _with_adapters(layer, kind: str, tensor):
    """``tensor`` (``layer``'s base ``weight`` or ``bias``) plus each active adapter's delta, out of place:
    PEFT's own ``merge`` arithmetic (``peft/tuners/lora/layer.py``: ``W += get_delta_weight(a)``, the bias
    ``+= lora_B.bias * scaling``), bit for bit, without touching the trainer's parameters.

    Raises:
        ValueError: a LoRA variant (DoRA, ...), whose merge is not a delta.
    """
    import torch

    if layer.merged or layer.disable_adapters:
        return tensor
    with torch.no_grad():
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A.keys():
                continue
            if adapter in (getattr(layer, "lora_variant", None) or {}):
                raise ValueError(f"LoRA variant {_lora_variant(layer)} (adapter {adapter!r}): SglGRPOTrainer merges "
                                 "plain LoRA adapters only")
            if kind == "weight":
                tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
            elif layer.lora_bias[adapter]:
                tensor = tensor + (layer.lora_B[adapter].bias * layer.scaling[adapter]).to(tensor.dtype)
    return tensor


def merged_adapter_weights(model) -> Iterator[Tuple[str, Any]]:
    """A PEFT (LoRA) model's weights with its active adapters merged in, under the base model's names
    (:func:`_base_name`), lazily, one tensor at a time: what TRL's vLLM colocate mode sends for a PEFT model
    (``VLLMGeneration._iter_params``), but computed out of place (:func:`_with_adapters`) where TRL merges in
    place and unmerges after, which leaves the trainer's base weights off by the rounding of ``W + d - d``
    at every sync and merged if the sync fails between the two. A weight without an adapter is the
    parameter itself (no copy); a merged one is a new tensor of the parameter's shape and dtype.

    Raises:
        ValueError: a LoRA variant (DoRA, ...) (:func:`_with_adapters`).
    """
    from peft.tuners.lora import LoraLayer

    owners = {}
    for prefix, module in model.named_modules():
        if isinstance(module, LoraLayer):
            owners[f"{prefix}.base_layer.weight"] = (module, "weight")
            owners[f"{prefix}.base_layer.bias"] = (module, "bias")
    for name, param in model.named_parameters():
        base = _base_name(name, model.prefix)
        if base is None:
            continue
        owner = owners.get(name)
        yield base, (param.detach() if owner is None else _with_adapters(owner[0], owner[1], param.detach()))


def policy_weights(model):
    """The policy's parameters, Hugging Face names, as the engine is to hold them: ``(name, tensor)`` pairs of
    ``model`` (the trainer's unwrapped model); for a PEFT model (TRL's ``peft_config``) its merged weights under
    the base model's names, made one at a time as the sync reads them (:func:`merged_adapter_weights`)."""
    if getattr(model, "peft_config", None):
        return merged_adapter_weights(model)
    return [(n, p.detach()) for n, p in model.named_parameters()]
