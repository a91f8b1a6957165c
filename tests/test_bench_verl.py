"""``python -m sgl_rollout.bench verl`` on the CPU: the timing probe (wrappers, import hooks, verl's
dispatch marks kept, this package's spans through :mod:`sgl_rollout.trace`, its way into Ray's workers),
the exit status where the GPU or verl's GPU stack is missing, the TP-layout refusal and the per-replica
request counts at verl's default log level."""

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from sgl_rollout.bench import processes, verl_compare, verl_probe
from sgl_rollout.config import TPLayoutError, check_tp_layout, heads_of_model_path, model_heads, tp_layout_problem
from verl_helpers import probe_dir, spans_in  # noqa: F401 - probe_dir is a fixture

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------ probe
def test_timed_records_sync_async_errors_and_step(probe_dir):
    calls = []

    async def update_weights(self, global_steps=None, mode="auto"):
        calls.append(("update", global_steps))
        return "done"

    def resume(self, tags):
        calls.append(("resume", tuple(tags)))
        if "bad" in tags:
            raise KeyError("bad")
        return 1

    w_update = verl_probe.timed(update_weights, "verl.update_weights", step_kw="global_steps", window=True)
    w_resume = verl_probe.timed(resume, "rollout.resume", name_of=verl_probe._tags_at(1))
    assert asyncio.iscoroutinefunction(w_update) and not asyncio.iscoroutinefunction(w_resume)
    assert asyncio.run(w_update(None, global_steps=7)) == "done"
    assert w_resume(None, ["weights"]) == 1
    with pytest.raises(KeyError):
        w_resume(None, ["kv_cache", "bad"])
    assert verl_probe.timed(w_resume, "again") is w_resume  # never wrapped twice
    got = spans_in(probe_dir)
    assert [s["name"] for s in got] == ["verl.update_weights", "rollout.resume[weights]", "rollout.resume[bad,kv_cache]"]
    assert got[0]["step"] == 7 and got[0]["pid"] == os.getpid() and got[0]["dt"] >= 0
    assert got[2]["error"] == "KeyError" and "error" not in got[1]
    assert calls == [("update", 7), ("resume", ("weights",)), ("resume", ("kv_cache", "bad"))]


class FakeCudaNvml:
    """torch.cuda and pynvml as the probe's memory snapshot reads them: one GPU, this process on it."""

    def __init__(self, monkeypatch, fail_nvml=False):
        import torch

        self.reserved = 40 * 2**20
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "memory_stats", lambda dev: {
            "allocated_bytes.all.current": 30 * 2**20, "reserved_bytes.all.current": self.reserved,
            "segment.all.current": 3})
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: types.SimpleNamespace(uuid="abc-1"))
        handles = {"GPU-abc-1": "h0"}
        self.nvml_calls = []
        monkeypatch.setattr(verl_probe, "_nvml_handles", {})  # a fresh process: no handle made yet
        fake = types.ModuleType("pynvml")
        fake.nvmlInit = lambda: self.nvml_calls.append("init")

        def by_uuid(u):
            self.nvml_calls.append("handle")
            if fail_nvml:
                raise RuntimeError("NVML_ERROR_NOT_FOUND")
            return handles[u]

        fake.nvmlDeviceGetHandleByUUID = by_uuid
        fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=900 * 2**20)
        fake.nvmlDeviceGetComputeRunningProcesses = lambda h: [
            types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=self.reserved + 500 * 2**20),
            types.SimpleNamespace(pid=2**22 + 7, usedGpuMemory=None)]
        monkeypatch.setitem(sys.modules, "pynvml", fake)


def test_the_weight_update_is_framed_by_memory_snapshots_outside_its_span(probe_dir, monkeypatch):
    cuda = FakeCudaNvml(monkeypatch)
    seen = []

    async def update_weights(self, global_steps=None):
        seen.append(spans_in(probe_dir) if probe_dir.exists() else [])
        cuda.reserved = 42 * 2**20  # the update leaves 2 MiB more reserved

    wrapped = verl_probe.timed(update_weights, "verl.update_weights", step_kw="global_steps", window=True, memory=True)
    asyncio.run(wrapped(None, global_steps=3))
    got = spans_in(probe_dir)
    assert [(s["name"], s.get("at")) for s in got] == [("probe.memory", "start"), ("verl.update_weights", None),
                                                       ("probe.memory", "end")]
    assert [s["name"] for s in seen[0]] == ["probe.memory"]  # taken before the update ran
    start, span, end = got
    assert start["t0"] + start["dt"] <= span["t0"] and end["t0"] >= span["t0"] + span["dt"]  # outside the span
    assert start["step"] == end["step"] == 3
    assert start["torch"] == {"allocated": 30 * 2**20, "reserved": 40 * 2**20, "segments": 3}
    assert end["torch"]["reserved"] == 42 * 2**20 and end["used"] == 900 * 2**20
    assert end["self_pid"] == os.getpid()
    assert end["procs"][0]["pid"] == os.getpid() and "python" in end["procs"][0]["name"]
    assert end["procs"][1] == {"pid": 2**22 + 7, "name": f"pid {2**22 + 7}", "used": None}
    assert cuda.nvml_calls == ["init", "handle"]  # once per process, not in every snapshot


def test_a_memory_snapshot_that_cannot_read_nvml_says_why_and_the_update_goes_on(probe_dir, monkeypatch):
    nvml = FakeCudaNvml(monkeypatch, fail_nvml=True)

    async def update_weights(self, global_steps=None):
        return "done"

    wrapped = verl_probe.timed(update_weights, "verl.update_weights", step_kw="global_steps", memory=True)
    assert asyncio.run(wrapped(None, global_steps=1)) == "done"
    mem = [s for s in spans_in(probe_dir) if s["name"] == "probe.memory"]
    assert len(mem) == 2 and all("NVML_ERROR_NOT_FOUND" in s["error"] for s in mem)
    assert nvml.nvml_calls == ["init", "handle", "init", "handle"]  # a failure is not cached: tried again
    assert mem[0]["torch"]["reserved"] == 40 * 2**20  # what was read before NVML failed is kept


