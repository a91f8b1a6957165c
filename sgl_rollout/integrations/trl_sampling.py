"""SGLang sampling parameters for TRL's ``GRPOTrainer`` settings (:func:`sampling_params_of`).

TRL's vLLM colocate mode builds vLLM's ``SamplingParams`` from the trainer's generation settings and then
lays ``GRPOConfig.generation_kwargs`` over them, with ``vllm_structured_outputs_regex`` winning over a
``structured_outputs`` there (``VLLMGeneration.generate``, ``trl/generation/vllm_generation.py``, TRL 1.16).
:class:`~.trl.SglGRPOTrainer` does the same with SGLang's sampling parameters
(``sglang/srt/sampling/sampling_params.py``), so a script written for the vLLM mode keeps its settings:

* vLLM's names are translated where SGLang's differ (:data:`VLLM_TO_SGLANG`, :data:`STRUCTURED_TO_SGLANG`);
  SGLang's own names are taken as they are (:data:`~sgl_rollout.engine.sglang_api.SAMPLING_PARAMS`, checked against each supported SGLang
  release's source by :mod:`sgl_rollout.engine.sglang_api`, which also checks the translations' targets);
* anything else (transformers-only keys such as ``num_beams`` or ``suppress_tokens``, a vLLM key SGLang has
  no equal for) is refused at start-up in one line, never dropped silently.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, Mapping, Optional

from ..engine.sglang_api import SAMPLING_PARAMS

#: vLLM ``SamplingParams`` names (TRL's ``generation_kwargs`` in its vLLM modes) -> SGLang's name for the same
#: setting. vLLM's ``seed`` becomes SGLang's per-request ``sampling_seed``, which SGLang applies only with
#: ``enable_deterministic_inference`` (``sglang/srt/sampling/sampling_batch_info.py``).
VLLM_TO_SGLANG = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "seed": "sampling_seed",
                  "include_stop_str_in_output": "no_stop_trim"}
#: vLLM ``StructuredOutputsParams`` fields -> SGLang's grammar parameter (one per request, SGLang's rule).
STRUCTURED_TO_SGLANG = {"regex": "regex", "json": "json_schema", "grammar": "ebnf", "structural_tag": "structural_tag"}
#: Keys TRL's vLLM mode sets itself, served here one fixed way: one completion per prompt (TRL's sampler has
#: repeated each prompt already) and the sampled tokens' logprobs always returned.
FIXED = {"n": (1,), "logprobs": (None, 0)}


def _structured(value: Any) -> Dict[str, Any]:
    """A ``structured_outputs`` entry (a dict, or vLLM's ``StructuredOutputsParams``) as SGLang's grammar
    parameter (more than one is refused by :func:`translate_generation_kwargs`). Raises ValueError: a field
    SGLang has no equal for."""
    fields = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else dict(value)
    given = {k: v for k, v in fields.items() if v not in (None, False) and not k.startswith("_")}
    other = sorted(set(given) - set(STRUCTURED_TO_SGLANG))
    if other:
        raise ValueError(f"generation_kwargs['structured_outputs'] fields {other} have no SGLang equal "
                         f"(SglGRPOTrainer takes {sorted(STRUCTURED_TO_SGLANG)})")
    return {STRUCTURED_TO_SGLANG[k]: (v if isinstance(v, str) else json.dumps(v)) for k, v in given.items()}


def translate_generation_kwargs(kwargs: Optional[Mapping[str, Any]], regex: Optional[str] = None) -> Dict[str, Any]:
    """TRL's ``generation_kwargs`` (and ``vllm_structured_outputs_regex``) as SGLang sampling parameters.

    Args:
        kwargs: ``GRPOConfig.generation_kwargs``: a dict, a JSON string of one, or None. Keys in vLLM's names
            (:data:`VLLM_TO_SGLANG`, ``structured_outputs``) or SGLang's (``sglang_api.SAMPLING_PARAMS``).
        regex: ``GRPOConfig.vllm_structured_outputs_regex``; it replaces a ``structured_outputs`` in
            ``kwargs``, as in TRL's vLLM mode.

    Returns:
        SGLang ``sampling_params`` entries (name -> value), empty for no settings.

    Raises:
        ValueError: a key with no SGLang equal, a fixed key (:data:`FIXED`) set otherwise, a vLLM name given
            together with its SGLang name, or more than one grammar; in one line naming the key.
    """
    kwargs = json.loads(kwargs) if isinstance(kwargs, str) else dict(kwargs or {})
    if regex is not None:
        kwargs["structured_outputs"] = {"regex": regex}
    out: Dict[str, Any] = {}
    unknown = sorted(k for k in kwargs if k not in VLLM_TO_SGLANG and k not in SAMPLING_PARAMS
                     and k not in FIXED and k != "structured_outputs")
    if unknown:
        raise ValueError(f"generation_kwargs {unknown} have no SGLang sampling parameter: SglGRPOTrainer takes "
                         f"vLLM's names (as TRL's vLLM modes: {sorted(VLLM_TO_SGLANG)}, structured_outputs) or "
                         f"SGLang's {list(SAMPLING_PARAMS)}")
    for key, allowed in FIXED.items():
        if key in kwargs and kwargs[key] not in allowed:
            raise ValueError(f"generation_kwargs[{key!r}]={kwargs[key]!r}: SglGRPOTrainer serves only {key}="
                             f"{allowed[0]!r} (one completion per prompt, the sampled tokens' logprobs)")
    for key, value in kwargs.items():
        if key in FIXED:
            continue
        if key == "structured_outputs":
            grammar = {} if value is None else _structured(value)
        else:
            grammar = {VLLM_TO_SGLANG.get(key, key): value}
        clash = sorted(set(grammar) & set(out))
        if clash:
            raise ValueError(f"generation_kwargs sets {clash} twice (a vLLM name and its SGLang name, or a "
                             "grammar in structured_outputs and by its SGLang name)")
        out.update(grammar)
    grammars = sorted(k for k in STRUCTURED_TO_SGLANG.values() if out.get(k) is not None)
    if len(grammars) > 1:
        raise ValueError(f"generation_kwargs sets the grammars {grammars}: SGLang takes one grammar per request")
    return out


def sampling_params_of(trainer) -> Dict[str, Any]:
    """SGLang sampling parameters equal to the ones TRL's vLLM colocate mode uses for ``trainer``.

    From the trainer's settings (``GRPOTrainer.__init__``): ``max_new_tokens`` = ``max_completion_length``,
    ``temperature``, ``top_p``, ``top_k`` (None or 0: off, SGLang's -1), ``min_p`` (None: 0),
    ``repetition_penalty``, the trainer's end-of-sequence ids as ``stop_token_ids``; then
    ``trainer.args.generation_kwargs`` laid over them (:func:`translate_generation_kwargs`; a
    ``stop_token_ids`` there adds to the end-of-sequence ids).

    Raises:
        ValueError: from :func:`translate_generation_kwargs`.
    """
    params = {"max_new_tokens": int(trainer.max_completion_length), "temperature": float(trainer.temperature),
              "top_p": float(trainer.top_p), "top_k": int(trainer.top_k) if trainer.top_k else -1,
              "min_p": float(trainer.min_p or 0.0), "repetition_penalty": float(trainer.repetition_penalty or 1.0)}
    eos = [int(t) for t in (trainer.eos_token_ids or [])]
    args = getattr(trainer, "args", None)
    extra = translate_generation_kwargs(getattr(args, "generation_kwargs", None),
                                        getattr(args, "vllm_structured_outputs_regex", None))
    stop = eos + [int(t) for t in extra.pop("stop_token_ids", None) or () if int(t) not in eos]
    params.update(extra)
    if stop:
        params["stop_token_ids"] = stop
    return params


__all__ = ["FIXED", "STRUCTURED_TO_SGLANG", "VLLM_TO_SGLANG", "sampling_params_of",
           "translate_generation_kwargs"]
