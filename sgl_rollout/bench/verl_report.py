"""Reading and reporting ``python -m sgl_rollout.bench verl`` runs: verl's metrics, the probe's spans,
the per-phase breakdown of ``timing_s/update_weights``, ``comparison.json``, the Markdown table, the plot.

A run folder (one side of one pair, written by :mod:`.verl_compare`) holds ``metrics.jsonl`` (verl's
file logger, ``verl/utils/tracking.py``), ``spans/spans-<pid>.jsonl`` (:mod:`.verl_probe`), ``nvml.json``
(device memory seen through NVML), ``cpu.json`` (the CPU time of the side's processes by role,
:mod:`.cpu_use`; runs since 2026-11-29) and ``run.json`` (exit status, command, what differed). Any of them
may be missing or cut short: a run that failed part-way is reported as such, with what it logged.
A committed run folder (``examples/verl/compare/<run>/``) keeps those files in one ``raw.tar.xz`` at its
top instead (:data:`RAW_ARCHIVE`), which :func:`write_report` reads in their place.

Statistics are over the training steps after the first (the first step pays one-time costs: CUDA-graph
warm-up, the first optimizer state, the weight manifest): the median and the 90th percentile (the
nearest-rank value). Weight-update phases come from one trainer process (TP rank 0 of replica 0): the
spans inside its ``verl.update_weights`` window, see :func:`update_breakdown`; generation phases from
SGLang's per-request spans between two updates, see :func:`gen_breakdown`.
"""

from __future__ import annotations

import collections
import json
import math
import re
import statistics
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from ..workloads import SCORE_KEY, load_metrics, metric_value, val_accuracy
from .cpu_use import CPU_FILE, cpu_in_windows
from .verl_trainers import ASYNC_KEYS

#: The two sides of a pair, in the order of the table's columns.
SIDES = ("builtin", "ours")
SIDE_LABELS = {"builtin": "verl built-in", "ours": "sgl-rollout"}

#: verl's per-step timers (``verl/trainer/ppo/ray_trainer.py``: ``marked_timer``) reported, in step order.
TIMING_KEYS = ("timing_s/gen", "timing_s/reward", "timing_s/old_log_prob", "timing_s/ref", "timing_s/adv",
               "timing_s/update_actor", "timing_s/update_weights", "timing_s/step",
               *ASYNC_KEYS, "perf/throughput")  # the asynchronous trainers' keys, verl's tokens per second
#: verl's trainer memory metrics (``verl/utils/profiler``: the actor's torch peak, GB).
MEMORY_KEYS = ("actor/perf/max_memory_allocated_gb", "actor/perf/max_memory_reserved_gb")
UPDATE_KEY = "timing_s/update_weights"
#: Derived per step: ``timing_s/gen`` less the slowest replica's sleep (the probe's ``replica.sleep``),
#: i.e. verl's wait for the step's samples. verl 0.9.1's default trainer (``trainer.use_v1``) waits in
#: its replay buffer's ``sample``, which sleeps its ``poll_interval`` (2 s) between checks
#: (``verl/trainer/ppo/v1/replay_buffer.py``), so this moves in steps of about 2 s.
GEN_WAIT_KEY = "timing_s/gen less replica.sleep"
#: Rows of the metrics table, in order.
TABLE_KEYS = TIMING_KEYS[:1] + (GEN_WAIT_KEY,) + TIMING_KEYS[1:] + MEMORY_KEYS

#: The weight-update target: ours at most this fraction of the built-in's ``timing_s/update_weights``.
UPDATE_TARGET_RATIO = 0.5

#: Trainer-side spans that split ``verl.update_weights`` into phases; time between them is verl's own.
TOP_SPANS = ("rollout.resume", "verl.get_per_tensor_param", "rollout.update_weights", "rollout.release")


# ------------------------------------------------------------------------------------ statistics
def p90(xs: Sequence[float]) -> Optional[float]:
    """90th percentile by nearest rank (None for no values)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(0.9 * len(s)) - 1)]


def med(xs: Sequence[float]) -> Optional[float]:
    """Median (None for no values)."""
    return statistics.median(xs) if xs else None


# ------------------------------------------------------------------------------------ loading
def load_spans(folder: Path) -> List[dict]:
    """Every span of ``folder/spans-*.jsonl`` (:mod:`.verl_probe`), sorted by start; lines that are not
    JSON objects with ``name``, ``t0`` and ``dt`` (a process killed mid-write) are skipped."""
    out = []
    for path in sorted(Path(folder).glob("spans-*.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and {"name", "t0", "dt"} <= rec.keys():
                out.append(rec)
    out.sort(key=lambda r: r["t0"])
    return out


#: ``ServerArgs`` fields that differ between any two engines (ports, addresses, seeds): not compared.
_VOLATILE_SERVER_ARG = re.compile(r"port|addr|host|seed")
#: ``ServerArgs`` fields naming the model's folder: a side reported against another run's side (``--sides``) read
#: its own copy, written into its run folder under the same name (``--random-model``: drawn from a fixed seed).
_MODEL_PATH_ARGS = ("model_path", "tokenizer_path", "served_model_name")
#: ``ServerArgs`` fields this package sets otherwise than verl's built-in on purpose, and why.
OWN_SERVER_ARGS = {
    "custom_weight_loader": "this package's fast-path loader (sgl_rollout.weight_sync.receiver)",
    "skip_server_warmup": "SGLang's warm-up request at start (verl's built-in skips it); before any step",
}


def server_args_of(spans: List[dict]) -> Optional[dict]:
    """The ``ServerArgs`` of a side's first engine among its ``spans`` (the probe's ``sglang.server_args``
    record: field -> JSON-safe value), or None when the run has none (recorded before 2026-11-28)."""
    for rec in spans:
        if rec["name"] == "sglang.server_args" and isinstance(rec.get("args"), dict):
            return rec["args"]
    return None


def server_arg_differences(builtin: Optional[dict], ours: Optional[dict]) -> Optional[List[dict]]:
    """The ``ServerArgs`` fields whose values differ between the sides' engines, ports, addresses and
    seeds left out: ``[{"arg", "builtin", "ours", "why"}, ...]`` by name (``why``: :data:`OWN_SERVER_ARGS`'
    reason, None for a difference this package did not mean); None unless both sides recorded theirs.
    A model folder of the same name in two run folders (:data:`_MODEL_PATH_ARGS`) is not a difference."""
    if not builtin or not ours:
        return None
    out = []
    for key in sorted(builtin.keys() | ours.keys()):
        a, b = builtin.get(key), ours.get(key)
        if _VOLATILE_SERVER_ARG.search(key) or a == b:
            continue
        if key in _MODEL_PATH_ARGS and isinstance(a, str) and isinstance(b, str) and Path(a).name == Path(b).name:
            continue
        out.append({"arg": key, "builtin": a, "ours": b, "why": OWN_SERVER_ARGS.get(key)})
    return out


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def training_rows(rows: List[dict]) -> List[dict]:
    """verl's records of training steps (those with a rollout score), in step order."""
    return [r for r in rows if metric_value(r.get(SCORE_KEY)) is not None]


# ------------------------------------------------------------------------------------ breakdown
def _end(s: dict) -> float:
    return s["t0"] + s["dt"]


def _base(name: str) -> str:
    return name.split("[", 1)[0]


def update_breakdown(spans: List[dict], update_s: Optional[float] = None) -> List[Tuple[str, float, Dict[str, float]]]:
    """Phases of one ``verl.update_weights`` call, in time order.

    ``spans`` are the spans of one step: the trainer's ``verl.update_weights`` span ``W`` first
    (its process is the trainer process), then any others. Returned phases:

    * ``ray: driver <-> trainer workers``: ``update_s`` (verl's ``timing_s/update_weights``) minus
      ``W``: Ray's dispatch of ``update_weights`` to every trainer worker and the driver's wait;
    * each trainer-side span of :data:`TOP_SPANS` inside ``W`` (e.g. ``rollout.resume[weights]``),
      with its children: the spans that start inside it in ``W``'s own process and in processes
      outside the trainer (no ``rank``: the server actors, SGLang), summed by name per process, then
      averaged over the processes that have the name (so 2 replicas' servers give one server's
      time, and the other trainer ranks, which run the same phases side by side and wait on each
      other's collectives, are left out); a child ``rollout.bucket`` (bucketing, the weights generator
      included) is reported less the ``verl.weights`` generator time where it reads the generator
      (:func:`_bucketing_reads_generator`), and what no child covers as ``(rest: calls, round trips)``;
    * ``verl: ...`` for the time between them (verl's own code: ``empty_cache``, offload, barrier).

    Returns:
        ``[(phase, seconds, {child: seconds})]``; empty when ``spans`` has no ``verl.update_weights``.
    """
    if not spans or spans[0]["name"] != "verl.update_weights":
        return []
    w, rest = spans[0], spans[1:]
    w0, w1 = w["t0"], _end(w)
    phases: List[Tuple[str, float, Dict[str, float]]] = []
    if update_s is not None:
        phases.append(("ray: driver <-> trainer workers", max(update_s - w["dt"], 0.0), {}))
    tops = [s for s in rest if s["pid"] == w["pid"] and _base(s["name"]) in TOP_SPANS and w0 <= s["t0"] <= w1]
    others = [s for s in rest if s not in tops and (s["pid"] == w["pid"] or s.get("rank") is None)]
    cursor, prev = w0, None
    for top in tops:
        phases.append(_gap(f"verl: {'start' if prev is None else prev} -> {top['name']}", cursor, top["t0"], others, w))
        t0, t1 = top["t0"], _end(top)
        inner = [s for s in others if t0 <= s["t0"] <= t1]
        kids = _per_process(inner)
        reads_inside = _bucketing_reads_generator(inner)
        if reads_inside:
            kids["rollout.bucket"] = max(kids["rollout.bucket"] - kids["verl.weights"], 0.0)
        if kids:
            # the rest of the phase: what no child span covers (spans nested in another child, e.g.
            # SGLang's side of a call inside the caller's span, are not counted twice)
            outer = _per_process([s for s in inner if not _nested(s, inner)])
            covered = sum(outer.values())
            if reads_inside:
                covered -= outer.get("verl.weights", 0.0)  # inside the bucketing
            kids["(rest: calls, round trips)"] = max(top["dt"] - covered, 0.0)
        phases.append((top["name"], top["dt"], kids))
        cursor, prev = max(cursor, t1), top["name"]
    phases.append(_gap(f"verl: {'start' if prev is None else prev} -> end", cursor, w1, others, w))
    return phases


def _bucketing_reads_generator(inner: List[dict]) -> bool:
    """True when the ``rollout.bucket`` spans among ``inner`` contain the ``verl.weights`` generator's reads.

    verl's bucketer and this package's flattened path (``BucketStream.next_payload``) read the generator
    inside their bucketing, so their first bucketing span starts no later than the generator's first
    read; the fast path writes a bucket into its buffer (``gather_bucket``) only after reading the tensors it
    needs, so its first such span starts after it.
    """
    buckets = [s["t0"] for s in inner if s["name"] == "rollout.bucket"]
    reads = [s["t0"] for s in inner if s["name"] == "verl.weights"]
    return bool(buckets and reads) and min(buckets) <= min(reads)