def test_no_memory_snapshot_without_a_cuda_context(probe_dir, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    verl_probe.memory_snapshot("start", step=0)
    assert not probe_dir.exists() or spans_in(probe_dir) == []


def test_window_only_spans_are_emitted_inside_the_weight_update_only(probe_dir):
    inner = verl_probe.timed(lambda: None, "torch.empty_cache", window_only=True)

    async def update_weights(global_steps=None):
        inner()
        await asyncio.sleep(0)
        inner()

    outer = verl_probe.timed(update_weights, "verl.update_weights", step_kw="global_steps", window=True)
    inner()  # outside: not recorded (torch calls are frequent in training)
    asyncio.run(outer(global_steps=1))
    inner()
    assert [s["name"] for s in spans_in(probe_dir)] == ["torch.empty_cache", "torch.empty_cache", "verl.update_weights"]
    assert verl_probe._window == 0


def test_generators_are_timed_as_busy_spans(probe_dir):
    def get_per_tensor_param():
        def gen():
            for i in range(3):
                yield f"w{i}", i
        return gen(), None

    wrapped = verl_probe.timed(get_per_tensor_param, "verl.get_per_tensor_param",
                               result=verl_probe._gen_result("verl.weights"))
    it, peft = wrapped()
    assert peft is None and list(it) == [("w0", 0), ("w1", 1), ("w2", 2)]

    async def buckets(weights, size):
        for w in weights:
            yield [w]

    abuckets = verl_probe._agen_factory(buckets, "rollout.bucket")

    async def drain():
        return [b async for b in abuckets(["a", "b"], 1)]

    assert asyncio.run(drain()) == [["a"], ["b"]]
    got = {s["name"]: s for s in spans_in(probe_dir)}
    assert got["verl.weights"]["busy"] and got["verl.weights"]["n"] == 3
    assert got["rollout.bucket"]["busy"] and got["rollout.bucket"]["n"] == 2
    assert got["verl.get_per_tensor_param"]["dt"] >= 0


def test_a_request_is_timed_at_its_first_item_even_if_never_closed(probe_dir):
    # SGLang's non-streaming callers take one item of generate_request and drop the iterator
    async def generate_request(obj):
        await asyncio.sleep(0.02)
        yield {"text": obj}
        yield {"never": "taken"}

    timed_request = verl_probe._agen_factory(generate_request, "sglang.generate_request", first_item=True)

    async def call():
        it = timed_request("hi")
        first = await it.__anext__()
        assert spans_in(probe_dir)[0]["name"] == "sglang.generate_request"  # written before the iterator ends
        return first

    assert asyncio.run(call()) == {"text": "hi"}
    (span,) = spans_in(probe_dir)
    assert 0.015 <= span["dt"] < 5 and not span.get("busy")


def test_stall_watchers_report_a_blocked_loop_and_a_held_gil(probe_dir, monkeypatch):
    """The server's ``generate`` wrapper starts a loop watcher on its loop and one GIL watcher per process;
    each reports only a stall longer than ``STALL_S`` (the spans a slow replica's request path shows)."""
    import threading
    import time
    import weakref

    monkeypatch.setattr(verl_probe, "_stall_stop", threading.Event())
    monkeypatch.setattr(verl_probe, "_watched_loops", weakref.WeakSet())
    monkeypatch.setattr(verl_probe, "_gil_watch_started", False)

    async def generate(prompt_ids):
        return list(prompt_ids)

    wrapped = verl_probe.timed(generate, "server.generate", watch=True)

    async def main():
        assert await wrapped([1, 2]) == [1, 2]
        await asyncio.sleep(0.05)  # quiet: nothing reported
        quiet = [s["name"] for s in spans_in(probe_dir)]
        time.sleep(0.08)  # blocks the loop; the GIL is released, so the GIL watcher stays quiet
        await asyncio.sleep(0.03)
        old = sys.getswitchinterval()
        sys.setswitchinterval(1.0)
        try:  # pure Python holding the GIL: no other thread runs
            t = time.perf_counter()
            while time.perf_counter() - t < 0.08:
                pass
        finally:
            sys.setswitchinterval(old)
        await asyncio.sleep(0.05)
        return quiet

    quiet = asyncio.run(main())
    # a long collection (the timer's callback driven by hand, automatic ones off): the GIL watcher writes it
    on_gc = gc.callbacks[-1]
    gc.disable()
    try:
        on_gc("start", {"generation": 2})
        time.sleep(0.05)
        on_gc("stop", {"generation": 2, "collected": 7})
        on_gc("start", {"generation": 0})
        on_gc("stop", {"generation": 0, "collected": 0})  # short: not written
        time.sleep(0.05)
    finally:
        gc.enable()
    verl_probe._stall_stop.set()
    assert sorted(quiet) == ["probe.stall_watch"] * 3 + ["server.generate"]
    got = spans_in(probe_dir)
    assert sorted(s["watch"] for s in got if s["name"] == "probe.stall_watch") == ["gc", "gil", "loop"]
    (collection,) = [s for s in got if s["name"] == "probe.gc"]
    assert 0.04 < collection["dt"] < 0.5 and (collection["generation"], collection["collected"]) == (2, 7)
    loop_stalls = [s for s in got if s["name"] == "probe.loop_stall"]
    gil_stalls = [s for s in got if s["name"] == "probe.gil_stall"]
    assert len(loop_stalls) == 2 and all(0.05 < s["dt"] < 0.5 for s in loop_stalls)
    assert {s["thread"] for s in loop_stalls} == {threading.current_thread().name}
    assert len(gil_stalls) == 1 and 0.05 < gil_stalls[0]["dt"] < 0.5


def test_patch_keeps_verl_dispatch_marks_and_install_hooks_imports(probe_dir, tmp_path, monkeypatch):
    """verl's ``register`` marks (the worker group reads them) survive; a module imported after install()
    is patched by wrapt's post-import hook."""
    pytest.importorskip("verl")
    from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch, register

    class Worker:
        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        async def update_weights(self, global_steps=None):
            return global_steps

    mod = types.ModuleType("probe_target")
    mod.Worker = Worker
    assert verl_probe._patch(mod, "Worker.update_weights", dict(name="verl.update_weights", step_kw="global_steps"))
    assert not verl_probe._patch(mod, "Missing.method", dict(name="x"))
    fn = Worker.update_weights
    assert getattr(fn, MAGIC_ATTR)["dispatch_mode"] == Dispatch.ONE_TO_ALL and asyncio.iscoroutinefunction(fn)
    assert asyncio.run(Worker().update_weights(global_steps=3)) == 3

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "probe_late_mod.py").write_text("class A:\n    def go(self):\n        return 5\n")
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setattr(verl_probe, "TARGETS", [("probe_late_mod", "A.go", dict(name="late.go"))])
    monkeypatch.setattr(verl_probe, "_installed", False)
    assert verl_probe.install()
    import probe_late_mod

    assert probe_late_mod.A().go() == 5
    # probe.*_stall spans come from the probe's stall watch when this host is busy: not what is tested here
    assert [s["name"] for s in spans_in(probe_dir) if not s["name"].startswith("probe.")] == [
        "verl.update_weights", "late.go"]


def test_a_wrapped_method_of_a_class_pickled_by_value_leaves_its_globals_behind(probe_dir, tmp_path, monkeypatch):
    """verl colocates its trainer workers into a class made at run time (``WorkerDict``), which Ray
    pickles by value with the worker's methods; a wrapped method must still go by reference, or the
    verl method inside it goes along with its globals (on the GPU host a torch config module, which
    cannot be pickled: every run failed at start-up)."""
    import cloudpickle

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "probe_worker_mod.py").write_text(
        "import threading\nLOCK = threading.Lock()\n"
        "class Worker:\n    def update_weights(self):\n        with LOCK:\n            return 3\n")
    monkeypatch.syspath_prepend(str(pkg))
    import probe_worker_mod

    assert verl_probe._patch(probe_worker_mod, "Worker.update_weights", dict(name="verl.update_weights"))

    def colocate(cls):
        class WorkerDict:  # local: pickled by value, its methods with it
            update_weights = cls.update_weights
        return WorkerDict

    restored = cloudpickle.loads(cloudpickle.dumps(colocate(probe_worker_mod.Worker)))
    assert restored.update_weights(None) == 3
    assert [s["name"] for s in spans_in(probe_dir)] == ["verl.update_weights"]


# ------------------------------------------------------------------------------------ this package's spans
def test_the_probe_wraps_nothing_of_this_package():
    """This package emits its own spans (sgl_rollout.trace); a target naming one of its modules would
    break silently at the next rename."""
    ours = [(mod, path) for mod, path, _how in verl_probe.TARGETS if mod == "sgl_rollout" or mod.startswith("sgl_rollout.")]
    assert ours == []


