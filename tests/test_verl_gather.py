"""The layered gather (``sgl_rollout.integrations.verl_gather``) on FSDP2 over gloo, 2 CPU processes: the same
names, order and values as verl's per-tensor ``full_tensor()`` stream, every unit resharded after it (also when
the reader stops early), training goes on after it; verl's key renaming and MoE unfusing applied as verl applies
them; the wrapper of verl's ``get_per_tensor_param`` switches on ``SGLROLLOUT_LAYERED_GATHER=1`` only."""

import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("verl")

from sgl_rollout.integrations import verl_gather  # noqa: E402

WORLD = 2


def _model(mixed):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=101, tie_word_embeddings=False)  # 101: uneven shards
    model = LlamaForCausalLM(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mixed else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def _all_sharded(model):
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in model.parameters())


def _rank(rank, port, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    res = {}
    for mixed in (False, True):
        model = _model(mixed)
        ref = [(k, v.full_tensor()) for k, v in model.state_dict().items()]
        got = list(verl_gather.layered_full_tensors(model))
        dtype = torch.bfloat16 if mixed else torch.float32
        res[mixed] = {"names": [k for k, _ in got] == [k for k, _ in ref],
                      "equal": all(torch.equal(g, r.to(dtype)) for (_, g), (_, r) in zip(got, ref)),
                      "dtypes": {g.dtype for _, g in got}, "resharded": _all_sharded(model)}
        exact = list(verl_gather.layered_full_tensors(model, narrow_ok=lambda dtype: False))
        res[mixed]["lossless"] = all(torch.equal(g, r) and g.dtype == torch.float32
                                     for (_, g), (_, r) in zip(exact, ref)) and _all_sharded(model)
        stream = verl_gather.layered_full_tensors(model)
        [next(stream) for _ in range(3)]  # a reader that stops inside layer 0's unit
        stream.close()
        res[mixed]["closed_resharded"] = _all_sharded(model)
        loss = model(torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss
        loss.backward()
        res[mixed]["trains"] = bool(torch.isfinite(loss)) and _all_sharded(model)
    engine = SimpleNamespace(module=_model(False), model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="llama")))
    from verl.utils.model import convert_weight_keys

    from sgl_rollout import trace

    spans = []
    trace.add_listener(lambda span: spans.append(span.name))
    names = [k for k, _ in verl_gather._stream(engine)]
    res["spans"] = spans  # the set-up's two spans, for bench verl's probe
    res["verl_names"] = names == list(convert_weight_keys(engine.module.state_dict(), engine.module).keys())
    res["can_use"] = verl_gather._can_use(engine)
    torch.save(res, out / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("gather")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(port, out), nprocs=WORLD, start_method="spawn")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("mixed", [False, True])
def test_same_names_order_and_values_as_verls_per_tensor_gather(ranks, mixed):
    for res in ranks:
        r = res[mixed]
        assert r["names"] and r["equal"], r
        assert r["dtypes"] == {torch.bfloat16 if mixed else torch.float32}  # the unit's compute dtype
        assert r["resharded"] and r["closed_resharded"] and r["trains"], r
        assert r["lossless"], r  # a unit whose compute dtype the receiver does not hold: verl's fp32, per tensor


def test_verls_renaming_and_the_engine_check(ranks):
    for res in ranks:
        assert res["verl_names"] and res["can_use"] is None
        assert res["spans"] == ["gather.state_dict", "gather.rename"]


def test_the_wrapper_switches_on_the_environment_only(monkeypatch):
    calls = []

    class Engine:
        def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
            calls.append(("verl", layered_summon, base_sync_done))
            return iter([("w", 1)]), None

    assert verl_gather.install(Engine) and verl_gather.install(Engine)  # idempotent
    monkeypatch.setattr(verl_gather, "_can_use", lambda engine: None)
    monkeypatch.setattr(verl_gather, "_stream", lambda engine: iter([("layered", 2)]))
    monkeypatch.delenv(verl_gather.ENV, raising=False)
    assert list(Engine().get_per_tensor_param(layered_summon=True)[0]) == [("w", 1)]
    monkeypatch.setenv(verl_gather.ENV, "1")
    stream, peft = Engine().get_per_tensor_param(base_sync_done=True)
    assert list(stream) == [("layered", 2)] and peft is None
    monkeypatch.setattr(verl_gather, "_can_use", lambda engine: "LoRA")
    assert list(Engine().get_per_tensor_param()[0]) == [("w", 1)]
    assert calls == [("verl", True, False), ("verl", False, False)]


def test_bench_verl_sets_the_switch_on_its_own_side_only(tmp_path):
    from sgl_rollout.bench import verl_compare

    assert verl_compare.GATHER_ENV == verl_gather.ENV
    ours = verl_compare.side_command("ours", tmp_path, tmp_path, 1, 1, 2, 0.5, layered_gather=True)
    builtin = verl_compare.side_command("builtin", tmp_path, tmp_path, 1, 1, 2, 0.5, layered_gather=True)
    switch = f"+ray_kwargs.ray_init.runtime_env.env_vars.{verl_gather.ENV}='1'"
    assert switch in ours and switch not in builtin
    assert switch not in verl_compare.side_command("ours", tmp_path, tmp_path, 1, 1, 2, 0.5)
    assert any("--ours-layered-gather" in d for d in verl_compare.differences(layered_gather=True))
