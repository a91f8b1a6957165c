"""The engine's generation calls: admitted only while the memory state allows, aborted in SGLang when
their caller stops waiting."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..twin import twin
from .core import EngineCore, sigint_deferred

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    """One sampled completion.

    Attributes:
        output_ids: generated token ids (int), prompt excluded.
        logprobs: log-probability (float, natural log) of each generated token under the engine's
            sampling distribution, same length as ``output_ids``; empty if not requested.
        finish_reason: SGLang's finish reason type, e.g. ``"length"`` or ``"stop"``.
    """

    output_ids: List[int]
    logprobs: List[float] = field(default_factory=list)
    finish_reason: Optional[str] = None


class GenerateCalls:
    """Generation on :class:`~.core.EngineCore`: ``generate`` / ``async_generate`` and aborts.

    A generate whose caller is interrupted or cancelled is aborted in SGLang by request id and stays
    counted (:class:`~sgl_rollout.memory.MemoryState`) until SGLang has ended it, so a release cannot
    trip the scheduler's idle assertion.
    """

    def _start_generate(self: EngineCore, input_ids, sampling_params, n, return_logprob, lora_path=None):
        batch = _expand(input_ids, n)
        self.check_alive()
        if lora_path is not None and not isinstance(lora_path, str):
            raise TypeError(f"lora_path must be an adapter name (str) or None, got {type(lora_path).__name__}")
        rids = [uuid.uuid4().hex for _ in batch]
        sent = None
        try:
            with sigint_deferred():  # counted and sent, or neither
                self.state.admit_request()
                try:
                    extra = {}
                    if lora_path is not None:
                        # read after admission: adapters change only inside a sync, which no request overlaps
                        extra["lora_path"] = [self._adapter_for_request(lora_path).sglang_name] * len(batch)
                    sent = self._submit(
                        lambda: self._engine.async_generate(input_ids=batch, sampling_params=dict(sampling_params or {}),
                                                            return_logprob=return_logprob, rid=rids, **extra),
                        lambda _exc: self.state.request_done(),
                    )
                except BaseException:
                    self.state.request_done()
                    raise
        except BaseException:
            if sent is not None:  # a Ctrl-C held off while the batch was sent: it runs, so abort it
                self._abort(rids)
            raise
        return sent, rids

    def _abort(self: EngineCore, rids: List[str]) -> None:
        """Abort ``rids`` in SGLang (from the engine's loop); they stay counted until SGLang ends them."""
        if not self.alive:
            return
        tm = self._tm()

        def abort():
            for rid in rids:
                tm.abort_request(rid=rid)

        self._loop.call_soon_threadsafe(abort)
        logger.warning("generate interrupted: aborting %d request(s) in SGLang", len(rids))

    def _generate(
        self,
        input_ids: List[List[int]],
        sampling_params: Optional[Dict[str, Any]] = None,
        n: int = 1,
        return_logprob: bool = True,
        lora_path: Optional[str] = None,
    ):
        """Sample ``n`` completions for each prompt.

        Concurrent calls (``async_generate`` from one loop, or several threads) are batched by SGLang's
        scheduler. An interrupted or cancelled call aborts its requests in SGLang.

        Args:
            input_ids: prompts as token-id lists, batch of B.
            sampling_params: SGLang sampling params (``temperature``, ``top_p``, ``max_new_tokens``, ...).
            n: samples per prompt, >= 1.
            return_logprob: also return each sampled token's log-probability.
            lora_path: name of a loaded LoRA adapter (``load_lora_adapter_from_tensors``) to apply;
                None: the base weights alone.

        Returns:
            B lists of ``n`` :class:`Generation` each, in prompt order.

        Raises:
            MemoryStateError: a memory region is released, a release/resume/sync is in progress, or the
                last weight sync did not complete.
            EngineDeadError: the engine died (before or during the call); EngineClosedError: shut down.
            ValueError: ``n`` < 1, an empty batch, or ``lora_path`` names no loaded adapter.
            KeyboardInterrupt: re-raised after the batch's requests were aborted in SGLang.
        """
        fut, rids = self._start_generate(input_ids, sampling_params, n, return_logprob, lora_path)
        outs = yield self.waiting(fut, lambda: self._abort(rids))
        return _group(outs, n, return_logprob)

    generate, async_generate = twin(_generate, before_sync=EngineCore._check_not_on_loop)

    def abort_all(self: EngineCore) -> None:
        """Abort every request running in SGLang (``abort_request(abort_all=True)``); they end shortly after.

        Raises:
            EngineDeadError, EngineClosedError: as every call.
        """
        self.check_alive()
        self._loop.call_soon_threadsafe(lambda: self._tm().abort_request(abort_all=True))


def _expand(input_ids: List[List[int]], n: int) -> List[List[int]]:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not input_ids:
        raise ValueError("empty batch")
    return [list(p) for p in input_ids for _ in range(n)]


def _group(outs: List[Dict[str, Any]], n: int, with_logprob: bool) -> List[List[Generation]]:
    if isinstance(outs, dict):  # SGLang returns a bare dict for a batch of one
        outs = [outs]
    gens = [_to_generation(o, with_logprob) for o in outs]
    return [gens[i : i + n] for i in range(0, len(gens), n)]


def _to_generation(out: Dict[str, Any], with_logprob: bool) -> Generation:
    meta = out.get("meta_info", {})
    finish = meta.get("finish_reason")
    logprobs: List[float] = []
    if with_logprob:
        logprobs = [float(lp) for lp, _tok, *_ in meta.get("output_token_logprobs", [])]
    return Generation(
        output_ids=list(out["output_ids"]),
        logprobs=logprobs,
        finish_reason=finish.get("type") if isinstance(finish, dict) else finish,
    )