def update_split(phases: List[Tuple[str, float, Dict[str, float]]]) -> Tuple[float, float]:
    """One step's weight update (the phases of :func:`update_breakdown`) split into verl's own part and
    the rollout's, seconds; the two add up to the phases' total (``timing_s/update_weights`` when the
    breakdown had it).

    verl's part: its phases between the rollout's calls (``verl: ...``: ``empty_cache``, offload, barrier),
    ``verl.get_per_tensor_param``, Ray's dispatch (``ray: ...``) and the time the rollout spent in verl's
    weights generator (a ``verl.weights`` child: verl's FSDP all-gather, run as the sync reads it). The
    rollout's part: the rest of its ``rollout.*`` phases (wake, sync, KV wake). ``gen: ...`` rows (the
    sleep before the update) are in neither.
    """
    verl = rollout = 0.0
    for name, secs, kids in phases:
        if name.startswith(("verl", "ray:")):
            verl += secs
        elif name.startswith("rollout."):
            generator = min(kids.get("verl.weights", 0.0), secs)
            verl += generator
            rollout += secs - generator
    return verl, rollout


def _per_process(spans: List[dict]) -> Dict[str, float]:
    """Seconds by span name: summed per process, then the mean over the processes that have it."""
    by: Dict[str, Dict[int, float]] = {}
    for s in spans:
        per = by.setdefault(s["name"], {})
        per[s["pid"]] = per.get(s["pid"], 0.0) + s["dt"]
    return {name: sum(per.values()) / len(per) for name, per in by.items()}


def _gap(name: str, t0: float, t1: float, others: List[dict], w: dict) -> Tuple[str, float, Dict[str, float]]:
    """The phase between two trainer-side spans: verl's own code, with the trainer's spans inside it
    (``torch.empty_cache``, ``torch.barrier``, ...) as children and the rest as ``(rest: verl)``."""
    inner = [s for s in others if s["pid"] == w["pid"] and t0 <= s["t0"] <= t1]
    kids = _per_process(inner)  # one process: the sums by name
    if kids:
        outer = [s for s in inner if not _nested(s, inner)]
        kids["(rest: verl)"] = max(t1 - t0 - sum(s["dt"] for s in outer), 0.0)
    return name, max(t1 - t0, 0.0), kids


def _nested(s: dict, among: List[dict]) -> bool:
    """True when ``s`` lies inside another (non-busy) span of ``among``; busy spans (summed iterator
    time) are never containers, nor is a span of the same name in another process (two replicas'
    servers doing the same thing at the same time)."""
    if s.get("busy"):
        return False
    return any(o is not s and not o.get("busy") and o["t0"] <= s["t0"] and _end(s) <= _end(o)
               and (o["dt"] > s["dt"] or o["t0"] < s["t0"])
               and (o["name"] != s["name"] or o["pid"] == s["pid"]) for o in among)


def steps_of(spans: List[dict]) -> Dict[int, List[dict]]:
    """Spans grouped by training step: for each ``verl.update_weights`` span of the lowest-ranked
    trainer process, that span first, then every span inside its window; plus ``replica.sleep`` spans
    (the end of that step's generation) before it."""
    ws = [s for s in spans if s["name"] == "verl.update_weights" and s.get("step") is not None]
    if not ws:
        return {}
    lead_rank = min((s.get("rank") or 0) for s in ws)
    ws = [s for s in ws if (s.get("rank") or 0) == lead_rank]
    lead_pid = ws[0]["pid"]
    ws = [s for s in ws if s["pid"] == lead_pid]
    out: Dict[int, List[dict]] = {}
    prev_end = -math.inf
    for w in ws:
        inside = [s for s in spans if s is not w and w["t0"] <= s["t0"] <= _end(w)]
        sleeps = [s for s in spans if s["name"] == "replica.sleep" and prev_end <= s["t0"] < w["t0"]]
        out[int(w["step"])] = [w] + inside + [dict(s, name="gen: replica.sleep") for s in sleeps]
        prev_end = _end(w)
    return out


#: SGLang's own time of one request on both sides (the probe's span of the tokenizer manager's
#: ``generate_request``, ended by its answer).
GEN_REQUEST = "sglang.generate_request"


#: The replay buffer of verl's default trainer (``trainer.use_v1``) polls for the step's samples with
#: a ``time.sleep(poll_interval)``, 2 s in verl 0.9.1 (``verl/trainer/ppo/v1/replay_buffer.py``).
POLL = "verl.replay_buffer.poll"


#: (label, span) of verl's driver between an update's end and the next step's first request
#: (:mod:`.verl_probe`'s ``verl.driver.*`` spans): ``gen: update end -> first request``'s children.
DRIVER_SPANS = (("compute_metrics", "verl.driver.compute_metrics"), ("log", "verl.driver.log"),
                ("next batch", "verl.driver.next_batch"), ("submit", "verl.driver.submit"),
                ("submit / generate_sequences", "verl.driver.generate_sequences"))


def gen_breakdown(spans: List[dict]) -> Dict[int, List[Tuple[str, float, Dict[str, float]]]]:
    """Where each step's generation goes, from the per-request spans of the rollout's process.

    verl 0.9.1 updates the rollout's weights at the end of a step (``verl/trainer/ppo/v1/trainer_sync.py``,
    ``on_step_end``; ``ray_trainer.py`` with ``trainer.use_v1=False``), so training step
    ``k`` generates between the lead trainer's ``verl.update_weights`` span of step ``k - 1`` and that of
    step ``k``. Inside that window (seconds):

    * ``gen: update end -> first request``: verl's own (the next batch, the agent-loop workers'
      dispatch); ``timing_s/gen`` starts inside it. Where the probe saw them, its children say when
      the step's first request left verl's client (``verl.client_generate``) and reached the server
      actor (``server.generate``), s after the update's end, and how long verl's driver spent in each of
      :data:`DRIVER_SPANS` before that first request (``driver: compute_metrics``, ``driver: log``,
      ``driver: next batch``, ``driver: submit`` and within it ``driver: submit / generate_sequences``; s);
    * ``gen: first request -> last answer``: the rollout serving the step's requests
      (``{"requests": n, "last request in": s after the first, "request median": s}`` as children);
      with the client's and server's spans also ``client -> SGLang, k-th request`` and ``server ->
      SGLang, k-th request`` (median over k of the k-th arrival at SGLang less the k-th send: the way
      in, without matching request ids), ``load-balancer round trip`` (median ``verl.acquire_server``),
      when verl's agent-loop workers sent (:func:`_client_sends`), and, in a run whose probe watched for
      stalls (``probe.stall_watch``; or, in runs recorded before that span, saw one: ``probe.loop_stall``,
      ``probe.gil_stall``), their count and the longest (s) from the update's end to the last answer, the
      engine's and the workers' apart, with long garbage collections where watched (:func:`_watched`);
    * ``gen: last answer -> replica.sleep``: the answers' way back to verl's driver; where the probe
      saw them, its children are ``server.generate returned`` and ``verl.client_generate returned``
      (s after the last answer until the server actor returned the last request, and until
      its answer was back over Ray in verl's agent-loop worker), ``replay-buffer poll
      sleep`` (s of the driver's replay-buffer poll sleeps after the last answer) and ``polls`` (how
      many poll sleeps the step's ``timing_s/gen`` holds: it moves in steps of the 2 s interval);
    * ``gen: replica.sleep``: the slowest replica's sleep (the end of ``timing_s/gen``).

    Returns:
        step -> ``[(phase, seconds, {child: value})]``; a step without request spans is left out.
    """
    named = _by_name(spans)
    stalls_seen = any(named.get(n) for n in ("probe.stall_watch", "probe.loop_stall", "probe.gil_stall"))
    out: Dict[int, List[Tuple[str, float, Dict[str, float]]]] = {}
    for step, t0, t1 in _generation_windows(spans):
        phases = _gen_window(named, t0, t1, stalls_seen)
        if phases is not None:
            out[step] = phases
    return out


def _by_name(spans: List[dict]) -> Dict[str, List[dict]]:
    named: Dict[str, List[dict]] = {}
    for s in spans:
        named.setdefault(s["name"], []).append(s)
    return named


def _generation_windows(spans: List[dict]) -> List[Tuple[int, float, float]]:
    """``(step, end of the update before it, start of its own update or inf)`` of each training step whose
    generation follows an update of the lead trainer rank (:func:`steps_of`)."""
    updates = {step: ss[0] for step, ss in steps_of(spans).items()}
    out = []
    for prev_step, w in sorted(updates.items()):
        nxt = updates.get(prev_step + 1)
        out.append((prev_step + 1, _end(w), nxt["t0"] if nxt is not None else math.inf))
    return out


def _requests_in(named: Dict[str, List[dict]], t0: float, t1: float) -> List[dict]:
    """SGLang's request spans (:data:`GEN_REQUEST`) that started in ``[t0, t1)``."""
    return [s for s in named.get(GEN_REQUEST, []) if t0 <= s["t0"] < t1]


def serving_windows(spans: List[dict]) -> Dict[int, Tuple[float, float]]:
    """step -> ``(first request, last answer)``, wall-clock seconds: the window in which the step's requests
    were served (``gen: first request -> last answer`` of :func:`gen_breakdown`); steps without request
    spans are left out."""
    named = _by_name(spans)
    out = {}
    for step, t0, t1 in _generation_windows(spans):
        reqs = _requests_in(named, t0, t1)
        if reqs:
            out[step] = (min(s["t0"] for s in reqs), max(_end(s) for s in reqs))
    return out


def _gen_window(named: Dict[str, List[dict]], t0: float, t1: float,
                stalls_seen: bool) -> Optional[List[Tuple[str, float, Dict[str, float]]]]:
    """The generation phases of one step (:func:`gen_breakdown`): between the end ``t0`` of one update
    and the start ``t1`` of the next (inf: none); ``named``: the spans by name. None without request spans."""
    reqs = _requests_in(named, t0, t1)
    if not reqs:
        return None
    first, last = min(s["t0"] for s in reqs), max(_end(s) for s in reqs)
    lead_in, serving = _gen_serving(named, reqs, t0, last, stalls_seen)
    phases = [("gen: update end -> first request", first - t0, lead_in),
              ("gen: first request -> last answer", last - first, serving)]
    after = [s for s in named.get("replica.sleep", []) if last <= s["t0"] < t1]
    if after:
        start = min(s["t0"] for s in after)
        phases.append(("gen: last answer -> replica.sleep", start - last, _gen_way_back(named, t0, last, start)))
        phases.append(("gen: replica.sleep", max(_end(s) for s in after) - start, {}))
    return phases


