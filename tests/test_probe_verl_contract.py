"""The timing probe keeps the calling convention of every verl function it wraps (issue 45, item 1).

verl 0.9.1 marks ``CheckpointEngineManager``'s steps with ``verl.utils.ray_utils.auto_await``, which looks
at its *caller's* frame: awaited from a coroutine it returns the coroutine, called from plain code it runs
the coroutine itself and returns the result. The probe's first wrapper was a plain function, so verl's
own ``await self.abort_replicas()`` got ``None`` and both sides of every one-step-off run died at the
first weight sync. Here verl's real ``CheckpointEngineManager.update_weights`` runs with the probe
installed, and every verl target of :data:`sgl_rollout.bench.verl_probe.TARGETS` is checked for the kind
of function it is (plain, coroutine, async generator, ``auto_await``) against what the probe makes of it.
"""

import ast
import asyncio
import importlib
import importlib.util
import inspect
import types
from pathlib import Path

import pytest

from sgl_rollout.bench import verl_probe
from verl_helpers import probe_dir, spans_in  # noqa: F401 - probe_dir is a fixture

pytest.importorskip("verl")
from verl.utils.ray_utils import auto_await  # noqa: E402


# ------------------------------------------------------------------ verl's real CheckpointEngineManager
class _Replica:
    """A ``RolloutReplica`` as ``CheckpointEngineManager`` drives it: coroutine methods, logged."""

    def __init__(self, log):
        self.log, self.workers = log, ["w0"]

    def __getattr__(self, name):
        async def call(*args, **kwargs):
            self.log.append(name)
        return call


class _WorkerGroup:
    """A ``RayWorkerGroup`` whose calls return plain values (the module's ``ray.get`` is the identity)."""

    def __init__(self, log, world_size=1, worker_handles=None, **_):
        self.log, self.world_size = log, world_size if worker_handles is None else len(worker_handles)

    def execute_checkpoint_engine(self, method, **kwargs):
        self.log.append(f"ckpt:{method[0]}")
        return [{}] * self.world_size

    def update_weights(self, **kwargs):
        self.log.append("update_weights")
        return [{"sync/bytes": 1}] * self.world_size


def _manager(monkeypatch, log):
    from verl.checkpoint_engine import base

    class Backend:
        @staticmethod
        def build_topology(actor_world, rollout_world, metadata):
            return {}, {}

    monkeypatch.setitem(base.CheckpointEngineRegistry._registry, "probe_test", Backend)
    monkeypatch.setattr(base, "ray", types.SimpleNamespace(get=lambda refs: refs))
    monkeypatch.setattr(base, "RayWorkerGroup", lambda **kw: _WorkerGroup(log, **kw))
    cfg = types.SimpleNamespace(backend="probe_test", custom_backend_module=None)
    return base.CheckpointEngineManager(cfg, _WorkerGroup(log), [_Replica(log), _Replica(log)])


def _patch_manager(monkeypatch):
    """Wrap ``CheckpointEngineManager``'s targets as the probe's import hook does, undone after the test."""
    from verl.checkpoint_engine import base

    for mod, path, how in verl_probe.TARGETS:
        if mod == "verl.checkpoint_engine.base" and path.startswith("CheckpointEngineManager."):
            attr = path.split(".")[1]
            monkeypatch.setattr(base.CheckpointEngineManager, attr, base.CheckpointEngineManager.__dict__[attr])
            assert verl_probe._patch(base, path, how)


EXPECTED_LOG = ["abort_all_requests"] * 2 + ["release_kv_cache"] * 2 + [
    "ckpt:prepare", "ckpt:prepare", "ckpt:init_process_group", "ckpt:init_process_group",
    "update_weights", "update_weights", "ckpt:finalize", "ckpt:finalize"] + ["resume_kv_cache"] * 2 + [
    "resume_generation"] * 2
EXPECTED_SPANS = ["ckpt.abort", "ckpt.release_kv", "ckpt.build_group", "ckpt.resume_kv", "ckpt.resume_generation"]


@pytest.mark.parametrize("caller", ["awaited", "plain_no_loop", "plain_in_loop"])
def test_verls_checkpoint_manager_update_weights_completes_with_the_probe(probe_dir, monkeypatch, caller):
    """The three ways verl calls an ``auto_await`` method, each through the real ``update_weights``."""
    log = []
    _patch_manager(monkeypatch)
    mgr = _manager(monkeypatch, log)

    async def awaited():
        return await mgr.update_weights(global_steps=3)

    def plain():
        return mgr.update_weights(global_steps=3)

    async def plain_in_loop():  # plain code on a loop's thread: auto_await runs it in a thread of its own
        return plain()

    if caller == "awaited":
        out = asyncio.run(awaited())
    elif caller == "plain_in_loop":
        out = asyncio.run(plain_in_loop())
    else:
        out = plain()
    assert out == {"sync/bytes": 1}  # the senders' metrics, merged by verl
    assert log == EXPECTED_LOG
    spans = [s for s in spans_in(probe_dir) if s["name"].startswith("ckpt.")]
    assert [s["name"] for s in spans] == EXPECTED_SPANS and not [s for s in spans if "error" in s]