def test_the_probe_records_the_packages_spans_through_the_trace_hook(probe_dir, monkeypatch):
    """Installed, the probe writes the spans of this package's fast-path sync (``rollout.bucket`` per
    bucket, ``rollout.call`` per round), its server's staged wake (``server.resume[<stage>]``, with the
    error of a refused stage) and its adapter (``rollout.resume[<tags>]``) in the records' format, without
    wrapping anything of the package; uninstalled, it writes nothing more."""
    from test_fast_path import hf_weights, rig

    from sgl_rollout import trace
    from sgl_rollout.integrations.verl_rollout import SglRollout
    from sgl_rollout.server import RolloutServer

    from sgl_rollout.weight_sync import fast_path as sender_mod

    monkeypatch.setattr(verl_probe, "TARGETS", [])  # verl's, SGLang's and torch's targets: other tests
    package_fns = lambda: [RolloutServer.resume_stage, SglRollout.resume, sender_mod.gather_bucket,  # noqa: E731
                           sender_mod.FastPathSender._call]
    before = package_fns()
    assert verl_probe.install()
    assert package_fns() == before  # nothing of the package was replaced

    weights = hf_weights(seed=1)
    _models, _engine, sender = rig(weights, 3000)  # many buckets
    sender.send(iter(weights))

    class Engine:
        tags = ("weights", "kv_cache", "cuda_graph")

        class state:
            released = ["weights", "kv_cache", "cuda_graph"]

        async def async_resume(self, tags):
            return list(tags)

    from sgl_rollout.switch import Switch

    engine = Engine()
    server = types.SimpleNamespace(_engine=engine, _switch=Switch(engine, config=None), layout=None)
    server._after_stage = lambda stage, tags: RolloutServer._after_stage(server, stage, tags)
    assert asyncio.run(RolloutServer.resume_stage(server, "kv_cache")) == ["kv_cache", "cuda_graph"]
    with pytest.raises(ValueError, match="unknown stage"):
        asyncio.run(RolloutServer.resume_stage(server, "optimizer"))
    adapter = types.SimpleNamespace(rollout_config=types.SimpleNamespace(free_cache_engine=False, sleep_level=2),
                                    is_leader_rank=True)
    asyncio.run(SglRollout.resume(adapter, tags=["weights"]))

    got = spans_in(probe_dir)
    names = [s["name"] for s in got]
    n_buckets = names.count("rollout.bucket")
    assert n_buckets > 3 and names.count("rollout.call") >= n_buckets  # plus the plan's and the end's rounds
    assert names[-3:] == ["server.resume[kv_cache]", "server.resume[optimizer]", "rollout.resume[weights]"]
    assert all(set(s) == {"name", "t0", "dt", "pid", "rank"} for s in got if s["name"] != "server.resume[optimizer]")
    refused = got[-2]
    assert refused["error"] == "ValueError" and set(refused) == {"name", "t0", "dt", "pid", "rank", "error"}
    assert all(s["pid"] == os.getpid() and s["dt"] >= 0 and abs(s["t0"] - got[0]["t0"]) < 60 for s in got)

    verl_probe.uninstall()
    assert not trace.enabled()
    asyncio.run(SglRollout.resume(adapter, tags=["kv_cache"]))
    assert len(spans_in(probe_dir)) == len(got)


def test_the_servers_generate_span_is_recorded_with_its_error_and_starts_the_stall_watchers(probe_dir, monkeypatch):
    """``server.generate`` of this package's server actor (here a request it refuses) is written with the
    error's class name, and starts the stall watchers as verl's wrapped server does."""
    import threading
    import weakref

    pytest.importorskip("verl")
    from sgl_rollout.integrations.verl_server import VerlRolloutServer

    monkeypatch.setattr(verl_probe, "TARGETS", [])
    monkeypatch.setattr(verl_probe, "_stall_stop", threading.Event())
    monkeypatch.setattr(verl_probe, "_watched_loops", weakref.WeakSet())
    monkeypatch.setattr(verl_probe, "_gil_watch_started", False)
    assert verl_probe.install()
    try:
        with pytest.raises(NotImplementedError):
            asyncio.run(VerlRolloutServer.generate(object.__new__(VerlRolloutServer), [1], {}, "r", audio_data=[1]))
    finally:
        verl_probe._stall_stop.set()
    got = spans_in(probe_dir)
    assert [(s["name"], s.get("error")) for s in got if s["name"] != "probe.stall_watch"] == [
        ("server.generate", "NotImplementedError")]
    assert sorted(s["watch"] for s in got if s["name"] == "probe.stall_watch") == ["gc", "gil", "loop"]


_IN_RAY = textwrap.dedent("""
    import asyncio, json, os, sys, types
    import ray

    runtime_env = json.loads(sys.argv[1])
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)

    def work():
        from sgl_rollout.server import RolloutServer
        class Engine:
            async def async_begin_sync(self):
                pass
        asyncio.run(RolloutServer.begin_weight_sync(types.SimpleNamespace(_engine=Engine())))
        import verl.workers.rollout.replica as replica  # the built-in side's driver target
        return os.getpid(), getattr(replica.RolloutReplica.sleep, "_sgl_rollout_probe", False)

    @ray.remote(num_cpus=0)
    class Inner:
        def go(self):
            return work()

    @ray.remote(num_cpus=0)
    class Outer:  # as verl's TaskRunner starts its workers: an actor with environment variables of its own
        def go(self):
            inner = Inner.options(runtime_env={"env_vars": {"INNER": "1"}}).remote()
            return [work(), ray.get(inner.go.remote())]

    outer = Outer.options(runtime_env={"env_vars": {"OUTER": "1"}}).remote()
    print(json.dumps({"driver": os.getpid(), "actors": ray.get(outer.go.remote())}))
    ray.shutdown()
""")