def _gen_serving(named: Dict[str, List[dict]], reqs: List[dict], t0: float, last: float,
                 stalls_seen: bool) -> Tuple[Dict[str, float], Dict[str, float]]:
    """The children of the first two phases of :func:`gen_breakdown` for the step whose requests ``reqs``
    started after the update's end ``t0`` and were answered by ``last``.

    Returns:
        (``gen: update end -> first request``'s children: when the first request left verl's client and
        reached the server actor; ``gen: first request -> last answer``'s: request count and times, the
        k-th request's way in, the load balancer's round trip and, where watched, the stalls).
    """
    first = min(s["t0"] for s in reqs)
    lead_in: Dict[str, float] = {}
    for label, name in DRIVER_SPANS:  # the driver's own work before the first request (seconds, summed)
        inside = [s["dt"] for s in named.get(name, []) if t0 <= s["t0"] < first]
        if inside:
            lead_in[f"driver: {label}"] = sum(inside)
    serving = {"requests": float(len(reqs)), "last request in": max(s["t0"] for s in reqs) - first,
               "request median": med([s["dt"] for s in reqs])}
    arrivals = sorted(s["t0"] for s in reqs)
    for label, way_in in (("verl.client_generate", "client -> SGLang"), ("server.generate", "server -> SGLang")):
        sent = sorted(s["t0"] for s in named.get(label, []) if t0 <= s["t0"] < last)
        if sent:
            lead_in[label] = sent[0] - t0
            serving[f"{way_in}, k-th request"] = med([a - b for a, b in zip(arrivals, sent)])
    acquires = [s["dt"] for s in named.get("verl.acquire_server", []) if t0 <= s["t0"] < last]
    if acquires:
        serving["load-balancer round trip"] = med(acquires)
    serving.update(_client_sends(named, t0, last))
    serving.update(_watched(named, t0, last, stalls_seen))
    return lead_in, serving


def _client_sends(named: Dict[str, List[dict]], t0: float, last: float) -> Dict[str, float]:
    """When verl's agent-loop workers sent the step's requests (``verl.client_generate`` starts between the
    update's end ``t0`` and the last answer ``last``), s after the step's first send: ``client sends:
    median`` over every request, and ``client sends: slowest worker's median`` (the largest of each
    worker process's median). A worker that sends late delays the step's last request however fast the
    server takes it. Empty without client spans."""
    sends = [s for s in named.get("verl.client_generate", []) if t0 <= s["t0"] < last]
    if not sends:
        return {}
    first = min(s["t0"] for s in sends)
    by_worker: Dict[Any, List[float]] = {}
    for s in sends:
        by_worker.setdefault(s["pid"], []).append(s["t0"] - first)
    return {"client sends: median": med([s["t0"] - first for s in sends]),
            "client sends: slowest worker's median": max(med(v) for v in by_worker.values())}


def _watched(named: Dict[str, List[dict]], t0: float, last: float, stalls_seen: bool) -> Dict[str, float]:
    """The stalls and long garbage collections (:mod:`.verl_probe`'s ``probe.loop_stall``, ``probe.gil_stall``,
    ``probe.gc``) between the update's end ``t0`` and the last answer ``last``, by role: the engine's
    processes (``loop stalls``, ``GIL stalls``, ``GC pauses``, each with its ``longest ...``; s) and, as
    ``client ...``, verl's agent-loop workers (the processes with ``verl.client_generate`` spans). A role's
    rows are there only where the probe watched it (``probe.stall_watch``: ``loop`` and ``gil`` give the
    stall rows, ``gc`` the GC rows; ``stalls_seen``: a run recorded before that span, whose stall spans
    are the engine's)."""
    clients = {s["pid"] for s in named.get("verl.client_generate", [])}
    out: Dict[str, float] = {}
    for role, mine in (("", lambda pid: pid not in clients), ("client ", lambda pid: pid in clients)):
        watches = {s.get("watch") for s in named.get("probe.stall_watch", []) if mine(s["pid"])}
        legacy = not role and stalls_seen and not named.get("probe.stall_watch")
        stalls = bool(watches & {"loop", "gil"}) or legacy
        for label, name, shown, noun in (("loop", "probe.loop_stall", stalls, "stall"),
                                          ("GIL", "probe.gil_stall", stalls, "stall"),
                                          ("GC", "probe.gc", "gc" in watches, "pause")):
            if not shown:
                continue
            seen = [s["dt"] for s in named.get(name, []) if mine(s["pid"]) and t0 <= s["t0"] < last]
            out[f"{role}{label} {noun}s"] = float(len(seen))
            out[f"longest {role}{label} {noun}"] = max(seen, default=0.0)
    return out


def _gen_way_back(named: Dict[str, List[dict]], t0: float, last: float, start: float) -> Dict[str, float]:
    """The children of :func:`gen_breakdown`'s ``gen: last answer -> replica.sleep`` for the step whose
    window opened at ``t0``, answered last at ``last`` and whose first replica began to sleep at ``start``:
    when the server actor and verl's client returned, and the driver's replay-buffer poll sleeps."""
    back = {}
    for label, name in (("server.generate returned", "server.generate"),
                        ("verl.client_generate returned", "verl.client_generate")):
        ends = [_end(s) for s in named.get(name, []) if t0 <= s["t0"] < last and _end(s) <= start]
        if ends:
            back[label] = max(ends) - last
    step_polls = [s for s in named.get(POLL, []) if t0 <= s["t0"] < start]
    if step_polls:
        back["replay-buffer poll sleep"] = sum(max(0.0, min(_end(s), start) - max(s["t0"], last))
                                               for s in step_polls)
        back["polls"] = float(len(step_polls))
    return back


def _collect_phases(per_step: Dict[int, List[Tuple[str, float, Dict[str, float]]]]) -> Dict[str, List[float]]:
    out: Dict[str, List[float]] = {}
    for _step, phases in sorted(per_step.items()):
        for name, secs, kids in phases:
            out.setdefault(name, []).append(secs)
            for k, v in kids.items():
                out.setdefault(f"{name} / {k}", []).append(v)
    return out


# ------------------------------------------------------------------------------------ one run
def summarize_run(run_dir: Path, planned_steps: Optional[int] = None) -> dict:
    """Everything the report needs of one run folder.

    Args:
        run_dir: the run folder.
        planned_steps: the configured training steps (``config.json``'s ``steps``); None: ``run.json``'s.

    Returns:
        dict: ``side``, ``pair``, ``status`` (``"ok"``; ``"failed"`` when the exit code is not 0 or fewer
        steps than planned were logged; ``"missing"``), ``exit_code`` (None: timed out or no ``run.json``),
        ``error``, ``steps`` (training steps logged), ``planned_steps``, ``metrics`` (key ->
        ``{"median", "p90", "n", "values"}`` over steps after the first, for :data:`TIMING_KEYS` and
        :data:`MEMORY_KEYS`, plus :data:`GEN_WAIT_KEY` where the probe recorded the sleeps), ``reward``
        and ``val_acc`` (``[[step, value], ...]``), ``nvml_peak_gb``
        (largest device memory in use on any GPU during the run, GB = 1e9 bytes), ``nvml_peak_processes``
        (:func:`peak_by_process`, where recorded), ``engine_awake_peaks`` (:func:`awake_peaks`, where
        recorded), ``update_memory`` (:func:`summarize_memory`, where the probe recorded memory),
        ``update_phases`` (phase -> ``{"median", "p90", "n"}``, see :func:`update_breakdown`, over the
        steps of ``metrics``: not the first, nor the sync verl runs before training, step 0) with
        ``update_phase_order``, ``update_split`` (``"verl"`` / ``"rollout"`` -> ``{"median", "p90", "n",
        "values"}``, seconds: :func:`update_split` of each of those steps), ``gen_phases`` with
        ``gen_phase_order`` (the same for
        :func:`gen_breakdown`, over the same steps), ``cpu_serving`` (:func:`cpu_while_serving`, where the
        run has ``cpu.json`` and request spans), ``per_step`` (step -> verl timings, for the plot), and
        ``server_args`` (:func:`server_args_of`; :func:`compare` takes it out and keeps the differences).
    """
    run_dir = Path(run_dir)
    info = _read_json(run_dir / "run.json")
    out: dict = {"dir": str(run_dir), "side": info.get("side"), "pair": info.get("pair"),
                 "planned_steps": planned_steps if planned_steps is not None else info.get("steps"),
                 "exit_code": info.get("exit_code"),
                 "wall_s": info.get("wall_s"), "error": info.get("error"), "jit_caches": info.get("jit_caches")}
    metrics_path = run_dir / "metrics.jsonl"
    rows = load_metrics(metrics_path) if metrics_path.exists() else []
    train = training_rows(rows)
    out["steps"] = len(train)
    out["status"] = _run_status(info, rows, out["planned_steps"], len(train))
    later = train[1:]
    later_steps = {r["step"] for r in later}
    out["metrics"] = metrics = _step_metrics(later)
    out["reward"] = [[r["step"], metric_value(r.get(SCORE_KEY))] for r in train]
    out["val_acc"] = [[s, a] for s, a in val_accuracy(rows)]
    out["per_step"] = {r["step"]: {k: metric_value(r.get(k)) for k in TIMING_KEYS if metric_value(r.get(k)) is not None} for r in train}
    out.update(_nvml_summary(_read_json(run_dir / "nvml.json")))
    spans = load_spans(run_dir / "spans")
    out["server_args"] = server_args_of(spans)  # taken out by compare(): comparison.json keeps the differences
    spans, memory = [s for s in spans if s["name"] != MEMORY_SPAN], memory_around_update(spans)
    if memory:
        out["update_memory"] = summarize_memory(memory, later_steps)
    update_by_step = {r["step"]: metric_value(r.get(UPDATE_KEY)) for r in train}
    per_step_phases, sleep_by_step, order = _update_phases_by_step(steps_of(spans), update_by_step)
    out.update(_update_summary(per_step_phases, order, later_steps))
    waits = [g - sleep_by_step[r["step"]] for r in later
             if (g := metric_value(r.get("timing_s/gen"))) is not None and r["step"] in sleep_by_step]
    if waits:
        metrics[GEN_WAIT_KEY] = _distribution(waits)
    gen = {k: v for k, v in gen_breakdown(spans).items() if k in later_steps}
    out["gen_phase_order"] = list(dict.fromkeys(label for phases in gen.values() for name, _s, kids in phases
                                                 for label in [name] + [f"{name} / {k}" for k in kids]))
    out["gen_phases"] = _phase_stats(_collect_phases(gen))
    out["ckpt_phases"] = ckpt_phases(spans)
    cpu_record = _read_json(run_dir / CPU_FILE)
    if cpu_record:  # runs before 2026-11-29 have none: their spans are not walked a second time
        cpu = cpu_while_serving(cpu_record, serving_windows(spans), later_steps)
        if cpu:
            out["cpu_serving"] = cpu
    return out


#: The row of :func:`cpu_while_serving` that sums every process, and the one with the window's length.
CPU_ALL, CPU_WINDOW = "all processes", "(the window, s)"


def cpu_while_serving(cpu: dict, windows: Dict[int, Tuple[float, float]], steps) -> Dict[str, dict]:
    """CPU seconds each process role used while each of ``steps`` served its requests (``cpu.json`` of
    :class:`~.cpu_use.CpuSampler`, in :func:`serving_windows`): role -> ``{"median", "p90", "n"}`` over the
    steps, plus :data:`CPU_ALL` (every role) and :data:`CPU_WINDOW` (the window's length, s); ``{}`` without
    a record or a window inside it."""
    per_step = cpu_in_windows(cpu, {k: v for k, v in windows.items() if k in steps})
    if not per_step:
        return {}
    collected: Dict[str, List[float]] = collections.defaultdict(list)
    for step, by_role in per_step.items():
        for role, used in by_role.items():
            collected[role].append(used)
        collected[CPU_ALL].append(sum(by_role.values()))
        collected[CPU_WINDOW].append(windows[step][1] - windows[step][0])
    return _phase_stats(collected)


#: Span-name prefix of verl's checkpoint-engine steps (:data:`.verl_probe.TARGETS`).
CKPT_PREFIX = "ckpt."


