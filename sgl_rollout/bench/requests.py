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

``--engine sglang`` (a GPU) times the same rounds against a real SGLang engine (a Llama-shaped model,
dummy weights, a few new tokens per request), with SGLang's own tokenizer manager in the path
(:func:`measure_real`): ``in_s`` is then the time until the round's last request was sent to the
scheduler, and ``back_s`` until the last caller had its answer after that.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import statistics
import threading
import time
from typing import Any, Awaitable, Callable, Dict, List, Optional, Tuple

from .processes import GcClock
from .request_double import BatchAnswerEngine, rotated, verl_server_args

MODES = ("sglang", "caller-loop", "engine-thread", "verl-server")
#: The ways into a real engine (:func:`measure_real`): SGLang's tokenizer manager given one request, as verl's
#: ``SGLangHttpServer`` sends it (``async_sglang_server.py``); ``sglang.Engine.async_generate`` given a batch
#: of one (SGLang's batch path: ``TokenizerManager._handle_batch_request``); this package's engine on the
#: caller's loop.
REAL_MODES = ("sglang", "sglang-batch1", "caller-loop")


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
        ``{"mode", "requests", "rounds": [{"in_s", "back_s"}], "in_s", "back_s", "objects_per_request"}``
        (medians, seconds), the ``warmup`` rounds left out; ``objects_per_request``: the objects Python's
        garbage collector tracks for each request in flight (an untimed round after the others, counted
        when its last request is in, less those tracked before it): what each collection has to walk.

    Raises:
        ValueError: unknown mode. AssertionError: an answer reached the wrong caller.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
    from ..config import RolloutConfig
    from ..engine import RolloutEngine

    async def main() -> Tuple[List[Dict[str, float]], float]:
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
            rows = [await _round(call, double, requests) for _ in range(warmup + rounds)][warmup:]
            gc.collect()
            before, double.count_held = len(gc.get_objects()), True
            await _round(call, double, requests)
            double.count_held = False
            return rows, (double.held - before) / requests
        finally:
            if engine is not None:
                engine.shutdown()
            if server is not None:
                await server.shutdown()

    per, held = on_a_loop_thread(main)
    return {"mode": mode, "requests": requests, "rounds": per, "in_s": statistics.median(r["in_s"] for r in per),
            "back_s": statistics.median(r["back_s"] for r in per), "objects_per_request": held}


async def _verl_server_call(requests: int, output_len: int):
    """A started :class:`~sgl_rollout.integrations.verl_server.VerlRolloutServer` on :class:`BatchAnswerEngine`
    (on the running loop, as in the actor) and the call verl's client makes of it, per request.

    Raises:
        ImportError: verl (or Ray) is not installed.
    """
    from ..integrations.verl_server import VerlRolloutServer

    class Server(VerlRolloutServer):
        engine_factory = functools.partial(BatchAnswerEngine, requests, output_len)

    args, kwargs = verl_server_args(output_len)
    server = Server(*args, **kwargs)
    await server.start()

    async def call(ids):
        out = await server.generate(ids, {"max_new_tokens": output_len, "temperature": 0.0}, request_id="bench")
        return list(out.token_ids)

    return server, call


