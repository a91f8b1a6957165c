"""Fast-path weight sync on CPU: the copy plan, the persistent buffer protocol, fallback and failures.

The engine double below does what SGLang 0.5.10 does with a ``custom_weight_loader`` request
(``tp_worker.update_weights_from_tensor`` -> ``ModelRunner.update_weights_from_tensor``): each rank's
payload is unpickled by SGLang's own ``MultiprocessingSerializer`` (its SafeUnpickler), each tensor
moved with ``.to(device)``, and the loader named by ``load_format`` is imported and called with
``(model, named_tensors)``. The models are SGLang-shaped doubles (fused ``qkv_proj`` and
``gate_up_proj``, TP shards, vocab padding, tied embeddings, q/k bias, q/k norm) whose
``load_weights`` narrows and copies the way SGLang's weight loaders do. The same checks run against
the real SGLang models on a GPU in ``tests/gpu/test_fast_path_gpu.py``.
"""

import copy
import functools
import itertools
import sys
import threading
import time

import pytest
import torch
from torch import nn

from _sglang_cpu import ensure_sglang_importable
from fakes import ThreadGroup
from sgl_rollout.config import FAST_SYNC_LOADER
from sgl_rollout.weight_sync import plan as plan_mod
from sgl_rollout.weight_sync import receiver
from sgl_rollout.weight_sync.manifest import SyncValidationError, SyncValidator, WeightManifest
from sgl_rollout.weight_sync.plan import Chunk, layout
from sgl_rollout.weight_sync import fast_path as fast_path_mod
from sgl_rollout.weight_sync.fast_path import FastPathError, FastPathSender

H, INTER, HEADS, KV, HD, VOCAB, LAYERS = 32, 48, 4, 2, 8, 50, 2


