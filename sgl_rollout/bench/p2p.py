"""``python -m sgl_rollout.bench p2p``: the ``sgl_rollout`` checkpoint engine's wire, swept from 0.1 to 16 GB,
next to a plain device-to-device copy of the same bytes (the limit).

Two processes, one GPU each (GPU 0 sends, GPU 1 receives), over a
:class:`~sgl_rollout.weight_sync.p2p.PeerGroup` (NCCL): the group each trainer rank sends a rollout TP rank's
buckets over (:mod:`sgl_rollout.weight_sync.p2p`). Then, in this process, ``dst.copy_(src)`` from GPU 0 to
GPU 1. Each figure is the median of ``--repeats`` timed transfers after one warm-up, in GB/s (1e9 bytes a
second). The receiver times each transfer: it tells the sender it is ready (a one-byte message, whose round
trip is inside the figure: tens of microseconds, a few per cent at 0.1 GB), then receives the buffer and
synchronizes its GPU.

Without CUDA the two processes use gloo on the CPU and there is no copy column: a check of the command
(``tests/test_bench_p2p.py``), not a figure of the wire.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, Optional, Sequence

#: The default sweep (GB of 1e9 bytes).
SIZES_GB = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``p2p`` subcommand's options."""
    p.add_argument("--sizes-gb", type=float, nargs="+", default=list(SIZES_GB),
                   help="transfer sizes in GB (1e9 bytes); default 0.1 to 16")
    p.add_argument("--repeats", type=int, default=5, help="timed transfers per size, after one warm-up")
    p.add_argument("--out", default="bench_p2p.json", help="JSON file, or a folder to write bench_p2p.json in")


def _peer(rank: int, port: int, sizes: Sequence[int], repeats: int, cuda: bool, out) -> None:
    """One side of the sweep (a spawned process): rank 0 sends, rank 1 receives and times; rank 1 puts
    ``[(bytes, median seconds)]`` on ``out``."""
    import torch

    from ..weight_sync.p2p import PeerGroup

    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    group = PeerGroup("127.0.0.1", port, rank, 2, device, timeout_s=600.0, prefix="bench_p2p")
    token, rows = torch.zeros(1, dtype=torch.uint8, device=device), []
    try:
        for n in sizes:
            buf = torch.ones(n, dtype=torch.uint8, device=device) if rank == 0 else torch.empty(n, dtype=torch.uint8,
                                                                                               device=device)
            times = []
            for i in range(repeats + 1):
                if rank == 0:
                    group.recv(token, 1)
                    group.send(buf, 1)
                    continue
                t0 = time.perf_counter()
                group.send(token, 0)
                group.recv(buf, 0)
                if cuda:
                    torch.cuda.synchronize(device)
                if i:
                    times.append(time.perf_counter() - t0)
            if rank == 1:
                if int(buf[-1]) != 1:
                    raise RuntimeError(f"the {n}-byte transfer did not arrive")
                rows.append((n, statistics.median(times)))
            del buf
            if cuda:
                torch.cuda.empty_cache()
    finally:
        group.close()
    if rank == 1:
        out.put(rows)


def _copy_seconds(n: int, repeats: int) -> float:
    """Median seconds of ``dst.copy_(src)`` of ``n`` bytes from GPU 0 to GPU 1, after one warm-up."""
    import torch

    src = torch.ones(n, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(n, dtype=torch.uint8, device="cuda:1")
    times = []
    for i in range(repeats + 1):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        if i:
            times.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(times)


def sweep(sizes_gb: Sequence[float], repeats: int = 5, cuda: Optional[bool] = None) -> Dict:
    """Time the wire and the plain copy at each size.

    Args:
        sizes_gb: transfer sizes in GB (1e9 bytes).
        repeats: timed transfers per size, after one warm-up.
        cuda: NCCL between GPUs 0 and 1 (None: when two GPUs are visible); False: gloo on the CPU, no copy
            column.

    Returns:
        ``{"device", "repeats", "rows": [{"bytes", "p2p_gb_per_s", "copy_gb_per_s" (None on the CPU)}]}``.

    Raises:
        RuntimeError: fewer than two GPUs with ``cuda=True``; a side failed (its exit code) or a transfer
            did not arrive.
    """
    import torch
    import torch.multiprocessing as mp

    if cuda is None:
        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    if cuda and torch.cuda.device_count() < 2:
        raise RuntimeError("bench p2p needs two visible GPUs")
    sizes = [max(1, int(gb * 1e9)) for gb in sizes_gb]
    ctx = mp.get_context("spawn")
    from torch.distributed.elastic.utils.distributed import get_free_port

    out, port = ctx.Queue(), get_free_port()
    procs = [ctx.Process(target=_peer, args=(r, port, sizes, repeats, cuda, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    rows = out.get(timeout=600 + 60 * len(sizes))
    for p in procs:
        p.join()
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"a side of the sweep failed (exit codes {bad})")
    table = []
    for n, secs in rows:
        copy = n / _copy_seconds(n, repeats) / 1e9 if cuda else None
        table.append({"bytes": n, "p2p_gb_per_s": n / secs / 1e9, "copy_gb_per_s": copy})
    device = torch.cuda.get_device_name(0) if cuda else "cpu (gloo)"
    return {"device": device, "repeats": repeats, "rows": table}


def print_table(res: Dict) -> List[str]:
    """Print :func:`sweep`'s result; returns the lines printed."""
    lines = [f"p2p wire (PeerGroup send/recv, GPU 0 -> GPU 1) vs plain copy, {res['device']}, "
             f"median of {res['repeats']}",
             f"{'GB':>8}{'p2p GB/s':>11}{'copy GB/s':>11}{'p2p/copy':>10}"]
    for r in res["rows"]:
        copy = r["copy_gb_per_s"]
        lines.append(f"{r['bytes'] / 1e9:>8.3f}{r['p2p_gb_per_s']:>11.1f}"
                     f"{copy if copy is not None else float('nan'):>11.1f}"
                     f"{(r['p2p_gb_per_s'] / copy) if copy else float('nan'):>10.2f}")
    print("\n".join(lines))
    return lines


def main(args: argparse.Namespace) -> int:
    """Run the sweep, print it, write ``args.out`` (a file, or ``bench_p2p.json`` in a folder)."""
    from . import write_result

    res = sweep(args.sizes_gb, args.repeats)
    print_table(res)
    print(f"wrote {write_result(res, args.out, 'bench_p2p.json')}")
    return 0
