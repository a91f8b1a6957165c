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


#: Where the kernels an SGLang engine compiles on first use are kept, by compiler (default locations; the
#: environment variable moves each): Triton's (``TRITON_CACHE_DIR``; the overlay's attention backend is
#: Triton), FlashInfer's (``FLASHINFER_WORKSPACE_BASE``/.cache/flashinfer) and SGLang's own JIT kernels, built
#: with tvm-ffi (``TVM_FFI_CACHE_DIR``, ``sglang/jit_kernel/utils.py``).
JIT_CACHES = {"triton": ("TRITON_CACHE_DIR", "~/.triton/cache"),
              "flashinfer": ("FLASHINFER_WORKSPACE_BASE", "~/.cache/flashinfer"),
              "tvm-ffi": ("TVM_FFI_CACHE_DIR", "~/.cache/tvm-ffi")}


def jit_cache_state(environ=None) -> dict:
    """Files and bytes in each of :data:`JIT_CACHES` now: ``{name: {"path", "files", "bytes"}}`` (0 and 0 for
    a missing folder). A run that starts with empty caches compiles its kernels during its first requests
    (about 90 s for the first generation of a fresh machine's first engine, 2026-11-28), which the other side
    of a pair, run after it, does not."""
    environ = os.environ if environ is None else environ
    out = {}
    for name, (var, default) in JIT_CACHES.items():
        base = environ.get(var)
        path = Path(base if base else os.path.expanduser(default))
        if name == "flashinfer" and base:
            path = path / ".cache" / "flashinfer"
        files = size = 0
        if path.is_dir():
            for f in path.rglob("*"):
                try:
                    if f.is_file():
                        files += 1
                        size += f.stat().st_size
                except OSError:
                    continue
        out[name] = {"path": str(path), "files": files, "bytes": size}
    return out
