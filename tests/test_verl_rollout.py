"""verl's real classes driving this package's replica, server actor and adapter on a local CPU Ray
cluster, with only SGLang replaced by an engine double (tests/fakes.py) inside the server actor:

* verl's hybrid call sequence (sleep, staged wake, weight sync, generate) through the adapter;
* two replicas through verl's ``LLMServerManager``, load balancer and ``LLMServerClient``;
* verl's ``CheckpointEngineWorker`` (no device mesh, an async weight generator) at TP=2 over gloo;
* verl's partial-rollout pause (``abort_all_requests`` / ``resume_generation``);
* LoRA served as an adapter: verl's ``update_weights(weights, peft_config=, base_sync_done=)`` sequence,
  the base sent only when the engine lacks it."""

import asyncio
import os
import pickle
import shutil
import socket
import sys
import threading
import time
import types

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("verl")

import _sglang_cpu  # noqa: E402
import fakes  # noqa: E402
import torch  # noqa: E402
from test_verl_config import compose, make_tiny_model  # noqa: E402
from verl.checkpoint_engine.base import CheckpointEngineWorker  # noqa: E402

from sgl_rollout.integrations.verl_rollout import SglRollout  # noqa: E402
from sgl_rollout.integrations.verl_server import SglRolloutReplica, VerlRolloutServer  # noqa: E402
from sgl_rollout.weight_sync.bucket import iter_buckets  # noqa: E402


class FakeServer(VerlRolloutServer):
    """The real server actor with the engine double, plus read-outs for the tests."""

    engine_factory = fakes.FakeSGLangEngine

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sync_log = []
        self.loaded = []

    async def start(self):
        _sglang_cpu.ensure_sglang_importable()
        # request objects without SGLang's serving stack
        sys.modules["sgl_rollout.engine.io_struct"].make = lambda name, **fields: types.SimpleNamespace(**fields)
        tags = await super().start()
        self._engine._engine.on_update = self._record
        return tags

    def _record(self, payloads):
        """What each TP rank's payload holds: [(name, sum of values)] per rank (or the unpickling error)."""
        bucket = []
        for p in payloads:
            try:
                d = pickle.loads(p)
                flat = d["flattened_tensor"]
                bucket.append([(m.name, float(flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape).double().sum()))
                               for m in d["metadata"]])
            except Exception as e:  # noqa: BLE001 - shown by the test
                bucket.append(repr(e))
        self.loaded.append(bucket)

    async def begin_weight_sync(self):
        self.sync_log.append("begin")
        return await super().begin_weight_sync()

    async def finish_weight_sync(self, ok=True, global_steps=None):
        self.sync_log.append(f"finish:{ok}")
        return await super().finish_weight_sync(ok, global_steps)

    async def fake_calls(self):
        return list(self._engine._engine.calls)

    async def last_sampling_params(self):
        return self._engine._engine.last_sampling_params

    async def server_args(self):
        return dict(self._engine._engine.server_args)

    async def read_log(self):
        return list(self.sync_log), list(self.loaded)

    async def block_generation(self, on: bool):
        self._engine._engine.block = threading.Event() if on else None

    async def set_lora_base_shapes(self, shapes):
        self._engine._engine.lora_base_shapes = dict(shapes)

    async def fake_lora(self):
        """The double's adapters: SGLang name -> (config, {tensor name: sum}), and whether it died."""
        fake = self._engine._engine
        return ({n: (a["config"], {k: float(t.double().sum()) for k, t in a["tensors"].items()})
                 for n, a in fake.lora.items()}, fake.dead)

    async def last_lora_path(self):
        return self._engine._engine.last_lora_path

    async def running_rids(self):
        """The request ids the double is generating now (SGLang's running batch)."""
        return sorted(self._engine._engine.running)


class Replica(SglRolloutReplica):
    server_class = FakeServer


class TrainerWorker:
    def ping(self):
        return True


