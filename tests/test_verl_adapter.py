"""verl's call sequence through this package's replica, server actor and in-worker adapter, on a local
CPU Ray cluster, with an engine double inside the server actor that fails the way SGLang does."""

import asyncio
import sys
import types

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("verl")

import fakes  # noqa: E402
from sgl_rollout.integrations.verl_rollout import SglRolloutAdapter, SglRolloutReplica, VerlRolloutServer  # noqa: E402


class FakeServer(VerlRolloutServer):
    engine_factory = fakes.FakeAsyncSGLangEngine

    async def fake_calls(self):
        return list(self._engine._engine.calls)

    async def last_sampling_params(self):
        return self._engine._engine.last_sampling_params


class TrainerWorker:
    def ping(self):
        return True


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="sgl_rollout_verl_test")
    for mod in (sys.modules[__name__], fakes):
        ray.cloudpickle.register_pickle_by_value(mod)  # the actors cannot import the test files
    yield
    ray.shutdown()


def test_verl_sequence(cluster, monkeypatch):
    import torch
    from verl.workers.config import RolloutConfig as VerlRolloutConfig

    monkeypatch.setenv("RANK", "0")
    cfg = VerlRolloutConfig(name="sglang", tensor_model_parallel_size=1, gpu_memory_utilization=0.5,
                            enforce_eager=True, response_length=7, max_model_len=64)
    model_config = types.SimpleNamespace(local_path="/fake/model")

    class Replica(SglRolloutReplica):
        server_class = FakeServer

    replica = Replica(replica_rank=0, config=cfg, model_config=model_config, gpus_per_node=1)
    replica.workers = [ray.remote(num_cpus=0)(TrainerWorker).options(runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": "3"}}).remote()]
    asyncio.run(replica.launch_servers())
    server = replica.server_handle
    assert ray.get(server.env.remote())["CUDA_VISIBLE_DEVICES"] == "3"
    assert replica.server_address.endswith(":0")

    # the server actor must build SGLang request objects without SGLang's serving stack here
    ray.get(server.__ray_call__.remote(
        lambda self: setattr(sys.modules["sgl_rollout.engine"], "_req", lambda n, **f: types.SimpleNamespace(**f))))

    adapter = SglRolloutAdapter(cfg, model_config, device_mesh=None)
    assert adapter.sleep_level == 2 and adapter.tp_rank == 0

    # verl: sleep_replicas(), then per step resume weights, update_weights, offload, resume kv_cache
    asyncio.run(replica.sleep())
    with pytest.raises(ray.exceptions.RayTaskError, match="already released"):
        asyncio.run(replica.sleep())  # a second sleep is refused, the engine lives on
    asyncio.run(adapter.resume(["weights"]))
    weights = ((f"model.layers.{i}.base_layer.weight", torch.full((256, 256), float(i))) for i in range(3))
    asyncio.run(adapter.update_weights(weights, peft_config=None, base_sync_done=True, global_steps=5))
    asyncio.run(adapter.resume(["kv_cache"]))
    asyncio.run(adapter.resume(["kv_cache"]))  # resuming a resident stage is a no-op, not a crash

    out = ray.get(server.generate.remote([1, 2, 3], {"logprobs": True, "temperature": 1.0}, request_id="r0"))
    assert out.token_ids == [4 + k for k in range(7)]  # response_length=7 new tokens by default
    assert out.log_probs == [-0.5] * 7 and out.stop_reason == "length"
    assert out.extra_fields["global_steps"] == 5
    out = ray.get(server.generate.remote([1, 2], {"max_tokens": 2}, request_id="r1"))
    assert out.token_ids == [3, 4] and out.log_probs is None
    out = ray.get(server.generate.remote([1], {"max_new_tokens": 3, "max_tokens": 9}, request_id="r2"))
    assert out.token_ids == [2, 3, 4]
    assert ray.get(server.last_sampling_params.remote()) == {"max_new_tokens": 3}  # vLLM's key never reaches SGLang

    kinds = [c[0] for c in ray.get(server.fake_calls.remote())]
    assert kinds == ["release", "resume", "update_weights", "resume", "generate", "generate", "generate"]
    calls = ray.get(server.fake_calls.remote())
    assert calls[0] == ("release", ("weights", "kv_cache"))
    assert calls[1] == ("resume", ("weights",)) and calls[3] == ("resume", ("kv_cache",))
    assert calls[2][1:3] == ("flattened_bucket", 1)

    with pytest.raises(NotImplementedError, match="LoRA"):
        asyncio.run(adapter.update_weights(iter([]), peft_config={"r": 8}, base_sync_done=True))
    with pytest.raises(NotImplementedError, match="delta_flush"):
        asyncio.run(adapter.update_weights(iter([]), wire_format="delta_flush"))
