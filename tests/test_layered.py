"""Layered weight streams (sgl_rollout.weight_sync.layered) on the CPU: the layered stream equals the
all-at-once stream bit for bit and in order (plain parameters, CPU offload, FSDP2 on a gloo group of
1 and of 2 processes), buckets never span two layers, and no gathered tensor outlives its consumer."""

import os
import tempfile
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from sgl_rollout.weight_sync.bucket import flatten_bucket, iter_buckets, tensor_nbytes
from sgl_rollout.weight_sync.layered import (
    LiveBytes,
    group_nbytes,
    hf_name,
    iter_all_at_once,
    iter_layered,
    layer_index,
    named_weights,
)

LAYERS = 3


def tiny_llama(tied: bool = False, seed: int = 0):
    """A random bf16 Llama-shaped model; vocab 67 and intermediate 72 shard unevenly over 2 ranks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=72, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied, attention_bias=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def snapshot(stream):
    """Materialize a stream as (name, dtype, shape, raw bytes); the stream's tensors are dropped as we go."""
    return [(n, t.dtype, tuple(t.shape), bits(t).clone()) for n, t in stream]


def assert_same(a, b):
    assert [x[:3] for x in a] == [x[:3] for x in b]
    for (name, *_rest, x), (_, *_r, y) in zip(a, b):
        assert torch.equal(x, y), name


def reference(model):
    return [(n, p.dtype, tuple(p.shape), bits(p).clone()) for n, p in model.named_parameters()]


# ----------------------------------------------------------------------------- names and groups
def test_hf_name_strips_wrapper_segments():
    raw = "_orig_mod.model._fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight"
    assert hf_name(raw) == "model.layers.0.mlp.up_proj.weight"
    assert hf_name("model.my_orig_mod.weight") == "model.my_orig_mod.weight"  # only whole segments
    assert hf_name("lm_head.weight") == "lm_head.weight"


def test_layer_index_groups():
    assert layer_index("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert layer_index("model.layers.3.mlp.experts.7.w1.weight") == "model.layers.3"  # experts stay in their layer
    assert layer_index("model.layers.12.input_layernorm.weight") != layer_index("model.layers.1.input_layernorm.weight")
    assert layer_index("transformer.h.0.attn.c_attn.bias") == "transformer.h.0"
    assert layer_index("model.visual.blocks.0.attn.qkv.weight") != layer_index("model.layers.0.mlp.up_proj.weight")
    assert layer_index("model.embed_tokens.weight") == "model.embed_tokens"
    assert layer_index("model.norm.weight") == "model.norm"
    assert layer_index("lm_head.weight") == "lm_head"
    assert layer_index("scale") == "scale"


def test_names_are_hugging_face_names_through_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_llama()
    want = [n for n, _ in model.named_parameters()]
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    compiled = torch.compile(model)  # only wrapped, never run
    assert any("_checkpoint_wrapped_module" in n for n, _ in compiled._orig_mod.named_parameters())
    assert [n for n, _ in iter_layered(compiled)] == want
    assert [n for n, _ in iter_all_at_once(compiled)] == want


def test_tied_weights_come_once_as_named_parameters_gives_them():
    model = tiny_llama(tied=True)
    names = [n for n, _ in iter_layered(model)]
    assert "lm_head.weight" not in names and names == [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" in model.state_dict()


def test_refusals():
    with pytest.raises(TypeError):
        iter_layered({"a": torch.zeros(1)})
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="meta device"):
        iter_layered(meta)

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self._flat_param = nn.Parameter(torch.zeros(4))

    with pytest.raises(ValueError, match="FlatParameter"):
        iter_all_at_once(Flat())

    outer = nn.Module()
    outer._orig_mod = nn.Linear(1, 1)  # "_orig_mod.weight" -> "weight"
    outer.weight = nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match="two parameters map to the name 'weight'"):
        named_weights(outer)


