"""A Qwen3-MoE's fast-path copy plan on CPU (issue 47, goal 4): the recorder against FusedMoE's loading ops.

SGLang's own ``FusedMoE`` cannot be built on this machine's CPU-only virtualenv (importing
``sglang/srt/layers/moe/fused_moe_triton/layer.py`` pulls in the OpenAI protocol, Triton and the parallel
state, and on a CPU it takes another branch, ``narrow_padded_param_and_loaded_weight``), so
:class:`FusedMoELike` below reproduces the ops its unquantized bf16 weight loader applies on a CUDA GPU,
written from reading ``FusedMoE.weight_loader`` -> ``_weight_loader_physical`` -> ``_weight_loader_impl``
-> ``_load_w13`` / ``_load_w2`` in SGLang 0.5.10.post1 and 0.5.12 (the same ops in both):

* ``ExpertLocationMetadata.logical_to_all_physical`` (``sglang/srt/eplb/expert_location.py``; the model
  runner always sets the trivial map for Qwen3-MoE): a CPU int tensor indexed by layer and logical expert,
  ``.tolist()``, the ``-1`` entries dropped; each physical expert mapped to this EP rank's local index,
  skipped (no op at all) when it lives on another rank;
* ``expert_data = param.data[local]``; gate (``w1``) and up (``w3``): ``shard = expert_data.shape[0] // 2``,
  ``loaded.narrow(0, shard * moe_tp_rank, shard)`` into ``expert_data.narrow(0, 0 or shard, shard)``;
  down (``w2``): ``shard = expert_data.shape[1]``, ``loaded.narrow(1, shard * moe_tp_rank, shard)`` into
  the whole ``expert_data``; then ``copy_``;
* with the ``triton_kernel`` runner (``transposed=True``) the parameters are stored transposed, the shard
  dim flips and the loaded weight is ``transpose(-2, -1)``'d first: gate/up land in strided columns.

:class:`Qwen3MoeLike` routes names as ``Qwen3MoeForCausalLM.load_weights`` (``sglang/srt/models/qwen3_moe.py``,
identical in both releases) does with ``FusedMoE.make_expert_params_mapping``: the per-expert checkpoint
tensors to the stacked ``w13_weight`` / ``w2_weight`` with shard ids ``w1``/``w3``/``w2``, the router
``mlp.gate.weight`` and the rest by a plain ``param.data.copy_``. Every sync goes through the real sender
(:class:`~sgl_rollout.weight_sync.fast_path.FastPathSender`) and the real receiver inside the engine double of
``tests/test_fast_path.py``; the result must equal, bit for bit, what the same loader does with real tensors.
"""

import dataclasses
import re

import pytest
import torch
from torch import nn

from sgl_rollout.weight_sync import plan as plan_mod
from sgl_rollout.weight_sync import receiver
from sgl_rollout.weight_sync.fast_path import FastPathSender
from sgl_rollout.weight_sync.manifest import SyncValidator
from sgl_rollout.weight_sync.plan import dtype_name
from test_fast_path import SGLangLikeEngine, manifest_of

H, MOE_I, E, LAYERS, VOCAB = 32, 24, 8, 2, 50
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_SHARD_ID = {"gate": "w1", "up": "w3", "down": "w2"}


