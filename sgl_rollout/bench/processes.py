"""Process-level helpers of the benchmarks: process roles for the device-memory tables of ``bench verl``
(:mod:`.verl_compare`'s NVML sampler and :mod:`.verl_probe`'s memory snapshots: a GPU process named by what
it is, the same in every run), and the time a process spends in Python's garbage collector
(:class:`GcClock`: ``bench trl``'s ``sync_gc_s``, the probe's ``probe.gc`` spans)."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Callable, Optional


class GcClock:
    """The seconds this process spends in Python's garbage collector, counted through ``gc.callbacks`` while
    installed (``with GcClock() as clock:``, or :meth:`install` for the process's life). A collection is CPU
    time on whichever thread allocated, an in-process engine's included, so one that falls inside a timed
    call lengthens it.

    Args:
        on_collection: ``(t0, dt, info) -> None`` called as each collection ends: its wall-clock start
            (``time.time()`` seconds), its duration (seconds) and ``gc.callbacks``' ``info`` (``generation``,
            ``collected``, ``uncollectable``). It runs inside the collection, on the thread that triggered it
            (maybe one holding a lock of the caller's): keep it to an append.

    Attributes:
        seconds: total seconds of the collections that ended while installed.
    """

    def __init__(self, on_collection: Optional[Callable[[float, float, dict], None]] = None):
        self.seconds = 0.0
        self.on_collection = on_collection
        self._t0: Optional[float] = None

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            dt = time.perf_counter() - self._t0
            self._t0 = None
            self.seconds += dt
            if self.on_collection is not None:
                self.on_collection(time.time() - dt, dt, info)

    def install(self) -> "GcClock":
        """Start counting (append the callback to ``gc.callbacks``)."""
        gc.callbacks.append(self._on)
        return self

    def uninstall(self) -> None:
        """Stop counting (remove the callback)."""
        gc.callbacks.remove(self._on)

    def __enter__(self) -> "GcClock":
        return self.install()

    def __exit__(self, *_exc) -> None:
        self.uninstall()


def process_name(pid: int, proc: str = "/proc") -> str:
    """A process's role, stable across runs: a Ray worker's title without its method
    (``ray::WorkerDict``, ``ray::VerlRolloutServer``, ``ray::SGLangHttpServer``), a set title as is
    (``sglang::scheduler``), else the program and its module or script (``python3 -m verl.trainer.main_ppo``,
    ``python log_monitor.py`` for ``python -u .../log_monitor.py``);
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
    if not name.startswith("python"):
        return f"{name} {os.path.basename(args[1])}" if len(args) > 1 and not args[1].startswith("-") else name
    rest = iter(args[1:])
    for a in rest:  # the interpreter's own flags (``-u``, ``-X opt``) come before the module or script
        if a == "-m":
            module = next(rest, None)
            return f"{name} -m {module}" if module else name
        if a == "-c" or not a.startswith("-"):
            return name if a == "-c" else f"{name} {os.path.basename(a)}"
        if a in ("-X", "-W"):
            next(rest, None)
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
