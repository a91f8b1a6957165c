"""The largest model whose train-to-rollout switch fits on one GPU: layered sync vs all at once.

Each trial is one run of ``bench_layered.py`` in a fresh process (an out-of-memory error cannot leave
a half-freed allocator behind for the next trial): a Qwen2-7B-shaped model with ``N`` decoder layers
(random bf16, 0.47 GB per layer plus 2.18 GB of embeddings), the trainer's parameters offloaded to
pinned CPU memory, a real SGLang engine at ``gpu_memory_utilization=--mem-fraction`` (0.9 by default),
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


def trial_command(method: str, layers: int, mem_fraction: float, out: str, bucket_mb: int) -> List[str]:
    """The ``bench_layered.py`` command line of one trial (offload layout, pinned, real engine, one sync)."""
    return [sys.executable, BENCH, "--layout", "offload", "--pin", "--engine", "--methods", method,
            "--layers", str(layers), "--mem-fraction", str(mem_fraction), "--bucket-mb", str(bucket_mb),
            "--repeats", "1", "--warmup", "0", "--out", out]


def run_trial(method: str, layers: int, args, runner=subprocess.run) -> Dict:
    """Run one trial; returns ``{"layers", "fits", "weight_bytes", "sync_s", "peak_bytes", "reason"}``."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "trial.json")
        cmd = trial_command(method, layers, args.mem_fraction, out, args.bucket_mb)
        rec: Dict = {"layers": layers, "fits": False}
        try:
            proc = runner(cmd, capture_output=True, text=True, timeout=args.trial_timeout)
        except subprocess.TimeoutExpired:
            rec["reason"] = f"timed out after {args.trial_timeout} s"
            return rec
        info = None
        if proc.returncode == 0 and os.path.exists(out):
            with open(out) as f:
                info = json.load(f)["layouts"]["offload"]
        if info is not None and info.get("generate_after_sync") == "ok":
            m = info["methods"][method]
            rec.update(fits=True, weight_bytes=info["weight_bytes"], sync_s=m.get("sync_s"),
                       switch_s=m.get("switch_s"), peak_bytes=m.get("peak_bytes"))
        else:
            tail = (proc.stdout or "")[-600:] + (proc.stderr or "")[-1400:]
            rec["reason"] = f"exit {proc.returncode}: " + " | ".join(ln for ln in tail.splitlines()[-6:] if ln.strip())
        return rec


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
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.lo < 1 or args.lo > args.hi:
        p.error("need 1 <= --lo <= --hi")
    results: Dict = {"mem_fraction": args.mem_fraction, "bucket_mb": args.bucket_mb, "methods": {}}
    for method in args.methods:
        trials: List[Dict] = []

        def fits(n: int, method=method, trials=trials) -> bool:
            rec = run_trial(method, n, args)
            trials.append(rec)
            print(f"{method:<12} {n:>4} layers: {'fits' if rec['fits'] else 'does not fit'}"
                  + (f" ({rec['weight_bytes'] / 1e9:.1f} GB of weights, sync {rec['sync_s']:.2f} s)" if rec["fits"]
                     else f" ({rec.get('reason', '')[:300]})"), flush=True)
            return rec["fits"]

        best, _ = largest_fitting(fits, args.lo, args.hi)
        best_rec = next((t for t in trials if t["layers"] == best), None)
        results["methods"][method] = {"largest_layers": best, "trials": trials,
                                      "largest_weight_bytes": best_rec["weight_bytes"] if best_rec else None}
    for method, r in results["methods"].items():
        gb = r["largest_weight_bytes"]
        print(f"{method:<12} largest fitting: {r['largest_layers']} layers"
              + (f", {gb / 1e9:.1f} GB of bf16 weights ({gb / 2e9:.1f}B parameters)" if gb else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
