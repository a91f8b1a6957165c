"""Engine benchmarks. ``python -m sgl_rollout.bench sync`` times the weight sync into a real SGLang engine;
``python -m sgl_rollout.bench lora`` times a LoRA adapter sync against a full sync (:func:`bench_lora`);
``python -m sgl_rollout.bench gather`` times the sender's copy primitives alone (:func:`bench_gather`).

Methods, all into the same engine (one GPU, a 1.1B Llama-shaped model: hidden 2048, 22 layers,
32000 vocab, bf16, ``load_format="dummy"``), each the median of ``--repeats`` runs:

* ``verl_per_tensor_2g``: per-tensor CUDA IPC handles in groups of up to 2 GiB, as verl sends them
  (``update_weights_from_tensor`` without a load format);
* ``slime_flat_512m``: SGLang's ``flattened_bucket`` format in 512 MiB buckets, as slime sends them;
* ``flat_<default>m``: the same format in this package's default bucket
  (``RolloutConfig().update_weights_bucket_megabytes``): the path before the fast path;
* ``fast_512m``, ``fast_<default>m``, ``fast_3072m``: the fast path
  (:class:`~sgl_rollout.weight_sync.fast_path.FastPathSender`: copy plan, persistent IPC buffer, the
  sender's gather into it, one scatter kernel on the receiving side), with the sender's gather /
  SGLang round trip / status check split of the last run; 3072 MiB holds the whole model (one call);
* ``fast_<default>m_copy``, ``_foreach``, ``_cat``: the default bucket with each gather
  method (the rows above use ``"auto"``);
* ``fast_<default>m_fresh``: as ``fast_<default>m``, but its buffer is released (and ``empty_cache``
  run) before each sync, untimed, as the worker does at sleep level 2: each sync allocates a buffer,
  shares it and the engine opens its handle anew;
* ``round_trip_fast_path``: one fast-path call that copies nothing (SGLang's request round trip);
* ``flatten_only_2g``: building 2 GiB flattened buckets, no engine call;
* ``split_with_sizes_copy``: scattering the same bytes from one buffer into 201 tensors in one kernel;
* ``d2d_copy``: one device-to-device copy of the same bytes, the physical limit.

The KV cache is released during all of them, as in a colocated RL step (so no sync pays SGLang's
prefix-cache flush). It prints a table of median seconds and GB/s (1e9 bytes of tensor data per second) and writes JSON.
Engine starts must sit under ``if __name__ == "__main__":`` (SGLang spawns its scheduler).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from ..weight_sync.driver import fenced
from .models import LLAMA_1B, LORA_TARGETS, SMOLLM2_135M, gpu_engine_flags, llama_named_tensors, lora_named_tensors, make_llama_dir

#: A bucket (MiB) that holds the whole bench model: the fast path's one-call sync.
ONE_BUCKET_MB = 3072


def _timed(fn: Callable[[], None], repeats: int, before: Optional[Callable[[], None]] = None) -> List[float]:
    """Seconds of each of ``repeats`` runs of ``fn`` (GPU work included); ``before`` runs untimed before each."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def _groups(named, limit):
    from ..weight_sync import iter_buckets

    return list(iter_buckets(named, limit))


def bench_sync(args) -> Dict:
    """Start one engine and time every sync method into it (see the module docstring).

    Args:
        args: ``repeats`` (int), ``mem_fraction`` (float), ``workdir`` (str, where the model config goes).

    Returns:
        dict with ``bytes`` (tensor data per sync), ``results`` (per method: ``median_s``, ``gb_per_s``,
        ``times_s``) and ``sender_peak_extra_bytes`` (torch peak allocation above the baseline during a
        flattened sync, per bucket size).
    """
    from ..config import RolloutConfig
    from ..engine import RolloutEngine
    from ..memory import KV_CACHE
    from ..switch import Switch

    model_dir = os.path.join(args.workdir, "llama-1.1b")
    make_llama_dir(model_dir, LLAMA_1B)
    cfg = RolloutConfig(model_path=model_dir, load_format="dummy", gpu_memory_utilization=args.mem_fraction,
                        enforce_eager=True, fast_sync=True, engine_kwargs=gpu_engine_flags())
    default_mb = cfg.update_weights_bucket_megabytes
    named = llama_named_tensors(LLAMA_1B)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    engine = RolloutEngine(cfg)
    try:
        # as in a colocated RL step: the KV cache is released while the weights arrive (SGLang flushed the
        # prefix cache when it released it, so no sync pays a flush)
        Switch(engine, cfg).release_stage(KV_CACHE)  # the KV cache and its CUDA-graph memory
        senders = _fast_senders(engine, named, default_mb)
        results = _time_methods(engine, named, nbytes, default_mb, senders, args.repeats)
        peak = _sender_peaks(engine, named, default_mb, senders)
    finally:
        engine.shutdown()
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "sglang": _version("sglang"),
        "model": "llama-1.1b " + json.dumps(LLAMA_1B),
        "bytes": nbytes,
        "n_tensors": len(named),
        "repeats": args.repeats,
        "results": results,
        "sender_peak_extra_bytes": peak,
    }