def measure_real(modes=REAL_MODES, requests: int = 256, rounds: int = 10, warmup: int = 2,
                 prompt_len: int = 256, new_tokens: int = 4, workdir: str = "/tmp/sgl_rollout_bench_requests",
                 mem_fraction: float = 0.5) -> List[Dict[str, Any]]:
    """Time rounds of ``requests`` concurrent requests into a real SGLang engine, each of ``modes`` (of
    :data:`REAL_MODES`) in turn within every round, so a drift of the machine falls on all of them alike;
    each round starts one mode later (:func:`rotated`).

    One engine (TinyLlama-1.1B's shape, ``load_format="dummy"``, eager) is started by
    :class:`~sgl_rollout.engine.RolloutEngine` on the loop of a thread of its own, as the server actor
    does (``loop=`` the caller's loop). Each request is ``prompt_len`` token ids and asks for
    ``new_tokens`` tokens, so the GPU's share of a round stays small. ``in_s``: seconds from the round's
    first call to its last request handed to the scheduler (SGLang's ``TokenizerManager._send_one_request``
    and ``_send_batch_request``, timed by wrapping them: :func:`_time_sends`); ``back_s``: from then until the last caller
    had its answer; ``round_s``: the whole round; ``gc_s``: seconds Python's garbage collector ran in this
    process (the tokenizer manager's, as in the server actor) during the round (:class:`~.processes.GcClock`).

    Returns:
        one dict per mode: ``{"mode", "requests", "rounds": [{"in_s", "back_s", "round_s", "gc_s"}], "in_s",
        "back_s", "round_s", "gc_s"}`` (medians, seconds), the ``warmup`` rounds left out.

    Raises:
        ValueError: an unknown mode. RuntimeError: this SGLang's tokenizer manager has no
        ``_send_one_request`` to time (:func:`_time_sends`). AssertionError: an answer had the wrong number of tokens.
        Whatever starting the engine raises (no GPU, no SGLang).
    """
    bad = [m for m in modes if m not in REAL_MODES]
    if bad:
        raise ValueError(f"unknown mode {bad[0]!r}; one of {REAL_MODES}")
    import os
    import uuid

    from ..config import RolloutConfig
    from ..engine import RolloutEngine
    from .models import LLAMA_1B, gpu_engine_flags, make_llama_dir

    model_dir = os.path.join(workdir, "llama-1.1b")
    make_llama_dir(model_dir, LLAMA_1B)
    params = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0}

    async def main() -> Dict[str, List[Dict[str, float]]]:
        from sglang.srt.managers.io_struct import GenerateReqInput

        cfg = RolloutConfig(model_path=model_dir, load_format="dummy", gpu_memory_utilization=mem_fraction,
                            enforce_eager=True, engine_kwargs=gpu_engine_flags())
        engine = RolloutEngine(cfg, loop=asyncio.get_running_loop())
        try:
            sent: List[float] = []
            tm = engine._tm()
            _time_sends(tm, sent)
            calls = {
                "sglang": lambda ids: tm.generate_request(GenerateReqInput(
                    input_ids=ids, sampling_params=dict(params), rid=uuid.uuid4().hex), None).__anext__(),
                "sglang-batch1": lambda ids: engine._engine.async_generate(
                    input_ids=[ids], sampling_params=dict(params), rid=[uuid.uuid4().hex]),
                "caller-loop": lambda ids: engine.async_generate([ids], dict(params), return_logprob=False),
            }
            per: Dict[str, List[Dict[str, float]]] = {m: [] for m in modes}
            for r in range(warmup + rounds):
                for m in rotated(modes, r):
                    sent.clear()
                    row = await _real_round(calls[m], sent, requests, prompt_len, new_tokens)
                    if r >= warmup:
                        per[m].append(row)
            return per
        finally:
            engine.shutdown()

    per = on_a_loop_thread(main)
    return [{"mode": m, "requests": requests, "rounds": rows,
             **{k: statistics.median(r[k] for r in rows) for k in ("in_s", "back_s", "round_s", "gc_s")}}
            for m, rows in per.items()]


def _time_sends(tm: Any, sent: List[float]) -> None:
    """Wrap the tokenizer manager ``tm``'s sends to the scheduler (on the instance) so that each request
    handed over appends the time (``time.perf_counter()``) to ``sent``: ``_send_one_request`` (one
    request) and, where SGLang has it, ``_send_batch_request`` (a batch tokenized at once: one time per
    request; SGLang 0.5.12 sends a batch of token ids so).

    Raises:
        RuntimeError: ``tm`` has no ``_send_one_request``.
    """
    if not hasattr(tm, "_send_one_request"):
        raise RuntimeError("this SGLang's tokenizer manager has no _send_one_request to time")
    one, batch = tm._send_one_request, getattr(tm, "_send_batch_request", None)

    def timed_one(*a, **kw):
        sent.append(time.perf_counter())
        return one(*a, **kw)

    def timed_batch(*a, **kw):
        n = next((len(x) for x in (*a, *kw.values()) if isinstance(x, (list, tuple))), 1)
        sent.extend([time.perf_counter()] * n)
        return batch(*a, **kw)

    tm._send_one_request = timed_one
    if batch is not None:
        tm._send_batch_request = timed_batch