def test_both_sides_install_the_probe_in_every_ray_worker_through_rays_setup_hook(tmp_path):
    """The runtime environment the built-in side's command gives ``ray.init`` (no verl plugin at all)
    installs the probe in an actor with environment variables of its own and in an actor that actor
    starts: this package's spans are recorded there and verl's targets are wrapped; the driver, not a
    Ray worker, records nothing."""
    pytest.importorskip("verl")
    pytest.importorskip("ray")
    cmd = verl_compare.side_command("builtin", tmp_path / "m", tmp_path / "run", 1, 1, 4, 0.5, python="python")
    runtime_env: dict = {}
    prefix = "+ray_kwargs.ray_init.runtime_env."
    for arg in cmd:
        if arg.startswith(prefix):
            key, value = arg[len(prefix):].split("=", 1)
            *owners, last = key.split(".")
            node = runtime_env
            for part in owners:
                node = node.setdefault(part, {})
            node[last] = value.strip("'")
    assert runtime_env["worker_process_setup_hook"] == verl_probe.SETUP_HOOK
    assert runtime_env["env_vars"]["VERL_USE_EXTERNAL_PLUGINS"] == "none"
    env = {k: v for k, v in os.environ.items() if k != verl_probe.ENV_DIR}
    env.update(RAY_ADDRESS="", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _IN_RAY, json.dumps(runtime_env)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (outer_pid, outer_wrapped), (inner_pid, inner_wrapped) = out["actors"]
    assert outer_wrapped and inner_wrapped and len({outer_pid, inner_pid, out["driver"]}) == 3
    spans = spans_in(tmp_path / "run" / "spans")
    assert sorted((s["name"], s["pid"]) for s in spans) == sorted(
        [("server.begin_weight_sync", outer_pid), ("server.begin_weight_sync", inner_pid)])


def test_install_is_inert_without_the_folder(monkeypatch):
    monkeypatch.delenv(verl_probe.ENV_DIR, raising=False)
    monkeypatch.setattr(verl_probe, "_installed", False)
    assert verl_probe.install() is False


def test_probe_targets_exist_in_verl():
    """Every verl target names a real attribute of verl 0.9.1 (a renamed method would silently go
    untimed)."""
    pytest.importorskip("verl")
    import importlib
    import importlib.util

    nccl = importlib.util.find_spec("verl.checkpoint_engine.nccl_checkpoint_engine").origin
    assert _defined_in_source(nccl, "NCCLCheckpointEngine.send_weights")  # async def counts
    assert not _defined_in_source(nccl, "NCCLCheckpointEngine.no_such_method")
    missing = []
    for mod, path, _how in verl_probe.TARGETS:
        if not (mod.startswith("verl.") or mod.startswith("torch")):
            continue
        if mod.startswith("verl.workers.rollout.sglang_rollout"):
            continue  # imports SGLang's serving stack, absent from the CPU test environment
        try:
            obj = importlib.import_module(mod)
        except ImportError:  # a backend whose transport is absent here (cupy, nixl): read its source
            if not _defined_in_source(importlib.util.find_spec(mod).origin, path):
                missing.append(f"{mod}.{path}")
            continue
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            missing.append(f"{mod}.{path}")
    assert missing == []


def _defined_in_source(origin: str, path: str) -> bool:
    """Whether the module file ``origin`` defines ``Class.method`` (``path``, one level) at its top level."""
    import ast

    cls, method = path.split(".")
    tree = ast.parse(Path(origin).read_text())
    return any(isinstance(node, ast.ClassDef) and node.name == cls
               and any(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == method for f in node.body)
               for node in tree.body)


# ------------------------------------------------------------------------------------ command
def test_command_on_a_machine_without_a_gpu_says_so_in_one_line_before_starting_anything(tmp_path):
    """No CUDA GPU visible (the CPU test environment, or CUDA_VISIBLE_DEVICES empty): the one line names
    the missing GPU, not SGLang's kernels (also missing here), and nothing is written."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "sgl_rollout.bench", "verl", "--steps", "1", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("bench verl: no CUDA GPU is visible"), proc.stderr
    assert "kernels" not in lines[0] and not out.exists()


def test_preflight_names_what_is_missing():
    present = lambda name: object()  # noqa: E731
    verl_compare.preflight(1, find_spec=present, cuda_devices=lambda: 1)
    with pytest.raises(verl_compare.SetupError, match=r"^verl \(pip install verl==0.9.1\) is not installed"):
        verl_compare.preflight(1, find_spec=lambda n: None if n == "verl" else object(), cuda_devices=lambda: 1)
    with pytest.raises(verl_compare.SetupError, match=r"^wrapt .*timing probe"):
        verl_compare.preflight(1, find_spec=lambda n: None if n == "wrapt" else object(), cuda_devices=lambda: 1)
    with pytest.raises(verl_compare.SetupError, match=r"2 CUDA GPU\(s\) needed, 1 visible \(CUDA_VISIBLE_DEVICES='3'\)"):
        verl_compare.preflight(2, find_spec=present, cuda_devices=lambda: 1, environ={"CUDA_VISIBLE_DEVICES": "3"})
    # no GPU: that is what is said, whatever else is missing (without a GPU, SGLang's kernels are too)
    with pytest.raises(verl_compare.SetupError, match=r"^no CUDA GPU is visible here; .* on 1 GPU"):
        verl_compare.preflight(1, find_spec=lambda n: None, cuda_devices=lambda: 0, environ={})


def test_the_installed_copy_verl_imports_is_this_checkout():
    # the test environment installs the checkout in editable mode (Makefile): the real check finds it
    verl_compare.check_installed_copy()


def _tree(root, files):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _where(path, entry_points=("sgl_rollout.integrations.verl:register",), code=0, stderr=""):
    out = json.dumps({"file": str(path / "__init__.py"), "entry_points": list(entry_points)}) + "\n"
    return lambda cmd, **kw: subprocess.CompletedProcess(cmd, code, out if code == 0 else "", stderr)


def test_a_stale_installed_copy_is_refused_with_what_differs(tmp_path):
    files = {"__init__.py": "", "engine/__init__.py": "", "engine/guarded.py": "x = 1\n", "worker.py": "w = 1\n"}
    here = _tree(tmp_path / "checkout" / "sgl_rollout", files)
    _tree(tmp_path / "checkout" / "patches", {"__init__.py": "", "p.py": "p = 1\n"})
    (tmp_path / "checkout" / "pyproject.toml").write_text("")
    # pip install . before engine/ existed and before worker.py changed; patches/ installed inside the package
    stale = _tree(tmp_path / "site" / "sgl_rollout", {"__init__.py": "", "worker.py": "w = 0\n",
                                                      "patches/__init__.py": "", "patches/p.py": "p = 1\n"})
    with pytest.raises(verl_compare.SetupError) as e:
        verl_compare.check_installed_copy(here=here, run=_where(stale))
    msg = str(e.value)
    assert "\n" not in msg and str(stale) in msg
    assert "2 module(s) missing there, 1 changed" in msg
    assert "engine/__init__.py" in msg and f"pip install -e {tmp_path / 'checkout'}" in msg
    # the same files elsewhere (pip install . of this very checkout) pass
    fresh = _tree(tmp_path / "site2" / "sgl_rollout", {**files, "patches/__init__.py": "", "patches/p.py": "p = 1\n"})
    verl_compare.check_installed_copy(here=here, run=_where(fresh))


def test_no_entry_point_or_no_import_is_refused(tmp_path):
    here = _tree(tmp_path / "sgl_rollout", {"__init__.py": ""})
    with pytest.raises(verl_compare.SetupError, match="entry point is not installed"):
        verl_compare.check_installed_copy(here=here, run=_where(here, entry_points=()))
    with pytest.raises(verl_compare.SetupError, match="cannot import sgl_rollout .ModuleNotFoundError: no sgl_rollout"):
        verl_compare.check_installed_copy(here=here, run=_where(here, code=1, stderr="Traceback\nModuleNotFoundError: no sgl_rollout"))


def test_the_two_sides_differ_only_in_the_plugins_and_the_run_name(tmp_path):
    pytest.importorskip("verl")
    b = verl_compare.side_command("builtin", tmp_path / "m", tmp_path / "b", 1, 1, 4, 0.5, python="python")
    o = verl_compare.side_command("ours", tmp_path / "m", tmp_path / "o", 1, 1, 4, 0.5, python="python")
    norm = lambda cmd, d: [a.replace(str(d), "RUN") for a in cmd]  # noqa: E731
    diff = [(x, y) for x, y in zip(norm(b, tmp_path / "b"), norm(o, tmp_path / "o")) if x != y]
    assert len(b) == len(o)
    assert diff == [("trainer.experiment_name=compare_builtin", "trainer.experiment_name=compare_ours"),
                    ("+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_PLUGINS='none'",
                     "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_PLUGINS='sgl_rollout'")]
    # both sides install the probe the same way, through Ray (no verl plugin of the probe's own)
    hook = f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={verl_probe.SETUP_HOOK}"
    assert hook in b and hook in o
    assert verl_compare.side_env("builtin", tmp_path / "b", base={})["VERL_USE_EXTERNAL_PLUGINS"] == "none"
    assert len(verl_compare.differences()) == 2
    # --fast-sync: one more override, on our side only, and said so
    fb = verl_compare.side_command("builtin", tmp_path / "m", tmp_path / "b", 1, 1, 4, 0.5, python="python", fast_sync=True)
    fo = verl_compare.side_command("ours", tmp_path / "m", tmp_path / "o", 1, 1, 4, 0.5, python="python", fast_sync=True)
    assert fb == b
    assert fo[-1] == verl_compare.FAST_SYNC_OVERRIDE and fo[:-1] == o
    assert "sgl_rollout.fast_sync=true on sgl-rollout's side only" in verl_compare.differences(fast_sync=True)[2]
    # --no-fast-sync: the flattened buckets, likewise on our side only
    no = verl_compare.side_command("ours", tmp_path / "m", tmp_path / "o", 1, 1, 4, 0.5, python="python", fast_sync=False)
    assert no[-1] == "+actor_rollout_ref.rollout.engine_kwargs.sgl_rollout.fast_sync=false" and no[:-1] == o
    assert "fast_sync=false on sgl-rollout's side only: SGLang's flattened" in verl_compare.differences(False)[2]
    # hydra composes the command's overrides (the quoted plugin list is one string, not a sweep)
    from test_verl_config import compose

    root = compose(*[a for a in o[3:] if not a.startswith(("actor_rollout_ref.model.path", "hydra."))],
                   model_path=str(tmp_path / "m"))
    assert root.ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_PLUGINS == "sgl_rollout"
    assert root.ray_kwargs.ray_init.runtime_env.worker_process_setup_hook == verl_probe.SETUP_HOOK


class FakeNvml:
    """pynvml's calls the sampler makes, over ``used`` (bytes per GPU) and ``procs`` ((pid, bytes) on each)."""

    def __init__(self, used, procs=()):
        self.used, self.procs = used, list(procs)

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.used)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=self.used[h])

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [types.SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in self.procs]


