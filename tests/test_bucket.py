import weakref

import pytest
import torch

from sgl_rollout.weight_sync import ALIGN, flatten_bucket, iter_buckets, tensor_nbytes


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _mixed():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(8, 6, generator=g)
    return [
        ("a.int8", torch.randint(-100, 100, (3,), dtype=torch.int8, generator=g)),  # odd size before fp32
        ("b.fp32", torch.randn(5, generator=g)),
        ("c.bf16", torch.randn(4, 7, generator=g).to(torch.bfloat16)),
        ("d.view", base[2:5]),  # a view with a storage offset
        ("e.transposed", base.t()),  # non-contiguous
        ("f.strided", base[:, ::2]),  # non-contiguous slice
        ("g.scalar", torch.tensor(3.5, dtype=torch.float64)),
        ("h.empty", torch.empty(0, 4, dtype=torch.float16)),
        ("i.bool", torch.tensor([True, False, True])),
    ]


def test_empty_input_gives_no_bucket():
    assert list(iter_buckets([], 1024)) == []
    with pytest.raises(ValueError):
        flatten_bucket([])


def test_bad_bucket_size_and_items():
    with pytest.raises(ValueError):
        list(iter_buckets([("x", torch.zeros(1))], 0))
    with pytest.raises(ValueError):
        list(iter_buckets([("x", [1, 2])], 10))


def test_huge_tensor_travels_alone_and_order_kept():
    small = [(f"s{i}", torch.zeros(16)) for i in range(3)]  # 64 B each -> one ALIGN slot each
    huge = ("huge", torch.zeros(10_000))
    items = small[:2] + [huge] + small[2:]
    buckets = list(iter_buckets(items, bucket_bytes=2 * ALIGN))
    names = [[n for n, _ in b] for b in buckets]
    assert names == [["s0", "s1"], ["huge"], ["s2"]]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in items]


def test_buckets_respect_limit():
    items = [(f"t{i}", torch.zeros(i * 10 + 1, dtype=torch.float32)) for i in range(50)]
    limit = 1000
    for b in iter_buckets(items, limit):
        total = sum((tensor_nbytes(t) + ALIGN - 1) // ALIGN * ALIGN for _, t in b)
        assert len(b) == 1 or total <= limit


def test_iter_buckets_is_lazy():
    pulled = []

    def gen():
        for i in range(10):
            pulled.append(i)
            yield f"t{i}", torch.zeros(16)

    it = iter_buckets(gen(), 2 * ALIGN)
    first = next(it)
    assert [n for n, _ in first] == ["t0", "t1"]
    assert len(pulled) <= 3


def test_flatten_mixed_dtypes_views_noncontiguous_bit_identical():
    items = _mixed()
    flat = flatten_bucket(items)
    assert flat.flattened_tensor.dtype == torch.uint8 and flat.flattened_tensor.dim() == 1
    for m in flat.metadata:
        assert m.start_idx % ALIGN == 0 and m.numel == m.end_idx - m.start_idx
    rebuilt = flat.tensors()
    assert [n for n, _ in rebuilt] == [n for n, _ in items]
    for (_, src), (_, got) in zip(items, rebuilt):
        assert got.dtype == src.dtype and got.shape == src.shape
        assert torch.equal(_bits(got), _bits(src))


def test_flatten_into_given_buffer_and_reject_small_one():
    items = _mixed()
    out = torch.full((1 << 16,), 0xAB, dtype=torch.uint8)
    flat = flatten_bucket(items, out=out)
    assert flat.flattened_tensor.data_ptr() == out.data_ptr()
    for (_, src), (_, got) in zip(items, flat.tensors()):
        assert torch.equal(_bits(got), _bits(src))
    with pytest.raises(ValueError):
        flatten_bucket(items, out=torch.empty(8, dtype=torch.uint8))


def test_group_of_closes_buckets_at_group_boundaries():
    ts = [(f"model.layers.{i // 2}.w{i % 2}", torch.zeros(4)) for i in range(6)]  # 2 tensors per layer
    buckets = list(iter_buckets(ts, bucket_bytes=1 << 20, group_of=lambda n: n.split(".")[2]))
    assert [[n for n, _ in b] for b in buckets] == [[n for n, _ in ts[i : i + 2]] for i in (0, 2, 4)]
    # without group_of everything fits one bucket
    assert len(list(iter_buckets(ts, bucket_bytes=1 << 20))) == 1


def test_bucket_stream_holds_at_most_max_held_and_releases_all_but_the_newest():
    from sgl_rollout.weight_sync import BucketStream

    items = [(f"w{i}", torch.full((256,), float(i))) for i in range(4)]  # 1 KiB each, one per bucket
    stream = BucketStream(iter(items), 1024, device="cpu", max_held=2)
    assert stream.next_payload() is not None and stream.next_payload() is not None and stream.held == 2
    with pytest.raises(RuntimeError, match="2 held, at most 2"):
        stream.next_payload()
    stream.release(keep_newest=True)
    assert stream.held == 1
    assert stream.next_payload() is not None and stream.held == 2
    stream.release()
    assert stream.held == 0
    assert stream.next_payload() is not None and stream.next_payload() is None  # the 4th, then the end
    assert stream.stats.n_buckets == 4
    with pytest.raises(ValueError, match="max_held"):
        BucketStream(iter(items), 1024, device="cpu", max_held=0)


def _observed_source(n, freed, numel=16):
    """(name, tensor) pairs of ``numel`` float32 zeros, made on demand; nobody but the consumer keeps them.

    ``freed`` gets a tensor's name once the tensor is deleted (weakref.finalize)."""
    for i in range(n):
        t = torch.zeros(numel)
        weakref.finalize(t, freed.add, f"t{i}")
        yield f"t{i}", t


@pytest.mark.parametrize("group_of", [None, lambda name: name])  # size-closed and group-closed buckets
def test_iter_buckets_drops_its_references_to_a_yielded_bucket(group_of):
    """While the consumer holds (loads) a bucket, the generator keeps none of its tensors: once the consumer
    drops the bucket, its source tensors are freed, with the generator still suspended at that yield."""
    freed = set()
    limit = 2 * ALIGN if group_of is None else 1 << 20  # 64 B tensors: two a bucket, or one per name
    per = 2 if group_of is None else 1
    it = iter_buckets(_observed_source(3 * per, freed), limit, group_of=group_of)
    seen = []
    for k in range(3):
        bucket = next(it)
        names = [n for n, _ in bucket]
        assert names == [f"t{i}" for i in range(k * per, (k + 1) * per)]  # what it yields is unchanged
        seen += names
        assert not freed & set(names)  # the consumer's list keeps them alive
        del bucket
        assert freed == set(seen), f"bucket {k}: still alive after the consumer dropped it: {set(seen) - freed}"
        if k < 2:  # the look-ahead (first tensor of the next bucket) was read and is kept for that bucket
            assert f"t{(k + 1) * per}" not in freed
    assert next(it, None) is None


def test_iter_buckets_yields_same_buckets_from_lists_and_generators():
    items = _mixed() + [(f"z{i}", torch.zeros(i * 7 + 1)) for i in range(20)]
    for limit in (1, ALIGN, 3 * ALIGN, 1 << 20):
        from_list = [[n for n, _ in b] for b in iter_buckets(items, limit)]
        from_gen = [[(n, t) for n, t in b] for b in iter_buckets((x for x in items), limit)]
        assert [[n for n, _ in b] for b in from_gen] == from_list
        flat = [t for b in from_gen for _, t in b]
        assert len(flat) == len(items) and all(a is b for a, (_, b) in zip(flat, items))  # same tensor objects
