"""``python -m sgl_rollout.bench requests --engine ray``: a request's way in and back through Ray, on the CPU.

In verl's runs the k-th request's way in (verl's client to SGLang) is later on this package's side in most
committed reports (``docs/gpu-tests.md``, issue 47 goal 1), yet the part inside this package's server
actor (its ``generate`` to SGLang's ``generate_request``) is a fraction of a millisecond: the rest is Ray's
delivery of the call to the actor. This benchmark asks whether the server actor itself makes that delivery
slower. Each round, ``clients`` Ray actors (as verl's ``AgentLoopWorker``\\ s) send ``requests`` concurrent
``generate`` calls, their share each, to one server actor holding the CPU engine double
(:class:`~.request_double.BatchAnswerEngine`, which answers the round at once when its last request is in):

* ``sglang``: an actor whose ``generate`` awaits the double directly and answers verl's ``TokenOutput``, as
  verl's ``SGLangHttpServer`` awaits SGLang's tokenizer manager (the floor; needs verl);
* ``verl-server``: this package's :class:`~sgl_rollout.integrations.verl_server.VerlRolloutServer` over the
  double, as verl's replica makes it (needs verl). As in verl's run, its engine has SGLang freeze the
  garbage collector of the actor's process after the first answer (:class:`WallClockEngine`); the floor's
  never is, as verl's server never asks;
* ``verl-server-bare``: the same actor, started the same way (its engine, watchdog thread and frozen GC),
  whose ``generate`` is the floor's: what it adds to ``sglang`` is this package's actor and process, and
  what ``verl-server`` adds to it is this package's request path (``VerlRolloutServer.generate`` and the
  engine's ``async_generate``).

The two modes alternate within each round (:func:`~.request_double.rotated`). Per round: ``kth_in_s``, the median
over k of the k-th arrival at the double less the k-th send (the report's ``client -> SGLang, k-th
request``); ``last_in_s``, the last arrival less the first send; ``back_s``, the double's answer to the last
client having its answer; ``loop_cpu_s``, the CPU time of the server actor's event loop thread over the round
(``time.thread_time()``: Ray's delivery of the calls, the server's ``generate``, the answers' return) per
request. Times are wall-clock (``time.time()``) across the host's processes. No GPU or
SGLang is used; the host's CPUs are shared by every actor, so run it on a quiet machine.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import statistics
import time
from typing import Any, Dict, List

from .request_double import BatchAnswerEngine, rotated, verl_server_args

RAY_MODES = ("sglang", "verl-server", "verl-server-bare")


class WallClockEngine(BatchAnswerEngine):
    """:class:`~.request_double.BatchAnswerEngine` that also keeps, per round, the wall-clock time each request
    arrived (``arrivals``) and the time the round was answered (``answered_wall``), for clocks compared
    across processes; and whose tokenizer manager has SGLang's ``freeze_gc`` (``gc.freeze()`` in this
    process, as ``TokenizerManager.freeze_gc`` freezes the process it runs in), which this package's engine
    calls after its first answer and verl's ``SGLangHttpServer`` never calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tokenizer_manager.freeze_gc = self._freeze_gc

    @staticmethod
    async def _freeze_gc() -> None:
        gc.freeze()

    def new_round(self) -> None:
        super().new_round()
        self.arrivals: List[float] = []
        self.answered_wall = None

    async def async_generate(self, input_ids, *args, **kwargs):
        self.arrivals.append(time.time())
        if len(self.arrivals) == self.batch:
            self.answered_wall = time.time()
        return await super().async_generate(input_ids, *args, **kwargs)

    def record(self) -> Dict[str, Any]:
        return {"arrivals": list(self.arrivals), "answered": self.answered_wall}


class PlainServer:
    """The floor's actor body: ``generate`` awaits the double directly, one request, and answers verl's
    ``TokenOutput``, as verl's ``SGLangHttpServer.generate`` awaits ``TokenizerManager.generate_request``
    (``verl/workers/rollout/sglang_rollout/async_sglang_server.py``; needs verl)."""

    def __init__(self, requests: int, output_len: int):
        self.double = WallClockEngine(requests, output_len)
        self.output_len = output_len

    async def generate(self, prompt_ids, sampling_params: dict, request_id: str, image_data=None,
                       video_data=None):
        return await _plain_answer(self.double, prompt_ids, sampling_params, self.output_len)

    async def new_round(self) -> None:
        self.double.new_round()

    async def record(self) -> Dict[str, Any]:
        return self.double.record()

    async def loop_cpu(self) -> float:
        return time.thread_time()


async def _plain_answer(double: WallClockEngine, prompt_ids, sampling_params: dict, output_len: int):
    """What verl's ``SGLangHttpServer.generate`` does with one request: await the engine's own call and
    answer verl's ``TokenOutput`` (needs verl)."""
    from verl.workers.rollout.replica import TokenOutput

    params = dict(sampling_params, max_new_tokens=output_len)
    out = await double.async_generate(list(prompt_ids), params)
    return TokenOutput(token_ids=out["output_ids"], log_probs=None, stop_reason=out["meta_info"]["finish_reason"]["type"],
                       extra_fields={"global_steps": 0})