def test_nvml_sampler_records_sm_use_by_process_since_its_last_read(monkeypatch):
    """``nvmlDeviceGetProcessUtilization`` gives samples after a timestamp: the sampler asks from the last one
    it saw, keeps each process's largest figure per point, and records nothing where NVML cannot tell."""
    monkeypatch.setattr(verl_compare, "process_name", lambda pid: {7: "sglang::scheduler", 8: "ray::Worker"}[pid])
    asked = []

    class Util(FakeNvml):
        def nvmlDeviceGetProcessUtilization(self, h, since):
            asked.append((h, since))
            if h == 0:
                raise RuntimeError("NVML_ERROR_NOT_FOUND")
            return [types.SimpleNamespace(pid=7, smUtil=40, timeStamp=since + 5),
                    types.SimpleNamespace(pid=7, smUtil=90, timeStamp=since + 9),
                    types.SimpleNamespace(pid=8, smUtil=100, timeStamp=since + 2)]

    s = verl_compare.NvmlSampler(nvml=Util([1, 2]))
    s._handles = [0, 1]  # read by hand first, without the sampling thread
    assert s._sm_by_name(1) == {"sglang::scheduler": 90, "ray::Worker": 100}
    assert s._sm_by_name(1) and asked[-1] == (1, 9)  # the next read starts at the last sample seen
    assert s._sm_by_name(0) == {}
    sampler = verl_compare.NvmlSampler(interval_s=0.01, nvml=Util([1, 2])).start()
    deadline = time.monotonic() + 10
    while not sampler.sm_series and time.monotonic() < deadline:  # the thread takes its first point at once
        time.sleep(0.01)
    out = sampler.stop()
    assert out["sm_series"] and all(len(gpus) == 2 for _t, gpus in out["sm_series"])
    assert out["sm_series"][0][1] == [{}, {"sglang::scheduler": 90, "ray::Worker": 100}]


def test_nvml_sampler_keeps_the_peak_and_reports_a_missing_nvml():
    nv = FakeNvml([100, 200])
    s = verl_compare.NvmlSampler(interval_s=0.01, nvml=nv).start()
    nv.used = [500, 150]
    import time

    time.sleep(0.1)
    nv.used = [300, 150]
    time.sleep(0.05)
    out = s.stop()
    assert out["baseline_bytes"] == {"0": 100, "1": 200} and out["peak_used_bytes"] == {"0": 500, "1": 200}
    assert out["error"] is None

    class NoNvml(FakeNvml):
        def nvmlInit(self):
            raise OSError("libnvidia-ml.so.1: cannot open")

    out = verl_compare.NvmlSampler(nvml=NoNvml([100, 200])).start().stop()
    assert out["peak_used_bytes"] == {} and "libnvidia-ml" in out["error"]


def test_nvml_sampler_samples_only_the_visible_gpus_in_cudas_order():
    class ByUuid(FakeNvml):
        def nvmlDeviceGetHandleByUUID(self, uuid):
            if uuid != "GPU-abc":
                raise KeyError(uuid)
            return 0

    nv = ByUuid([100, 200, 300])
    out = verl_compare.NvmlSampler(nvml=nv, environ={"CUDA_VISIBLE_DEVICES": "2,1"}).start().stop()
    assert out["baseline_bytes"] == {"0": 300, "1": 200}  # CUDA's device 0 is NVML's 2
    out = verl_compare.NvmlSampler(nvml=nv, environ={"CUDA_VISIBLE_DEVICES": "GPU-abc,7,1"}).start().stop()
    assert out["baseline_bytes"] == {"0": 100}  # the list ends at the first GPU that does not exist
    out = verl_compare.NvmlSampler(nvml=nv, environ={"CUDA_VISIBLE_DEVICES": "GPU-zzz,1"}).start().stop()
    assert out["baseline_bytes"] == {}
    out = verl_compare.NvmlSampler(nvml=nv, environ={}).start().stop()
    assert out["baseline_bytes"] == {"0": 100, "1": 200, "2": 300}


def test_nvml_sampler_records_who_held_the_memory_at_each_gpus_peak():
    import time

    nv = FakeNvml([100], [(1, 60)])
    s = verl_compare.NvmlSampler(interval_s=0.01, nvml=nv).start()
    nv.used, nv.procs = [900], [(1, 60), (os.getpid(), 800), (2**22 + 7, None)]  # the peak
    time.sleep(0.1)
    nv.used, nv.procs = [500], [(1, 60)]  # lower: the peak's processes stay
    time.sleep(0.05)
    out = s.stop()
    assert out["peak_used_bytes"] == {"0": 900}
    procs = out["peak_processes"]["0"]
    assert [p["used_bytes"] for p in procs] == [800, 60, None]  # largest first
    assert procs[0]["pid"] == os.getpid() and "python" in procs[0]["name"]
    assert procs[2]["name"] == f"pid {2**22 + 7}"  # gone (or never there): said so

    class OldDriver(FakeNvml):
        def nvmlDeviceGetComputeRunningProcesses(self, h):
            raise RuntimeError("Not Supported")

    out = verl_compare.NvmlSampler(interval_s=0.01, nvml=OldDriver([100])).start().stop()
    assert out["peak_processes"] == {"0": []} and out["error"] is None
    assert out["process_series"][0][1] == [{}]


def test_nvml_sampler_records_each_process_names_memory_once_a_second():
    import time

    nv = FakeNvml([900], [(os.getpid(), 800), (os.getpid(), 50), (2**22 + 7, None)])
    s = verl_compare.NvmlSampler(interval_s=0.01, nvml=nv).start()
    time.sleep(0.1)
    out = s.stop()
    assert len(out["process_series"]) == len(out["series"]) == 1  # one point per second
    t, gpus = out["process_series"][0]
    assert t < 1.0 and len(gpus) == 1
    (name, used), = gpus[0].items()  # summed over the processes of one name; unknown sizes left out
    assert "python" in name and used == 850


@pytest.mark.parametrize("cmdline,name", [
    (b"ray::WorkerDict.actor_rollout_compute_log_prob\0", "ray::WorkerDict"),
    (b"ray::VerlRolloutServer\0\0", "ray::VerlRolloutServer"),
    (b"sglang::scheduler_TP0\0", "sglang::scheduler_TP0"),
    (b"/usr/bin/python3\0-m\0verl.trainer.main_ppo\0algorithm.adv_estimator=grpo\0", "python3 -m verl.trainer.main_ppo"),
    (b"python\0/tmp/run/train.py\0--x\0", "python train.py"),
    # the interpreter's flags before the script or module (Ray starts its monitors with -u)
    (b"/usr/bin/python3\0-u\0/site/ray/_private/log_monitor.py\0--logs-dir=/tmp\0", "python3 log_monitor.py"),
    (b"python\0-X\0faulthandler\0-m\0pkg.mod\0", "python -m pkg.mod"),
    (b"python\0-c\0import x\0", "python"),
    (b"/site/ray/core/src/ray/raylet/raylet\0--node_ip_address=1.2.3.4\0/site/setup_worker.py\0", "raylet"),
    (b"/usr/bin/tool\0job.cfg\0", "tool job.cfg"),
    (b"", "pid 42"),
])
def test_process_names_are_roles_not_pids(tmp_path, cmdline, name):
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cmdline").write_bytes(cmdline)
    assert processes.process_name(42, proc=str(tmp_path)) == name
    assert processes.process_name(43, proc=str(tmp_path)) == "pid 43"


