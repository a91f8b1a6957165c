"""``python -m sgl_rollout.bench requests``: the guarded engine's own cost per generate request, on the CPU.

In verl's run a replica receives a step's requests within a few hundred milliseconds and SGLang answers
a decode batch's worth of them in one go (its tokenizer manager wakes every waiting request when the
batch's outputs arrive). What this package adds per request between the server actor and SGLang's
coroutine, and back, delays every one of them. This benchmark times that path alone: ``requests``
concurrent calls of :meth:`~sgl_rollout.engine.RolloutEngine.async_generate` on an event loop in a
thread of its own (as Ray runs an async actor's loop), against an engine double whose
``async_generate`` answers all of them at once when the last one is in. Three ways:

* ``sglang``: the double's coroutine awaited directly on the loop, as verl's ``SGLangHttpServer`` awaits
  SGLang's tokenizer manager (the floor);
* ``caller-loop``: :class:`RolloutEngine` with ``loop=`` the caller's loop (what
  :class:`sgl_rollout.server.RolloutServer` uses);
* ``engine-thread``: :class:`RolloutEngine` on its own thread's loop (``SGLROLLOUT_ENGINE_LOOP=thread``);
* ``verl-server``: verl's whole call into this package, :meth:`VerlRolloutServer.generate
  <sgl_rollout.integrations.verl_server.VerlRolloutServer.generate>` (its checks, admission, verl's
  ``TokenOutput``) over the engine on the caller's loop, as the server actor runs it (needs verl).

Per round it records ``in_s`` (seconds from the first call to the last request reaching the double) and
``back_s`` (seconds from the double answering to the last caller having its answer). No GPU, SGLang or
Ray is used: the figures are the Python path's, on this machine's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import threading
import time
import types
from typing import Any, Awaitable, Callable, Dict, List, Optional

MODES = ("sglang", "caller-loop", "engine-thread", "verl-server")


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
        self.new_round()

    def new_round(self) -> None:
        """Forget the last round (call between rounds, on the loop that serves them)."""
        self._in, self._ready, self.answered_at = 0, None, None

    async def async_generate(self, input_ids, sampling_params=None, return_logprob=False, rid=None,
                             **_kwargs) -> List[Dict[str, Any]]:
        if self._ready is None:
            self._ready = asyncio.Event()
        self._in += len(input_ids)
        if self._in >= self.batch:
            self.answered_at = time.perf_counter()
            self._ready.set()
        await self._ready.wait()
        return [{"output_ids": [p[-1] + 1 + k for k in range(self.output_len)],
                 "meta_info": {"finish_reason": {"type": "length"}}} for p in input_ids]

    def shutdown(self) -> None:
        """Nothing to stop."""


async def _round(call, engine: BatchAnswerEngine, requests: int) -> Dict[str, float]:
    engine.new_round()
    done: List[float] = []
    outs: Dict[int, List[int]] = {}

    async def one(i: int) -> None:
        outs[i] = await call([i, i + 1])
        done.append(time.perf_counter())

    t0 = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(requests)])
    wrong = sum(outs[i] != [i + 2 + k for k in range(engine.output_len)] for i in range(requests))
    if wrong:
        raise AssertionError(f"{wrong} of {requests} answers were not their request's")
    return {"in_s": engine.answered_at - t0, "back_s": max(done) - engine.answered_at}


def on_a_loop_thread(make_coro: Callable[[], Awaitable[Any]], name: str = "actor-loop",
                     timeout_s: Optional[float] = None) -> Any:
    """``asyncio.run(make_coro())`` in a new thread (as Ray runs an async actor's loop, off the main
    thread); returns its result or raises its exception here.

    Raises:
        TimeoutError: still running after ``timeout_s`` seconds (None: no limit).
    """
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = asyncio.run(make_coro())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{name} still running after {timeout_s} s")
    if "error" in box:
        raise box["error"]
    return box["result"]


def measure(mode: str, requests: int = 256, rounds: int = 10, warmup: int = 2,
            output_len: int = 128) -> Dict[str, Any]:
    """Time ``rounds`` rounds of ``requests`` concurrent requests through ``mode`` (one of :data:`MODES`).

    Returns:
        ``{"mode", "requests", "rounds": [{"in_s", "back_s"}], "in_s", "back_s"}`` (medians, seconds),
        the ``warmup`` rounds left out.

    Raises:
        ValueError: unknown mode. AssertionError: an answer reached the wrong caller.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
    from ..config import RolloutConfig
    from ..engine import RolloutEngine

    async def main() -> List[Dict[str, float]]:
        server = None
        if mode == "verl-server":
            server, call = await _verl_server_call(requests, output_len)
            engine, double = None, server._engine._engine
        elif mode == "sglang":
            double = BatchAnswerEngine(requests, output_len)

            async def call(ids):
                return (await double.async_generate([ids], {"max_new_tokens": output_len}))[0]["output_ids"]
            engine = None
        else:
            loop = asyncio.get_running_loop() if mode == "caller-loop" else None
            engine = RolloutEngine(RolloutConfig(model_path="bench-double", enforce_eager=True),
                                   engine_factory=functools.partial(BatchAnswerEngine, requests, output_len),
                                   loop=loop)
            double = engine._engine

            async def call(ids):
                gens = await engine.async_generate([ids], {"max_new_tokens": output_len}, return_logprob=False)
                return gens[0][0].output_ids
        try:
            return [await _round(call, double, requests) for _ in range(warmup + rounds)][warmup:]
        finally:
            if engine is not None:
                engine.shutdown()
            if server is not None:
                await server.shutdown()

    per = on_a_loop_thread(main)
    return {"mode": mode, "requests": requests, "rounds": per,
            "in_s": statistics.median(r["in_s"] for r in per), "back_s": statistics.median(r["back_s"] for r in per)}