def _ours_body(requests: int, output_len: int, bare: bool = False):
    """This package's server actor body over :class:`WallClockEngine` (imports verl); with ``bare``, its
    ``generate`` is the plain actor's (:func:`_plain_answer`, the double's GC frozen at the first request as
    this package's engine freezes it after its first answer)."""
    from ..integrations.verl_server import VerlRolloutServer

    class OursServer(VerlRolloutServer):
        engine_factory = functools.partial(WallClockEngine, requests, output_len)

        if bare:
            async def generate(self, prompt_ids, sampling_params: dict, request_id: str, image_data=None,
                               video_data=None):
                double = self._engine._engine
                if not getattr(self, "_gc_frozen", False):
                    self._gc_frozen = True
                    await double.tokenizer_manager.freeze_gc()
                return await _plain_answer(double, prompt_ids, sampling_params, output_len)

        async def new_round(self) -> None:
            self._engine._engine.new_round()

        async def record(self) -> Dict[str, Any]:
            return self._engine._engine.record()

        async def loop_cpu(self) -> float:
            return time.thread_time()

    return OursServer


class Client:
    """The body of a sending actor (verl's agent-loop worker): ``send`` makes ``n`` concurrent calls of the
    server's ``generate`` and returns each one's send time and answer time (wall clock) and how many answers
    were not their request's."""

    async def send(self, server, n: int, base: int, output_len: int) -> Dict[str, Any]:
        sent: List[float] = []
        done: List[float] = []
        wrong = 0

        async def one(i: int) -> None:
            nonlocal wrong
            ids = [base + i, base + i + 1]
            sent.append(time.time())
            out = await server.generate.remote(ids, {"max_new_tokens": output_len, "temperature": 0.0},
                                               request_id=f"bench-{base + i}")
            done.append(time.time())
            out = list(getattr(out, "token_ids", out))
            wrong += out != [ids[-1] + 1 + k for k in range(output_len)]

        await asyncio.gather(*[one(i) for i in range(n)])
        return {"sent": sent, "done": done, "wrong": wrong}


def _round_figures(sends: List[dict], rec: Dict[str, Any], requests: int) -> Dict[str, float]:
    sent = sorted(t for s in sends for t in s["sent"])
    arrivals = sorted(rec["arrivals"])
    wrong = sum(s["wrong"] for s in sends)
    if wrong or len(arrivals) != requests:
        raise AssertionError(f"{wrong} wrong answers, {len(arrivals)} of {requests} requests arrived")
    return {"kth_in_s": statistics.median(a - s for a, s in zip(arrivals, sent)),
            "last_in_s": arrivals[-1] - sent[0],
            "back_s": max(t for s in sends for t in s["done"]) - rec["answered"]}


def measure_ray(modes=RAY_MODES, requests: int = 256, clients: int = 4, rounds: int = 10, warmup: int = 2,
                output_len: int = 4) -> List[Dict[str, Any]]:
    """Time rounds of ``requests`` calls from ``clients`` Ray actors into each of ``modes`` (of
    :data:`RAY_MODES`), on a local Ray cluster this function starts and stops (or the one already
    initialized, left running).

    Returns:
        per mode ``{"mode", "requests", "clients", "rounds": [{"kth_in_s", "last_in_s", "back_s", "loop_cpu_s"}],
        "kth_in_s", "last_in_s", "back_s", "loop_cpu_s"}`` (medians, seconds), the ``warmup`` rounds left out.

    Raises:
        ValueError: unknown mode, or ``requests`` not a multiple of ``clients``.
        ImportError: Ray or verl is not installed.
        AssertionError: an answer reached the wrong caller, or a request was lost.
    """
    import ray

    bad = [m for m in modes if m not in RAY_MODES]
    if bad or requests % clients:
        raise ValueError(f"modes must be of {RAY_MODES} (got {bad}) and requests a multiple of clients")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=clients + len(modes), include_dashboard=False, log_to_driver=False)
    try:
        servers = {}
        for m in modes:
            if m == "sglang":
                servers[m] = ray.remote(PlainServer).options(max_concurrency=1000).remote(requests, output_len)
            else:
                args, kwargs = verl_server_args(output_len)
                actor = ray.remote(_ours_body(requests, output_len, bare=m == "verl-server-bare")).options(
                    max_concurrency=1000).remote(*args, **kwargs)
                ray.get(actor.start.remote())
                servers[m] = actor
        senders = [ray.remote(Client).remote() for _ in range(clients)]
        per: Dict[str, List[Dict[str, float]]] = {m: [] for m in modes}
        share = requests // clients
        for r in range(warmup + rounds):
            for m in rotated(modes, r):
                ray.get(servers[m].new_round.remote())
                cpu0 = ray.get(servers[m].loop_cpu.remote())
                sends = ray.get([c.send.remote(servers[m], share, 1000 * k, output_len) for k, c in enumerate(senders)])
                cpu = ray.get(servers[m].loop_cpu.remote()) - cpu0
                figures = _round_figures(sends, ray.get(servers[m].record.remote()), requests)
                figures["loop_cpu_s"] = cpu / requests
                if r >= warmup:
                    per[m].append(figures)
        for m, actor in servers.items():
            if m != "sglang":
                ray.get(actor.shutdown.remote())
    finally:
        if started:
            ray.shutdown()
    return [{"mode": m, "requests": requests, "clients": clients, "rounds": rows,
             **{k: statistics.median(row[k] for row in rows) for k in ("kth_in_s", "last_in_s", "back_s", "loop_cpu_s")}}
            for m, rows in per.items()]