async def _real_round(call, sent: List[float], requests: int, prompt_len: int, new_tokens: int) -> Dict[str, float]:
    """One round of :func:`measure_real`: ``requests`` concurrent ``call(ids)``; ``sent`` fills with the
    times the tokenizer manager handed each request to the scheduler."""
    done: List[float] = []

    async def one(i: int) -> None:
        out = await call([(i * 7 + k) % 30000 + 10 for k in range(prompt_len)])
        first = out[0] if isinstance(out, list) else out
        ids = first[0].output_ids if isinstance(first, list) else first["output_ids"]
        if len(ids) != new_tokens:
            raise AssertionError(f"an answer had {len(ids)} tokens, not {new_tokens}")
        done.append(time.perf_counter())

    with GcClock() as gc_time:
        t0 = time.perf_counter()
        await asyncio.gather(*[one(i) for i in range(requests)])
    if len(sent) < requests:
        raise AssertionError(f"{len(sent)} of {requests} requests were seen going to the scheduler")
    last_in = max(sent)
    return {"in_s": last_in - t0, "back_s": max(done) - last_in, "round_s": max(done) - t0, "gc_s": gc_time.seconds}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``requests`` subcommand's options."""
    p.add_argument("--requests", type=int, default=256, help="concurrent requests per round (verl: batch x n)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--modes", default=None, help=f"comma-separated, of {MODES} (with --engine sglang: of "
                   f"{REAL_MODES}; with --engine ray: of ('sglang', 'verl-server', 'verl-server-bare')); default: all")
    p.add_argument("--engine", choices=("double", "sglang", "ray"), default="double",
                   help="double: the CPU engine double; sglang: a real SGLang engine on a GPU (measure_real); "
                   "ray: the double behind a Ray server actor, sent to from --clients Ray actors "
                   "(sgl_rollout.bench.ray_requests)")
    p.add_argument("--clients", type=int, default=4, help="with --engine ray: sending actors (verl's agent-loop "
                   "workers), each sending its share of --requests")
    p.add_argument("--out", default="bench_requests.json")


def main(args: argparse.Namespace) -> int:
    """Measure each mode, print a table (ms per round, microseconds per request) and write ``args.out``."""
    n = args.requests
    ms, us = ("ms", 1e3), ("us", 1e6 / n)
    if args.engine == "ray":
        from .ray_requests import RAY_MODES, measure_ray

        results = measure_ray(tuple((args.modes or ",".join(RAY_MODES)).split(",")), n, args.clients, args.rounds)
        title = (f"{n} requests from {args.clients} Ray actors into one server actor (CPU, engine double), "
                 f"median of {args.rounds} rounds:")
        cols = [("k-th in (ms)", "kth_in_s", ms), ("last in (ms)", "last_in_s", ms), ("back (ms)", "back_s", ms),
                ("loop CPU us/request", "loop_cpu_s", ("us", 1e6))]
    elif args.engine == "sglang":
        results = measure_real(tuple((args.modes or ",".join(REAL_MODES)).split(",")), n, args.rounds)
        title = f"{n} concurrent requests into one SGLang engine, median of {args.rounds} rounds:"
        cols = [("all in (ms)", "in_s", ms), ("all back (ms)", "back_s", ms), ("round (ms)", "round_s", ms),
                ("us/request in", "in_s", us), ("GC (ms)", "gc_s", ms)]
    else:
        results = []
        for m in (args.modes or ",".join(MODES)).split(","):
            try:
                results.append(measure(m, n, args.rounds))
            except ImportError as exc:  # verl-server without verl
                print(f"{m}: skipped ({exc})")
        title = f"{n} concurrent requests, median of {args.rounds} rounds (CPU, engine double):"
        cols = [("all in (ms)", "in_s", ms), ("all back (ms)", "back_s", ms), ("us/request in", "in_s", us),
                ("us/request back", "back_s", us), ("objects/request", "objects_per_request", ("n", 1))]
    print(title)
    width = max([14] + [len(r["mode"]) + 1 for r in results])
    print(f"{'mode':<{width}}" + "".join(f"{head:>{len(head) + 2}}" for head, _, _ in cols))
    for r in results:
        print(f"{r['mode']:<{width}}" + "".join(f"{r[key] * scale:>{len(head) + 2}.{1 if unit == 'ms' else 0}f}"
                                           for head, key, (unit, scale) in cols))
    from . import write_result

    write_result(results, args.out, "bench_requests.json")
    return 0