# ------------------------------------------------------------------------------------ TP layout
@pytest.mark.parametrize("tp,heads,gpus,msg", [
    (2, (9, 3), None, "does not divide the model's 9 attention heads.*TP sizes that fit: \\[1, 3, 9\\]"),
    (2, (8, 3), None, "does not fit the model's 3 KV heads"),
    (4, (32, 8), 2, "tensor_model_parallel_size=4 exceeds the 2 GPU\\(s\\) available"),
])
def test_tp_layout_refused_with_the_numbers(tp, heads, gpus, msg):
    with pytest.raises(TPLayoutError, match=msg):
        check_tp_layout(tp, heads, gpus)


@pytest.mark.parametrize("tp,heads", [(1, (9, 3)), (3, (9, 3)), (2, (8, 2)), (8, (32, 4)), (4, (32, 2))])
def test_tp_layouts_sglang_runs_pass(tp, heads):
    assert tp_layout_problem(tp, heads, gpus=8) is None


def test_model_heads_from_configs(tmp_path):
    assert model_heads({"num_attention_heads": 9, "num_key_value_heads": 3}) == (9, 3)
    assert model_heads(types.SimpleNamespace(num_attention_heads=8)) == (8, 8)  # MHA: KV heads = heads
    vl = types.SimpleNamespace(text_config=types.SimpleNamespace(num_attention_heads=16, num_key_value_heads=2))
    assert model_heads(vl) == (16, 2) and model_heads({}) is None
    # a multimodal config.json read as JSON: its text_config is a dict (Qwen2.5-VL under transformers 5)
    assert model_heads({"model_type": "qwen2_5_vl", "text_config": {"num_attention_heads": 28,
                                                                     "num_key_value_heads": 4}}) == (28, 4)
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9, "num_key_value_heads": 3}))
    assert heads_of_model_path(str(tmp_path)) == (9, 3) and heads_of_model_path(str(tmp_path / "none")) is None


def test_engine_refuses_the_layout_before_sglang_starts(tmp_path, monkeypatch):
    """RolloutEngine with the real SGLang factory: the refusal comes before SGLang is imported or spawns."""
    from sgl_rollout.config import RolloutConfig
    from sgl_rollout.engine import RolloutEngine

    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9, "num_key_value_heads": 3}))
    monkeypatch.setitem(sys.modules, "sglang.srt.entrypoints.engine", None)  # importing it would fail loudly
    with pytest.raises(TPLayoutError, match="9 attention heads"):
        RolloutEngine(RolloutConfig(model_path=str(tmp_path), tensor_model_parallel_size=2))


def test_verl_rollout_refuses_a_tp_the_model_heads_do_not_split(tmp_path, monkeypatch):
    """verl's trainer worker builds the adapter before any replica starts: that is where it is refused."""
    pytest.importorskip("verl")
    from test_verl_config import compose, make_tiny_model

    from sgl_rollout.integrations.verl_rollout import SglRollout
    from sgl_rollout.integrations.verl_config import check_verl_tp

    model = make_tiny_model(str(tmp_path / "tiny"))  # 4 attention heads, 2 KV heads
    root = compose("actor_rollout_ref.rollout.tensor_model_parallel_size=3", model_path=model)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(TPLayoutError, match=r"actor_rollout_ref.rollout.tensor_model_parallel_size=3 does not "
                                            r"divide the model's 4 attention heads"):
        SglRollout(root.actor_rollout_ref.rollout, root.actor_rollout_ref.model, device_mesh=None)
    root = compose("actor_rollout_ref.rollout.tensor_model_parallel_size=2", model_path=model)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(TPLayoutError, match="exceeds the 1 GPU"):
        SglRollout(root.actor_rollout_ref.rollout, root.actor_rollout_ref.model, device_mesh=None)
    smol = types.SimpleNamespace(hf_config=types.SimpleNamespace(num_attention_heads=9, num_key_value_heads=3))
    with pytest.raises(TPLayoutError, match="9 attention heads"):
        check_verl_tp(root.actor_rollout_ref.rollout, smol)


# ------------------------------------------------------------------------------------ request counts
def test_request_counts_reach_verls_console_at_its_default_level(tmp_path):
    """In a process set up as verl sets up every process (``import verl``: root logger at WARNING), the
    server's sleep prints the replica's request counts on stderr, which Ray forwards to verl's console."""
    pytest.importorskip("verl")
    pytest.importorskip("ray")
    script = textwrap.dedent("""
        import asyncio, logging
        import verl  # sets the root logger to WARNING, as in verl's driver and Ray actors
        assert logging.getLogger().level == logging.WARNING
        from sgl_rollout.integrations.verl_server import VerlRolloutServer
        srv = VerlRolloutServer({"model_path": "/models/x", "free_cache_engine": False})
        srv._served.update(total=300, since_sleep=128)
        logging.getLogger("sgl_rollout").info("ordinary INFO stays hidden")
        asyncio.run(srv.sleep())
        """)
    env = dict(os.environ, RAY_ADDRESS="", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "served 128 requests since the last sleep (300 in all)" in proc.stderr
    assert "ordinary INFO stays hidden" not in proc.stderr


def test_last_error_line_names_the_exception_not_a_warning(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("\x1b[36m(TaskRunnerV1 pid=1)\x1b[0m UserWarning: megatron engine is not available: "
                   "ModuleNotFoundError('megatron')\n"
                   "ray.exceptions.RayTaskError(OutOfMemoryError): ray::WorkerDict.update_actor()\n"
                   "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB.\n"
                   "  Training Progress:  33%\n")
    assert verl_compare.last_error_line(log) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB."
    log.write_text("UserWarning: megatron engine is not available: ModuleNotFoundError('megatron')\nstep:1\n")
    assert verl_compare.last_error_line(log) is None
    assert verl_compare.last_error_line(tmp_path / "absent.log") is None


def test_random_model_is_written_by_a_child_process(tmp_path, monkeypatch):
    """The random model's weights are made in a child process (on the GPU host, the runner would otherwise
    hold a CUDA context and the weights' cached blocks on GPU 0 through both runs); the result has the
    source's vocabulary and tokenizer files."""
    import torch

    from sgl_rollout.bench import models

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"vocab_size": 96}))
    (src / "tokenizer.json").write_text("{}")
    (src / "model.safetensors").write_text("not copied")
    monkeypatch.setattr(models, "LLAMA_1B", dict(models.LLAMA_TINY))  # read by the parent, sent to the child
    children = []
    real_run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: children.append(cmd) or real_run(cmd, **kw))
    out = verl_compare.random_model_like(src, tmp_path / "random")
    assert len(children) == 1 and children[0][0] == sys.executable
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 96 and cfg["hidden_size"] == models.LLAMA_TINY["hidden_size"]
    assert (out / "tokenizer.json").is_file() and list(out.glob("*.safetensors"))
    assert (out / "model.safetensors").read_bytes() != b"not copied"
    assert not torch.cuda.is_initialized()
    assert verl_compare.random_model_like(src, tmp_path / "random") == out and len(children) == 1  # written once


def test_the_8b_random_shape_is_a_7b_plus_model_sent_to_the_child(tmp_path, monkeypatch):
    """``--random-model 8b``: Llama-3-8B's dims with the source's vocabulary (issue 47's sharded transfer
    of 7B+); counted here from the shape, the child that writes 15 GB of weights is not run."""
    from sgl_rollout.bench import models

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"vocab_size": 49152}))
    sent = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: sent.append(json.loads(cmd[-2])))
    verl_compare.random_model_like(src, tmp_path / "random8b", "8b")
    (dims,) = sent
    h, i, n, kv = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"], dims["num_key_value_heads"]
    head = h // dims["num_attention_heads"]
    params = n * (2 * h * h + 2 * h * kv * head + 3 * h * i + 2 * h) + 2 * dims["vocab_size"] * h + h
    assert dims["vocab_size"] == 49152 and dims["hidden_size"] == models.LLAMA3_8B["hidden_size"]
    assert 7.0e9 < params < 8.0e9, params
    with pytest.raises(ValueError, match="unknown random model shape"):
        verl_compare.random_model_like(src, tmp_path / "x", "70b")
    parser = argparse.ArgumentParser()
    verl_compare.add_arguments(parser)
    assert parser.parse_args(["--random-model", "8b"]).random_model == "8b"