class CEWorker(CheckpointEngineWorker):
    """verl's CheckpointEngineWorker, whose checkpoint engine yields given weights as an async generator."""

    def __init__(self, *args, **kwargs):
        _sglang_cpu.ensure_sglang_importable()
        torch.multiprocessing.set_sharing_strategy("file_system")  # the server actor opens CPU payloads
        super().__init__(*args, **kwargs)

    def set_weights(self, items, fail_at=None):
        async def receive_weights(global_steps=None):
            for i, (name, tensor) in enumerate(items):
                if i == fail_at:
                    raise RuntimeError("boom: the checkpoint engine lost the connection")
                await asyncio.sleep(0)
                yield name, tensor

        self.checkpoint_engine.receive_weights = receive_weights


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, namespace="sgl_rollout_verl_test")
    for mod in (sys.modules[__name__], fakes, _sglang_cpu):
        ray.cloudpickle.register_pickle_by_value(mod)  # the actors cannot import the test files
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "tiny-llama"), hidden=128, intermediate=256, vocab=512)


def _stop(*servers):
    for s in servers:
        ray.get(s.shutdown.remote())
        ray.kill(s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ce_setup(cluster, tiny_model):
    """Two verl CheckpointEngineWorkers of a TP=2 standalone replica (made first: their start-up overlaps
    the manager's), with the verl configs they were built from."""
    from verl.workers.config import CheckpointEngineConfig
    from verl.workers.config import RolloutConfig as VerlRolloutConfig

    cfg = VerlRolloutConfig(name="sglang", tensor_model_parallel_size=2, n_gpus_per_node=2, enforce_eager=True,
                            checkpoint_engine=CheckpointEngineConfig(backend="naive", update_weights_bucket_megabytes=1))
    model = {"_target_": "verl.workers.config.HFModelConfig", "path": tiny_model}
    port = _free_port()
    workers = [
        ray.remote(CEWorker).options(num_cpus=0, runtime_env={"env_vars": {
            "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}}).remote(
            rollout_config=cfg, model_config=model, replica_rank=2)
        for r in range(2)]
    yield cfg, model, workers
    for w in workers:
        ray.kill(w)


@pytest.fixture(scope="module")
def manager(cluster, tiny_model, ce_setup):
    """verl's LLMServerManager over two TP=1 replicas on one node (hybrid mode), from the composed
    ppo_trainer config: response_length 7, max_model_len 64, the model copied to /dev/shm (use_shm)."""
    from verl.workers.rollout.llm_server import LLMServerManager

    class Manager(LLMServerManager):
        rollout_replica_class = Replica

    root = compose("actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.n_gpus_per_node=2",
                   "actor_rollout_ref.model.use_shm=true", "data.max_response_length=7",
                   "actor_rollout_ref.rollout.max_model_len=64", "actor_rollout_ref.rollout.enforce_eager=true",
                   model_path=tiny_model)
    workers = [ray.remote(num_cpus=0)(TrainerWorker).options(runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": str(i)}}).remote()
               for i in range(2)]
    m = Manager.create(root, worker_group=types.SimpleNamespace(workers=workers, world_size=2))
    m.root = root
    local = ray.get(m.server_handles[0].model_path.remote())
    yield m
    _stop(*m.server_handles)
    ray.kill(m.global_load_balancer)
    shutil.rmtree(os.path.dirname(local), ignore_errors=True)


def _generates(server) -> int:
    return sum(c[0] == "generate" for c in ray.get(server.fake_calls.remote()))


def test_two_replicas_get_distinct_addresses_and_share_requests(manager):
    """verl's LLMServerManager keys its load balancer by server address: two replicas on one node
    must both get entries, and both must serve (40 requests through verl's real client)."""
    servers = manager.server_handles
    assert len(servers) == 2 and len(set(manager.server_addresses)) == 2
    host, port = manager.server_addresses[0].rsplit(":", 1)
    assert int(port) > 0 and host == ray.util.get_node_ip_address()
    with pytest.raises(ConnectionRefusedError):  # reserved, but no HTTP server behind it
        socket.create_connection((host, int(port)), timeout=5).close()
    status = ray.get(manager.global_load_balancer.get_status.remote())
    assert status["active_servers"] == 2
    # use_shm: each engine loads from the node's /dev/shm copy, as verl's own server does
    local = ray.get(servers[0].model_path.remote())
    assert local.startswith("/dev/shm/verl-cache/") and ray.get(servers[0].server_args.remote())["model_path"] == local
    assert ray.get(servers[1].env.remote())["CUDA_VISIBLE_DEVICES"] == "1"

    client = manager.get_client()
    before = [_generates(s) for s in servers]

    async def requests():
        return await asyncio.gather(*[
            client.generate(f"req{i}", prompt_ids=[5, 6, 7], sampling_params={"max_tokens": 4, "logprobs": True})
            for i in range(40)])

    outs = asyncio.run(requests())
    assert all(o.token_ids == [8, 9, 10, 11] and len(o.log_probs) == 4 for o in outs)
    per_server = [_generates(s) - b for s, b in zip(servers, before)]
    assert sum(per_server) == 40 and min(per_server) > 0, per_server
    # each server's own count (logged at every sleep) agrees with what its engine saw
    counts = [ray.get(s.request_counts.remote()) for s in servers]
    assert [c["since_sleep"] for c in counts] == per_server, counts


def test_verl_sequence(manager, tiny_model, monkeypatch):
    """verl's hybrid step through replica 0 and an adapter as verl's trainer worker builds it."""
    from safetensors.torch import load_file
    from verl.utils.config import omega_conf_to_dataclass

    monkeypatch.setenv("RANK", "0")
    # the server actor opens the payloads to check them: CPU storages must be shared by file name
    monkeypatch.setattr(torch.multiprocessing, "_sharing_strategy", torch.multiprocessing.get_sharing_strategy())
    torch.multiprocessing.set_sharing_strategy("file_system")
    replica, server = manager.get_replicas()[0], manager.server_handles[0]
    cfg = omega_conf_to_dataclass(manager.root.actor_rollout_ref.rollout)
    adapter = SglRollout(cfg, manager.root.actor_rollout_ref.model, device_mesh=None)
    assert adapter.sleep_level == 2 and adapter.tp_rank == 0 and adapter.is_leader_rank
    calls_before = len(ray.get(server.fake_calls.remote()))

    # verl: sleep_replicas(), then per step resume weights, update_weights, offload, resume kv_cache
    asyncio.run(replica.sleep())
    with pytest.raises(ray.exceptions.RayTaskError, match="already released"):
        asyncio.run(replica.sleep())  # a second sleep is refused, the engine lives on
    asyncio.run(adapter.resume(["weights"]))
    items = sorted(load_file(os.path.join(tiny_model, "model.safetensors")).items())
    lora_named = [(n.replace("up_proj.", "up_proj.base_layer."), t) for n, t in items]  # verl's LoRA-merged names
    asyncio.run(adapter.update_weights(iter(lora_named), peft_config=None, base_sync_done=True, global_steps=5))
    asyncio.run(adapter.resume(["kv_cache"]))
    asyncio.run(adapter.resume(["kv_cache"]))  # resuming a resident stage is a no-op, not a crash
    log, loaded = ray.get(server.read_log.remote())
    assert log[-2:] == ["begin", "finish:True"]
    assert loaded[-1][0] == [(n, float(t.double().sum())) for n, t in items]  # names folded, values intact

    out = ray.get(server.generate.remote([1, 2, 3], {"logprobs": True, "temperature": 1.0}, request_id="r0"))
    assert out.token_ids == [4 + k for k in range(7)]  # response_length=7 new tokens by default
    assert out.log_probs == [-0.5] * 7 and out.stop_reason == "length"
    assert out.extra_fields["global_steps"] == 5
    out = ray.get(server.generate.remote([1, 2], {"max_tokens": 2}, request_id="r1"))
    assert out.token_ids == [3, 4] and out.log_probs is None
    out = ray.get(server.generate.remote([1], {"max_new_tokens": 3, "max_tokens": 9}, request_id="r2"))
    assert out.token_ids == [2, 3, 4]
    assert ray.get(server.last_sampling_params.remote()) == {"max_new_tokens": 3}  # vLLM's key never reaches SGLang
    out = ray.get(server.generate.remote([1], {"max_new_tokens": 0, "logprobs": True}, request_id="r3"))
    assert out.token_ids == [] and out.log_probs == []  # 0 means none, not the default length
    assert ray.get(server.last_sampling_params.remote())["max_new_tokens"] == 0
    out = ray.get(server.generate.remote(list(range(60)), {"max_tokens": 100}, request_id="r4"))
    assert len(out.token_ids) == 64 - 60 - 1  # bounded by max_model_len
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        ray.get(server.generate.remote([1], {"max_tokens": -1}, request_id="r5"))
    # verl's teacher request (prompt logprobs): row j is prompt position j+1, the last row padding
    out = ray.get(server.generate.remote([1, 2], {"prompt_logprobs": 0, "max_tokens": 1}, request_id="r6"))
    assert out.extra_fields["prompt_ids"] == [[2], [0]] and out.extra_fields["prompt_logprobs"] == [[-0.5], [0.0]]
    with pytest.raises(NotImplementedError, match="audio"):
        ray.get(server.generate.remote([1], {}, request_id="r7", audio_data=[b"x"]))

    calls = ray.get(server.fake_calls.remote())[calls_before:]
    assert [c[0] for c in calls] == ["release", "resume", "update_weights", "resume"] + ["generate"] * 6
    assert calls[0] == ("release", ("weights", "kv_cache"))
    assert calls[1] == ("resume", ("weights",)) and calls[3] == ("resume", ("kv_cache",))
    assert calls[2][1:3] == ("flattened_bucket", 1)

    with pytest.raises(NotImplementedError, match="LoRA"):
        asyncio.run(adapter.update_weights(iter([]), peft_config={"r": 8}, base_sync_done=True))
    with pytest.raises(NotImplementedError, match="delta_flush"):
        asyncio.run(adapter.update_weights(iter([]), wire_format="delta_flush"))
    # a name the model does not have never reaches the engine; the sync is ended as failed
    with pytest.raises(Exception, match="model.layers.9.mlp.up_proj.weight"):
        asyncio.run(adapter.update_weights(iter([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])))
    assert ray.get(server.read_log.remote())[0][-2:] == ["begin", "finish:False"]


def test_partial_rollout_pause(manager):
    """verl's abort_all_requests / resume_generation: abort what runs, hold (or reject) new requests."""
    replica, server = manager.get_replicas()[1], manager.server_handles[1]
    ray.get(server.block_generation.remote(True))
    running = server.generate.remote([1], {"max_tokens": 2}, request_id="p0")
    # the abort must find p0 running: one sent before p0 is admitted holds p0 behind the pause instead
    # (the engine names requests itself, so p0 is the one request it runs)
    deadline = time.monotonic() + 30
    while not ray.get(server.running_rids.remote()):
        assert time.monotonic() < deadline, "p0 never reached the engine"
        time.sleep(0.01)
    asyncio.run(replica.abort_all_requests())
    assert ray.get(running, timeout=30).stop_reason == "abort"
    ray.get(server.block_generation.remote(False))
    held = server.generate.remote([1], {"max_tokens": 2}, request_id="p1")
    ready, _ = ray.wait([held], timeout=1.0)
    assert not ready  # waits behind the pause, as SGLang's paused tokenizer manager does
    assert ray.get(server.release_kv_cache.remote()) == ["kv_cache"]  # nothing runs: admitted
    ray.get(server.resume_kv_cache.remote())
    asyncio.run(replica.resume_generation())
    assert ray.get(held, timeout=30).token_ids == [2, 3]
    asyncio.run(replica.abort_all_requests(reject_request=True))
    with pytest.raises(RuntimeError, match="reject_request=True"):
        ray.get(server.generate.remote([1], {"max_tokens": 2}, request_id="p2"))
    asyncio.run(replica.resume_generation())
    assert ray.get(server.generate.remote([1], {"max_tokens": 1}, request_id="p3")).token_ids == [2]


def test_checkpoint_engine_worker_tp2_async_generator(ce_setup, tiny_model):
    """verl's CheckpointEngineWorker builds the adapter with device_mesh=None before torch.distributed
    is up and feeds it an async generator; at TP=2 the engine must get 2 payloads per bucket."""
    from safetensors.torch import load_file
    from verl.workers.rollout.replica import RolloutMode

    cfg, model, workers = ce_setup
    # standalone replicas come after the hybrid ones (verl's start_rank), here after the manager's 0 and 1
    replica = Replica(replica_rank=2, config=cfg, model_config=model, gpus_per_node=2)
    replica.workers, replica.rollout_mode = workers, RolloutMode.STANDALONE
    asyncio.run(replica.launch_servers())
    server = replica.server_handle
    try:
        assert ray.get([w.is_leader_rank.remote() for w in workers]) == [True, False]
        assert ray.get([w.get_replica_rank.remote() for w in workers]) == [2, 2]

        items = sorted(load_file(os.path.join(tiny_model, "model.safetensors")).items())
        expected = [[(n, float(t.double().sum())) for n, t in b] for b in iter_buckets(items, 1 << 20)]
        assert len(expected) >= 2

        def sync(per_rank=(None, None), fail_at=(None, None), global_steps=7):
            ray.get([w.set_weights.remote(per_rank[r] or items, fail_at=fail_at[r]) for r, w in enumerate(workers)])
            refs = [w.update_weights.remote(global_steps=global_steps) for w in workers]
            results = []
            for ref in refs:
                try:
                    results.append(ray.get(ref, timeout=120))
                except ray.exceptions.RayTaskError as e:
                    results.append(e)
            return results

        # verl's CheckpointEngineManager.update_weights: abort, release the KV cache, sync, resume
        asyncio.run(replica.abort_all_requests())
        asyncio.run(replica.release_kv_cache())
        assert sync() == [None, None]
        asyncio.run(replica.resume_kv_cache())
        asyncio.run(replica.resume_generation())

        log, loaded = ray.get(server.read_log.remote())
        assert log == ["begin", "finish:True"]
        updates = [c for c in ray.get(server.fake_calls.remote()) if c[0] == "update_weights"]
        assert [c[2] for c in updates] == [2] * len(expected)  # one payload per TP rank, every bucket
        assert loaded == [[b, b] for b in expected]  # both ranks' buckets hold exactly the weights sent
        out = ray.get(server.generate.remote([1, 2], {"max_tokens": 2}, request_id="x"))
        assert out.extra_fields["global_steps"] == 7

        # a bad tensor late in the sync (the manifest check): both ranks raise, the engine is told
        bad = items[:-1] + [(items[-1][0], torch.zeros(3, 3))]
        results = sync(per_rank=(bad, bad))
        assert all("SyncValidationError" in str(r) and items[-1][0] in str(r) for r in results), results
        assert ray.get(server.read_log.remote())[0][-2:] == ["begin", "finish:False"]
        with pytest.raises(ray.exceptions.RayTaskError, match="did not complete"):
            ray.get(server.generate.remote([1], {"max_tokens": 1}, request_id="y"))  # mixed weights: refused

        # rank 1's generator fails mid-sync: both ranks raise, nobody hangs
        results = sync(fail_at=(None, 3))
        assert "boom" in str(results[1]) and "TP rank 1" in str(results[0]) and "boom" in str(results[0])
        assert ray.get(server.read_log.remote())[0][-1] == "finish:False"

        assert sync(global_steps=8) == [None, None]  # a complete sync lets generation resume
        assert ray.get(server.generate.remote([1], {"max_tokens": 1}, request_id="z")).extra_fields["global_steps"] == 8
    finally:
        _stop(server)


# ======================================================================= LoRA served as an adapter
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_weights(tiny_model, seed):
    """What verl's FSDP engine hands the rollout (``get_per_tensor_param``) for a PEFT model of ``tiny_model``:
    the base (``base_sync_done=False``: names with ``.base_layer``, as ``replace_lora_wrapper`` makes them) and
    the adapter (``base_sync_done=True``: PEFT's saved names, CPU tensors), and ``peft_config.to_dict()``."""
    import peft
    from peft.utils.save_and_load import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    base = [(n.replace("base_model.model.", "").replace(".base_layer", "").replace(
        "_proj.weight", "_proj.base_layer.weight"), p.detach().clone())
        for n, p in pm.named_parameters() if "lora_" not in n]
    adapter = [(k, v.detach().cpu().clone()) for k, v in get_peft_model_state_dict(pm).items()]
    return base, adapter, pm.peft_config["default"].to_dict()


async def verl_update_weights(adapter, state, base, lora, peft_config, global_steps, free_cache_engine):
    """The rollout side of verl 0.9.1's ``ActorRolloutRefWorker.update_weights`` (naive mode,
    ``verl/workers/engine_workers.py``), call for call: resume weights unless SGLang sleeps at level 1,
    the base while verl's ``base_sync_done`` is False, the adapter, resume the KV cache."""
    if free_cache_engine and getattr(adapter, "sleep_level", 2) != 1:
        await adapter.resume(tags=["weights"])
    do_lora_base_sync = False
    if not state["peft_merge"] and peft_config is not None:
        adapter.sleep_level = 1
        do_lora_base_sync = not state["base_sync_done"]
    if do_lora_base_sync:
        await adapter.update_weights(iter(base), peft_config=peft_config, base_sync_done=False,
                                     global_steps=global_steps)
    await adapter.update_weights(iter(lora), peft_config=peft_config, base_sync_done=True, global_steps=global_steps)
    if free_cache_engine:
        await adapter.resume(tags=["kv_cache"])
    state["base_sync_done"] = True


def launch_lora_replica(rank, tiny_model, *overrides):
    """A hybrid replica (engine double) and the adapter verl's trainer worker builds, for a composed config
    with LoRA served as an adapter."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.replica import RolloutMode

    root = compose("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
                   "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.n_gpus_per_node=1",
                   "actor_rollout_ref.rollout.enforce_eager=true", *overrides, model_path=tiny_model)
    cfg = omega_conf_to_dataclass(root.actor_rollout_ref.rollout)
    model_cfg = root.actor_rollout_ref.model
    worker = ray.remote(num_cpus=0)(TrainerWorker).options(runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": "0"}}).remote()
    replica = Replica(replica_rank=rank, config=cfg, model_config=model_cfg, gpus_per_node=1)
    replica.workers, replica.rollout_mode = [worker], RolloutMode.HYBRID
    asyncio.run(replica.launch_servers())
    server = replica.server_handle
    adapter = SglRollout(cfg, model_cfg, device_mesh=None, replica_rank=rank)
    return root, replica, server, adapter, worker


def _sent(server):
    """(base buckets, names of the base tensors, adapter loads, adapter payload bytes) the engine double
    received (TP rank 0's payloads)."""
    calls = ray.get(server.fake_calls.remote())
    log = ray.get(server.read_log.remote())[1]
    base_names = [name for bucket in log for name, _sum in bucket[0]]
    loads = [c for c in calls if c[0] == "load_lora"]
    return sum(c[0] == "update_weights" for c in calls), base_names, len(loads), sum(c[3] for c in loads)


@pytest.mark.parametrize("free_cache_engine", [True, False])
def test_verl_lora_adapter_sequence_sends_base_once(cluster, tiny_model, monkeypatch, free_cache_engine):
    """verl's hybrid steps with LoRA served as an adapter (dummy load, so verl hands the base on the first
    step): base weights cross once, the adapter every step, sleep releases only the KV cache (level 1),
    and every request carries the current adapter."""
    from safetensors.torch import load_file

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.multiprocessing, "_sharing_strategy", torch.multiprocessing.get_sharing_strategy())
    torch.multiprocessing.set_sharing_strategy("file_system")
    rank = 10 if free_cache_engine else 11
    root, replica, server, adapter, worker = launch_lora_replica(
        rank, tiny_model, f"actor_rollout_ref.rollout.free_cache_engine={str(free_cache_engine).lower()}")
    try:
        args = ray.get(server.server_args.remote())
        assert args["enable_lora"] is True and args["max_lora_rank"] == 8 and args["load_format"] == "dummy"
        assert args["lora_target_modules"] == LORA_TARGETS
        assert adapter.sleep_level == 1 and adapter.rollout_config.sleep_level == 1
        ckpt = load_file(os.path.join(tiny_model, "model.safetensors"))
        ray.get(server.set_lora_base_shapes.remote(
            {n[: -len(".weight")]: tuple(t.shape) for n, t in ckpt.items() if t.dim() == 2}))
        state = {"peft_merge": False, "base_sync_done": "dummy" not in root.actor_rollout_ref.rollout.load_format}
        assert state["base_sync_done"] is False
        base_bytes = sum(t.numel() * t.element_size() for t in ckpt.values())

        asyncio.run(replica.sleep())  # verl's sleep_replicas() before the first step
        history = []
        for step in range(1, 4):
            base, lora, peft_config = lora_weights(tiny_model, seed=step)
            asyncio.run(verl_update_weights(adapter, state, base, lora, peft_config, step, free_cache_engine))
            history.append(_sent(server))
            out = ray.get(server.generate.remote([1, 2, 3], {"max_tokens": 2}, request_id=f"s{step}"))
            assert out.extra_fields["global_steps"] == step and len(out.token_ids) == 2
            assert ray.get(server.last_lora_path.remote()) == [f"verl_policy@v{step}.{step}"]
            loaded, dead = ray.get(server.fake_lora.remote())
            assert not dead and list(loaded) == [f"verl_policy@v{step}.{step}"]  # the old version is gone
            cfg, sums = loaded[f"verl_policy@v{step}.{step}"]
            assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and cfg["target_modules"] == sorted(LORA_TARGETS)
            assert sums == {k: float(v.double().sum()) for k, v in lora}  # this step's adapter, intact
            asyncio.run(replica.sleep())
        buckets = [h[0] for h in history]
        assert buckets[0] >= 1 and buckets == [buckets[0]] * 3  # base buckets only on the first step
        sent_names = history[-1][1]
        assert sorted(sent_names) == sorted(ckpt)  # every base tensor exactly once (.base_layer folded)
        assert sum(ckpt[n].numel() * ckpt[n].element_size() for n in sent_names) == base_bytes
        assert [h[2] for h in history] == [1, 2, 3]  # the adapter every step
        assert adapter.base_syncs == 1 and adapter.adapter_syncs == 3 and adapter.base_syncs_skipped == 0
        adapter_bytes = [b - a for a, b in zip([0] + [h[3] for h in history], [h[3] for h in history])]
        assert len(set(adapter_bytes)) == 1 and 0 < adapter_bytes[0] < base_bytes / 5
        print(f"\nbase {base_bytes} bytes once; adapter payload {adapter_bytes[0]} bytes every step")
        releases = [c for c in ray.get(server.fake_calls.remote()) if c[0] == "release"]
        if free_cache_engine:
            assert releases and all(c[1] == ("kv_cache",) for c in releases)  # level 1: weights stay
        else:
            assert not releases
        status = ray.get(server.lora_status.remote())
        assert status["adapters"] == {"verl_policy": 3} and not status["base_sync_needed"]

        # verl offers the base again (its base_sync_done reset, say): the engine has it, nothing is sent
        state["base_sync_done"] = False
        base, lora, peft_config = lora_weights(tiny_model, seed=9)
        asyncio.run(verl_update_weights(adapter, state, base, lora, peft_config, 4, free_cache_engine))
        assert _sent(server)[0] == buckets[0] and adapter.base_syncs_skipped == 1 and adapter.adapter_syncs == 4
    finally:
        _stop(server)
        ray.kill(worker)


def test_verl_lora_adapter_refusals_never_reach_the_engine(cluster, tiny_model, monkeypatch):
    """A real load format (verl never sends the base), then: a malformed adapter, an adapter after the engine
    lost its base weights, a peft_config for an engine without LoRA; the double never sees a bad call."""
    from safetensors.torch import load_file

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.multiprocessing, "_sharing_strategy", torch.multiprocessing.get_sharing_strategy())
    torch.multiprocessing.set_sharing_strategy("file_system")
    root, replica, server, adapter, worker = launch_lora_replica(
        12, tiny_model, "actor_rollout_ref.rollout.load_format=safetensors")
    try:
        ckpt = load_file(os.path.join(tiny_model, "model.safetensors"))
        ray.get(server.set_lora_base_shapes.remote(
            {n[: -len(".weight")]: tuple(t.shape) for n, t in ckpt.items() if t.dim() == 2}))
        state = {"peft_merge": False, "base_sync_done": "dummy" not in root.actor_rollout_ref.rollout.load_format}
        base, lora, peft_config = lora_weights(tiny_model, seed=1)
        asyncio.run(replica.sleep())
        asyncio.run(verl_update_weights(adapter, state, base, lora, peft_config, 1, True))
        assert _sent(server)[:3] == (0, [], 1)  # a real load: the base never travels

        bad = list(lora)
        bad[0] = (bad[0][0], torch.zeros(8, bad[0][1].shape[1] + 1))  # lora_A with the wrong in-dim
        with pytest.raises(Exception, match="expected \\(8, 128\\)"):
            asyncio.run(adapter.update_weights(iter(bad), peft_config=peft_config, base_sync_done=True))
        with pytest.raises(Exception, match="rsLoRA"):
            asyncio.run(adapter.update_weights(iter(lora), peft_config={**peft_config, "use_rslora": True},
                                               base_sync_done=True))
        assert _sent(server)[2] == 1
        loaded, dead = ray.get(server.fake_lora.remote())
        assert not dead and list(loaded) == ["verl_policy@v1.1"]  # the good version still serves
        assert ray.get(server.generate.remote([1], {"max_tokens": 1}, request_id="a")).token_ids == [2]

        # someone releases the weights (level 2 by hand): the adapter alone is refused before SGLang sees it
        ray.get(server.release.remote(["weights", "kv_cache"]))
        ray.get(server.resume.remote(["weights"]))
        with pytest.raises(Exception, match="lacks its base weights"):
            asyncio.run(adapter.update_weights(iter(lora), peft_config=peft_config, base_sync_done=True))
        assert _sent(server)[2] == 1
        # verl offering the base now sends it (the rule says the engine lacks it), then the adapter loads
        state["base_sync_done"] = False
        asyncio.run(verl_update_weights(adapter, state, base, lora, peft_config, 2, True))
        buckets, _, loads, _ = _sent(server)
        assert buckets >= 1 and loads == 2 and adapter.base_syncs == 1
        assert not ray.get(server.fake_lora.remote())[1]
    finally:
        _stop(server)
        ray.kill(worker)

    # the adapter of an engine without LoRA (merged LoRA) refuses a peft_config, naming the keys
    from verl.utils.config import omega_conf_to_dataclass

    root = compose("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora.merge=true",
                   model_path=tiny_model)
    merged = SglRollout(omega_conf_to_dataclass(root.actor_rollout_ref.rollout), root.actor_rollout_ref.model,
                               device_mesh=None)
    assert not merged.rollout_config.lora_enabled and merged.sleep_level == 2
    with pytest.raises(NotImplementedError, match="lora.merge"):
        asyncio.run(merged.update_weights(iter([]), peft_config={"r": 8}, base_sync_done=True))


def test_verl_lora_settings_map_and_refuse(tiny_model):
    """verl's LoRA keys as verl's SGLang server reads them; what sgl-rollout cannot serve with an adapter is
    refused at start-up naming the key (no Ray needed)."""
    from verl.utils.config import omega_conf_to_dataclass

    from sgl_rollout.integrations.verl_config import rollout_config_for_verl

    def mapped(*overrides):
        root = compose(*overrides, model_path=tiny_model)
        return rollout_config_for_verl(omega_conf_to_dataclass(root.actor_rollout_ref.rollout), tiny_model,
                                       model_config=root.actor_rollout_ref.model)

    cfg = mapped("actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32")
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules, cfg.sleep_level) == (16, 32.0, "all-linear", 1)
    kw = cfg.to_server_args()
    assert kw["enable_lora"] and kw["max_lora_rank"] == 16 and kw["lora_target_modules"] == LORA_TARGETS
    assert mapped("actor_rollout_ref.model.lora.rank=4").lora_rank == 4  # Megatron's key
    assert mapped("actor_rollout_ref.model.lora_rank=8",
                  "actor_rollout_ref.model.target_modules=[v_proj,q_proj]").lora_target_modules == ["q_proj", "v_proj"]
    merged = mapped("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora.merge=true")
    assert merged.lora_rank == 0 and merged.sleep_level == 2  # merged: full weight syncs, as before
    assert mapped().lora_rank == 0
    for override, key in [("actor_rollout_ref.model.target_modules='.*proj'", "actor_rollout_ref.model.target_modules"),
                          ("actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
                           "actor_rollout_ref.rollout.checkpoint_engine.backend='nccl'"),
                          ("actor_rollout_ref.rollout.quantization=fp8", "actor_rollout_ref.rollout.quantization='fp8'")]:
        with pytest.raises(Exception, match="does not serve") as e:
            mapped("actor_rollout_ref.model.lora_rank=8", override)
        assert key in str(e.value), (key, str(e.value))
    # the replica no longer refuses LoRA served as an adapter (verl builds replicas before anything else)
    root = compose("actor_rollout_ref.model.lora_rank=8", model_path=tiny_model)
    Replica(replica_rank=0, config=root.actor_rollout_ref.rollout, model_config=root.actor_rollout_ref.model,
            gpus_per_node=8)