# ----------------------------------------------------------------------------- equality
@pytest.mark.parametrize("tied", [False, True])
def test_plain_parameters_layered_equals_all_at_once(tied):
    model = tiny_llama(tied)
    ref = reference(model)
    assert_same(snapshot(iter_layered(model)), ref)
    assert_same(snapshot(iter_all_at_once(model)), ref)
    # plain local tensors: no copy at all
    name, t = next(iter_layered(model))
    assert t.data_ptr() == dict(model.named_parameters())[name].data_ptr()


def test_cpu_offload_path_layered_equals_all_at_once():
    model = tiny_llama()
    ref = reference(model)
    for kwargs in (dict(device="cpu"), dict(device=torch.device("cpu")), dict(device="cpu", dtype=torch.bfloat16)):
        assert_same(snapshot(iter_layered(model, **kwargs)), snapshot(iter_all_at_once(model, **kwargs)))
        assert_same(snapshot(iter_layered(model, **kwargs)), ref)
    # a cast makes real copies (as a move to the GPU would): same values in float32, both ways
    lay = snapshot(iter_layered(model, device="cpu", dtype=torch.float32))
    assert_same(lay, snapshot(iter_all_at_once(model, device="cpu", dtype=torch.float32)))
    assert all(d == torch.float32 for _, d, _, _ in lay)
    p = dict(model.named_parameters())
    for name, _, shape, raw in lay:
        assert torch.equal(raw.view(torch.float32).view(shape), p[name].float()), name