def test_the_moe_random_shape_writes_a_qwen3_moe_sglang_loads_per_expert(tmp_path, monkeypatch):
    """``--random-model moe`` (issue 47, goal 4's bench pair): a Qwen3-MoE with the source's vocabulary and
    tokenizer files, its checkpoint one tensor per expert and projection (what SGLang's ``load_weights``
    reads), a head size SGLang's fused rotary kernel takes; written by the child (a tiny shape here)."""
    from safetensors import safe_open

    from sgl_rollout.bench import models
    from sgl_rollout.config import RolloutConfig
    from sgl_rollout.engine.core import fused_kv_rope_problem

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"vocab_size": 96}))
    (src / "tokenizer.json").write_text("{}")
    tiny = {k: v for k, v in models.QWEN3_MOE_TINY.items() if k != "vocab_size"}
    monkeypatch.setattr(models, "QWEN3_MOE_BENCH", dict(tiny, num_hidden_layers=2))
    out = verl_compare.random_model_like(src, tmp_path / "moe", "moe")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["vocab_size"] == 96
    assert cfg.get("num_experts", cfg.get("num_local_experts")) == 8  # transformers 5 writes num_local_experts
    assert (out / "tokenizer.json").is_file()
    names = set()
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names |= set(st.keys())
    assert {f"model.layers.1.mlp.experts.7.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")} <= names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)
    assert fused_kv_rope_problem(RolloutConfig(model_path=str(out))) is None


# ------------------------------------------------------------------------------------ --nnodes
def test_more_nodes_need_a_cluster_or_the_simulation():
    verl_compare.check_nodes(1, False, environ={})
    verl_compare.check_nodes(2, False, environ={"RAY_ADDRESS": "10.0.0.1:6379"})
    verl_compare.check_nodes(2, True, environ={})
    with pytest.raises(verl_compare.SetupError, match="RAY_ADDRESS"):
        verl_compare.check_nodes(2, False, environ={})
    with pytest.raises(verl_compare.SetupError, match=">= 1"):
        verl_compare.check_nodes(0, True, environ={})


def test_two_node_side_command_composes_into_verls_config(tmp_path):
    from test_verl_task import trainer_config

    cmd = verl_compare.side_command("ours", tmp_path / "m", tmp_path / "run", 1, 2, 4, 0.5, python="python",
                                    nnodes=2, worker_env={"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"})
    cfg = trainer_config(cmd[3:])
    assert cfg.trainer.nnodes == 2 and cfg.trainer.n_gpus_per_node == 1
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2  # one replica over both nodes
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES == "1"
    assert "address" not in cfg.ray_kwargs.ray_init  # joins the cluster RAY_ADDRESS names
    one = trainer_config(verl_compare.side_command("ours", tmp_path / "m", tmp_path / "run", 1, 1, 4, 0.5,
                                                   python="python")[3:])
    assert one.ray_kwargs.ray_init.address == "local"  # one node: a Ray cluster of its own, never another run's


def test_simulated_nodes_are_raylets_with_their_own_devices():
    ray = pytest.importorskip("ray")
    with verl_compare.simulated_nodes(1, 2) as (env, worker_env):
        assert env == {} and worker_env == {}
    # all GPUs visible, and a run given GPUs 2,3 of a 4-GPU host (its nodes must be on 2 and 3: on the
    # GPUs the parent was not given, the first GPU run died with "invalid device ordinal")
    for environ, count, expect in (({}, 2, ["0", "1"]), ({"CUDA_VISIBLE_DEVICES": "2,3"}, None, ["2", "3"])):
        with verl_compare.simulated_nodes(2, 1, environ=environ, count=count) as (env, worker_env):
            ray.init(address=env["RAY_ADDRESS"], runtime_env={"env_vars": worker_env}, include_dashboard=False)
            try:
                alive = [n for n in ray.nodes() if n["Alive"]]
                assert len(alive) == 2 and all(n["Resources"].get("GPU") == 1 for n in alive)

                @ray.remote(num_gpus=1)
                def visible():
                    import os
                    import time
                    time.sleep(2)  # both hold their GPU at once: one on each raylet
                    ids = ray.get_runtime_context().get_accelerator_ids()["GPU"]
                    return (os.environ.get("CUDA_VISIBLE_DEVICES"),
                            os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"), ids)

                # two tasks, one GPU each: one per raylet, each on its raylet's device
                got = ray.get([visible.remote(), visible.remote()])
                assert sorted(cvd for cvd, _, _ in got) == expect
                for cvd, noset, ids in got:
                    # verl 0.9.1's Worker._setup_env_cuda_visible_devices: with NOSET set it calls
                    # set_device(int(ids[0])), which must be an ordinal of the devices this process sees
                    # (node 1's "1" in a one-GPU process was "invalid device ordinal" on the GPU run)
                    assert not noset or int(ids[0]) < len(cvd.split(",")), (cvd, noset, ids)
            finally:
                ray.shutdown()
    with pytest.raises(verl_compare.SetupError, match="simulate-nodes .*: 4 needed, 2 visible"):
        with verl_compare.simulated_nodes(2, 2, environ={"CUDA_VISIBLE_DEVICES": "0,1"}):
            pass


def test_at_once_splits_the_visible_gpus_between_the_sides():
    assert verl_compare.split_devices(2, environ={"CUDA_VISIBLE_DEVICES": "3,5,6,7"}) == ("3,5", "6,7")
    assert verl_compare.split_devices(1, environ={}, count=2) == ("0", "1")
    with pytest.raises(verl_compare.SetupError, match="2 needed, 1 visible"):
        verl_compare.split_devices(1, environ={"CUDA_VISIBLE_DEVICES": "0"})
    verl_compare.check_at_once(False, ["ours"], 2)  # not asked: nothing to refuse
    with pytest.raises(verl_compare.SetupError, match="both sides"):
        verl_compare.check_at_once(True, ["ours"], 1)
    with pytest.raises(verl_compare.SetupError, match="--nnodes 1"):
        verl_compare.check_at_once(True, ["builtin", "ours"], 2)


def test_at_once_runs_both_sides_of_a_pair_together_each_on_its_gpus(tmp_path, monkeypatch):
    """Both sides start before either ends, each with its own CUDA_VISIBLE_DEVICES and an NVML sampler
    reading that same variable; the report says the pair ran at once."""
    import argparse
    import threading

    events, lock = [], threading.Lock()
    # Each side waits for the other at a barrier: run in turn, the first side's wait times out (the barrier
    # breaks) instead of depending on how a slow CI machine schedules the two threads.
    both_started = threading.Barrier(2, timeout=30)

    def fake_run_side(side, pair, cmd, env, run_dir, steps, timeout_s, sampler_factory=None):
        sampler = sampler_factory()
        with lock:
            events.append(("start", side, env["CUDA_VISIBLE_DEVICES"], sampler._environ["CUDA_VISIBLE_DEVICES"]))
        try:
            both_started.wait()
        except threading.BrokenBarrierError:
            events.append(("alone", side))
        with lock:
            events.append(("end", side))
        run_dir.mkdir(parents=True, exist_ok=True)
        return {"exit_code": 0, "wall_s": 0.3}

    monkeypatch.setattr(verl_compare, "run_side", fake_run_side)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    args = argparse.Namespace(ngpus=1, tp=1, steps=2, gpu_memory_utilization=0.5, overrides=[], fast_sync=None,
                              task="arith", nnodes=1, trainer="sync", rollout_gpus=0, timeout_s=60.0, at_once=True,
                              ours_checkpoint_engine="nccl", ours_layered_gather=False)
    run_dirs, orders = verl_compare.plan_pairs(out, 1, ["builtin", "ours"])
    config = {"title": "t", "steps": 2, "at_once": True}
    failed = verl_compare._run_pairs(args, out, run_dirs, orders, config, tmp_path / "m", 4, {}, {})
    assert failed  # the fake runs logged no steps
    starts = {e[1]: e[2:] for e in events if e[0] == "start"}
    assert starts == {"builtin": ("4", "4"), "ours": ("5", "5")}
    assert [e[0] for e in events[:2]] == ["start", "start"]  # together, not in turn
    assert not [e for e in events if e[0] == "alone"]
    assert "## Pair 1 (both sides at once, each on GPUs of its own)" in (out / "comparison.md").read_text()


def test_a_tp_the_models_heads_do_not_split_is_refused_before_any_side_starts(tmp_path, monkeypatch, capsys):
    """``bench verl --ngpus 1 --tp 2 --nnodes 2 --simulate-nodes`` on SmolLM2 (9 heads) ran both sides into
    this package's refusal a minute into verl's start (2026-11-28, fifth session): main refuses it at once."""
    import argparse

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 9, "num_key_value_heads": 3}))
    monkeypatch.setattr(verl_compare, "prepare_task", lambda args, out, n_val: model)
    monkeypatch.setattr(verl_compare, "check_installed_copy", lambda: None)
    monkeypatch.setattr(verl_compare, "preflight", lambda n: None)
    monkeypatch.setattr(verl_compare, "run_side", lambda *a, **k: pytest.fail("a side started"))
    parser = argparse.ArgumentParser()
    verl_compare.add_arguments(parser)
    args = parser.parse_args(["--ngpus", "2", "--tp", "2", "--out", str(tmp_path / "out")])
    assert verl_compare.main(args) == 2
    err = capsys.readouterr().err
    assert "--tp=2 does not divide the model's 9 attention heads" in err and "[1, 3, 9]" in err
    verl_compare.check_model_tp(3, model)  # fits
    verl_compare.check_model_tp(2, tmp_path / "no-config")  # nothing to check against: left to the rollouts