def ckpt_phases(spans: List[dict]) -> Dict[str, dict]:
    """verl's checkpoint-engine steps of a run (standalone replicas, the asynchronous trainers): for each
    ``ckpt.*`` span name, :func:`_distribution` of its durations in milliseconds over its calls after each
    process's first (the first builds the communication group and pays one-time costs), plus
    ``"processes"``. Names that ran only once per process are left out; ``{}`` for a run without them
    (the colocated trainer)."""
    by_name: Dict[str, Dict[Any, List[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for span in spans:
        if span["name"].startswith(CKPT_PREFIX):
            by_name[span["name"]][span.get("pid")].append(float(span["dt"]) * 1e3)
    out = {}
    for name, per_pid in by_name.items():
        later = [v for durations in per_pid.values() for v in durations[1:]]
        if later:
            out[name] = {**_distribution(later), "processes": len(per_pid)}
    return out


def _run_status(info: dict, rows: List[dict], planned_steps: Optional[int], steps: int) -> str:
    """:func:`summarize_run`'s ``status``: ``"missing"`` (neither ``run.json`` nor metrics), ``"failed"``
    (an exit code other than 0, or fewer than ``planned_steps`` training steps logged) or ``"ok"``."""
    if not info and not rows:
        return "missing"
    if info.get("exit_code") not in (0, None) or (planned_steps and steps < planned_steps):
        return "failed"
    return "ok"


def _distribution(vals: List[float]) -> dict:
    """``{"median", "p90", "n", "values"}`` of ``vals`` (a metric of :func:`summarize_run`)."""
    return {"median": med(vals), "p90": p90(vals), "n": len(vals), "values": vals}


def _phase_stats(collected: Dict[str, List[float]]) -> Dict[str, dict]:
    """Phase -> ``{"median", "p90", "n"}`` of each phase's seconds (of :func:`_collect_phases`)."""
    return {k: {"median": med(v), "p90": p90(v), "n": len(v)} for k, v in collected.items()}


def _step_metrics(later: List[dict]) -> Dict[str, dict]:
    """:data:`TIMING_KEYS` and :data:`MEMORY_KEYS` over the training rows ``later`` (the steps after the
    first): key -> :func:`_distribution`, for each key logged as a number in at least one row."""
    metrics = {}
    for key in TIMING_KEYS + MEMORY_KEYS:
        vals = [v for r in later if (v := metric_value(r.get(key))) is not None]
        if vals:
            metrics[key] = _distribution(vals)
    return metrics


def _nvml_summary(nvml: dict) -> dict:
    """What :func:`summarize_run` reports of ``nvml.json``: ``nvml_peak_gb``, ``nvml_error`` and, where
    recorded, ``nvml_peak_processes``, ``engine_awake_peaks`` and ``sm_by_process``."""
    peaks = [p for p in (nvml.get("peak_used_bytes") or {}).values() if p is not None]
    out = {"nvml_peak_gb": max(peaks) / 1e9 if peaks else None, "nvml_error": nvml.get("error")}
    if (by_process := peak_by_process(nvml)) is not None:  # runs recorded before it keep their report
        out["nvml_peak_processes"] = by_process
    if (awake := awake_peaks(nvml)) is not None:
        out["engine_awake_peaks"] = awake
    if (sm := sm_by_process(nvml)):
        out["sm_by_process"] = sm
    return out


def sm_by_process(nvml: dict) -> Dict[str, List[float]]:
    """How busy each process kept the SMs of its GPU, from ``nvml.json``'s ``sm_series``
    (:class:`.verl_compare.NvmlSampler`; runs recorded before it have none: {}).

    Returns:
        ``"GPU <i>: <process name>"`` -> ``[seconds seen busy (SM utilization > 0), mean SM utilization % over
        those seconds]``.
    """
    busy: Dict[str, List[int]] = {}
    for _t, gpus in nvml.get("sm_series") or []:
        for i, by_name in enumerate(gpus):
            for name, util in by_name.items():
                if util > 0:
                    busy.setdefault(f"GPU {i}: {name}", []).append(util)
    return {k: [float(len(v)), sum(v) / len(v)] for k, v in sorted(busy.items())}


def _update_phases_by_step(by_step: Dict[int, List[dict]], update_by_step: Dict[int, Optional[float]]
                           ) -> Tuple[Dict[int, List[Tuple[str, float, Dict[str, float]]]], Dict[int, float], List[str]]:
    """The weight-update phases of each step (:func:`update_breakdown` of the spans of :func:`steps_of`,
    then the slowest replica's sleep that ended the step's generation).

    Returns:
        (step -> phases, step -> the slowest replica's sleep in s, every phase and ``phase / child``
        name in the order first seen).
    """
    per_step_phases = {}
    sleep_by_step: Dict[int, float] = {}  # the slowest replica's sleep ending each step's gen, s
    order: List[str] = []
    for step, ss in by_step.items():
        phases = update_breakdown([s for s in ss if not s["name"].startswith("gen: ")], update_by_step.get(step))
        sleeps = [s for s in ss if s["name"] == "gen: replica.sleep"]
        if sleeps:
            sleep_by_step[step] = max(s["dt"] for s in sleeps)
            phases.append(("gen: replica.sleep (slowest replica)", sleep_by_step[step], {}))
        per_step_phases[step] = phases
        for name, _secs, kids in phases:
            for n in [name] + [f"{name} / {k}" for k in kids]:
                if n not in order:
                    order.append(n)
    return per_step_phases, sleep_by_step, order


def _update_summary(per_step_phases: Dict[int, List[Tuple[str, float, Dict[str, float]]]], order: List[str],
                    later_steps: Set[int]) -> dict:
    """:func:`summarize_run`'s ``update_phases_per_step``, ``update_split``, ``update_phases`` and
    ``update_phase_order`` (the statistics over ``later_steps``, the steps after the first)."""
    splits = [update_split(p) for k, p in sorted(per_step_phases.items())
              if k in later_steps and any(not name.startswith("gen: ") for name, _s, _k in p)]
    collected = _collect_phases({k: v for k, v in per_step_phases.items() if k in later_steps})
    return {
        "update_phases_per_step": {str(k): v for k, v in per_step_phases.items()},
        "update_split": {part: _distribution(vals)
                         for part, vals in (("verl", [v for v, _r in splits]), ("rollout", [r for _v, r in splits]))
                         if vals},
        "update_phases": _phase_stats(collected),
        "update_phase_order": order,
    }


# ------------------------------------------------------------------------------------ comparison
def _metric(run: dict, key: str, stat: str = "median") -> Optional[float]:
    m = run.get("metrics", {}).get(key)
    return m.get(stat) if m else None


def _trainer_key(builtin: dict, ours: dict, keys: Tuple[str, ...]) -> str:
    """The first of ``keys`` whose median both runs recorded and is not 0 (the trainer's own name for the
    figure); the last of ``keys`` when none is."""
    for key in keys:
        if all(_metric(run, key) for run in (builtin, ours)):
            return key
    return keys[-1]


def _last(series: List[list]) -> Optional[float]:
    vals = [v for _s, v in series if v is not None]
    return vals[-1] if vals else None


def _first(series: List[list]) -> Optional[float]:
    vals = [v for _s, v in series if v is not None]
    return vals[0] if vals else None


def accuracy_noise(p1: Optional[float], p2: Optional[float], n_val: int) -> Optional[float]:
    """Two standard errors of the difference of two held-out accuracies over ``n_val`` problems each
    (binomial): the band within which two runs of the same method differ by chance."""
    if p1 is None or p2 is None or n_val <= 0:
        return None
    return 2.0 * math.sqrt((p1 * (1 - p1) + p2 * (1 - p2)) / n_val)


def targets(builtin: dict, ours: dict, n_val: int) -> List[dict]:
    """The issue's targets for one pair, each ``{"target", "builtin", "ours", "ratio", "met"}`` (``met``
    None when a side lacks the figure):

    * the weight update's median (``timing_s/update_weights``; the fully-async trainer's
      ``timing_s/param_sync``): ours <= half the built-in's;
    * the generation's median (``timing_s/gen``; the one-step-off trainer's ``timing_s/generate_async``,
      its ``timing_s/gen`` being 0 after the first step), ``timing_s/step``,
      ``actor/perf/max_memory_allocated_gb`` and the NVML peak: ours <= the built-in's;
    * last held-out accuracy: within :func:`accuracy_noise`.
    """
    rows = []
    upd = _trainer_key(builtin, ours, (UPDATE_KEY, "timing_s/param_sync"))
    gen = _trainer_key(builtin, ours, ("timing_s/generate_async", "timing_s/gen"))

    def add(target, b, o, limit_ratio):
        ratio = (o / b) if (b not in (None, 0) and o is not None) else None
        rows.append({"target": target, "builtin": b, "ours": o, "ratio": ratio,
                     "met": None if ratio is None else ratio <= limit_ratio})

    add(f"{upd} (median) <= {UPDATE_TARGET_RATIO}x built-in", _metric(builtin, upd), _metric(ours, upd),
        UPDATE_TARGET_RATIO)
    add(f"{gen} (median) <= built-in", _metric(builtin, gen), _metric(ours, gen), 1.0)
    add("timing_s/step (median) <= built-in", _metric(builtin, "timing_s/step"), _metric(ours, "timing_s/step"), 1.0)
    add("actor/perf/max_memory_allocated_gb <= built-in", _metric(builtin, MEMORY_KEYS[0], "p90"),
        _metric(ours, MEMORY_KEYS[0], "p90"), 1.0)
    add("NVML peak device memory <= built-in", builtin.get("nvml_peak_gb"), ours.get("nvml_peak_gb"), 1.0)
    b_acc, o_acc = _last(builtin.get("val_acc", [])), _last(ours.get("val_acc", []))
    band = accuracy_noise(b_acc, o_acc, n_val)
    rows.append({"target": f"last held-out accuracy within noise (+-2 SE over {n_val} problems)", "builtin": b_acc,
                 "ours": o_acc, "ratio": None, "band": band,
                 "met": None if band is None else abs(b_acc - o_acc) <= band})
    return rows


#: verl's greedy validation before training (``trainer.validation_data_dir``, ``_write_generations`` in
#: ``verl/trainer/ppo/ray_trainer.py``: one JSON line per sample, file named after ``global_steps``, 0).
VAL_BEFORE_TRAINING = Path("val_generations") / "0.jsonl"


def greedy_agreement(builtin_dir: Path, ours_dir: Path, name: str = VAL_BEFORE_TRAINING) -> Optional[dict]:
    """How many of verl's greedy validation outputs (``name``: before training by default, both sides on
    the checkpoint's weights) are the same text on both sides; None unless both runs wrote it.

    verl orders its dump by each sample's uid, a fresh ``uuid4`` per run (``_validate``,
    ``verl/trainer/ppo/v1/trainer_base.py``), not by the file's order (seen on 2×H200: the shapes task's
    ground truths came in different orders on the two sides), so samples are matched by prompt
    and ground truth, not by line: ``equal`` is the size of the multiset intersection of
    ``(input, gts, output)``. Where prompts repeat (the shapes task asks one question of different
    pictures, which verl's dump does not name), equal counts still mean the two sides gave the same
    answers to the same number of prompts of each ground truth.

    Returns:
        ``{"compared": n, "equal": k, "first_difference": None or {"index", "input", "builtin", "ours"}}``:
        ``n`` the smaller side's sample count; the first difference is the first built-in sample (by its
        line ``index``) whose output the other side did not give as often for that prompt and ground
        truth, with one such output of ours (None where ours has none left); texts cut to 300 characters.
    """
    def outputs(d: Path) -> Optional[List[dict]]:
        path = Path(d) / name
        if not path.is_file():
            return None
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    b, o = outputs(builtin_dir), outputs(ours_dir)
    if b is None or o is None:
        return None

    def key(x: dict) -> Tuple[str, str]:
        return str(x.get("input")), str(x.get("gts"))

    count_b = collections.Counter((key(x), str(x.get("output"))) for x in b)
    count_o = collections.Counter((key(x), str(x.get("output"))) for x in o)
    first = None
    for i, x in enumerate(b):
        k = (key(x), str(x.get("output")))
        if count_o[k] < count_b[k]:
            theirs = next((str(y.get("output")) for y in o if key(y) == key(x)
                           and count_o[(key(y), str(y.get("output")))] > count_b[(key(y), str(y.get("output")))]), None)
            first = {"index": i, "input": str(x.get("input"))[-300:], "builtin": str(x.get("output"))[:300],
                     "ours": None if theirs is None else theirs[:300]}
            break
    return {"compared": min(len(b), len(o)), "equal": sum((count_b & count_o).values()), "first_difference": first}


def _first_greedy_episodes(run_dir: Path) -> Optional[Dict[Tuple[int, ...], List[List[int]]]]:
    """``{prompt ids: turns' token ids}`` of the first greedy episode of each prompt in ``run_dir/turns``
    (:func:`sgl_rollout.bench.agent_task.log_greedy_episode`, earliest first: the validation before
    training); None where the run logged none."""
    files = sorted((Path(run_dir) / "turns").glob("*.jsonl"))
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    first: Dict[Tuple[int, ...], List[List[int]]] = {}
    for row in sorted(rows, key=lambda r: r.get("t", 0.0)):
        first.setdefault(tuple(row["prompt"]), row["turns"])
    return first


def turn_agreement(builtin_dir: Path, ours_dir: Path) -> Optional[dict]:
    """The tools task's greedy episodes compared token id by token id, turn by turn, prompt by prompt
    (each side's first episode of each prompt); None unless both runs logged episodes.

    Returns:
        ``{"episodes": prompts both sides ran, "equal": episodes equal in every turn, "turns": turns
        compared, "tokens": token ids compared (both sides' turns, position by position up to the shorter),
        "one_side_only": prompts only one side ran, "first_difference": None or {"prompt_tail", "turn",
        "token", "builtin", "ours"}}`` (the first differing turn's ids from the first difference on, 8 each).
    """
    b, o = _first_greedy_episodes(builtin_dir), _first_greedy_episodes(ours_dir)
    if b is None or o is None:
        return None
    common = [p for p in b if p in o]
    equal = turns = tokens = 0
    first = None
    for prompt in common:
        tb, to = b[prompt], o[prompt]
        turns += max(len(tb), len(to))
        tokens += sum(min(len(x), len(y)) for x, y in zip(tb, to))
        if tb == to:
            equal += 1
            continue
        if first is None:
            turn = next(i for i in range(max(len(tb), len(to))) if i >= min(len(tb), len(to)) or tb[i] != to[i])
            x, y = (tb[turn] if turn < len(tb) else []), (to[turn] if turn < len(to) else [])
            k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            first = {"prompt_tail": list(prompt[-8:]), "turn": turn, "token": k, "builtin": x[k:k + 8], "ours": y[k:k + 8]}
    return {"episodes": len(common), "equal": equal, "turns": turns, "tokens": tokens,
            "one_side_only": len(set(b) ^ set(o)), "first_difference": first}


def last_common_validation(builtin_dir: Path, ours_dir: Path) -> Optional[Tuple[int, str]]:
    """``(step, relative path)`` of the last validation after training that both runs dumped
    (``val_generations/<step>.jsonl``, step > 0), or None."""
    def steps(d: Path) -> Set[int]:
        folder = Path(d) / Path(VAL_BEFORE_TRAINING).parent
        return {int(p.stem) for p in folder.glob("*.jsonl") if p.stem.isdigit() and int(p.stem) > 0}

    common = steps(builtin_dir) & steps(ours_dir)
    if not common:
        return None
    step = max(common)
    return step, str(Path(VAL_BEFORE_TRAINING).parent / f"{step}.jsonl")


def compare(run_dirs: Dict[int, Dict[str, Path]], config: Optional[dict] = None, n_val: int = 128) -> dict:
    """``comparison.json``'s content for the run folders of each pair (``{pair: {side: folder}}``); runs
    are planned for ``config["steps"]`` steps where the config has them (:func:`summarize_run`)."""
    planned = (config or {}).get("steps")
    pairs = []
    for pair in sorted(run_dirs):
        runs = {side: summarize_run(path, planned) for side, path in run_dirs[pair].items()}
        server_args = {side: run.pop("server_args", None) for side, run in runs.items()}
        entry = {"pair": pair, "runs": runs}
        if all(s in runs for s in SIDES):
            entry["targets"] = targets(runs["builtin"], runs["ours"], n_val)
            entry["greedy_val"] = greedy_agreement(run_dirs[pair]["builtin"], run_dirs[pair]["ours"])
            entry["tool_turns"] = turn_agreement(run_dirs[pair]["builtin"], run_dirs[pair]["ours"])
            diffs = server_arg_differences(server_args["builtin"], server_args["ours"])
            if diffs is not None:
                entry["server_args_differ"] = diffs
            last = last_common_validation(run_dirs[pair]["builtin"], run_dirs[pair]["ours"])
            if last is not None:
                entry["greedy_val_last"] = {"step": last[0], **greedy_agreement(
                    run_dirs[pair]["builtin"], run_dirs[pair]["ours"], last[1])}
        pairs.append(entry)
    comp = {"config": config or {}, "pairs": pairs}
    summary = across_pairs(comp)
    if summary:
        comp["across_pairs"] = summary
    return comp


def across_pairs(comparison: dict) -> List[dict]:
    """The targets over every pair that ran both sides (``--pairs N``: one machine's run-to-run noise is
    large, so one pair decides little). One row per target of :func:`targets`, in its order:
    ``{"target", "per_pair": [{"pair", "builtin", "ours", "ratio", "met"} (and "band" for the accuracy
    target), ...], "median_ratio", "met", "of"}``: ``ratio`` is ours / built-in (None for the accuracy
    target, which has no ratio, and where a side lacks the figure), ``median_ratio`` the median of the
    pairs' ratios, ``met`` in how many of the ``of`` pairs that could be judged the target was met.
    Empty with fewer than two such pairs, so a one-pair report has no summary."""
    entries = [e for e in comparison.get("pairs", []) if e.get("targets")]
    if len(entries) < 2:
        return []
    rows = []
    for i, first in enumerate(entries[0]["targets"]):
        per = [{"pair": e["pair"], **{k: v for k, v in e["targets"][i].items() if k != "target"}} for e in entries]
        ratios = [p["ratio"] for p in per if p["ratio"] is not None]
        judged = [p["met"] for p in per if p["met"] is not None]
        rows.append({"target": first["target"], "per_pair": per,
                     "median_ratio": statistics.median(ratios) if ratios else None,
                     "met": sum(1 for m in judged if m), "of": len(judged)})
    return rows


# ------------------------------------------------------------------------------------ Markdown
def _across_pairs_table(rows: List[dict]) -> List[str]:
    """Markdown of :func:`across_pairs`: per pair the ratio ours / built-in (the accuracy target: both
    figures, built-in / ours, and the band), the median over the pairs, and in how many pairs the target
    was met."""
    if not rows:
        return []
    pairs = [p["pair"] for p in rows[0]["per_pair"]]
    lines = [f"## All {len(pairs)} pairs (ratio sgl-rollout / built-in per pair)", "",
             "| target | " + " | ".join(f"pair {n}" for n in pairs) + " | median over pairs | met in |",
             "| --- | " + " | ".join("---:" for _ in pairs) + " | ---: | --- |"]
    for row in rows:
        cells = [f"{_f(p['builtin'])} / {_f(p['ours'])} (band {_f(p['band'])})" if "band" in p
                 else _f(p["ratio"], ".2f") for p in row["per_pair"]]
        lines.append(f"| {row['target']} | " + " | ".join(cells) + f" | {_f(row['median_ratio'], '.2f')} | "
                     f"{row['met']} of {row['of']} pairs |")
    return lines + [""]


def _f(v, spec=".3f", unit="") -> str:
    return "n/a" if v is None else f"{format(v, spec)}{unit}"


def _mib(v: Optional[float]) -> str:
    """Bytes as whole MiB for a table cell ("n/a" for None)."""
    return _f(None if v is None else v / 2**20, ".0f")


def sum_by_name(procs: Iterable[dict], key: str) -> Dict[str, int]:
    """Device memory per process name, summed over the processes of one name.

    Args:
        procs: NVML process records, ``{"pid", "name", key}`` (``key``: bytes, or None where NVML gave no
            figure: left out), as :class:`.verl_compare.NvmlSampler` (``"used_bytes"``) and the probe's
            ``probe.memory`` (``"used"``) write them.
        key: the field holding the bytes.

    Returns:
        name -> bytes.
    """
    out: Dict[str, int] = {}
    for p in procs:
        if p.get(key) is not None:
            out[p["name"]] = out.get(p["name"], 0) + p[key]
    return out


def _status(run: dict) -> str:
    """The ``run`` cell: ``N steps``, ``not run``, or ``failed after K of N steps (exit C: error)`` (the
    error line without terminal colours, its ``|`` escaped for the table)."""
    if run["status"] == "ok":
        return f"{run['steps']} steps"
    if run["status"] == "missing":
        return "not run"
    code = run.get("exit_code")
    why = f"exit {code}" if code not in (None, 0) else "stopped early"
    err = re.sub(r"\x1b\[[0-9;]*m", "", run.get("error") or "").strip().replace("|", "\\|")
    err = f": {err}" if err else ""
    return f"**failed after {run['steps']} of {run.get('planned_steps') or '?'} steps** ({why}{err})"


def update_verdict(builtin: dict, ours: dict) -> Optional[str]:
    """Why the ``timing_s/update_weights`` target is met or missed in one pair, from
    :func:`update_split`: each side's median per-step split (verl's own phases, the rollout's), half the
    built-in's median figure, and whether verl's phases on our side alone already exceed it (then 2x is
    out of reach in this pair unless they get shorter) or by how much the rollout's phases miss what
    they leave. None when a side lacks the figure or the split (a run without the probe's spans)."""
    b_upd, o_upd = _metric(builtin, UPDATE_KEY), _metric(ours, UPDATE_KEY)
    b_split, o_split = builtin.get("update_split") or {}, ours.get("update_split") or {}
    if b_upd is None or o_upd is None or not all(k in d for d in (b_split, o_split) for k in ("verl", "rollout")):
        return None
    ms = {f"{side}_{part}": 1e3 * split[part]["median"]
          for side, split in (("b", b_split), ("o", o_split)) for part in ("verl", "rollout")}
    half = 1e3 * UPDATE_TARGET_RATIO * b_upd
    head = (f"`timing_s/update_weights` per step, split (median ms over steps after the first, built-in / "
            f"sgl-rollout): verl's own phases (its `empty_cache`, `get_per_tensor_param`, weights generator, "
            f"offload, barrier, Ray dispatch) {ms['b_verl']:.0f} / {ms['o_verl']:.0f}; the rollout's (its "
            f"wake, sync less verl's generator, KV wake) {ms['b_rollout']:.0f} / {ms['o_rollout']:.0f}. Half "
            f"the built-in's figure: {half:.0f} ms. ")
    if 1e3 * o_upd <= half:
        return head + "The 2x target is met."
    if ms["o_verl"] >= half:
        return head + ("verl's own phases on our side alone take more than that: 2x is out of reach in this "
                       "pair unless they get shorter.")
    room = half - ms["o_verl"]
    return head + (f"verl's own phases on our side leave {room:.0f} ms of it; the rollout's take "
                   f"{ms['o_rollout']:.0f} ms, {ms['o_rollout'] - room:.0f} ms over.")


def _ckpt_lines(runs: Dict[str, dict]) -> List[str]:
    """A table of verl's checkpoint-engine steps (:func:`ckpt_phases`), median ms per side; none where no
    side has them."""
    names = sorted({n for run in runs.values() for n in (run.get("ckpt_phases") or {})})
    if not names:
        return []
    cols = [s for s in SIDES if s in runs]
    lines = ["verl's checkpoint-engine steps per weight sync (median ms over the calls after each process's "
             "first; `n` calls):", "", "| step | " + " | ".join(SIDE_LABELS[s] for s in cols) + " |",
             "| --- |" + " ---: |" * len(cols)]
    for name in names:
        cells = []
        for s in cols:
            ph = (runs[s].get("ckpt_phases") or {}).get(name)
            cells.append("n/a" if ph is None else f"{ph['median']:.1f} (n={ph['n']})")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return lines + [""]


def _greedy_lines(entry: dict) -> List[str]:
    """The report's lines on greedy equality: verl's validation dump (:func:`greedy_agreement`) and the
    tools task's turns (:func:`turn_agreement`), each with a blank line; none where the runs left neither."""
    lines: List[str] = []
    g = entry.get("greedy_val")
    if g:
        lines.append(f"Greedy validation before training, same weights on both sides: {g['equal']} of "
                     f"{g['compared']} outputs the same text (`{VAL_BEFORE_TRAINING}`)"
                     + ("" if g["first_difference"] is None else f"; first difference at sample {g['first_difference']['index']}")
                     + " (matched by prompt and ground truth: verl orders them by random uids)")
        gl = entry.get("greedy_val_last")
        if gl:
            lines[-1] += (f"; after training, at step {gl['step']}: {gl['equal']} of {gl['compared']}"
                          + ("" if gl["first_difference"] is None else
                             f", first difference at sample {gl['first_difference']['index']}"))
        lines[-1] += "."
        lines.append("")
    t = entry.get("tool_turns")
    if t:
        lines.append(f"Tool turns, greedy, token ids (each side's first episode of each prompt, `turns/`): {t['equal']} "
                     f"of {t['episodes']} episodes equal in every turn ({t['turns']} turns, {t['tokens']} token ids "
                     "compared)" + (f"; {t['one_side_only']} prompts ran on one side only" if t["one_side_only"] else "")
                     + ("" if t["first_difference"] is None else
                        f"; first difference in turn {t['first_difference']['turn']} at token {t['first_difference']['token']}")
                     + ".")
        lines.append("")
    return lines


#: The parts of a step this package owns (issue 47's "the step, in one line"): label -> where the report
#: keeps its median (a verl metric, or a phase of :func:`gen_breakdown`).
OWNED_PARTS = (
    ("update", ("metrics", UPDATE_KEY)),
    ("sync", ("metrics", "timing_s/sync_rollout_weights")),  # one-step-off's weight sync
    ("sync", ("metrics", "timing_s/param_sync")),  # fully-async's
    ("way in", ("gen_phases", "gen: first request -> last answer / client -> SGLang, k-th request")),
    ("way back", ("gen_phases", "gen: last answer -> replica.sleep / server.generate returned")),
    ("sleep", ("gen_phases", "gen: replica.sleep")),
)


def owned_seconds(run: dict) -> Tuple[Optional[float], List[str]]:
    """The step's seconds this package owns on one side: the sum of the medians (over the steps after the
    first) of :data:`OWNED_PARTS` the run recorded: the weight update (``timing_s/update_weights``, the
    wake's stages inside it; the asynchronous trainers' sync, ``timing_s/sync_rollout_weights`` or
    ``timing_s/param_sync``), a request's way in (verl's client to SGLang, the k-th request), the answers'
    way back (the last answer to the server actor's return) and the replica's sleep.

    Returns:
        (seconds, the parts found); None when none was recorded.
    """
    total, found = 0.0, []
    for label, (where, key) in OWNED_PARTS:
        v = (run.get(where) or {}).get(key, {}).get("median")
        if v is not None:
            total, found = total + v, found + ([label] if label not in found else [])
    return (total if found else None), found


def _owned_line(runs: Dict[str, dict], cols: List[str]) -> List[str]:
    """The report's one line on the package's own part of the step (:func:`owned_seconds`), with the
    ratio and issue 47's aim (<= 0.5x the built-in's)."""
    got = {s: owned_seconds(runs[s]) for s in cols}
    if all(v is None for v, _ in got.values()):
        return []
    parts = sorted({p for _, found in got.values() for p in found}, key=[p for p, _ in OWNED_PARTS].index)
    line = f"The step's own part, sum of the medians of {' + '.join(parts)}: " + ", ".join(
        f"{SIDE_LABELS[s]} {_f(got[s][0])} s" for s in cols)
    if len(cols) == 2 and got["builtin"][0] and got["ours"][0] is not None:
        line += f", {_f(got['ours'][0] / got['builtin'][0], '.2f')}x (aim: <= 0.5x)"
    return [line, ""]


def markdown(comparison: dict) -> str:
    """The report: with two or more pairs first the targets over all of them (:func:`across_pairs`);
    then per pair, verl's metrics (median / p90 over steps after the first) side by side, the targets,
    and the weight-update breakdown (median seconds per phase)."""
    lines: List[str] = []
    cfg = comparison.get("config", {})
    if cfg:
        lines.append(f"# verl built-in SGLang rollout vs sgl-rollout: {cfg.get('title', '')}".rstrip(": "))
        lines.append("")
        for k in ("model", "machine", "command", "steps", "ngpus", "tp", "sglang", "verl", "sgl_rollout"):
            if cfg.get(k) is not None:
                lines.append(f"- {k}: `{cfg[k]}`")
        for d in cfg.get("differences", []):
            lines.append(f"- differs: {d}")
        lines.append("")
    lines += _across_pairs_table(comparison.get("across_pairs") or [])
    for entry in comparison.get("pairs", []):
        runs = entry["runs"]
        order = " then ".join(SIDE_LABELS[s] for s in entry.get("order", SIDES) if s in runs)
        if cfg.get("at_once") and len(runs) == 2:
            order = "both sides at once, each on GPUs of its own"
        lines.append(f"## Pair {entry['pair']}" + (f" ({'' if cfg.get('at_once') else 'run '}{order})" if order else ""))
        lines.append("")
        cols = [s for s in SIDES if s in runs]
        lines.append("| metric | " + " | ".join(f"{SIDE_LABELS[s]}: median / p90" for s in cols)
                     + (" | sgl-rollout / built-in |" if len(cols) == 2 else " |"))
        lines.append("| --- | " + " | ".join("---:" for _ in cols) + (" | ---: |" if len(cols) == 2 else " |"))
        lines.append("| run | " + " | ".join(_status(runs[s]) for s in cols) + (" | |" if len(cols) == 2 else " |"))
        for key in TABLE_KEYS:
            if not any(key in runs[s].get("metrics", {}) for s in cols):
                continue
            cells = [f"{_f(_metric(runs[s], key))} / {_f(_metric(runs[s], key, 'p90'))}" for s in cols]
            ratio = ""
            if len(cols) == 2:
                b, o = _metric(runs["builtin"], key), _metric(runs["ours"], key)
                ratio = f" | {_f(o / b, '.2f')}x" if b and o is not None else " | n/a"
            label = ("`timing_s/gen` less the replicas' sleep (verl's wait for the samples: 2 s polls)"
                     if key == GEN_WAIT_KEY else f"`{key}`")
            lines.append(f"| {label} | " + " | ".join(cells) + ratio + (" |" if ratio else " |"))
        nv = [f"{_f(runs[s].get('nvml_peak_gb'), '.1f', ' GB')}" for s in cols]
        lines.append("| peak device memory (NVML, any GPU) | " + " | ".join(nv) + (" | |" if len(cols) == 2 else " |"))
        rw = [f"{_f(_first(runs[s]['reward']))} -> {_f(_last(runs[s]['reward']))}" for s in cols]
        lines.append("| rollout score, first -> last step | " + " | ".join(rw) + (" | |" if len(cols) == 2 else " |"))
        va = [f"{_f(_first(runs[s]['val_acc']))} -> {_f(_last(runs[s]['val_acc']))}" for s in cols]
        lines.append("| held-out accuracy, first -> last | " + " | ".join(va) + (" | |" if len(cols) == 2 else " |"))
        lines.append("")
        lines += _owned_line(runs, cols)
        lines += _greedy_lines(entry) + _ckpt_lines(runs)
        lines += _peak_process_table(runs, cols)
        lines += _awake_lines(runs, cols)
        lines += _sm_lines(runs, cols)
        lines += _jit_lines(runs, cols)
        lines += _server_args_lines(entry)
        lines += _memory_table(runs, cols)
        if entry.get("targets"):
            lines.append("| target | built-in | sgl-rollout | ratio | met |")
            lines.append("| --- | ---: | ---: | ---: | --- |")
            for t in entry["targets"]:
                met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
                extra = f" (band {_f(t.get('band'))})" if t.get("band") is not None else ""
                lines.append(f"| {t['target']} | {_f(t['builtin'])} | {_f(t['ours'])} | "
                             f"{_f(t['ratio'], '.2f')}{extra} | {met} |")
            lines.append("")
            verdict = update_verdict(runs["builtin"], runs["ours"])
            if verdict:
                lines += [verdict, ""]
        lines += _phase_table(runs, cols, "update_phases", "update_phase_order",
                              "Where `timing_s/update_weights` goes (median ms over steps after the first; "
                              "`a / b`: b's share of phase a, on the lead trainer rank and in one engine "
                              "process each):")
        lines += _phase_table(runs, cols, "gen_phases", "gen_phase_order",
                              "Where `timing_s/gen` goes (median over steps after the first; ms, request counts as "
                              "numbers; the first phase starts before verl's `gen` timer; a row `a / b` under "
                              "`last answer -> replica.sleep` is how long after the last answer b happened):")
        lines += _cpu_lines(runs, cols)
    return "\n".join(lines) + "\n"


#: The probe's memory record around each ``verl.update_weights`` (:func:`.verl_probe.memory_snapshot`).
MEMORY_SPAN = "probe.memory"


def memory_around_update(spans: List[dict]) -> Dict[str, Dict[str, Dict[str, float]]]:
    """Device memory by process at the start and end of each weight update, from the probe's
    ``probe.memory`` records of the lowest-ranked trainer process.

    Returns:
        ``{"<at>": {"<step>": {row: bytes}}}`` with ``at`` ``"start"`` / ``"end"`` and rows: each process
        name NVML listed on that trainer's GPU (bytes summed by name; processes NVML gives no figure for
        are left out), then for the trainer process itself ``"trainer process: NVML"``, ``"trainer
        process: torch reserved"`` and ``"trainer process: torch allocated"`` (``torch.cuda.memory_stats``)
        and ``"trainer process: outside torch's allocator"`` (its NVML figure less torch's reserved: CUDA
        context, loaded kernel code, IPC mappings), and ``"GPU in use"``. Empty where no record has
        figures (older runs).
    """
    recs = [s for s in spans if s["name"] == MEMORY_SPAN and s.get("step") is not None and s.get("procs")]
    if not recs:
        return {}
    lead = min((s.get("rank") or 0) for s in recs)
    recs = [s for s in recs if (s.get("rank") or 0) == lead]
    lead_pid = recs[0]["pid"]
    out: Dict[str, Dict[str, Dict[str, float]]] = {}
    for r in recs:
        if r["pid"] != lead_pid:
            continue
        rows: Dict[str, float] = dict(sum_by_name(r["procs"], "used"))
        mine = next((p for p in r["procs"] if p["pid"] == r.get("self_pid") and p.get("used") is not None), None)
        torch_ = r.get("torch") or {}
        if mine is not None and torch_:
            rows["trainer process: NVML"] = mine["used"]
            rows["trainer process: torch reserved"] = torch_.get("reserved", 0)
            rows["trainer process: torch allocated"] = torch_.get("allocated", 0)
            rows["trainer process: outside torch's allocator"] = mine["used"] - torch_.get("reserved", 0)
        if r.get("used") is not None:
            rows["GPU in use"] = r["used"]
        out.setdefault(r["at"], {})[str(r["step"])] = rows
    return out


def summarize_memory(memory: Dict[str, Dict[str, Dict[str, float]]], later_steps: Iterable[int]) -> Dict[str, dict]:
    """:func:`memory_around_update`'s records reduced for the report: ``{"first": {at: rows}, "later":
    {at: {row: median bytes over later_steps}}}``, ``first`` being the first update recorded (verl's sync
    before training)."""
    later = {str(k) for k in later_steps}
    out: Dict[str, dict] = {"first": {}, "later": {}}
    for at, by_step in memory.items():
        steps = sorted(by_step, key=int)
        out["first"][at] = by_step[steps[0]]
        rows = list(dict.fromkeys(r for k in steps if k in later for r in by_step[k]))
        out["later"][at] = {r: med([by_step[k][r] for k in steps if k in later and r in by_step[k]]) for r in rows}
    return out


def _memory_table(runs: dict, cols: List[str]) -> List[str]:
    """Markdown lines: device memory by process at the weight update's start and end (MiB), the first
    update (verl's sync before training) and the median over the steps after the first; none without
    records."""
    mem = {s: runs[s].get("update_memory") or {} for s in cols}
    if not any(mem.values()):
        return []
    def pick(side: str, at: str, which: str, row: str) -> Optional[float]:
        return ((mem[side].get(which) or {}).get(at) or {}).get(row)

    rows = list(dict.fromkeys(r for s in cols for which in mem[s].values() for at in which.values() for r in at))
    head = ["| moment | process | " + " | ".join(SIDE_LABELS[s] for s in cols)
            + (" | difference |" if len(cols) == 2 else " |"),
            "| --- | --- | " + " | ".join("---:" for _ in cols) + (" | ---: |" if len(cols) == 2 else " |")]
    lines = []
    for at, which, label in (("start", "first", "first update, start"), ("end", "first", "first update, end"),
                             ("start", "later", "later updates, start"), ("end", "later", "later updates, end")):
        for row in rows:
            vals = [pick(s, at, which, row) for s in cols]
            if all(v is None for v in vals):
                continue
            diff = ""
            if len(cols) == 2:
                diff = " | " + (_mib(vals[1] - vals[0]) if None not in vals else "n/a")
            lines.append(f"| {label} | {row} | " + " | ".join(_mib(v) for v in vals) + diff + " |")
    if not lines:
        return []
    return (["Device memory around the weight update, by process (MiB; the lead trainer rank's GPU, NVML and "
             "that process's torch allocator; the first update is verl's sync before training, the later ones "
             "the median over the steps after the first):", ""] + head + lines + [""])


def peak_by_process(nvml: dict) -> Optional[dict]:
    """Who held the device memory at a run's NVML peak, from ``nvml.json`` (:class:`.verl_compare.NvmlSampler`).

    Returns:
        None where no process was recorded (older runs, or a driver that does not list them); else, for
        the GPU with the largest peak: ``gpu``, ``peak_bytes``, ``by_name`` (process name -> bytes, summed
        over the processes of one name) and ``unattributed_bytes`` (the peak less every listed process:
        the driver's own memory and processes NVML did not list).
    """
    peaks = {k: v for k, v in (nvml.get("peak_used_bytes") or {}).items() if v is not None}
    procs = nvml.get("peak_processes") or {}
    if not peaks:
        return None
    gpu = max(peaks, key=peaks.get)
    by_name = sum_by_name(procs.get(gpu) or [], "used_bytes")
    if not by_name:
        return None
    return {"gpu": gpu, "peak_bytes": peaks[gpu], "by_name": by_name,
            "unattributed_bytes": peaks[gpu] - sum(by_name.values())}


def awake_peaks(nvml: dict) -> Optional[dict]:
    """The engine's largest memory in each period it was awake, from ``nvml.json``'s ``process_series``
    (one sample a second, :class:`.verl_compare.NvmlSampler`).

    The engine is the process name holding the most memory on the GPU with the run's largest peak (SGLang's
    scheduler); it is awake while it holds more than half its largest figure, so each awake period is one
    generation (verl's validation, a step's rollout) with the weight update before it; a sleep shorter
    than the sampling interval falls between two samples and joins two periods. How much these
    peaks spread within one run is what the generation itself moves the NVML peak by.

    Returns:
        None without a process series; else ``gpu``, ``name`` and ``peaks_bytes`` (one per awake period,
        in order).
    """
    series = nvml.get("process_series") or []
    peaks = {k: v for k, v in (nvml.get("peak_used_bytes") or {}).items() if v is not None}
    if not series or not peaks:
        return None
    gpu = max(peaks, key=peaks.get)
    i = int(gpu)
    points = [g[i] for _t, g in series if i < len(g)]
    top: Dict[str, int] = {}
    for by_name in points:
        for n, b in by_name.items():
            top[n] = max(top.get(n, 0), b)
    if not top:
        return None
    name = max(top, key=top.get)
    out: List[int] = []
    awake = False
    for by_name in points:
        used = by_name.get(name, 0)
        if used > top[name] / 2:
            if not awake:
                out.append(used)
            out[-1] = max(out[-1], used)
            awake = True
        else:
            awake = False
    return {"gpu": gpu, "name": name, "peaks_bytes": out}


def _awake_lines(runs: dict, cols: List[str]) -> List[str]:
    """Markdown lines: the engine's largest memory in each awake period, per side; none without series."""
    got = {s: runs[s].get("engine_awake_peaks") for s in cols}
    if not any(got.values()):
        return []
    lines = []
    for s in cols:
        a = got[s]
        if not a or not a["peaks_bytes"]:
            continue
        mib = [b / 2**20 for b in a["peaks_bytes"]]
        lines.append(f"- {SIDE_LABELS[s]}: {a['name']} on GPU {a['gpu']}: "
                     + ", ".join(f"{v:.0f}" for v in mib) + f" (spread {max(mib) - min(mib):.0f})")
    return (["The engine's largest memory in each period it was awake (MiB; NVML, one sample a second; each "
             "period is one generation and the weight update before it; a sleep between two samples joins two periods):",
             ""] + lines + [""]) if lines else []


def _jit_lines(runs: dict, cols: List[str]) -> List[str]:
    """Markdown lines: each side's kernel caches at its start (``run.json``'s ``jit_caches``), and a warning
    when one side started with empty ones; none for runs recorded before."""
    got = {s: runs[s].get("jit_caches") for s in cols}
    if not any(got.values()):
        return []
    lines = ["Kernel caches at each side's start (files; a side that starts with none compiles its kernels during "
             "its first requests, verl's validation before training included):", ""]
    cold = []
    for s in cols:
        c = got[s] or {}
        if c and not any(v.get("files") for v in c.values()):
            cold.append(s)
        lines.append(f"- {SIDE_LABELS[s]}: " + (", ".join(f"{n} {v.get('files', 0)}" for n, v in c.items()) or "n/a"))
    if cold and len(cold) < len([s for s in cols if got[s]]):
        lines.append(f"- **the sides did not start alike**: {', '.join(SIDE_LABELS[s] for s in cold)} started with "
                     "empty caches, so its first generation paid for compiling kernels the other side found compiled")
    return lines + [""]


def _server_args_lines(entry: dict) -> List[str]:
    """Markdown lines: the SGLang settings the sides' engines differ in (:func:`server_arg_differences`),
    with a warning for each one this package did not mean; none where a side recorded none."""
    diffs = entry.get("server_args_differ")
    if diffs is None:
        return []
    head = "SGLang's settings (each engine's `ServerArgs`; ports, addresses and seeds left out):"
    if not diffs:
        return [head + " the same on both sides.", ""]
    lines = [head, "", "| setting | verl built-in | sgl-rollout | why |", "| --- | --- | --- | --- |"]
    for d in diffs:
        why = d["why"] or "**not this package's choice: the sides ran unlike engines**"
        lines.append(f"| `{d['arg']}` | `{_short(d['builtin'])}` | `{_short(d['ours'])}` | {why} |")
    return lines + [""]


def _short(value: Any, width: int = 60) -> str:
    text = json.dumps(value, default=str)
    return (text if len(text) <= width else text[: width - 3] + "...").replace("|", "\\|")


#: Roles under this many CPU seconds (median) on every side share one row of :func:`_cpu_lines`.
CPU_ROW_MIN_S = 0.01


def _cpu_lines(runs: dict, cols: List[str]) -> List[str]:
    """Markdown lines: CPU seconds by process role while the requests were served (:func:`cpu_while_serving`),
    the busiest roles first, those under :data:`CPU_ROW_MIN_S` on every side summed in one row, then every
    process and the window; none without records."""
    got = {s: runs[s].get("cpu_serving") or {} for s in cols}
    if not any(got.values()):
        return []
    roles = sorted({n for g in got.values() for n in g} - {CPU_ALL, CPU_WINDOW},
                   key=lambda n: -max((g.get(n) or {}).get("median") or 0.0 for g in got.values()))
    out = ["CPU seconds by process while the step's requests were served (first request -> last answer; "
           "user + system, every process below the side's root, summed by role; psutil every 0.5 s, linear "
           "between samples; median over steps after the first):", "",
           "| process | " + " | ".join(SIDE_LABELS[s] for s in cols) + " |",
           "| --- | " + " | ".join("---:" for _ in cols) + " |"]
    def median(s: str, n: str) -> float:
        return (got[s].get(n) or {}).get("median") or 0.0

    def row(name: str, cells: List[str]) -> str:
        return f"| {name} | " + " | ".join(cells) + " |"

    def cells_of(n: str) -> List[str]:
        return [_f((got[s].get(n) or {}).get("median"), ".2f") if n in got[s] else "" for s in cols]

    small = [n for n in roles if all(median(s, n) < CPU_ROW_MIN_S for s in cols)]
    out += [row(n, cells_of(n)) for n in roles if n not in small]
    if small:  # Ray's idle workers, per-actor process titles, helpers: one line, before the totals
        out.append(row(f"({len(small)} other roles, each under {CPU_ROW_MIN_S} s)",
                       [_f(sum(median(s, n) for n in small), ".2f") for s in cols]))
    return out + [row(n, cells_of(n)) for n in (CPU_ALL, CPU_WINDOW)] + [""]


def _sm_lines(runs: dict, cols: List[str]) -> List[str]:
    """Markdown lines: each process's SM use per side (:func:`sm_by_process`); none without records."""
    got = {s: runs[s].get("sm_by_process") or {} for s in cols}
    names = sorted({n for g in got.values() for n in g})
    if not names:
        return []
    out = ["SM use by process (NVML, one sample a second: seconds a process kept any SM busy, and its mean SM "
           "utilization over those seconds):", "",
           "| process | " + " | ".join(SIDE_LABELS[s] for s in cols) + " |",
           "| --- | " + " | ".join("---:" for _ in cols) + " |"]
    for n in names:
        cells = [f"{got[s][n][0]:.0f} s, {got[s][n][1]:.0f}%" if n in got[s] else "" for s in cols]
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    return out + [""]


def _peak_process_table(runs: dict, cols: List[str]) -> List[str]:
    """Markdown lines: device memory at each side's NVML peak by process (MiB); none without records."""
    peaks = {s: runs[s].get("nvml_peak_processes") for s in cols}
    if not any(peaks.values()):
        return []
    names = sorted({n for p in peaks.values() if p for n in p["by_name"]},
                   key=lambda n: -max((p or {}).get("by_name", {}).get(n, 0) for p in peaks.values()))
    out = ["Device memory at the NVML peak, by process (MiB; on each run's GPU with the largest peak: "
           + ", ".join(f"{SIDE_LABELS[s]} GPU {peaks[s]['gpu']}" for s in cols if peaks[s]) + "):", "",
           "| process | " + " | ".join(SIDE_LABELS[s] for s in cols) + " |",
           "| --- | " + " | ".join("---:" for _ in cols) + " |"]
    for n in names:
        out.append(f"| {n} | " + " | ".join(_mib((peaks[s] or {}).get("by_name", {}).get(n)) for s in cols) + " |")
    out.append("| not listed by NVML (the driver's own, unlisted processes) | "
               + " | ".join(_mib((peaks[s] or {}).get("unattributed_bytes")) for s in cols) + " |")
    out.append("| the peak | " + " | ".join(_mib((peaks[s] or {}).get("peak_bytes")) for s in cols) + " |")
    return out + [""]


def _phase_table(runs: dict, cols: List[str], key: str, order_key: str, title: str) -> List[str]:
    """Markdown lines of one breakdown: a row per phase of any side's ``order_key``, the median of
    ``runs[side][key][phase]`` per side (ms; a ``/ requests``, ``/ polls``, ``stalls`` or ``pauses`` row as a
    count); none without phases. A phase no side has a median for (seen only in the first step) gets no row."""
    labels = list(dict.fromkeys(n for s in cols for n in runs[s].get(order_key, [])))
    if not labels:
        return []
    out = [title, "", "| phase | " + " | ".join(SIDE_LABELS[s] for s in cols) + " |",
           "| --- | " + " | ".join("---:" for _ in cols) + " |"]
    for label in labels:
        count = label.endswith((" / requests", " / polls", " stalls", " pauses"))
        values = [runs[s].get(key, {}).get(label, {}).get("median") for s in cols]
        if all(v is None for v in values):
            continue
        cells = [_f(None if v is None else (v if count else v * 1e3), ".0f" if count else ".1f") for v in values]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out + [""]


# ------------------------------------------------------------------------------------ plot
STEP_PHASES = ("timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor",
               "timing_s/update_weights")


def plot(comparison: dict, path: Path) -> Optional[Path]:
    """Per-step time by phase for both sides of every pair: one row of two panels per pair (left:
    verl's step phases as stacked bars, the rest of ``timing_s/step`` as "other"; right: the weight
    update's phases). Returns the PNG path, or None when no run logged a step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [p for p in comparison.get("pairs", []) if any(r.get("per_step") for r in p["runs"].values())]
    if not pairs:
        return None
    fig, axes = plt.subplots(len(pairs), 2, figsize=(15, 4.5 * len(pairs)), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for row, entry in enumerate(pairs):
        ax, ax2 = axes[row]
        width = 0.38
        for i, side in enumerate(s for s in SIDES if s in entry["runs"]):
            run = entry["runs"][side]
            steps = sorted(run.get("per_step", {}), key=int)
            xs = [int(s) + (i - 0.5) * width for s in steps]
            bottom = [0.0] * len(steps)
            for j, key in enumerate(STEP_PHASES + ("other",)):
                if key == "other":
                    vals = [max((run["per_step"][s].get("timing_s/step") or 0.0) - b, 0.0) for s, b in zip(steps, bottom)]
                else:
                    vals = [run["per_step"][s].get(key) or 0.0 for s in steps]
                ax.bar(xs, vals, width, bottom=bottom, color=colors[j % 10], hatch="" if side == "builtin" else "//",
                       edgecolor="black", linewidth=0.3,
                       label=(key.split("/")[-1] if i == 0 else None))
                bottom = [b + v for b, v in zip(bottom, vals)]
            # weight-update phases per step (top-level only)
            per = run.get("update_phases_per_step", {})
            ph_steps = sorted(per, key=int)
            xs2 = [int(s) + (i - 0.5) * width for s in ph_steps]
            bottom2 = [0.0] * len(ph_steps)
            names = [n for n in run.get("update_phase_order", []) if " / " not in n and not n.startswith("gen:")]
            for j, name in enumerate(names):
                vals = [next((sec for n, sec, _k in per[s] if n == name), 0.0) for s in ph_steps]
                ax2.bar(xs2, vals, width, bottom=bottom2, color=colors[j % 10], hatch="" if side == "builtin" else "//",
                        edgecolor="black", linewidth=0.3, label=name if i == 0 or side == "ours" else None)
                bottom2 = [b + v for b, v in zip(bottom2, vals)]
        ax.set_title(f"pair {entry['pair']}: verl step phases\n(plain: built-in, hatched: sgl-rollout)", fontsize=10)
        ax.set_xlabel("training step")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7, ncol=3)
        ax2.set_title(f"pair {entry['pair']}: timing_s/update_weights by phase\n(plain: built-in, hatched: sgl-rollout)",
                      fontsize=10)
        ax2.set_xlabel("training step")
        ax2.set_ylabel("seconds")
        handles, labels = ax2.get_legend_handles_labels()
        seen = {}
        for h, lab in zip(handles, labels):
            seen.setdefault(lab, h)
        ax2.legend(list(seen.values()), list(seen.keys()), fontsize=6, ncol=1, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = Path(path)
    save_palette_png(fig, path, dpi=110)
    plt.close(fig)
    return path


def save_palette_png(fig, path: Path, dpi: int) -> None:
    """Save a Matplotlib figure as a 256-colour PNG (Pillow's median-cut palette): a bar chart looks the same at
    about half the bytes of Matplotlib's RGBA file, and the reports committed under ``examples/`` share 5 MB."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    with Image.open(buf) as img:
        img.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, format="PNG", optimize=True)


#: The raw files of a committed run folder, in one archive at its top: ``pairN/<side>/`` (``metrics.jsonl``,
#: ``run.json``, ``nvml.json``, where kept ``cpu.json`` and ``spans/``) and ``bench.log``, as the runner wrote them.
RAW_ARCHIVE = "raw.tar.xz"


def unpack_raw(archive: Path, dest: Path) -> Path:
    """Write the regular files of ``archive`` (:data:`RAW_ARCHIVE`) under ``dest``, which it returns; a
    member whose path is absolute or climbs out with ``..`` raises ValueError, other kinds are skipped."""
    with tarfile.open(archive, "r:xz") as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            rel = Path(member.name)
            if rel.is_absolute() or ".." in rel.parts:
                raise ValueError(f"{archive}: {member.name!r} is not inside the run folder")
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(member).read())
    return dest


def _raw_dir(run_dir: Path, out_dir: Path, unpacked: Path) -> Path:
    """Where ``run_dir``'s raw files are: the folder itself when it has ``run.json`` or ``metrics.jsonl``,
    else its place in the unpacked :data:`RAW_ARCHIVE` when that has it."""
    if (run_dir / "run.json").exists() or (run_dir / "metrics.jsonl").exists():
        return run_dir
    try:
        packed = unpacked / Path(run_dir).relative_to(out_dir)
    except ValueError:
        return run_dir
    return packed if packed.is_dir() else run_dir


def rewrite_markdown(out_dir: Path) -> str:
    """Write ``out_dir``'s ``comparison.md`` again from its ``comparison.json`` alone and return it
    (``bench verl --report-only --from-json``): for a change to the report's text, such as a line added
    after the run (issue 47's :func:`_owned_line`), in a folder whose raw archive no longer holds the
    spans that :func:`write_report` would need to keep every section. The figures, ``comparison.json``
    and ``comparison.png`` stay as they are.

    Raises:
        FileNotFoundError: no ``comparison.json`` in ``out_dir``.
    """
    src = Path(out_dir) / "comparison.json"
    if not src.is_file():
        raise FileNotFoundError(f"no comparison.json in {out_dir} (--from-json re-writes a written report)")
    text = markdown(json.loads(src.read_text()))
    (Path(out_dir) / "comparison.md").write_text(text)
    return text


def write_report(out_dir: Path, run_dirs: Dict[int, Dict[str, Path]], config: Optional[dict] = None,
                 n_val: int = 128, orders: Optional[Dict[int, Iterable[str]]] = None) -> dict:
    """Write ``comparison.json``, ``comparison.md`` and ``comparison.png`` into ``out_dir``; returns the
    comparison (also when runs failed or are missing: they are reported as such). A run folder without
    its raw files is read from ``out_dir``'s :data:`RAW_ARCHIVE` where there is one; ``dir`` stays the
    run folder's path."""
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="verl-report-") as tmp:
        read_dirs = run_dirs
        if (out_dir / RAW_ARCHIVE).is_file():
            unpacked = unpack_raw(out_dir / RAW_ARCHIVE, Path(tmp))
            read_dirs = {pair: {side: _raw_dir(Path(d), out_dir, unpacked) for side, d in dirs.items()}
                         for pair, dirs in run_dirs.items()}
        comp = compare(read_dirs, config, n_val)
    for entry in comp["pairs"]:
        for side, run in entry["runs"].items():
            run["dir"] = str(run_dirs[entry["pair"]][side])
    for entry in comp["pairs"]:
        if orders and entry["pair"] in orders:
            entry["order"] = list(orders[entry["pair"]])
    # compact: a report's figures run to tens of thousands of numbers, and examples/ stays under 5 MB
    (out_dir / "comparison.json").write_text(json.dumps(comp, separators=(",", ":"), default=str) + "\n")
    (out_dir / "comparison.md").write_text(markdown(comp))
    png = plot(comp, out_dir / "comparison.png")
    comp["plot"] = str(png) if png else None
    return comp
