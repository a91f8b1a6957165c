"""A bucket flattened and serialized here is rebuilt bit-identically by SGLang's own code in another process."""

import multiprocessing as mp

import pytest
import torch

from sgl_rollout.engine.sglang_version import TESTED

from sgl_rollout.weight_sync import flatten_bucket, iter_buckets, serialize
from sgl_rollout.weight_sync.ipc import DEVICE_ARG_INDEX, _with_uuid


def _receiver(conn):
    # Runs in a spawned process: the receiving side exactly as SGLang 0.5.10 does it
    # (tp_worker.update_weights_from_tensor -> ModelRunner._update_weights_from_flattened_bucket).
    import sys

    tests_dir, tree = conn.recv()
    sys.path[:0] = [p for p in (tree, tests_dir) if p]
    from _sglang_cpu import ensure_sglang_importable

    ensure_sglang_importable()
    import sglang

    assert tree is None or sglang.__file__.startswith(tree), sglang.__file__  # that release's own code
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    out = []
    while True:
        payloads = conn.recv()
        if payloads is None:
            break
        data = MultiprocessingSerializer.deserialize(payloads[0])  # this is TP rank 0's payload
        meta = [
            FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel)
            for m in data["metadata"]
        ]
        bucket = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=meta)
        for name, t in bucket.reconstruct_tensors():
            raw = t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            out.append((name, str(t.dtype), tuple(t.shape), raw.numpy().tobytes()))
        conn.send("ack")  # the sender may now free this bucket
    conn.send(out)


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("version", sorted(TESTED))
def test_flattened_bucket_rebuilt_by_sglang_in_another_process(version):
    """Each supported release's own deserializer (its SafeUnpickler) and FlattenedTensorBucket."""
    import os

    from sgl_rollout.engine.sglang_version import installed_sglang
    from test_sglang_versions import _tree

    tree = None if version == installed_sglang() else str(_tree(version))

    g = torch.Generator().manual_seed(1)
    base = torch.randn(32, 16, generator=g)
    named = [
        ("model.embed_tokens.weight", torch.randn(100, 16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", base.t()),  # non-contiguous
        ("model.layers.0.mlp.gate_proj.weight", base[4:20]),  # view with offset
        ("odd.int8", torch.randint(-5, 5, (7,), dtype=torch.int8, generator=g)),
        ("model.norm.weight", torch.randn(16, generator=g).to(torch.float16)),
        ("scalar.fp64", torch.tensor(2.25, dtype=torch.float64)),
    ]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child,))
    proc.start()
    try:
        parent.send((os.path.dirname(__file__), tree))
        n_buckets = 0
        for bucket in iter_buckets(named, bucket_bytes=4096):
            flat = flatten_bucket(bucket, device="cpu")
            data = serialize(flat.payload())
            parent.send([data, data])  # one payload per TP rank (TP=2)
            assert parent.recv() == "ack"
            n_buckets += 1
        parent.send(None)
        got = parent.recv()
    finally:
        proc.join(timeout=60)
    assert n_buckets >= 2  # the test really crossed bucket boundaries
    assert [g_[0] for g_ in got] == [n for n, _ in named]
    for (name, dtype, shape, raw), (_, src) in zip(got, named):
        assert dtype == str(src.dtype) and shape == tuple(src.shape), name
        assert raw == _bits(src), name


def test_uuid_replaces_device_index(monkeypatch):
    import sgl_rollout.weight_sync.ipc as ipc

    monkeypatch.setattr(ipc, "device_uuid", lambda i: f"uuid-of-{i}")
    args = tuple(range(DEVICE_ARG_INDEX)) + (3, "handle", 99)
    out = _with_uuid(args)
    assert out[DEVICE_ARG_INDEX] == "uuid-of-3"
    assert out[:DEVICE_ARG_INDEX] == args[:DEVICE_ARG_INDEX] and out[DEVICE_ARG_INDEX + 1 :] == args[DEVICE_ARG_INDEX + 1 :]
    already = args[:DEVICE_ARG_INDEX] + ("GPU-abc",) + args[DEVICE_ARG_INDEX + 1 :]
    assert _with_uuid(already) == already
    import pytest

    with pytest.raises(TypeError):
        _with_uuid(args[:DEVICE_ARG_INDEX] + (None,) + args[DEVICE_ARG_INDEX + 1 :])
