"""The train-to-rollout switch's empty_cache phase: freezing long-lived objects so the full
collection is cheap, and that garbage created later (trainer tensors in reference cycles) still goes.

``python tests/test_switch.py`` runs a CPU micro-benchmark (imports torch, transformers, Ray and verl
where installed, builds a SmolLM2-135M-shaped Llama and its AdamW state on CPU) and prints the
figures: live objects, ``gc.collect()`` before and after :func:`freeze_long_lived`, and
:func:`aggressive_empty_cache` on a fake CUDA allocator (what the seed's rounds cost vs now).
"""

import gc
import statistics
import time
import weakref

import pytest

from sgl_rollout.memory import GiB, aggressive_empty_cache, freeze_long_lived
from test_memory_utils import _FakeCuda


@pytest.fixture
def unfreeze():
    yield
    gc.unfreeze()  # leave no frozen heap to the other tests


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cycle collector frees it


def _tracked() -> int:
    return sum(len(gc.get_objects(g)) for g in range(3))


def test_freeze_takes_live_objects_out_of_collections(unfreeze):
    keep = [_Node() for _ in range(5000)]
    n_before = _tracked()
    frozen = freeze_long_lived()
    assert frozen >= 5000 and gc.get_freeze_count() >= frozen
    assert _tracked() < n_before // 10  # a full collection now traverses almost nothing
    assert not any(o is keep[0] for g in range(3) for o in gc.get_objects(g))


def test_freeze_collects_garbage_first(unfreeze):
    ref = weakref.ref(_Node())  # cycle garbage alive now
    freeze_long_lived()
    assert ref() is None  # freed, not frozen
    ref = weakref.ref(_Node())
    freeze_long_lived(collect=False)
    assert ref() is not None  # frozen: the documented caveat


def test_cycles_created_after_freeze_are_still_collected(unfreeze):
    holder = []
    freeze_long_lived()
    dead = weakref.ref(_Node())
    alive = _Node()
    holder.append(alive)  # referenced from a frozen object: must survive
    alive_ref = weakref.ref(alive)
    del alive
    gc.collect()
    assert dead() is None and alive_ref() is not None


def test_freeze_again_is_cheap_and_freezes_only_new_objects(unfreeze):
    freeze_long_lived()
    count = gc.get_freeze_count()
    new = [_Node() for _ in range(100)]
    t = time.perf_counter()
    again = freeze_long_lived()
    assert time.perf_counter() - t < 0.1
    assert 100 <= again < count // 10  # frozen objects freed since leave the count: compare loosely
    assert not any(o is new[0] for g in range(3) for o in gc.get_objects(g))


def test_trainer_cycle_garbage_freed_after_freeze(monkeypatch, unfreeze):
    """The switch after start-up: the heap is frozen, the step's dropped tensors sit in a cycle in
    the oldest unfrozen generation; aggressive_empty_cache returns their bytes in round 1."""
    fake = _FakeCuda(monkeypatch, allocated=GiB)
    freeze_long_lived()
    step = {"activations": fake.tensor(3 * GiB)}
    step["self"] = step
    gc.collect()  # promoted to the oldest generation while alive during the step
    del step
    res = aggressive_empty_cache()
    assert res == [3 * GiB, 0] and fake.allocated == GiB
    assert res.rounds[0].gc_generation == 2


# ----------------------------------------------------------------------------- micro-benchmark
def _median_s(fn, n=5):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _switch(collect, cycle):
    """One switch on the fake allocator: the trainer's 3 GiB were offloaded (cached, not yet
    returned); with ``cycle`` another 2 GiB of its tensors hang in a reference cycle. As in the
    demo, round 1 frees over 1 GiB and round 2 frees nothing."""
    with pytest.MonkeyPatch.context() as mp:
        fake = _FakeCuda(mp, allocated=GiB, cached=3 * GiB)
        if cycle:
            step = {"t": fake.tensor(2 * GiB)}
            step["self"] = step
            gc.collect(0)
            del step
        t = time.perf_counter()
        res = aggressive_empty_cache(collect=collect)
        wall = time.perf_counter() - t
        assert res[0] == (5 if cycle else 3) * GiB and fake.allocated == GiB
        return wall, res


def _report(when, collect, cycle):
    wall, res = _switch(collect, cycle)
    print(f"aggressive_empty_cache(collect={collect!r}) {when} freeze, fake CUDA, "
          f"{'2 GiB in a cycle' if cycle else 'no cycle garbage'}: {wall * 1e3:.2f} ms, {len(res)} rounds, "
          f"full collections {sum(r.gc_generation == 2 for r in res.rounds)}, parts (ms): "
          + ", ".join(f"{k.split('.')[1]} {v * 1e3:.3f}" for k, v in res.phase_seconds().items()))


def _bench() -> None:
    import importlib
    import platform

    import torch
    import transformers

    t0 = time.perf_counter()
    extra = []
    for mod in ("ray", "verl"):
        try:
            importlib.import_module(mod)
            extra.append(mod)
        except Exception:  # noqa: BLE001 - optional
            pass
    cfg = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                   tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"also imported: {extra or 'nothing'}; SmolLM2-135M-shaped Llama + AdamW step on CPU "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params) in {time.perf_counter() - t0:.1f} s")
    gc.collect()
    print(f"tracked live objects: {len(gc.get_objects())}")
    full = _median_s(gc.collect)
    print(f"gc.collect() (full), median of 5, before freeze: {full * 1e3:.1f} ms")
    for cycle in (False, True):
        for collect in ("always", "auto"):
            _report("before", collect, cycle)
    t = time.perf_counter()
    n = freeze_long_lived()
    print(f"freeze_long_lived(): froze {n} objects in {(time.perf_counter() - t) * 1e3:.1f} ms")
    full_after = _median_s(gc.collect)
    print(f"gc.collect() (full), median of 5, after freeze: {full_after * 1e3:.2f} ms")
    model(ids, labels=ids).loss.backward()  # a training step's objects, created after the freeze
    opt.step()
    opt.zero_grad()
    t = time.perf_counter()
    again = freeze_long_lived()
    print(f"freeze_long_lived() again after a step: froze {again} more objects in {(time.perf_counter() - t) * 1e3:.2f} ms")
    for cycle in (False, True):
        for collect in ("always", "auto"):
            _report("after", collect, cycle)
    wall = _median_s(aggressive_empty_cache)
    print(f"aggressive_empty_cache() with no CUDA (one gc.collect), after freeze: {wall * 1e3:.2f} ms")


if __name__ == "__main__":
    _bench()


def test_what_a_sleep_releases_is_the_switchs_rule_everywhere():
    """``sleep_releases`` follows ``sleep_tags``, and the LoRA path's prediction of a released base
    (``needs_base_sync`` without an observation) is that rule, not its own (issue 46)."""
    from sgl_rollout.memory import KV_CACHE, WEIGHTS
    from sgl_rollout.switch import sleep_releases
    from sgl_rollout.weight_sync.lora import needs_base_sync

    for fce in (True, False):
        for level in (1, 2):
            assert sleep_releases(KV_CACHE, fce, level) is fce
            assert sleep_releases(WEIGHTS, fce, level) is (fce and level == 2)
            assert needs_base_sync(free_cache_engine=fce, sleep_level=level, base_sync_done=True,
                                   load_format="auto") is sleep_releases(WEIGHTS, fce, level)
    with pytest.raises(ValueError, match="sleep_level must be 1 or 2"):
        sleep_releases(WEIGHTS, True, 3)
    with pytest.raises(ValueError, match="unknown stage"):
        sleep_releases("lora", True, 1)