def moe_weights(seed=0, dtype=torch.bfloat16):
    """Random tensors under a Qwen3-MoE checkpoint's names (one tensor per expert and projection)."""
    g = torch.Generator().manual_seed(seed)
    w = {"model.embed_tokens.weight": torch.randn(VOCAB, H, generator=g)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = torch.randn(H, generator=g)
        w[p + "mlp.gate.weight"] = torch.randn(E, H, generator=g)
        for e in range(E):
            w[p + f"mlp.experts.{e}.gate_proj.weight"] = torch.randn(MOE_I, H, generator=g)
            w[p + f"mlp.experts.{e}.up_proj.weight"] = torch.randn(MOE_I, H, generator=g)
            w[p + f"mlp.experts.{e}.down_proj.weight"] = torch.randn(H, MOE_I, generator=g)
        w[p + "post_attention_layernorm.weight"] = torch.randn(H, generator=g)
    w["model.norm.weight"] = torch.randn(H, generator=g)
    w["lm_head.weight"] = torch.randn(VOCAB, H, generator=g)
    return [(k, v.to(dtype)) for k, v in w.items()]


def _zeros(*shape):
    return nn.Parameter(torch.zeros(*shape, dtype=torch.bfloat16), requires_grad=False)


class FusedMoELike(nn.Module):
    """One rank's experts of one layer: ``w13_weight`` ``(local experts, 2 * MOE_I / moe_tp, H)`` and
    ``w2_weight`` ``(local experts, H, MOE_I / moe_tp)``, bf16 (transposed with ``transposed``), and the
    loader ops listed in the module docstring. ``redundant`` extra physical experts hold logical experts
    ``0, 1, ...`` again (EPLB's trivial map), so a logical expert may be copied twice."""

    def __init__(self, layer_id, moe_tp_rank=0, moe_tp_size=1, ep_rank=0, ep_size=1, redundant=0, transposed=False):
        super().__init__()
        self.layer_id, self.moe_tp_rank, self.ep_rank, self.transposed = layer_id, moe_tp_rank, ep_rank, transposed
        physical = E + redundant
        self.num_local = physical // ep_size
        inter = MOE_I // moe_tp_size
        w13, w2 = (2 * inter, H), (H, inter)
        if transposed:
            w13, w2 = w13[::-1], w2[::-1]
        self.w13_weight = _zeros(self.num_local, *w13)
        self.w2_weight = _zeros(self.num_local, *w2)
        copies = -(-physical // E)
        table = torch.full((LAYERS, E, copies), -1, dtype=torch.int64)
        for p in range(physical):
            table[:, p % E, p // E] = p
        self.logical_to_all_physical_map_cpu = table

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id):
        physical = [p for p in self.logical_to_all_physical_map_cpu[self.layer_id, expert_id].tolist() if p != -1]
        for p in physical:
            local = p - self.ep_rank * self.num_local
            if 0 <= local < self.num_local:
                self._load(param, loaded_weight, shard_id, local)

    def _load(self, param, loaded, shard_id, local):
        if shard_id not in ("w1", "w2", "w3"):
            raise ValueError(shard_id)
        expert_data = param.data[local]
        dim = {"w1": 0, "w2": 1, "w3": 0}[shard_id]
        if self.transposed:
            dim = int(not dim)
            loaded = loaded.transpose(-2, -1)
        if shard_id == "w2":
            size = expert_data.shape[dim]
            loaded = loaded.narrow(dim, size * self.moe_tp_rank, size)
        else:
            size = expert_data.shape[dim] // 2
            loaded = loaded.narrow(dim, size * self.moe_tp_rank, size)
            expert_data = expert_data.narrow(dim, size if shard_id == "w3" else 0, size)
        expert_data.copy_(loaded)


class Qwen3MoeLike(nn.Module):
    """One TP rank of a Qwen3-MoE-shaped model (norms, router, experts, replicated embeddings): attention
    and vocab sharding are left to ``tests/test_fast_path.py``. ``tp_size`` ranks split into ``ep_size``
    expert-parallel groups of ``tp_size // ep_size`` MoE-TP ranks (SGLang: moe_tp = tp / ep)."""

    def __init__(self, tp_rank=0, tp_size=1, ep_size=1, redundant=0, transposed=False):
        super().__init__()
        moe_tp = tp_size // ep_size
        self.embed = _zeros(VOCAB, H)
        self.layers = nn.ModuleList()
        for i in range(LAYERS):
            layer = nn.Module()
            layer.ln1, layer.ln2, layer.gate = _zeros(H), _zeros(H), _zeros(E, H)
            layer.experts = FusedMoELike(i, tp_rank % moe_tp, moe_tp, tp_rank // moe_tp, ep_size, redundant, transposed)
            self.layers.append(layer)
        self.norm = _zeros(H)
        self.lm_head = _zeros(VOCAB, H)

    def _plain(self, name):
        top = {"model.embed_tokens.weight": self.embed, "lm_head.weight": self.lm_head, "model.norm.weight": self.norm}
        if name in top:
            return top[name]
        layer = self.layers[int(name.split(".")[2])]
        rest = name.split(".", 3)[3]
        return {"input_layernorm.weight": layer.ln1, "post_attention_layernorm.weight": layer.ln2,
                "mlp.gate.weight": layer.gate}[rest]

    def load_weights(self, weights):
        for name, w in weights:
            m = _EXPERT.fullmatch(name)
            if m is None:
                self._plain(name).data.copy_(w)  # default_weight_loader, ReplicatedLinear's router
                continue
            layer, expert, proj = int(m[1]), int(m[2]), m[3]
            moe = self.layers[layer].experts
            stacked = "w2" if proj == "down" else "w13"
            moe.weight_loader(getattr(moe, stacked + "_weight"), w,
                              f"model.layers.{layer}.mlp.experts.{stacked}_weight", shard_id=_SHARD_ID[proj],
                              expert_id=expert)


#: (TP size, EP size, redundant experts): TP=1; TP=2 (each rank half of every expert); EP=2 (each rank four
#: whole experts); EP=2 with two redundant physical experts (logical experts 0 and 1 on both ranks).
CASES = {"tp1": (1, 1, 0), "tp2": (2, 1, 0), "ep2": (2, 2, 0), "ep2-redundant": (2, 2, 2)}


def ranks(case, **kw):
    tp, ep, redundant = CASES[case]
    return [Qwen3MoeLike(r, tp, ep, redundant, **kw) for r in range(tp)]


def differing(models, refs):
    """Names of the parameters (rank-prefixed) that differ in any bit between ``models`` and ``refs``."""
    out = []
    for r, (m, ref) in enumerate(zip(models, refs)):
        for (n, a), (_, b) in zip(m.named_parameters(), ref.named_parameters()):
            if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
                out.append(f"rank {r}: {n}")
    return out


def loaded(case, weights, **kw):
    """What the loader itself does with real tensors, per rank."""
    refs = ranks(case, **kw)
    for m in refs:
        m.load_weights(weights)
    return refs


def sync(models, weights, bucket_bytes, w0=None):
    sender = FastPathSender(SGLangLikeEngine(models), manifest_of(w0 or weights), bucket_bytes,
                            devices=["cpu"] * len(models))
    sender.send(iter(weights), validator=SyncValidator(manifest_of(w0 or weights)))
    return sender


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("bucket_bytes", [1 << 20, 700])  # one bucket; many, expert rows split between them
def test_moe_fast_path_equals_the_loader_bit_for_bit(case, bucket_bytes):
    models = ranks(case)
    w0 = moe_weights(seed=0)
    sender = FastPathSender(SGLangLikeEngine(models), manifest_of(w0), bucket_bytes, devices=["cpu"] * len(models))
    for seed in (1, 2):  # two syncs through one plan
        weights = moe_weights(seed=seed)
        sender.send(iter(weights), validator=SyncValidator(manifest_of(w0)))
        assert sender.covered, sender.reason
        assert not differing(models, loaded(case, weights))
    assert all(m.layers[0].experts.w13_weight.abs().sum() > 0 for m in models)
    if bucket_bytes == 700:
        assert len(sender.plan.layouts[0]) > 10


def _chunks(model, weights):
    entries = [[n, dtype_name(t.dtype), list(t.shape)] for n, t in weights]
    params, chunks, fills = receiver.trace_chunks(model, entries)
    assert not fills
    names = [n for n, _ in model.named_parameters()]
    return {(c.name, names[c.param]): c for c in chunks}, dict(model.named_parameters())


def _experts_of(chunks):
    return sorted({int(m[2]) for name, _ in chunks for m in [_EXPERT.fullmatch(name)] if m})


def test_the_plan_follows_the_expert_index_tp_narrowing_and_ep_skips():
    w = moe_weights()
    half = MOE_I // 2
    # TP=2, rank 1: the second half of each expert's gate/up rows and of its down_proj columns (strided)
    chunks, params = _chunks(ranks("tp2")[1], w)
    assert _experts_of(chunks) == list(range(E))
    per_expert = 2 * half * H  # elements of one expert in w13_weight (and in w2_weight: H * half, half of it)
    for e in (0, 5):
        gate = chunks[(f"model.layers.1.mlp.experts.{e}.gate_proj.weight", "layers.1.experts.w13_weight")]
        up = chunks[(f"model.layers.1.mlp.experts.{e}.up_proj.weight", "layers.1.experts.w13_weight")]
        down = chunks[(f"model.layers.1.mlp.experts.{e}.down_proj.weight", "layers.1.experts.w2_weight")]
        assert (gate.offset, gate.sizes, gate.strides, gate.dst_offset) == (half * H, (half, H), (H, 1), e * per_expert)
        assert (up.offset, up.dst_offset) == (half * H, e * per_expert + half * H)
        assert (down.offset, down.sizes, down.strides, down.dst_offset) == (half, (H, half), (MOE_I, 1), e * H * half)
    # EP=2, rank 1: experts 4..7 whole, in local slots 0..3; nothing of experts 0..3
    chunks, _ = _chunks(ranks("ep2")[1], w)
    assert _experts_of(chunks) == [4, 5, 6, 7]
    up6 = chunks[("model.layers.0.mlp.experts.6.up_proj.weight", "layers.0.experts.w13_weight")]
    assert (up6.offset, up6.sizes, up6.dst_offset) == (0, (MOE_I, H), 2 * (2 * MOE_I * H) + MOE_I * H)
    # two redundant experts: rank 1 holds physical 5..9 = logical 5, 6, 7, 0, 1 (0 and 1 live on rank 0 too)
    chunks, _ = _chunks(ranks("ep2-redundant")[1], w)
    assert _experts_of(chunks) == [0, 1, 5, 6, 7]
    down0 = chunks[("model.layers.0.mlp.experts.0.down_proj.weight", "layers.0.experts.w2_weight")]
    assert down0.dst_offset == 3 * H * MOE_I  # local slot 3 (physical 8)


def test_a_recorder_that_ignored_the_expert_index_would_fail(monkeypatch):
    """The comparison catches a plan that writes every expert into expert 0's rows (each later one over
    the one before): the same sync, the same check as above, differs."""
    real = receiver._chunk

    def without_expert(dst, src, pi, param, entries, starts):
        c = real(dst, src, pi, param, entries, starts)
        return dataclasses.replace(c, dst_offset=c.dst_offset % param[0].numel()) if param.dim() == 3 else c

    monkeypatch.setattr(receiver, "_chunk", without_expert)
    for case in ("tp1", "ep2"):
        models, weights = ranks(case), moe_weights(seed=3)
        sender = sync(models, weights, 1 << 20)
        assert sender.covered
        bad = differing(models, loaded(case, weights))
        assert bad and all("experts" in n for n in bad), bad


def test_transposed_expert_layout_falls_back_to_load_weights():
    """The ``triton_kernel`` runner's layout writes gate/up into strided columns: not a plan; the sync takes
    SGLang's own load_weights and loads the same weights."""
    models, weights = ranks("tp2", transposed=True), moe_weights(seed=4)
    sender = sync(models, weights, 1 << 20)
    assert sender.covered is False and "non-contiguous" in sender.reason
    assert not differing(models, loaded("tp2", weights, transposed=True))


def test_a_plan_too_big_for_the_status_block_falls_back_instead_of_failing_every_sync(monkeypatch):
    """Qwen3-30B-A3B's plan is about 2 MB of JSON, the status block 1 MiB: here a 4 KiB block and the 5 KB
    plan of each TP=2 rank (an EP=2 rank's 3 KB plan fits). The loader answers "not covered" (before, its
    answer raised in ``encode_status`` and the sender's FastPathError came back on every sync), and op
    ``load`` syncs the weights."""
    monkeypatch.setattr(plan_mod, "STATUS_BYTES", 4096)
    models = ranks("tp2")
    for seed in (5, 6):
        weights = moe_weights(seed=seed)
        sender = sync(models, weights, 1 << 20)
        assert sender.covered is False and "status block" in sender.reason, sender.reason
        assert not differing(models, loaded("tp2", weights))
    sender = sync(ranks("ep2"), moe_weights(seed=7), 1 << 20)
    assert sender.covered
    body = {"covered": True, "chunks": [["x" * 4000]]}
    assert plan_mod.status_room(body) < 0 and plan_mod.status_room({"covered": False}) > 0


def test_a_packed_plan_fits_the_status_block_and_syncs_bit_exact(monkeypatch):
    """Above ``PACK_ABOVE`` the loader packs the chunks (zlib); here a 4 KiB block, where the TP=2 ranks'
    5 KB plans did not fit unpacked (the test above), and packing from 1 KiB on: covered, and bit-exact."""
    monkeypatch.setattr(plan_mod, "STATUS_BYTES", 4096)
    monkeypatch.setattr(plan_mod, "PACK_ABOVE", 1024)
    models, weights = ranks("tp2"), moe_weights(seed=8)
    sender = sync(models, weights, 1 << 20)
    assert sender.covered, sender.reason
    assert not differing(models, loaded("tp2", weights))


def test_pack_chunks_round_trip_and_refuses_a_corrupt_answer(monkeypatch):
    chunks = [[f"model.layers.{i}.mlp.experts.{e}.up_proj.weight", 0, [8, 16], [16, 1], "bfloat16", i, e * 128]
              for i in range(4) for e in range(64)]
    assert plan_mod.pack_chunks(chunks) == {"chunks": chunks}  # small: as it is
    monkeypatch.setattr(plan_mod, "PACK_ABOVE", 1024)
    packed = plan_mod.pack_chunks(chunks)
    assert set(packed) == {"chunks_z"} and len(packed["chunks_z"]) < len(str(chunks)) / 5
    assert plan_mod.unpack_chunks(packed) == chunks and plan_mod.unpack_chunks({"covered": False}) is None
    with pytest.raises(ValueError, match="does not unpack"):
        plan_mod.unpack_chunks({"chunks_z": packed["chunks_z"][:-8] + "AAAAAAAA"})


def test_qwen3_moe_folder_and_checkpoint_names(tmp_path):
    """:func:`~sgl_rollout.bench.models.make_qwen3_moe_dir` saves per-expert checkpoint tensors (the weight
    manifest's names); :func:`~sgl_rollout.bench.models.qwen3_moe_checkpoint_tensors` gives the same names and
    bits from the in-memory model (fused experts under transformers 5); :func:`route_by_token` routes token
    ``t`` at layer ``L`` to experts ``(t + L) mod 8`` and ``(t + L + 1) mod 8`` (float32, exact ranking)."""
    import glob

    from safetensors.torch import load_file

    from sgl_rollout.bench.models import QWEN3_MOE_TINY, make_qwen3_moe_dir, qwen3_moe_checkpoint_tensors, \
        redraw, route_by_token
    from sgl_rollout.weight_sync.manifest import WeightManifest

    shape = dict(QWEN3_MOE_TINY, num_hidden_layers=2)
    model = make_qwen3_moe_dir(str(tmp_path), shape)
    saved = {}
    for f in glob.glob(str(tmp_path / "*.safetensors")):
        saved.update(load_file(f))
    named = qwen3_moe_checkpoint_tensors(model)
    assert set(saved) == {n for n, _ in named} == set(WeightManifest.from_pretrained(str(tmp_path)).names())
    assert all(torch.equal(saved[n], t) for n, t in named)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in saved
    redraw(model, seed=1)
    route_by_token(model)
    ids = torch.arange(1, 40)[None]
    with torch.no_grad():
        out = model.float()(ids, output_router_logits=True)
    for layer, logits in enumerate(out.router_logits):
        top = logits.float().topk(3, dim=-1)
        expected = torch.stack([(ids[0] + layer) % E, (ids[0] + layer + 1) % E], -1)
        assert torch.equal(top.indices[:, :2], expected)
        assert (top.values[:, 1] - top.values[:, 2]).min() > 0.1