def _fast_senders(engine, named, default_mb: int) -> Dict:
    """The fast-path senders of :func:`bench_sync`, by method name: ``fast_<mb>m`` for 512 MiB, the default
    bucket and :data:`ONE_BUCKET_MB`, the default bucket with each gather method (``fast_<default>m_<method>``)
    and ``fast_<default>m_fresh`` (its buffer released before each timed sync)."""
    from ..weight_sync.fast_path import FastPathSender
    from ..weight_sync.manifest import WeightManifest

    manifest = WeightManifest.from_named_tensors(named)
    senders = {f"fast_{mb}m": FastPathSender(engine, manifest, mb << 20) for mb in (512, default_mb, ONE_BUCKET_MB)}
    for method in ("copy", "foreach", "cat"):
        senders[f"fast_{default_mb}m_{method}"] = FastPathSender(engine, manifest, default_mb << 20, gather=method)
    senders[f"fast_{default_mb}m_fresh"] = FastPathSender(engine, manifest, default_mb << 20)
    return senders


def _per_tensor_sync(engine, named) -> Callable[[], None]:
    """A sync as verl sends it: per-tensor CUDA IPC handles in groups of up to 2 GiB."""
    from ..weight_sync import serialize

    def per_tensor():
        with fenced(engine):
            for group in _groups(named, 2 << 30):
                ok, msg = engine.update_weights_from_tensor([serialize(group)], load_format=None)
                assert ok, msg
        engine.flush_cache()
        torch.cuda.ipc_collect()
    return per_tensor


def _flat_sync(engine, named, mb: int) -> Callable[[], None]:
    """A sync in SGLang's ``flattened_bucket`` format, in buckets of ``mb`` MiB."""
    from ..weight_sync import send_flattened_buckets

    def run():
        with fenced(engine):
            send_flattened_buckets(engine, named, bucket_bytes=mb << 20)
    return run


def _flatten_only(named) -> Callable[[], None]:
    """Building 2 GiB flattened buckets on the GPU, no engine call."""
    from ..weight_sync import flatten_bucket

    def run():
        for bucket in _groups(named, 2 << 30):
            flatten_bucket(bucket, device="cuda")
    return run


def _fast_sync(engine, sender, named) -> Callable[[], None]:
    """A fast-path sync of ``named`` through ``sender``."""
    def run():
        with fenced(engine):
            sender.send(named)
    return run


def _release_sender(engine, sender) -> None:
    """Release ``sender``'s buffer (the engine closes its handle); the next sync allocates it again."""
    with fenced(engine):
        sender.release()


def _time_methods(engine, named, nbytes: int, default_mb: int, senders: Dict, repeats: int) -> Dict:
    """Time every method of :func:`bench_sync` (one warm-up, then ``repeats`` timed runs each).

    Returns:
        method -> ``median_s``, ``gb_per_s``, ``times_s``; for a fast-path sender also ``last_parts_s``,
        ``buckets`` and ``covered``.
    """
    fresh = f"fast_{default_mb}m_fresh"

    def release_fresh():  # as after a level-2 release: the next sync allocates, shares and opens anew
        _release_sender(engine, senders[fresh])
        torch.cuda.empty_cache()

    flat_all = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(flat_all)
    sizes = [t.numel() * t.element_size() for _, t in named]
    outs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    methods = {
        "verl_per_tensor_2g": _per_tensor_sync(engine, named),
        "slime_flat_512m": _flat_sync(engine, named, 512),
        f"flat_{default_mb}m": _flat_sync(engine, named, default_mb),
        **{key: _fast_sync(engine, snd, named) for key, snd in senders.items()},
        "flatten_only_2g": _flatten_only(named),
        "round_trip_fast_path": lambda: _ping(engine, senders[f"fast_{default_mb}m"]),
        "split_with_sizes_copy": lambda: torch.split_with_sizes_copy(flat_all, sizes, out=outs),
        "d2d_copy": lambda: dst.copy_(flat_all),
    }
    results = {}
    for name, fn in methods.items():
        before = release_fresh if name == fresh else None
        fn()  # warm-up
        times = _timed(fn, repeats, before)
        med = statistics.median(times)
        results[name] = {"median_s": med, "gb_per_s": nbytes / med / 1e9, "times_s": times}
        if name in senders:
            snd = senders[name]
            results[name]["last_parts_s"] = dict(snd.timings)
            results[name]["buckets"] = len(snd.plan.layouts[0]) if snd.covered else None
            results[name]["covered"] = snd.covered
    return results  # the copy baselines' buffers go with this frame, before the peaks are measured