def test_each_engines_server_args_are_recorded_and_the_report_names_the_settings_the_sides_differ_in(tmp_path,
                                                                                                   monkeypatch):
    """The fifth session found by hand (SGLang's info log) that the two sides' engines differed in
    ``disable_piecewise_cuda_graph``: the probe now records each engine's ServerArgs and the report lists
    the differences, naming those this package does not mean."""
    import dataclasses

    from sgl_rollout.bench import verl_report

    @dataclasses.dataclass
    class Args:  # a ServerArgs stand-in: the recorder reads any dataclass
        model_path: str = "/m"
        port: int = 30000
        random_seed: int = 1
        disable_piecewise_cuda_graph: bool = False
        custom_weight_loader: list = dataclasses.field(default_factory=list)
        odd: object = dataclasses.field(default_factory=object)

    class TokenizerManager:
        def __init__(self, server_args, port_args):
            self.server_args = server_args

    runs = {}
    for side, args in (("builtin", Args()), ("ours", Args(port=30001, random_seed=2, disable_piecewise_cuda_graph=True,
                                                          custom_weight_loader=["x.load_weights"]))):
        spans = tmp_path / side / "spans"
        monkeypatch.setenv(verl_probe.ENV_DIR, str(spans))
        monkeypatch.setattr(verl_probe, "_file", None)
        wrapped = verl_probe._server_args_recorder(TokenizerManager.__init__)
        wrapped(TokenizerManager.__new__(TokenizerManager), args, None)
        verl_probe._file.close()
        runs[side] = verl_report.server_args_of(verl_report.load_spans(spans))
    assert runs["builtin"]["odd"] == "<object object>" and runs["builtin"]["custom_weight_loader"] == []

    class Unprintable:
        def __str__(self):
            raise RuntimeError("no")

    assert verl_probe._json_safe(Unprintable()) == "<unprintable>"  # never stops the engine's start
    diffs = verl_report.server_arg_differences(runs["builtin"], runs["ours"])
    assert [d["arg"] for d in diffs] == ["custom_weight_loader", "disable_piecewise_cuda_graph"]  # not port, seed
    assert diffs[0]["why"] and diffs[1]["why"] is None
    lines = verl_report._server_args_lines({"server_args_differ": diffs})
    assert any("`disable_piecewise_cuda_graph` | `false` | `true` | **not this package's choice" in ln for ln in lines)
    assert verl_report.server_arg_differences(runs["builtin"], None) is None
    assert verl_report._server_args_lines({"server_args_differ": []})[0].endswith("the same on both sides.")


def test_the_same_model_folder_in_two_run_folders_is_not_a_server_args_difference():
    """A side reported against another run's side (``--sides``) read its own copy of the model, written into
    its run folder under the same name: the sixth session's report listed ``model_path`` as the sides running
    unlike engines. Another model is still a difference."""
    from sgl_rollout.bench import verl_report

    a = {"model_path": "/tmp/res/a/model-1b-random", "tokenizer_path": "/tmp/res/a/model-1b-random", "tp_size": 1}
    b = {"model_path": "/tmp/res/b/model-1b-random", "tokenizer_path": "/tmp/res/b/model-1b-random", "tp_size": 1}
    assert verl_report.server_arg_differences(a, b) == []
    c = dict(b, model_path="/tmp/res/b/model-8b-random")
    assert [d["arg"] for d in verl_report.server_arg_differences(a, c)] == ["model_path"]


def test_the_server_args_target_is_sglangs_tokenizer_manager_in_both_releases():
    """``TokenizerManager.__init__(self, server_args, ...)`` in SGLang 0.5.10.post1 (installed) and 0.5.12 (its
    source, unpacked by ``make test``): the probe's ServerArgs record reads that argument."""
    import ast
    import importlib.util
    import os

    installed = Path(importlib.util.find_spec("sglang").origin).parent / "srt" / "managers" / "tokenizer_manager.py"
    sources = Path(os.environ.get("SGLROLLOUT_SGLANG_SOURCES", Path(sys.prefix) / "sglang-src"))
    for path in (installed, sources / "0.5.12" / "sglang" / "srt" / "managers" / "tokenizer_manager.py"):
        tree = ast.parse(path.read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TokenizerManager")
        init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
        assert [a.arg for a in init.args.args[:2]] == ["self", "server_args"], path
    assert ("sglang.srt.managers.tokenizer_manager", "TokenizerManager.__init__") in [
        (m, p) for m, p, _how in verl_probe.TARGETS]


def test_verls_key_renaming_is_timed_inside_an_update_only(probe_dir, monkeypatch):
    """``convert_weight_keys`` of verl's FSDP engine module (inside ``get_per_tensor_param``) keeps its result
    under the probe and is written only while an ``update_weights`` runs (the trainer renames keys elsewhere)."""
    pytest.importorskip("verl")
    from verl.workers.engine.fsdp import transformer_impl

    monkeypatch.setattr(transformer_impl, "convert_weight_keys", transformer_impl.convert_weight_keys)
    how = next(h for m, p, h in verl_probe.TARGETS if (m, p) == ("verl.workers.engine.fsdp.transformer_impl",
                                                                  "convert_weight_keys"))
    assert verl_probe._patch(transformer_impl, "convert_weight_keys", how)
    state = {"model.w": 1}
    assert transformer_impl.convert_weight_keys(state, types.SimpleNamespace()) == state  # outside: not written
    monkeypatch.setattr(verl_probe, "_window", 0)
    verl_probe._open_window(1)
    try:
        assert transformer_impl.convert_weight_keys(state, types.SimpleNamespace()) == state
    finally:
        verl_probe._open_window(-1)
    assert [s["name"] for s in spans_in(probe_dir)] == ["verl.convert_weight_keys"]