def test_the_first_wrapper_broke_update_weights_as_verl_did_on_the_gpu(probe_dir, monkeypatch):
    """What 5b3bb3a's probe did (a plain wrapper around an ``auto_await`` function) fails here the way
    both sides failed on the GPUs, so the test above can fail."""
    from verl.checkpoint_engine import base

    log = []
    monkeypatch.setattr(base.CheckpointEngineManager, "abort_replicas",
                        verl_probe._mark(verl_probe._timed_function(
                            base.CheckpointEngineManager.__dict__["abort_replicas"], lambda a, k: "ckpt.abort",
                            lambda k, e: {}, None, False)))
    mgr = _manager(monkeypatch, log)

    async def awaited():
        return await mgr.update_weights(global_steps=1)

    with pytest.raises(TypeError, match="NoneType can't be used in 'await' expression"):
        asyncio.run(awaited())


# ------------------------------------------------------------------ every verl target keeps its kind
def _imported_from(mod: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` of module ``mod`` reads (``from .x import`` and ``from ..x
    import`` resolved against ``mod``'s package)."""
    if not node.level:
        return node.module
    spec = importlib.util.find_spec(mod)
    package = mod if spec.submodule_search_locations else mod.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _kind_in_source(mod: str, path: str):
    """(``"def"`` | ``"async def"`` | ``"async gen"``, decorated with ``auto_await``) of ``mod.path`` read in
    verl's source (modules that cannot import here, SGLang's serving stack or cupy, included)."""
    origin = importlib.util.find_spec(mod).origin
    tree = ast.parse(Path(origin).read_text())
    *owners, name = path.split(".")
    body = tree.body
    if not owners:  # a module-level function may be imported from elsewhere: read it where it is defined
        for node in body:
            if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
                real = next(a.name for a in node.names if (a.asname or a.name) == name)
                return _kind_in_source(_imported_from(mod, node), real)
        if not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in body):
            for node in body:  # ``from x import *`` (verl.utils.debug re-exports verl.utils.profiler so)
                if isinstance(node, ast.ImportFrom) and [a.name for a in node.names] == ["*"]:
                    try:
                        return _kind_in_source(_imported_from(mod, node), name)
                    except StopIteration:
                        continue
    for owner in owners:
        body = next(n.body for n in body if isinstance(n, ast.ClassDef) and n.name == owner)
    node = next(n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)
    decorators = {ast.unparse(d) for d in node.decorator_list}
    if isinstance(node, ast.FunctionDef):
        return "def", "auto_await" in decorators
    gen = any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(node))
    return ("async gen" if gen else "async def"), "auto_await" in decorators


def _verl_targets():
    return [(mod, path, how) for mod, path, how in verl_probe.TARGETS if mod.startswith("verl.")]


def _stand_in(kind: str, decorated: bool):
    """A function of the kind verl's target is, returning 7 (an async generator: yielding 7)."""
    if kind == "def":
        def fn(self, tags=None):
            return 7
    elif kind == "async gen":
        async def fn(self, tags=None):
            yield 7
    else:
        async def fn(self, tags=None):
            await asyncio.sleep(0)
            return 7
    return auto_await(fn) if decorated else fn


async def _drain(out):
    if inspect.isasyncgen(out) or hasattr(out, "__anext__"):
        return [x async for x in out]
    return await out if inspect.isawaitable(out) else out


def _call_every_way(obj, kind, decorated):
    """What ``obj.fn()`` gives in each context verl calls it from."""
    got = {}

    arg = ["weights"]  # what the targets that name their span by an argument read (tags)

    async def awaited():
        return await _drain(obj.fn(arg))

    def plain():
        return obj.fn(arg)

    async def in_loop():  # plain code running on an event loop's thread (verl's sync trainer code in a loop)
        return plain()

    got["awaited"] = asyncio.run(awaited())
    if decorated:  # auto_await: a plain caller gets the result, with or without a running loop
        got["plain"] = plain()
        got["plain_in_loop"] = asyncio.run(in_loop())
    elif kind == "def":
        got["plain"] = plain()
    return got


@pytest.mark.parametrize("target", _verl_targets(), ids=lambda t: f"{t[0].rsplit('.', 1)[-1]}:{t[1]}")
def test_every_verl_target_keeps_its_calling_convention(probe_dir, target):
    """Each target's kind is read in verl's source; a stand-in of that kind, wrapped exactly as the probe
    wraps the target (``_patch`` with the target's own options), answers every caller as the unwrapped
    one does. Where the module imports here, the real attribute is checked to be of that kind too."""
    mod, path, how = target
    kind, decorated = _kind_in_source(mod, path)
    assert (kind == "async gen") == ("agen" in how), f"{mod}.{path} is {kind}: the probe wraps it as {how}"
    if how.get("result") is not None:
        how = {k: v for k, v in how.items() if k != "result"}  # the stand-in returns 7, not a generator
    cls = type("Owner", (), {"fn": _stand_in(kind, decorated)})
    plain = _call_every_way(cls(), kind, decorated)
    holder = types.ModuleType("holder")
    holder.Owner = cls
    assert verl_probe._patch(holder, "Owner.fn", how)
    wrapped = cls.__dict__["fn"]
    assert getattr(wrapped, "_sgl_rollout_probe", False)
    assert (verl_probe._auto_await_of(wrapped) is not None) == decorated
    assert inspect.iscoroutinefunction(wrapped) == (kind == "async def" and not decorated)
    assert _call_every_way(cls(), kind, decorated) == plain
    try:
        real = importlib.import_module(mod)
    except ImportError:
        return  # SGLang's serving stack or a transport absent here: the source said what it is
    obj = real
    for part in path.split("."):
        obj = inspect.getattr_static(obj, part)
    assert (verl_probe._auto_await_of(obj) is not None) == decorated
    if not decorated:
        assert inspect.iscoroutinefunction(obj) == (kind == "async def")
        assert inspect.isasyncgenfunction(obj) == (kind == "async gen")
