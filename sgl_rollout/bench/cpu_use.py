"""CPU time of one ``bench verl`` side's processes, by role, and how much of it fell in a window of time.

Issue 47 goal 1: the k-th request's way in (verl's client to SGLang) is later on this package's side in most
committed reports, but this package's own part of it (its server actor's ``generate`` to SGLang's
``generate_request``) is a fraction of a millisecond, and verl's own load-balancer round trip, which runs
no code of ours, is later on our side too. That points at how busy the host's processes are, which
neither the probe's spans nor NVML show. :class:`CpuSampler` records it: the user and system CPU seconds
of every process below a side's root (verl's driver; Ray's GCS, raylet and workers, SGLang's schedulers),
summed by role (:func:`~.processes.process_name`: ``ray::WorkerDict``, ``ray::AgentLoopWorker``,
``ray::VerlRolloutServer`` or ``ray::SGLangHttpServer``, ``sglang::scheduler``, ``raylet``, ...).
:func:`cpu_in_windows` then gives each role's CPU seconds inside each step's serving window (first request to
last answer, :func:`~.verl_report.serving_windows`), for the report's table.

Processes of a Ray cluster the side did not start itself (``RAY_ADDRESS``, or the raylets that
``--simulate-nodes`` starts from the runner) are not below its root and are not counted.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Dict, List, Optional, Tuple

from ..engine.lifecycle import processes_below
from .processes import process_name

#: Name of the side's file this module's figures are kept in (next to ``nvml.json``).
CPU_FILE = "cpu.json"


class CpuSampler:
    """Cumulative CPU seconds of a process tree, by process role, sampled in a thread (psutil).

    Each sample reads the process table once (:func:`~sgl_rollout.engine.lifecycle.processes_below`, as the
    engine's watchdog does), takes every process below ``root_pid`` (and the root), and adds to its role the CPU time (``cpu_times().user + .system``,
    seconds; children's times not included) it used since the last sample; a process first seen adds
    all of its time so far (it started during the run). A process that ends between two samples loses
    what it used since the last one (at most ``interval_s`` of it).

    Args:
        root_pid: the side's process (the runner's child).
        interval_s: seconds between samples.

    ``stop()`` returns ``cpu.json``'s content: ``{"interval_s", "names": [role, ...], "rows": [[t, cpu s of
    each role], ...], "error"}``, ``t`` wall-clock seconds (``time.time()``, comparable with the probe's
    spans), each value the role's CPU seconds since :meth:`start` (non-decreasing; 0 before the role's
    first process appeared).
    """

    def __init__(self, root_pid: int, interval_s: float = 0.5):
        self.root_pid = int(root_pid)
        self.interval_s = interval_s
        self._seen: Dict[int, float] = {}
        self._names: Dict[int, str] = {}
        self._total: Dict[str, float] = {}
        self._rows: List[Tuple[float, Dict[str, float]]] = []
        self.error: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _tree(self) -> list:
        """The root (while it runs) and every process below it, as psutil processes."""
        import psutil

        try:
            root = [psutil.Process(self.root_pid)]
        except psutil.NoSuchProcess:
            root = []
        return root + list(processes_below({self.root_pid}).values())

    #: The role of CPU time whose process ended before its name could be read.
    ENDED = "(ended before it was named)"

    def _name(self, pid: int) -> str:
        """The process's role now (a Ray worker's changes when it takes an actor), else the last one seen."""
        name = process_name(pid)
        if name.startswith("pid "):  # gone between the table's pass and this read
            return self._names.get(pid, self.ENDED)
        self._names[pid] = name
        return name

    def sample(self) -> None:
        """Take one sample now (the thread calls this every ``interval_s``)."""
        for p in self._tree():
            try:
                t = p.cpu_times()
            except Exception:  # noqa: BLE001 - the process ended during the pass (psutil.NoSuchProcess, ...)
                continue
            used = float(t.user) + float(t.system)
            delta = used - self._seen.get(p.pid, 0.0)
            self._seen[p.pid] = used
            if delta > 0:
                name = self._name(p.pid)
                self._total[name] = self._total.get(name, 0.0) + delta
        self._rows.append((time.time(), dict(self._total)))

    def start(self) -> "CpuSampler":
        """Take the first sample and start the thread (no thread, with ``error`` set, where psutil cannot
        read the process table)."""
        try:
            self.sample()
        except Exception as exc:  # noqa: BLE001 - the run goes on without the figure
            self.error = f"CPU sampling unavailable: {type(exc).__name__}: {exc}"
            return self
        self._thread = threading.Thread(target=self._run, name="sgl-rollout-cpu", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as exc:  # noqa: BLE001 - keep what was sampled
                self.error = f"CPU sampling failed: {type(exc).__name__}: {exc}"
                return

    def stop(self) -> dict:
        """Take a last sample, stop the thread; returns ``cpu.json``'s content (see the class)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            try:
                self.sample()
            except Exception:  # noqa: BLE001
                pass
        names = sorted({n for _t, totals in self._rows for n in totals})
        rows = [[round(t, 3)] + [round(totals.get(n, 0.0), 3) for n in names] for t, totals in self._rows]
        return {"interval_s": self.interval_s, "names": names, "rows": rows, "error": self.error}


def _at(times: List[float], values: List[float], t: float) -> float:
    """A cumulative series at ``t``, linear between samples (``times`` ascending, ``t`` inside them)."""
    i = bisect.bisect_right(times, t)
    if i >= len(times):
        return values[-1]
    if i == 0:
        return values[0]
    t0, t1 = times[i - 1], times[i]
    v0, v1 = values[i - 1], values[i]
    return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def cpu_in_windows(cpu: dict, windows: Dict[int, Tuple[float, float]]) -> Dict[int, Dict[str, float]]:
    """Each role's CPU seconds inside each window, from :class:`CpuSampler`'s record.

    Args:
        cpu: ``cpu.json``'s content.
        windows: key (a step) -> ``(start, end)``, wall-clock seconds.

    Returns:
        key -> ``{role: CPU seconds}`` (the cumulative series read at both ends, linear between samples),
        for the windows that lie inside the record (a window the sampler did not cover both ends of is left
        out); ``{}`` for an empty record.
    """
    rows = cpu.get("rows") or []
    names = cpu.get("names") or []
    if len(rows) < 2:
        return {}
    times = [float(r[0]) for r in rows]
    series = {name: [float(r[j + 1]) for r in rows] for j, name in enumerate(names)}
    out: Dict[int, Dict[str, float]] = {}
    for key, (a, b) in windows.items():
        if times[0] <= a <= b <= times[-1]:
            out[key] = {name: max(0.0, _at(times, v, b) - _at(times, v, a)) for name, v in series.items()}
    return out