async def _verl_server_call(requests: int, output_len: int):
    """A started :class:`~sgl_rollout.integrations.verl_server.VerlRolloutServer` on :class:`BatchAnswerEngine`
    (on the running loop, as in the actor) and the call verl's client makes of it, per request.

    Raises:
        ImportError: verl (or Ray) is not installed.
    """
    from ..integrations.verl_server import VerlRolloutServer

    class Server(VerlRolloutServer):
        engine_factory = functools.partial(BatchAnswerEngine, requests, output_len)

    server = Server({"model_path": "bench-double", "enforce_eager": True, "free_cache_engine": False},
                    max_model_len=output_len + 64, response_length=output_len)
    await server.start()

    async def call(ids):
        out = await server.generate(ids, {"max_new_tokens": output_len, "temperature": 0.0}, request_id="bench")
        return list(out.token_ids)

    return server, call


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``requests`` subcommand's options."""
    p.add_argument("--requests", type=int, default=256, help="concurrent requests per round (verl: batch x n)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    p.add_argument("--out", default="bench_requests.json")


def main(args: argparse.Namespace) -> int:
    """Measure each mode, print a table (ms per round, microseconds per request) and write ``args.out``."""
    results = []
    for m in args.modes.split(","):
        try:
            results.append(measure(m, args.requests, args.rounds))
        except ImportError as exc:  # verl-server without verl
            print(f"{m}: skipped ({exc})")
    n = args.requests
    print(f"{n} concurrent requests, median of {args.rounds} rounds (CPU, engine double):")
    print(f"{'mode':<14}{'all in (ms)':>12}{'all back (ms)':>14}{'us/request in':>15}{'us/request back':>17}")
    for r in results:
        print(f"{r['mode']:<14}{1e3 * r['in_s']:>12.1f}{1e3 * r['back_s']:>14.1f}"
              f"{1e6 * r['in_s'] / n:>15.0f}{1e6 * r['back_s'] / n:>17.0f}")
    from . import write_result

    write_result(results, args.out, "bench_requests.json")
    return 0
