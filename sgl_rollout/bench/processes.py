"""Process roles for the device-memory tables of ``bench verl`` (:mod:`.verl_compare`'s NVML sampler and
:mod:`.verl_probe`'s memory snapshots): a GPU process named by what it is, the same in every run."""

from __future__ import annotations

import os
from pathlib import Path


def process_name(pid: int, proc: str = "/proc") -> str:
    """A process's role, stable across runs: a Ray worker's title without its method
    (``ray::WorkerDict``, ``ray::VerlRolloutServer``, ``ray::SGLangHttpServer``), a set title as is
    (``sglang::scheduler``), else the program and its module or script (``python3 -m verl.trainer.main_ppo``);
    ``"pid <pid>"`` where ``/proc`` cannot tell (the process is gone, or in another PID namespace)."""
    try:
        raw = (Path(proc) / str(pid) / "cmdline").read_bytes()
    except OSError:
        return f"pid {pid}"
    args = [a for a in raw.replace(b"\0", b" ").decode(errors="replace").split() if a]
    if not args:
        return f"pid {pid}"
    first = args[0]
    if first.startswith("ray::"):
        return first.split(".", 1)[0]
    if "::" in first:
        return first
    name = os.path.basename(first)
    if len(args) > 2 and args[1] == "-m":
        return f"{name} -m {args[2]}"
    if len(args) > 1 and not args[1].startswith("-"):
        return f"{name} {os.path.basename(args[1])}"
    return name