def hf_weights(tie=False, bias=False, qk_norm=False, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = {"model.embed_tokens.weight": torch.randn(VOCAB, H, generator=g)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = torch.randn(HEADS * HD, H, generator=g)
        w[p + "self_attn.k_proj.weight"] = torch.randn(KV * HD, H, generator=g)
        w[p + "self_attn.v_proj.weight"] = torch.randn(KV * HD, H, generator=g)
        if bias:
            for x, n in (("q", HEADS), ("k", KV), ("v", KV)):
                w[p + f"self_attn.{x}_proj.bias"] = torch.randn(n * HD, generator=g)
        w[p + "self_attn.o_proj.weight"] = torch.randn(H, HEADS * HD, generator=g)
        if qk_norm:
            w[p + "self_attn.q_norm.weight"] = torch.randn(HD, generator=g)
            w[p + "self_attn.k_norm.weight"] = torch.randn(HD, generator=g)
        w[p + "mlp.gate_proj.weight"] = torch.randn(INTER, H, generator=g)
        w[p + "mlp.up_proj.weight"] = torch.randn(INTER, H, generator=g)
        w[p + "mlp.down_proj.weight"] = torch.randn(H, INTER, generator=g)
        w[p + "input_layernorm.weight"] = torch.randn(H, generator=g)
        w[p + "post_attention_layernorm.weight"] = torch.randn(H, generator=g)
    w["model.norm.weight"] = torch.randn(H, generator=g)
    if not tie:
        w["lm_head.weight"] = torch.randn(VOCAB, H, generator=g)
    return [(k, v.to(dtype)) for k, v in w.items()]


class SGLangShaped(nn.Module):
    """An SGLang-like model of one TP rank: fused, sharded, vocab-padded parameters."""

    def __init__(self, tp_rank=0, tp_size=1, tie=False, bias=False, qk_norm=False, uncovered=False):
        super().__init__()
        self.r, self.tp, self.tie, self.uncovered = tp_rank, tp_size, tie, uncovered
        pad_vocab = (VOCAB + 63) // 64 * 64
        self.vshard = pad_vocab // tp_size
        z = lambda *s: nn.Parameter(torch.zeros(*s, dtype=torch.bfloat16), requires_grad=False)  # noqa: E731
        self.embed = z(self.vshard, H)
        self.layers = nn.ModuleList()
        q, kv = HEADS * HD // tp_size, KV * HD // tp_size
        for _ in range(LAYERS):
            layer = nn.Module()
            layer.qkv = z(q + 2 * kv, H)
            if bias:
                layer.qkv_bias = z(q + 2 * kv)
            layer.o = z(H, HEADS * HD // tp_size)
            if qk_norm:
                layer.q_norm, layer.k_norm = z(HD), z(HD)
            layer.gate_up = z(2 * INTER // tp_size, H)
            layer.down = z(H, INTER // tp_size)
            layer.ln1, layer.ln2 = z(H), z(H)
            self.layers.append(layer)
        self.norm = z(H)
        self.lm_head = self.embed if tie else z(self.vshard, H)

    def load_weights(self, weights):
        q, kv, it = HEADS * HD // self.tp, KV * HD // self.tp, INTER // self.tp
        for name, w in weights:
            if self.tie and name == "lm_head.weight":
                continue
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                param = self.embed if name.startswith("model") else self.lm_head
                start = self.r * self.vshard
                n = max(0, min(VOCAB - start, self.vshard))
                param.data[:n].copy_(w.narrow(0, start, n))
                param.data[n:].fill_(0)  # padding rows zeroed, as SGLang's VocabParallelEmbedding does
                continue
            if name == "model.norm.weight":
                self.norm.data.copy_(w)
                continue
            i, rest = int(name.split(".")[2]), ".".join(name.split(".")[3:])
            layer = self.layers[i]
            if rest.startswith("self_attn.") and rest[10] in "qkv" and rest[11:17] == "_proj.":
                x, kind = rest[10], rest[17:]
                size = q if x == "q" else kv
                off = {"q": 0, "k": q, "v": q + kv}[x]
                param = layer.qkv if kind == "weight" else layer.qkv_bias
                param.data.narrow(0, off, size).copy_(w.narrow(0, self.r * size, size))
            elif rest == "self_attn.o_proj.weight":
                layer.o.data.copy_(w.narrow(1, self.r * q, q))
            elif rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
                off = 0 if "gate" in rest else it
                layer.gate_up.data.narrow(0, off, it).copy_(w.narrow(0, self.r * it, it))
            elif rest == "mlp.down_proj.weight":
                layer.down.data.copy_(w.narrow(1, self.r * it, it))
            elif rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
                getattr(layer, rest[10] + "_norm").data.copy_(w)
            elif rest == "input_layernorm.weight":
                layer.ln1.data.copy_(w)
                if self.uncovered:
                    layer.ln1.data.add_(1)  # a loader that does more than copy
            elif rest == "post_attention_layernorm.weight":
                layer.ln2.data.copy_(w)
            else:
                raise KeyError(name)


class SGLangLikeEngine:
    """``update_weights_from_tensor`` as SGLang's TP workers and model runner run it."""

    def __init__(self, models):
        ensure_sglang_importable()
        from sglang.srt.utils import MultiprocessingSerializer

        self.models, self.ser = models, MultiprocessingSerializer
        self.loader_calls = 0
        self.flushes = 0

    def update_weights_from_tensor(self, payloads, load_format=None, flush_cache=False):
        from sglang.srt.utils import dynamic_import

        assert load_format == FAST_SYNC_LOADER
        for model, payload in zip(self.models, payloads):
            named = [(n, t.to("cpu")) for n, t in self.ser.deserialize(payload)]
            self.loader_calls += 1
            dynamic_import(load_format)(model, named)  # SGLang ignores what it returns
        return True, "Success"

    def flush_cache(self):
        self.flushes += 1


def manifest_of(weights):
    return WeightManifest.from_named_tensors(weights)


def rig(weights, bucket_bytes, **model_kw):
    """One SGLang-shaped TP rank, the engine double over it and a fast-path sender on the CPU."""
    models = [SGLangShaped(**model_kw)]
    engine = SGLangLikeEngine(models)
    return models, engine, FastPathSender(engine, manifest_of(weights), bucket_bytes, devices=["cpu"])


def reference(tp_size, weights, **kw):
    models = [SGLangShaped(r, tp_size, **{k: v for k, v in kw.items() if k != "uncovered"}) for r in range(tp_size)]
    for m in models:
        m.load_weights(weights)
    return models


def assert_same_params(models, refs):
    for m, ref in zip(models, refs):
        for (n, a), (_, b) in zip(m.named_parameters(), ref.named_parameters()):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), n  # bit for bit, whole tensors


@pytest.mark.parametrize("tp_size,tie,bias,qk_norm", [
    (1, False, False, False),   # Llama, untied
    (1, True, False, False),    # Llama, tied embeddings
    (2, False, True, False),    # Qwen2-like (q/k/v bias), TP=2 (strided o_proj/down_proj shards, vocab padding)
    (2, True, False, True),     # Qwen3-like (q/k norm), tied, TP=2
])
@pytest.mark.parametrize("bucket_bytes", [1 << 20, 3000])  # one bucket; many buckets with rows split between them
@pytest.mark.parametrize("gather", ["auto", "copy", "foreach", "cat"])
@pytest.mark.parametrize("step_bytes", [None, 600])  # a bucket gathered at once; in steps of a few pieces
def test_fast_path_equals_load_weights_bit_for_bit(tp_size, tie, bias, qk_norm, bucket_bytes, gather, step_bytes,
                                                   monkeypatch):
    if step_bytes is not None:
        monkeypatch.setattr(fast_path_mod, "GATHER_STEP_BYTES", step_bytes)
    kw = dict(tie=tie, bias=bias, qk_norm=qk_norm)
    models = [SGLangShaped(r, tp_size, **kw) for r in range(tp_size)]
    engine = SGLangLikeEngine(models)
    w0 = hf_weights(seed=0, **kw)
    sender = FastPathSender(engine, manifest_of(w0), bucket_bytes, devices=["cpu"] * tp_size, gather=gather)
    for seed in (1, 2):  # two syncs through the same plan and buffers
        weights = hf_weights(seed=seed, **kw)
        stats = sender.send(iter(weights), validator=SyncValidator(manifest_of(w0)))
        assert sender.covered, sender.reason
        assert_same_params(models, reference(tp_size, weights, **kw))
    assert stats.n_tensors == len(weights) and engine.flushes == 2
    if bucket_bytes == 3000:
        assert stats.n_buckets > 5 and stats.max_bucket_bytes <= 3000
    # the plan's pieces of each bucket are merged into fewer copies on the receiving side
    assert sum(len(b) for b in sender.plan.layouts[0]) >= stats.n_buckets


def test_non_contiguous_trainer_tensors_are_sent_as_their_values():
    # a transposed view (the values, not the memory order, are the weight), whole and split between buckets
    w = [(n, t.t().contiguous().t() if t.dim() == 2 else t) for n, t in hf_weights(seed=21)]
    assert any(not t.is_contiguous() for _, t in w)
    for tp_size, bucket_bytes in ((1, 1 << 20), (2, 3000)):
        models = [SGLangShaped(r, tp_size) for r in range(tp_size)]
        sender = FastPathSender(SGLangLikeEngine(models), manifest_of(w), bucket_bytes, devices=["cpu"] * tp_size)
        sender.send(w)
        assert sender.covered
        assert_same_params(models, reference(tp_size, [(n, t.contiguous()) for n, t in w]))


def test_release_frees_the_buffers_views_included():
    from torch.multiprocessing.reductions import StorageWeakRef

    w = hf_weights(seed=4)
    sender = FastPathSender(SGLangLikeEngine([SGLangShaped()]), manifest_of(w), 3000, devices=["cpu"])
    sender.send(w)
    memory = StorageWeakRef(sender._buffers[0].untyped_storage())  # views of it (the gather's targets) hold it
    assert not memory.expired()
    sender.release()
    assert not sender.holds_buffers and sender.buffer_bytes == 0
    assert memory.expired()


def test_unknown_gather_method_is_refused():
    with pytest.raises(ValueError, match="gather must be one of"):
        FastPathSender(SGLangLikeEngine([SGLangShaped()]), manifest_of(hf_weights()), 1 << 20, devices=["cpu"],
                       gather="memcpy")


def test_fp32_trainer_weights_are_cast_like_load_weights():
    w = hf_weights(dtype=torch.float32, seed=3)
    models, engine, sender = rig(w, 1 << 20)
    sender.send(w)
    assert sender.covered
    assert_same_params(models, reference(1, w))


def test_constant_fills_are_replayed_every_sync():
    # after a level-2 release the weights come back undefined: the padding rows must be zeroed again
    models = [SGLangShaped()]
    w = hf_weights(seed=15)
    sender = FastPathSender(SGLangLikeEngine(models), manifest_of(w), 1 << 20, devices=["cpu"])
    sender.send(w)
    assert sender.covered
    with torch.no_grad():
        for p in models[0].parameters():
            p.fill_(float("nan"))  # "undefined" memory after a resume without a CPU backup
    sender.send(w)
    assert_same_params(models, reference(1, w))


def test_out_of_order_stream_is_held_until_its_bucket():
    w = hf_weights(seed=4)
    models, engine, sender = rig(w, 4000)
    sender.send(list(reversed(w)))
    assert_same_params(models, reference(1, w))


def live_bytes_stream(weights, live: dict):
    """A fresh copy of each of ``weights``, as verl's generator makes each gathered tensor: ``live["now"]`` is
    the bytes of the copies still referenced, ``live["peak"]`` its largest value."""
    import weakref

    def freed(nbytes):
        live["now"] -= nbytes

    for name, t in weights:
        c = t.clone()
        nbytes = c.numel() * c.element_size()
        live["now"] += nbytes
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(c, freed, nbytes)
        yield name, c
        del c


@pytest.mark.parametrize("step_bytes", [4096, 1 << 20])
def test_a_bucket_is_gathered_in_steps_and_each_source_dropped_after_its_last(step_bytes, monkeypatch):
    """One bucket holds the whole model; gathered in steps of 4 KiB the sender holds about a step of the
    trainer's tensors at a time, not the bucket's (issue 47: at most about one bucket of extra memory, the
    buffer). With one step per bucket (the old gather) it held them all. The stream comes in the order the
    plan reads it (as verl's HF-ordered stream meets SGLang's Llama, whose parameters are in that order;
    this double registers ``norm`` and ``lm_head`` before the layers)."""
    monkeypatch.setattr(fast_path_mod, "GATHER_STEP_BYTES", step_bytes)
    models, engine, sender = rig(hf_weights(seed=0), 1 << 20)
    assert sender.ensure_plan()
    first_use = {}
    for op in sender.plan.program.ops[0][0].ops:
        first_use.setdefault(op.name, len(first_use))
    w = sorted(hf_weights(seed=3), key=lambda nt: first_use[nt[0]])
    total = sum(t.numel() * t.element_size() for _, t in w)
    largest = max(t.numel() * t.element_size() for _, t in w)
    live = {"now": 0, "peak": 0}
    stats = sender.send(live_bytes_stream(w, live))
    assert stats.n_buckets == 1 and sender.covered
    assert_same_params(models, reference(1, w))
    if step_bytes == 4096:
        assert live["peak"] <= step_bytes + 2 * largest < total // 2, (live, total)
    else:
        assert live["peak"] >= total * 0.9, (live, total)


def test_uncovered_layout_falls_back_to_load_weights_and_says_why():
    w = hf_weights(seed=5)
    models, engine, sender = rig(w, 1 << 20, uncovered=True)
    sender.send(w)
    assert sender.covered is False and "writes a parameter" in sender.reason
    ref = SGLangShaped(uncovered=True)
    ref.load_weights(w)
    assert_same_params(models, [ref])  # the trace changed nothing; the fallback loaded like SGLang


def test_loader_failure_raises_in_the_sender_and_a_retry_succeeds():
    w = hf_weights(seed=6)
    models, engine, sender = rig(w, 1 << 20)
    sender.send(w)
    w2 = hf_weights(seed=7)
    sender.fault = "raise"
    with pytest.raises(FastPathError, match="fault injected"):
        sender.send(w2)
    sender.send(w2)
    assert_same_params(models, reference(1, w2))


def test_a_loader_that_never_ran_is_reported():
    class Deaf(SGLangLikeEngine):
        def update_weights_from_tensor(self, payloads, load_format=None, flush_cache=False):
            return True, "Success"  # e.g. the loader is not registered and SGLang did something else

    w = hf_weights()
    sender = FastPathSender(Deaf([SGLangShaped()]), manifest_of(w), 1 << 20, devices=["cpu"])
    with pytest.raises(FastPathError, match="did not answer"):
        sender.send(w)


def test_missing_and_bad_weights_refused_before_their_bucket():
    w = hf_weights(seed=8)
    models, engine, sender = rig(w, 1 << 20)
    sender.send(w)
    before = copy.deepcopy(models[0].state_dict())
    calls = engine.loader_calls
    with pytest.raises(SyncValidationError, match="without"):
        sender.send(w[:-3])  # a full sync lacking weights: the one bucket is never sent
    bad = [(n, t[:1] if n.endswith("down_proj.weight") else t) for n, t in hf_weights(seed=9)]
    with pytest.raises(SyncValidationError, match="shape"):
        sender.send(bad, validator=SyncValidator(manifest_of(w)))
    assert engine.loader_calls == calls
    for k, v in models[0].state_dict().items():
        assert torch.equal(v, before[k])


def test_partial_sync_goes_through_load_weights():
    w = hf_weights(seed=10)
    models, engine, sender = rig(w, 1 << 20)
    sender.send(w)
    part = [(n, t) for n, t in hf_weights(seed=11) if "layers.1." in n]
    sender.send(part, partial=True)
    assert_same_params(models, reference(1, w + part))


def test_release_closes_and_the_next_sync_reopens():
    w = hf_weights(seed=12)
    models, engine, sender = rig(w, 1 << 20)
    sender.send(w)
    assert any(k.startswith(sender.key) for k in receiver._SHARED)
    sender.release()
    assert not any(k.startswith(sender.key) for k in receiver._SHARED)
    assert sender._buffers == [None]
    w2 = hf_weights(seed=13)
    sender.send(w2)
    assert_same_params(models, reference(1, w2))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_send_with_release_closes_the_handles_with_the_last_bucket(tp_size):
    """``send(release=True)``: the engine drops its handles in the last bucket's call, no ``release`` round
    trip follows, the sender holds nothing; a sync after it opens them again."""
    w = hf_weights(seed=14)
    models = [SGLangShaped(r, tp_size) for r in range(tp_size)]
    engine = SGLangLikeEngine(models)
    sender = FastPathSender(engine, manifest_of(w), 3000, devices=["cpu"] * tp_size)
    sender.send(w)  # the plan, then the buckets
    n_buckets = sender.plan.program.n_buckets
    assert n_buckets > 1
    w2 = hf_weights(seed=15)
    calls = engine.loader_calls
    stats = sender.send(w2, release=True)
    assert stats.n_buckets == n_buckets and engine.loader_calls - calls == n_buckets * tp_size
    assert not sender.holds_buffers and sender.buffer_bytes == 0
    assert not any(k.startswith(sender.key) for k in receiver._SHARED)
    assert_same_params(models, reference(tp_size, w2))
    calls = engine.loader_calls
    sender.release()  # nothing left to close: no call
    assert engine.loader_calls == calls
    w3 = hf_weights(seed=16)
    sender.send(w3)
    assert sender.holds_buffers and any(k.startswith(sender.key) for k in receiver._SHARED)
    assert_same_params(models, reference(tp_size, w3))
    sender.release()


def test_send_with_release_whose_last_bucket_fails_keeps_the_handles_for_release():
    w = hf_weights(seed=17)
    models, engine, sender = rig(w, 1 << 20)  # one bucket: the first is the last
    sender.send(w)
    sender.fault = "raise"
    with pytest.raises(FastPathError, match="fault injected"):
        sender.send(hf_weights(seed=18), release=True)
    assert sender.holds_buffers and any(k.startswith(sender.key) for k in receiver._SHARED)
    sender.release()
    assert not sender.holds_buffers and not any(k.startswith(sender.key) for k in receiver._SHARED)
    w2 = hf_weights(seed=19)
    sender.send(w2, release=True)
    assert_same_params(models, reference(1, w2))


def test_partial_send_with_release_leaves_the_buffers_to_release():
    w = hf_weights(seed=20)
    models, engine, sender = rig(w, 1 << 20)
    sender.send(w)
    part = [(n, t) for n, t in hf_weights(seed=21) if "layers.0." in n]
    sender.send(part, partial=True, release=True)  # op load: the last bucket is not known in advance
    assert sender.holds_buffers and any(k.startswith(sender.key) for k in receiver._SHARED)
    sender.release()
    assert not any(k.startswith(sender.key) for k in receiver._SHARED)
    assert_same_params(models, reference(1, w + part))


@pytest.mark.parametrize("tp_size,bucket_bytes", [(1, 1 << 20), (1, 3000), (2, 3000)])
def test_first_bucket_gathered_ahead_calls_no_engine_and_the_send_equals_a_plain_one(tp_size, bucket_bytes):
    """``gather_ahead`` (run while SGLang resumes the weights) gathers bucket 0 without calling the engine;
    ``send(ahead=...)`` sends it as gathered and reads the stream on from it: the same calls and weights as a
    plain send, the ahead part kept in the timings."""
    w = hf_weights(seed=22)
    models = [SGLangShaped(r, tp_size) for r in range(tp_size)]
    engine = SGLangLikeEngine(models)
    sender = FastPathSender(engine, manifest_of(w), bucket_bytes, devices=["cpu"] * tp_size)
    assert sender.gather_ahead(iter(w)) is None  # no plan yet: nothing read, send asks for it in the fence
    sender.send(w)
    n_buckets = sender.plan.program.n_buckets
    w2 = hf_weights(seed=23)
    calls = engine.loader_calls
    stream = iter(w2)
    ahead = sender.gather_ahead(stream)
    assert engine.loader_calls == calls and ahead.first is not None
    assert len(ahead.first) == tp_size and all(buf is not None for _, buf in ahead.first)
    assert_same_params(models, reference(tp_size, w))  # nothing of w2 reached the engine yet
    stats = sender.send(iter(()), release=True, ahead=ahead)  # the stream comes from ahead, not this argument
    assert stats.n_buckets == n_buckets and stats.n_tensors == len(w2)
    assert engine.loader_calls - calls == n_buckets * tp_size
    assert_same_params(models, reference(tp_size, w2))
    assert "gather.ahead" in sender.timings and "call" in sender.timings
    assert not sender.holds_buffers


def test_first_bucket_gathered_ahead_refuses_a_bad_tensor_before_anything_is_sent():
    w = hf_weights(seed=24)
    models, engine, sender = rig(w, 3000)
    sender.send(w)
    bad = [(n, t[:1] if i == 0 else t) for i, (n, t) in enumerate(hf_weights(seed=25))]
    calls = engine.loader_calls
    with pytest.raises(SyncValidationError, match="shape"):
        sender.gather_ahead(iter(bad), validator=SyncValidator(manifest_of(w)))
    assert engine.loader_calls == calls
    assert_same_params(models, reference(1, w))
    with pytest.raises(ValueError, match="partial"):
        sender.send(w, partial=True, ahead=sender.gather_ahead(iter(w)))
    sender.release()


def test_layout_splits_rows_and_covers_every_element_once():
    chunks = [Chunk("a", 0, (10, 4), (4, 1), "bfloat16", 0, 0), Chunk("b", 3, (7, 3), (8, 2), "float32", 1, 5)]
    buckets = layout(chunks, 64)
    assert all(plan_mod.bucket_size(b) <= 64 for b in buckets)
    rows = {"a": 0, "b": 0}
    for pieces in buckets:
        for pc in pieces:
            assert pc.start % plan_mod.PIECE_ALIGN == 0
            rows[pc.chunk.name] += pc.chunk.sizes[0]
    assert rows == {"a": 10, "b": 7}
    with pytest.raises(ValueError, match="one row"):
        layout(chunks, 8)


def test_header_and_status_roundtrip():
    name = plan_mod.header_name({"op": "copy", "bucket": 3})
    assert plan_mod.parse_header(name)["bucket"] == 3
    raw = plan_mod.encode_status(7, plan_mod.OK, {"x": [1, 2]})
    assert plan_mod.decode_header(raw)[:2] == (7, plan_mod.OK)
    with pytest.raises(ValueError):
        plan_mod.parse_header("model.layers.0.weight")


def test_orders_of_rank_and_bucket_do_not_matter_for_the_result():
    # every rank's layout differs (replicated norms vs sharded matrices); buckets are sent in step
    w = hf_weights(seed=14, bias=True)
    models = [SGLangShaped(r, 2, bias=True) for r in range(2)]
    sender = FastPathSender(SGLangLikeEngine(models), manifest_of(w), 2500, devices=["cpu", "cpu"])
    sender.send(itertools.chain(w))
    assert_same_params(models, reference(2, w, bias=True))


def test_digest_changes_with_the_weights_and_matches_for_equal_weights():
    models = [SGLangShaped()]
    sender = FastPathSender(SGLangLikeEngine(models), manifest_of(hf_weights()), 1 << 20, devices=["cpu"])
    sender.send(hf_weights(seed=1))
    d1 = sender.digest()
    sender.send(hf_weights(seed=2), partial=True)
    assert sender.digest() != d1
    sender.send(hf_weights(seed=1), partial=True)
    assert sender.digest() == d1 and len(d1[0]) == len(list(models[0].parameters()))


def test_strided_and_cast_sources_take_the_general_copy():
    # strided TP shards of fp32 sources cannot use one cat: same result anyway
    w = [(n, t.float()) for n, t in hf_weights(seed=16)]
    models = [SGLangShaped(r, 2) for r in range(2)]
    sender = FastPathSender(SGLangLikeEngine(models), manifest_of(w), 1 << 20, devices=["cpu", "cpu"])
    sender.send(w)
    assert sender.ping() > 0
    assert_same_params(models, reference(2, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiling_pieces_get_their_views_in_one_call_once_per_buffer(monkeypatch, dtype):
    # a few hundred Python views cost milliseconds: made in one C++ call, only for a new buffer
    calls = {"unflatten": 0, "foreach": 0}

    def counting(name, real):
        def f(*a, **k):
            calls[name] += 1
            return real(*a, **k)
        return f

    monkeypatch.setattr(torch._C._nn, "unflatten_dense_tensors", counting("unflatten", torch._C._nn.unflatten_dense_tensors))
    monkeypatch.setattr(torch, "_foreach_copy_", counting("foreach", torch._foreach_copy_))
    w = hf_weights(dtype=dtype, seed=18)
    models, engine, sender = rig(w, 1 << 20)
    sender.send(w)  # on the CPU, sharing moves the buffer into shared memory: its second sync has new views
    sender.send(w)
    made = calls["unflatten"]
    for seed in (19, 20):
        w = hf_weights(dtype=dtype, seed=seed)
        sender.send(w)
        assert_same_params(models, reference(1, w))  # fp32: cast inside the one foreach copy
    assert calls == {"unflatten": made, "foreach": 4}  # the same views again; one copy per sync (one bucket)
    sender.release()  # as before a level-2 release: the next sync has a new buffer, so new views
    sender.send(w)
    assert calls["unflatten"] > made and calls["foreach"] == 5
    assert_same_params(models, reference(1, w))


def test_trainer_parameters_that_require_grad_are_sent():
    w = [(n, t.float().requires_grad_()) for n, t in hf_weights(seed=17)]
    models = [SGLangShaped()]
    sender = FastPathSender(SGLangLikeEngine(models), manifest_of(w), 1 << 20, devices=["cpu"])
    sender.send(w)
    assert sender.covered and sender.buffer_bytes > 0
    ref = reference(1, [(n, t.detach()) for n, t in w])
    assert_same_params(models, ref)
    w_bf16 = [(n, t.detach().bfloat16().requires_grad_()) for n, t in w]  # the torch.cat path
    sender.send(w_bf16)
    assert_same_params(models, reference(1, [(n, t.detach()) for n, t in w_bf16]))


def test_an_engine_without_the_registered_loader_is_never_called():
    # SGLang would raise NotImplementedError inside its scheduler for an unregistered load_format
    from sgl_rollout.config import RolloutConfig

    engine = SGLangLikeEngine([SGLangShaped()])
    engine.config = RolloutConfig(model_path="/m", fast_sync=False)  # the loader is not registered
    w = hf_weights()
    sender = FastPathSender(engine, manifest_of(w), 1 << 20, devices=["cpu"])
    with pytest.raises(FastPathError, match="not launched with"):
        sender.send(w)
    assert engine.loader_calls == 0
    engine.config = RolloutConfig(model_path="/m", fast_sync=True)
    sender.send(w)
    assert sender.covered and engine.loader_calls > 0


def test_call_time_is_split_by_the_loaders_clock():
    """The loader stamps its entry and answer; the sender splits the call into request, loader, reply."""
    weights = hf_weights(seed=1)
    models, engine, sender = rig(weights, 1 << 20)
    inner = engine.update_weights_from_tensor

    def slow_way_in(payloads, **kw):
        time.sleep(0.05)  # as a busy tokenizer manager would delay the request
        return inner(payloads, **kw)

    engine.update_weights_from_tensor = slow_way_in
    sender.send(iter(weights))
    t = sender.timings
    assert t["call.request"] >= 0.05 and 0 <= t["call.loader"] < t["call.request"] and t["call.reply"] >= 0
    assert abs(t["call.request"] + t["call.loader"] + t["call.reply"] - t["call"]) < 0.01, t
    parts = ("gather.alloc", "gather.copy", "gather.serialize", "gather.wait")
    assert all(t[p] >= 0 for p in parts) and t["gather.serialize"] > 0 and sum(t[p] for p in parts) <= t["gather"], t


class RoundOverRanks:
    """The engine as each of several single-rank senders sees it (one process per TP rank, as under
    verl): a call returns once every rank's payload has reached the engine, in one SGLang call."""

    def __init__(self, engine, group):
        self.engine, self.group = engine, group

    def update_weights_from_tensor(self, payloads, load_format=None, flush_cache=False):
        rank = threading.current_thread().rank
        everyone = [p for part in self.group.all_gather(rank, payloads) for p in part]
        if rank == 0:
            self.engine.update_weights_from_tensor(everyone, load_format=load_format)
        self.group.all_gather(rank, None)  # the others return once the engine answered
        return True, "Success"

    def flush_cache(self):
        pass


def split_senders(models, weights0, bucket_bytes, tp_size):
    """One sender per TP rank, each serving its own rank, sharing plans and answers over threads."""
    group = ThreadGroup(tp_size)
    engine = RoundOverRanks(SGLangLikeEngine(models), group)
    return group, [FastPathSender(engine, manifest_of(weights0), bucket_bytes, devices=["cpu"], tp_size=tp_size,
                                  tp_ranks=[r], share=functools.partial(_share, group, r)) for r in range(tp_size)]


def _share(group, rank, obj):
    return group.all_gather(rank, obj)


def _as_rank(rank, fn):
    threading.current_thread().rank = rank
    return fn()


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 3000])
def test_one_sender_per_tp_rank_loads_what_one_sender_for_all_does(bucket_bytes):
    kw = dict(tie=True, qk_norm=True)
    models = [SGLangShaped(r, 2, **kw) for r in range(2)]
    w0 = hf_weights(seed=0, **kw)
    group, senders = split_senders(models, w0, bucket_bytes, 2)
    for seed in (1, 2):
        w = hf_weights(seed=seed, **kw)
        out = group.run(lambda r, s: _as_rank(r, lambda: s.send(iter(w))), senders)
        assert not any(isinstance(o, BaseException) for o in out), out
        assert_same_params(models, reference(2, w, **kw))
    # both ran the same buckets, from every rank's layout; each wrote only its own rank's buffer
    assert out[0].n_buckets == out[1].n_buckets and all(s.covered for s in senders)
    assert senders[0].plan.layouts == senders[1].plan.layouts and len(senders[0]._buffers) == 1
    if bucket_bytes == 3000:
        assert out[0].n_buckets > 5


def test_a_loader_failure_on_one_rank_raises_on_every_rank_and_a_retry_succeeds():
    models = [SGLangShaped(r, 2) for r in range(2)]
    w0 = hf_weights(seed=0)
    group, senders = split_senders(models, w0, 3000, 2)
    group.run(lambda r, s: _as_rank(r, lambda: s.send(iter(w0))), senders)
    senders[1].fault = "raise"
    w = hf_weights(seed=9)
    out = group.run(lambda r, s: _as_rank(r, lambda: s.send(iter(w))), senders)
    assert all(isinstance(o, FastPathError) and "TP rank 1" in str(o) and "fault injected" in str(o) for o in out), out
    group.run(lambda r, s: _as_rank(r, lambda: s.send(iter(w))), senders)
    assert_same_params(models, reference(2, w))


def test_serving_some_ranks_needs_share_and_matching_ranks():
    w = hf_weights()
    with pytest.raises(ValueError, match="needs share"):
        FastPathSender(SGLangLikeEngine([SGLangShaped()]), manifest_of(w), 1 << 20, devices=["cpu"], tp_size=2,
                       tp_ranks=[1])
    with pytest.raises(ValueError, match="one rank below tp_size"):
        FastPathSender(SGLangLikeEngine([SGLangShaped()]), manifest_of(w), 1 << 20, devices=["cpu"], tp_size=2,
                       tp_ranks=[2], share=lambda x: [x])


def test_every_weight_write_empties_sglangs_multimodal_embedding_cache(monkeypatch):
    """SGLang keeps vision-tower outputs per image hash across requests (``mm_utils.embedding_cache``) and
    its flush after a weight update leaves them: the receiver empties the cache after each ``copy`` and
    ``load``, so an image seen before a sync is encoded again with the new weights."""
    import types

    class Cache:
        def __init__(self):
            self.items = {"image-hash": "old features"}

        def clear(self):
            self.items.clear()

    cache = Cache()
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.mm_utils", types.SimpleNamespace(embedding_cache=cache))
    w = hf_weights(seed=20)
    models, engine, sender = rig(w, 1 << 20)
    sender.send(w)  # plan, then copy
    assert sender.covered and cache.items == {}
    cache.items["image-hash"] = "features"
    sender.send([(n, t) for n, t in w if "layers.0." in n], partial=True)  # load
    assert cache.items == {}
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.mm_utils", types.SimpleNamespace(embedding_cache=None))
    assert not receiver.forget_mm_embeddings()  # a text-only engine: nothing there, no error
    sender.send(w)
    assert_same_params(models, reference(1, w))


@pytest.mark.parametrize("step_bytes", [600, 1 << 20])
def test_every_tp_ranks_sender_reads_the_stream_to_the_same_point_before_each_bucket(step_bytes, monkeypatch):
    """verl's weights generator gathers collectively and the ranks agree after each bucket, so one sender
    per TP rank must read the same tensors before each bucket's call (:class:`GatherSteps` depends on the
    plan alone): a sender that read further would wait inside the generator for one that waits in the
    agreement."""
    monkeypatch.setattr(fast_path_mod, "GATHER_STEP_BYTES", step_bytes)
    kw = dict(tie=True, qk_norm=True)
    models = [SGLangShaped(r, 2, **kw) for r in range(2)]
    w0 = hf_weights(seed=0, **kw)
    group, senders = split_senders(models, w0, 3000, 2)
    w = hf_weights(seed=9, **kw)
    read_at_call = {0: [], 1: []}

    def counted(r):
        for item in w:
            yield item
            read_at_call[r].append(None)  # advanced past this item: one more read

    def send(r, s):
        calls = []
        real_call = s._call
        s._call = lambda headers, bufs: (calls.append(len(read_at_call[r])), real_call(headers, bufs))[1]
        s.send(counted(r))
        return calls

    out = group.run(lambda r, s: _as_rank(r, lambda: send(r, s)), senders)
    assert not any(isinstance(o, BaseException) for o in out), out
    assert out[0] == out[1] and len(out[0]) > 3, out  # the same reads before every call, many buckets
    assert_same_params(models, reference(2, w, **kw))
