"""The largest model whose train-to-rollout switch fits on one GPU: layered sync vs all at once.

Each trial is one run of ``bench_layered.py`` in a fresh process (an out-of-memory error cannot leave
a half-freed allocator behind for the next trial): a Qwen2-7B-shaped model with ``N`` decoder layers
(random bf16, 0.47 GB per layer plus 2.18 GB of embeddings), the trainer's parameters offloaded to
CPU memory (pinned with ``--pin``: the sync is faster, what fits on the GPU is the same, and pinning
70 GB costs a trial tens of seconds), a real SGLang engine at ``gpu_memory_utilization=--mem-fraction`` (0.9 by default),
then one sync with sleep level 2 and the staged wake (weights resumed, the sync, the KV cache resumed)
and a generate. A trial fits when that run exits 0 and reports its generate; anything else (an
out-of-memory error in the engine's start, the sync or the KV cache's resume; a timeout) does not, and
the last lines of its output are kept as the reason.

Per method, a binary search over ``N`` in ``[--lo, --hi]`` (fitting is taken to be monotone in ``N``):
the result is the largest ``N`` that fits and its weight bytes.

    python examples/layered/fit_search.py --lo 28 --hi 150 --out examples/layered/fit_h100.json
    python examples/layered/fit_search.py --methods layered --lo 100 --hi 150 --trial-timeout 240
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Callable, Dict, List, Optional, Tuple

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_layered.py")


def largest_fitting(fits: Callable[[int], bool], lo: int, hi: int) -> Tuple[Optional[int], List[int]]:
    """Binary search for the largest ``n`` in ``[lo, hi]`` with ``fits(n)``, taking ``fits`` as monotone
    (true up to some ``n``, false after). Returns ``(n, tried)``; ``n`` is None when ``fits(lo)`` is false.

    Raises:
        ValueError: ``lo > hi``.
    """
    if lo > hi:
        raise ValueError(f"empty range [{lo}, {hi}]")
    tried = [lo]
    if not fits(lo):
        return None, tried
    good, bad = lo, hi + 1
    while bad - good > 1:
        mid = (good + bad) // 2
        tried.append(mid)
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good, tried


def trial_command(method: str, layers: int, mem_fraction: float, out: str, bucket_mb: int,
                  pin: bool = False) -> List[str]:
    """The ``bench_layered.py`` command line of one trial (offload layout, real engine, one sync)."""
    return [sys.executable, BENCH, "--layout", "offload", *(["--pin"] if pin else []), "--engine", "--methods", method,
            "--layers", str(layers), "--mem-fraction", str(mem_fraction), "--bucket-mb", str(bucket_mb),
            "--repeats", "1", "--warmup", "0", "--out", out]


#: The trial's process group while one runs (a SIGTERM to the search ends it too).
_RUNNING: List[int] = []


def _kill_group(pgid: int) -> None:
    import signal

    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_in_group(cmd: List[str], capture_output: bool = True, text: bool = True,
                 timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """``subprocess.run`` in a new session whose whole process group is killed once the command exits:
    a trial's SGLang scheduler is a grandchild, and one left alive by a timeout or a crash would hold
    GPU memory through the next trials. Output goes through files, not pipes, so a grandchild that
    keeps them open cannot hold the wait.

    Raises:
        subprocess.TimeoutExpired: as ``subprocess.run`` (with the output so far), once the group is killed.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out if capture_output else None, stderr=err if capture_output else None,
                                text=text, start_new_session=True)
        _RUNNING.append(proc.pid)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc.pid)
            proc.wait()
            _RUNNING.remove(proc.pid)
        out.seek(0)
        err.seek(0)
        stdout, stderr = (out.read(), err.read()) if capture_output else (None, None)
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _end_on_sigterm() -> None:
    """On SIGTERM (a ``timeout`` around the search), kill the running trial's group, then exit 143."""
    import signal

    def handler(signum, _frame):
        for pgid in list(_RUNNING):
            _kill_group(pgid)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def failure_reason(output: str, n_tail: int = 3) -> str:
    """The error lines of a trial's output (an out-of-memory error, SGLang's "Not enough memory", a
    traceback's last line), then its last ``n_tail`` lines."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip() and not ln.startswith("\r")]
    errors = [ln for ln in lines if re.search(r"(Error|Exception|out of memory|Not enough memory)\b", ln)
              and not ln.startswith(("File ", "Traceback"))]
    keep = list(dict.fromkeys(errors[:3] + errors[-2:]))
    return " | ".join(keep + [ln for ln in lines[-n_tail:] if ln not in keep])


def gpu_used_mib() -> Optional[int]:
    """GPU 0's used memory (MiB) as ``nvidia-smi`` reports it (None without it): what a trial starts with."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def run_trial(method: str, layers: int, args, runner=run_in_group) -> Dict:
    """Run one trial; returns ``{"layers", "fits", "weight_bytes", "sync_s", "peak_bytes", "reason"}``."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "trial.json")
        cmd = trial_command(method, layers, args.mem_fraction, out, args.bucket_mb, getattr(args, "pin", False))
        rec: Dict = {"layers": layers, "fits": False, "gpu_used_mib_before": gpu_used_mib()}
        try:
            proc = runner(cmd, capture_output=True, text=True, timeout=args.trial_timeout)
        except subprocess.TimeoutExpired as exc:
            seen = _text(exc.output) + _text(exc.stderr)
            rec["reason"] = f"timed out after {args.trial_timeout} s" + (f": {failure_reason(seen)}" if seen else "")
            return rec
        info = None
        if proc.returncode == 0 and os.path.exists(out):
            with open(out) as f:
                info = json.load(f)["layouts"]["offload"]
        if info is not None and info.get("generate_after_sync") == "ok":
            m = info["methods"][method]
            rec.update(fits=True, weight_bytes=info["weight_bytes"], sync_s=m.get("sync_s"),
                       switch_s=m.get("switch_s"), peak_bytes=m.get("peak_bytes"),
                       device_used_max_bytes=m.get("device_used_max_bytes"))
        else:
            rec["reason"] = f"exit {proc.returncode}: " + failure_reason((proc.stdout or "") + (proc.stderr or ""))
        return rec


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--methods", nargs="+", choices=("all_at_once", "layered", "direct"),
                   default=["all_at_once", "layered"])
    p.add_argument("--lo", type=int, default=28, help="fewest decoder layers tried (the 7B's own 28)")
    p.add_argument("--hi", type=int, default=150, help="most decoder layers tried")
    p.add_argument("--mem-fraction", type=float, default=0.9, help="the engine's gpu_memory_utilization")
    p.add_argument("--bucket-mb", type=int, default=2048)
    p.add_argument("--trial-timeout", type=float, default=300.0, help="seconds per trial before it counts as not fitting")
    p.add_argument("--pin", action="store_true", help="pin the trainer's CPU parameters")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.lo < 1 or args.lo > args.hi:
        p.error("need 1 <= --lo <= --hi")
    _end_on_sigterm()
    results: Dict = {"mem_fraction": args.mem_fraction, "bucket_mb": args.bucket_mb, "pin": args.pin, "methods": {}}

    def save() -> None:  # after every trial: a search cut short keeps what it found
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    for method in args.methods:
        trials: List[Dict] = []
        results["methods"][method] = {"largest_layers": None, "trials": trials, "largest_weight_bytes": None}

        def fits(n: int, method=method, trials=trials) -> bool:
            rec = run_trial(method, n, args)
            trials.append(rec)
            save()
            used = rec.get("gpu_used_mib_before")
            print(f"{method:<12} {n:>4} layers: {'fits' if rec['fits'] else 'does not fit'}"
                  + (f" ({rec['weight_bytes'] / 1e9:.1f} GB of weights, sync {rec['sync_s']:.2f} s)" if rec["fits"]
                     else f" ({rec.get('reason', '')[:600]})")
                  + (f" [GPU used before: {used} MiB]" if used else ""), flush=True)
            return rec["fits"]

        best, _ = largest_fitting(fits, args.lo, args.hi)
        best_rec = next((t for t in trials if t["layers"] == best), None)
        results["methods"][method].update(largest_layers=best,
                                          largest_weight_bytes=best_rec["weight_bytes"] if best_rec else None)
        save()
    for method, r in results["methods"].items():
        gb = r["largest_weight_bytes"]
        print(f"{method:<12} largest fitting: {r['largest_layers']} layers"
              + (f", {gb / 1e9:.1f} GB of bf16 weights ({gb / 2e9:.1f}B parameters)" if gb else ""))
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