def _sender_peaks(engine, named, default_mb: int, senders: Dict) -> Dict[str, int]:
    """Torch's peak allocation above the baseline during one sync: flattened (512, 2048 and the default
    MiB) and through each fast-path sender, its buffer allocated anew by the measured sync."""
    peak = {}
    for mb in (512, 2048, default_mb):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _flat_sync(engine, named, mb)()
        peak[f"flat_{mb}m"] = torch.cuda.max_memory_allocated() - base
    for snd in senders.values():
        _release_sender(engine, snd)  # the buffer is allocated again by the measured sync
    for key, snd in senders.items():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _fast_sync(engine, snd, named)()
        peak[key] = torch.cuda.max_memory_allocated() - base
        _release_sender(engine, snd)
    return peak


def bench_gather(args) -> Dict:
    """The copy primitives a fast-path sender's gather can use, without an engine: the trainer's tensors
    of each model shape (the demo's SmolLM2-135M, the 1.1B Llama; bf16, and fp32 cast into the bf16
    buffer) written into one flat buffer in order. Per primitive, the median over ``args.repeats`` of the
    CPU time of the call and of the time until the GPU finished it (seconds); every result is checked
    against ``torch.cat``. ``make_views`` is the cost of a new buffer's per-piece views in Python, and
    ``unflatten_views`` the same in one C++ call (what a sender pays once per buffer)."""
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "repeats": args.repeats, "models": {}}
    for label, shape in (("smollm2-135m", SMOLLM2_135M), ("llama-1.1b", LLAMA_1B)):
        srcs = [t for _, t in llama_named_tensors(shape)]
        srcs32 = [t.float() for t in srcs]
        buf = torch.empty(sum(t.numel() for t in srcs), dtype=torch.bfloat16, device="cuda")
        ref = torch.cat([t.view(-1) for t in srcs])

        def py_views():
            views, at = [], 0
            for t in srcs:
                views.append(buf[at:at + t.numel()].view(t.shape))
                at += t.numel()
            return views

        views = py_views()
        prims = {
            "foreach_copy (views made once)": lambda: torch._foreach_copy_(views, srcs),
            "torch.cat": lambda: torch.cat([t.view(-1) for t in srcs], out=buf),
            "copy_ per tensor": lambda: [d.copy_(t) for d, t in zip(views, srcs)],
            "torch._chunk_cat": lambda: torch._chunk_cat(srcs, 0, 1, out=buf.view(1, -1)),
            "fp32: foreach_copy (cast)": lambda: torch._foreach_copy_(views, srcs32),
            "fp32: copy_ per tensor (cast)": lambda: [d.copy_(t) for d, t in zip(views, srcs32)],
            "make_views (Python, new buffer)": py_views,
            "unflatten_views (C++, new buffer)": lambda: torch._C._nn.unflatten_dense_tensors(buf, srcs),
        }
        rows = {}
        for name, fn in prims.items():
            cpu, total = [], []
            for i in range(args.repeats + 2):
                buf.zero_()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                if i >= 2:  # two warm-ups
                    cpu.append(t1 - t0)
                    total.append(time.perf_counter() - t0)
            exact = "views" in name or torch.equal(buf, ref)
            if not exact:
                raise AssertionError(f"bench gather: {name} wrote wrong bytes")
            rows[name] = {"cpu_s": statistics.median(cpu), "total_s": statistics.median(total)}
        out["models"][label] = {"bytes": buf.numel() * 2, "tensors": len(srcs), "results": rows}
        del srcs, srcs32, buf, ref, views
        torch.cuda.empty_cache()
    return out


def print_gather_table(res: Dict) -> None:
    print(f"gather primitives on {res['device']} (median of {res['repeats']}; ms)")
    for label, m in res["models"].items():
        print(f"{label}: {m['tensors']} tensors, {m['bytes'] / 1e9:.2f} GB")
        for name, r in m["results"].items():
            print(f"  {name:36s} cpu {r['cpu_s'] * 1e3:8.3f}   until done {r['total_s'] * 1e3:8.3f}")