def _fsdp2(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def test_fsdp2_single_process_gloo_layered_equals_all_at_once(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = tiny_llama()
        ref = reference(model)
        _fsdp2(model, init_device_mesh("cpu", (1,)))
        assert all(isinstance(p, DTensor) for p in model.parameters())
        lay = snapshot(iter_layered(model))
        assert_same(lay, snapshot(iter_all_at_once(model)))
        assert_same(lay, ref)
        assert not any(isinstance(t, DTensor) for _, t in iter_layered(model))
    finally:
        dist.destroy_process_group()


def _fsdp2_rank(rank: int, world: int, init_file: str, tied: bool) -> None:
    """One rank of the 2-process gloo FSDP2 check (spawned; raises on failure)."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = tiny_llama(tied)  # same seed on every rank: the reference is the unsharded model
        ref = reference(model)
        _fsdp2(model, init_device_mesh("cpu", (world,)))
        local = {n: p.to_local().shape for n, p in model.named_parameters()}
        assert local["model.embed_tokens.weight"][0] < 67  # really sharded (unevenly: 34 + 33)
        lay = snapshot(iter_layered(model))
        assert_same(lay, snapshot(iter_all_at_once(model)))
        assert_same(lay, ref)
        # full_tensor() makes new tensors here: each dies with the consumer's reference
        stream = iter_layered(model)
        for _ in range(5):
            _name, t = next(stream)
            ref_t = weakref.ref(t)
            del t, _name
            assert ref_t() is None
        for _ in stream:  # every rank drains its stream (the gathers are collectives)
            pass
        # the bounded-memory consumer: buckets closed at layers, one flat buffer at a time
        _check_layered_peak(model, bucket_bytes=4096)
        # both ranks done before either tears gloo down: a rank that destroyed its group while the other
        # still used its connections aborted that one once on CI's 2-core machine ("terminate called
        # without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp2_two_processes_gloo_layered_equals_all_at_once(tied):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_fsdp2_rank, args=(2, os.path.join(d, "pg"), tied), nprocs=2, join=True)


# ----------------------------------------------------------------------------- buckets and memory
@pytest.mark.parametrize("bucket_bytes", [1, 700, 4096, 1 << 30])
def test_buckets_never_span_two_layers(bucket_bytes):
    model = tiny_llama()
    buckets = list(iter_buckets(iter_layered(model), bucket_bytes, group_of=layer_index))
    keys = [{layer_index(n) for n, _ in b} for b in buckets]
    assert all(len(k) == 1 for k in keys)
    flat = [n for b in buckets for n, _ in b]
    assert flat == [n for n, _ in model.named_parameters()]  # nothing lost, order kept
    if bucket_bytes == 1 << 30:  # room for everything: exactly one bucket per group
        assert [next(iter(k)) for k in keys] == list(group_nbytes(model))
    assert all(layer_index(n).startswith("model.layers.") for n, _ in buckets[1])


def test_layered_generator_keeps_no_reference_to_what_it_yielded():
    model = tiny_llama()
    stream = iter_layered(model, device="cpu", dtype=torch.float32)  # fresh tensors (as a move to the GPU)
    seen = []
    for _ in range(12):  # well into layer 1
        name, t = next(stream)
        seen.append((name, weakref.ref(t)))
        del t
        assert seen[-1][1]() is None, name  # freed the moment the consumer let go, generator still alive
    # a consumer that keeps a whole layer: only it holds them; dropping its list frees them
    layer = [(n, t) for n, t in (next(stream) for _ in range(3))]
    refs = [weakref.ref(t) for _, t in layer]
    del layer
    assert all(r() is None for r in refs)
    # the all-at-once stream holds everything it has not yet handed over
    meter = LiveBytes()
    eager = iter_all_at_once(model, device="cpu", dtype=torch.float32, meter=meter)
    _, first = next(eager)
    total = sum(p.numel() * 4 for p in model.parameters())
    assert meter.live == total
    del first
    assert meter.live == total - model.model.embed_tokens.weight.numel() * 4
    eager.close()
    assert meter.live == 0


def _check_layered_peak(model, bucket_bytes: int, **kwargs) -> dict:
    """Drive each stream as the sender does (iter_buckets -> flatten -> drop) and check the peaks."""
    out = {}
    for kind, make in (("layered", iter_layered), ("all_at_once", iter_all_at_once)):
        meter = LiveBytes()
        max_flat = 0
        for bucket in iter_buckets(make(model, meter=meter, **kwargs), bucket_bytes, group_of=layer_index):
            flat = flatten_bucket(bucket)
            meter.track(flat.flattened_tensor)
            max_flat = max(max_flat, flat.nbytes)
            del flat, bucket
        assert meter.live == 0
        out[kind] = (meter.peak, max_flat)
    dtype = kwargs.get("dtype")
    groups = group_nbytes(model, dtype=dtype)
    layer = max(groups.values())
    total = sum(groups.values())
    names = [n for n, _ in named_weights(model)]
    params = dict(named_weights(model))
    size = {n: params[n].numel() * torch.empty((), dtype=dtype or params[n].dtype).element_size() for n in names}
    biggest = max(size.values())
    peak, max_flat = out["layered"]
    # one bucket's tensors (never more than a layer) + its flat buffer + one tensor of look-ahead
    assert peak <= min(layer, max(bucket_bytes, biggest)) + max_flat + biggest, (peak, layer, max_flat, biggest)
    peak_all, _ = out["all_at_once"]
    gathers_copy = out["all_at_once"][0] > out["all_at_once"][1]
    if gathers_copy:
        assert peak_all >= total  # every weight at once
        assert peak < peak_all
    return {"layer": layer, "total": total, "layered_peak": peak, "all_at_once_peak": peak_all}


@pytest.mark.parametrize("bucket_bytes", [700, 4096, 1 << 20])
def test_layered_peak_is_one_layer_plus_one_bucket(bucket_bytes):
    from transformers import LlamaConfig, LlamaForCausalLM

    # bigger layers than the embeddings, so "one layer" is a decoder layer
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    fig = _check_layered_peak(model, bucket_bytes, device="cpu", dtype=torch.float32)
    assert fig["all_at_once_peak"] >= fig["total"] > 3 * fig["layer"]
    # the goal: layered extra peak <= one layer + one bucket (+ one tensor read ahead)
    biggest = 32 * 128 * 4
    assert fig["layered_peak"] <= fig["layer"] + max(bucket_bytes, biggest) + biggest


def test_meter_ignores_tensors_that_are_the_parameters():
    model = tiny_llama()
    meter = LiveBytes()
    kept = list(iter_all_at_once(model, meter=meter))  # plain tensors: no copy, nothing allocated
    assert meter.peak == 0 and meter.tracked == 0 and len(kept) == len(list(model.parameters()))
    assert sum(tensor_nbytes(t) for _, t in kept) > 0
