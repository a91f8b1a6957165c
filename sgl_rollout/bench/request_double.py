"""The CPU engine double of ``python -m sgl_rollout.bench requests`` (:mod:`.requests`, and through Ray
:mod:`.ray_requests`), and the order its ways take in each round."""

from __future__ import annotations

import asyncio
import gc
import time
import types
from typing import Any, Dict, Optional, Tuple


class BatchAnswerEngine:
    """An ``sglang.Engine`` stand-in that answers one round of requests as one decode batch.

    ``async_generate`` (SGLang's signature, ``sglang/srt/entrypoints/engine.py``) waits until
    ``batch`` requests of the round are in, then every waiting call returns: ``output_len`` token ids
    (the prompt's last id + 1, + 2, ...) and finish reason ``"length"``. It starts no process.

    Args:
        batch: requests per round.
        output_len: token ids per answer.
        **server_args: what :class:`~sgl_rollout.engine.RolloutEngine` passes to SGLang (ignored).
    """

    def __init__(self, batch: int, output_len: int = 128, **server_args: Any):
        self.batch, self.output_len = batch, output_len
        self.tokenizer_manager = types.SimpleNamespace(abort_request=lambda **_kw: None, asyncio_tasks=set())
        #: when True, the number of objects Python's garbage collector tracks (``gc.get_objects()``) is
        #: taken into :attr:`held` once the round's last request is in, before any is answered
        self.count_held = False
        self.held: Optional[int] = None
        self.new_round()

    def new_round(self) -> None:
        """Forget the last round (call between rounds, on the loop that serves them)."""
        self._in, self._ready, self.answered_at = 0, None, None

    async def async_generate(self, input_ids, sampling_params=None, return_logprob=False, rid=None,
                             **_kwargs):
        """A list of answers for a batch (lists of ids), one answer (a dict) for one request (bare ids),
        as SGLang's ``Engine.async_generate``."""
        single = bool(input_ids) and isinstance(input_ids[0], int)
        batch = [input_ids] if single else input_ids
        if self._ready is None:
            self._ready = asyncio.Event()
        self._in += len(batch)
        if self._in >= self.batch:
            if self.count_held:
                self.held = len(gc.get_objects())
            self.answered_at = time.perf_counter()
            self._ready.set()
        await self._ready.wait()
        outs = [{"output_ids": [p[-1] + 1 + k for k in range(self.output_len)],
                 "meta_info": {"finish_reason": {"type": "length"}}} for p in batch]
        return outs[0] if single else outs

    def shutdown(self) -> None:
        """Nothing to stop."""


def rotated(modes, r: int) -> tuple:
    """``modes`` in round ``r``'s order: each round starts one mode later, so no mode always follows the
    same one (the scheduler may still be tidying up the previous round when the next one begins)."""
    k = r % len(modes) if modes else 0
    return tuple(modes[k:]) + tuple(modes[:k])


def verl_server_args(output_len: int) -> Tuple[tuple, Dict[str, Any]]:
    """``(args, kwargs)`` to build :class:`~sgl_rollout.integrations.verl_server.VerlRolloutServer` (or a
    subclass whose ``engine_factory`` makes the double) as verl's replica does, with room for ``output_len``
    new tokens (integers) after a short prompt."""
    config = {"model_path": "bench-double", "enforce_eager": True, "free_cache_engine": False}
    return (config,), {"max_model_len": output_len + 64, "response_length": output_len}