def bench_lora(args) -> Dict:
    """Adapter sync vs full sync, per model shape (the demo's SmolLM2-135M and the 1.1B Llama): one engine
    each with LoRA on (``lora_rank=args.rank``, all-linear targets), the KV cache released as in a
    colocated step; medians of ``args.repeats`` of a full sync (flattened buckets, this package's
    default bucket) and of an adapter sync (:class:`~sgl_rollout.weight_sync.lora.AdapterSync`: check,
    serialize, SGLang's ``load_lora_adapter_from_tensors`` replacing the previous version)."""
    from ..config import RolloutConfig
    from ..engine import RolloutEngine
    from ..memory import KV_CACHE
    from ..switch import Switch
    from ..weight_sync import send_flattened_buckets
    from ..weight_sync.lora import AdapterSync
    from ..weight_sync.manifest import WeightManifest

    out = {"device": torch.cuda.get_device_name(), "sglang": _version("sglang"), "rank": args.rank,
           "repeats": args.repeats, "models": {}}
    for label, shape in (("smollm2-135m", SMOLLM2_135M), ("llama-1.1b", LLAMA_1B)):
        model_dir = os.path.join(args.workdir, label)
        make_llama_dir(model_dir, shape)
        cfg = RolloutConfig(model_path=model_dir, load_format="dummy", gpu_memory_utilization=args.mem_fraction,
                            enforce_eager=True, lora_rank=args.rank, lora_target_modules=list(LORA_TARGETS),
                            engine_kwargs=gpu_engine_flags())
        named = llama_named_tensors(shape)
        adapter = lora_named_tensors(shape, args.rank)
        peft_config = {"r": args.rank, "lora_alpha": 2 * args.rank, "target_modules": list(LORA_TARGETS)}
        engine = RolloutEngine(cfg)
        try:
            Switch(engine, cfg).release_stage(KV_CACHE)
            sync = AdapterSync(engine, manifest=WeightManifest.from_named_tensors(named))

            def full():
                with fenced(engine):
                    send_flattened_buckets(engine, named, bucket_bytes=cfg.bucket_bytes)

            full()
            full_t = _timed(full, args.repeats)
            sync.sync(adapter, peft_config)  # warm-up (the first version)
            adapter_t, loads, builds, parts = [], [], [], []
            for _ in range(args.repeats):
                st = sync.sync(adapter, peft_config)
                adapter_t.append(st.seconds)
                loads.append(st.load_seconds)
                builds.append(st.build_seconds)
                parts.append(st.build_parts)
            nbytes = sum(t.numel() * t.element_size() for _, t in named)
            out["models"][label] = {
                "base_bytes": nbytes, "base_tensors": len(named), "adapter_bytes": st.adapter_bytes,
                "adapter_tensors": st.adapter_tensors, "full_sync_median_s": statistics.median(full_t),
                "adapter_sync_median_s": statistics.median(adapter_t),
                "adapter_load_median_s": statistics.median(loads), "adapter_build_median_s": statistics.median(builds),
                "adapter_build_parts_median_s": {k: statistics.median(p[k] for p in parts) for k in parts[0]},
                "base_sent_after_first": st.base_sent,
            }
        finally:
            engine.shutdown()
    return out


def print_lora_table(res: Dict) -> None:
    """Print :func:`bench_lora`'s result (ms, MB)."""
    print(f"\nLoRA rank {res['rank']} adapter sync vs full sync into SGLang {res['sglang']} on {res['device']}, "
          f"median of {res['repeats']}")
    print(f"{'model':<14}{'full MB':>9}{'full ms':>9}{'adapter MB':>12}{'adapter ms':>12}{'(SGLang load ms)':>18}"
          "  (build: check, flatten, serialize ms)")
    for label, r in res["models"].items():
        parts = ", ".join(f"{v * 1e3:.2f}" for v in r.get("adapter_build_parts_median_s", {}).values())
        print(f"{label:<14}{r['base_bytes'] / 1e6:>9.0f}{r['full_sync_median_s'] * 1e3:>9.2f}"
              f"{r['adapter_bytes'] / 1e6:>12.2f}{r['adapter_sync_median_s'] * 1e3:>12.2f}"
              f"{r['adapter_load_median_s'] * 1e3:>18.2f}  ({parts})")


def _ping(engine, sender) -> None:
    with fenced(engine):
        sender.ping()


def _version(pkg):
    from importlib.metadata import version

    try:
        return version(pkg)
    except Exception:  # noqa: BLE001
        return "?"


def print_table(res: Dict) -> None:
    """Print :func:`bench_sync`'s result as a table (ms, GB/s, sender peak MiB)."""
    print(f"\nweight sync into SGLang {res['sglang']} on {res['device']}: {res['n_tensors']} tensors, "
          f"{res['bytes'] / 1e9:.2f} GB, median of {res['repeats']}")
    print(f"{'method':<22}{'median ms':>12}{'GB/s':>10}")
    for name, r in res["results"].items():
        parts = r.get("last_parts_s")
        extra = ("  (" + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in parts.items()) + f"; {r.get('buckets')} buckets)"
                 if parts else "")
        print(f"{name:<22}{r['median_s'] * 1e3:>12.2f}{r['gb_per_s']:>10.1f}{extra}")
    for name, b in res.get("sender_peak_extra_bytes", {}).items():
        print(f"sender peak extra, {name}: {b / 2**20:.0f} MiB")
