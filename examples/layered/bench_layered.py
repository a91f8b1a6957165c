"""Layered vs all-at-once weight sync: the trainer's extra peak memory and the sync time.

A Qwen2-7B-shaped model (hidden 3584, 28 layers, vocab 152064, bf16, random weights, nothing
downloaded: built on the meta device, then materialized shard by shard) is the trainer, in one of two
layouts:

* ``fsdp2``: sharded with FSDP2 (``fully_shard`` per decoder layer and at the root) over ``--nproc``
  ranks (spawned with ``torch.multiprocessing``; NCCL on CUDA, gloo on the CPU);
* ``offload``: one process, parameters in (optionally pinned) CPU memory, as an offloaded trainer
  keeps them.

Each sync streams the trainer's weights with :mod:`sgl_rollout.weight_sync.layered` and one method:

* ``all_at_once``: every weight gathered (FSDP2 ``full_tensor``) or moved to the GPU first, then sent:
  verl without ``layered_summon``;
* ``layered``: each weight gathered when the sender asks for it, buckets closed at decoder layers
  (``iter_buckets(group_of=layer_index)``);
* ``direct`` (offload only): layered, but CPU weights are not moved first: the sender copies them
  from host memory into its GPU bucket buffer.

The sync goes to one of two targets:

* ``--no-engine`` (default): the trainer side alone, as the sender does it: ``iter_buckets`` ->
  ``flatten_bucket`` into a bucket buffer on the device -> synchronize -> drop;
* ``--engine``: a real SGLang engine per rank (``RolloutWorker``, TP=1 on the rank's GPU,
  ``load_format="dummy"``, ``sleep_level=2``): each repeat sleeps it and runs
  ``update_weights`` (the staged wake: weights, sync, KV cache) with the stream; the worker's
  ``config.layered_summon`` is set for the layered methods.

Figures per method, median of ``--repeats`` (after ``--warmup`` runs): sync seconds (slowest rank),
GB/s of weight bytes, the trainer's extra peak (``torch.cuda.max_memory_allocated`` over the sync
minus the allocation before it, largest rank; on the CPU the bytes of gathered tensors and bucket
buffers alive at once, counted with ``layered.LiveBytes``), and the bound "one layer + one bucket".
Prints a table; ``--out`` writes JSON.

    python examples/layered/bench_layered.py --layout fsdp2 --nproc 2 --out fsdp2_h200x2.json
    python examples/layered/bench_layered.py --layout offload --pin --out offload_h100.json
    python examples/layered/bench_layered.py --layout offload --engine --mem-fraction 0.5
    python examples/layered/bench_layered.py --tiny --device cpu      # CPU check, tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch

#: Qwen2-7B's shape (Qwen/Qwen2-7B config.json).
QWEN2_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
#: A tiny Qwen2 for CPU checks.
QWEN2_TINY = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256, rope_theta=10000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
METHODS = {"fsdp2": ("all_at_once", "layered"), "offload": ("all_at_once", "layered", "direct")}
GB = 1e9


def qwen2_config(args):
    from transformers import Qwen2Config

    shape = dict(QWEN2_TINY if args.tiny else QWEN2_7B)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    return Qwen2Config(**shape, architectures=["Qwen2ForCausalLM"], torch_dtype=torch.bfloat16,
                       bos_token_id=1, eos_token_id=2)


def build_on_meta(cfg):
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


@torch.no_grad()
def materialize(model, device, seed: int, fill_on=None) -> None:
    """Allocate the parameters (each rank only its shards) on ``device`` and fill them: norms 1, the rest
    N(0, 0.02); random per rank (a benchmark needs the bytes, not a model that agrees across ranks).
    ``fill_on``: draw the random values there, one parameter at a time, and copy them in (a GPU fills
    the 7B shape's 15 GB in about a second; the CPU's ``normal_`` took minutes)."""
    model.to_empty(device=device)
    g = torch.Generator(device=fill_on or device).manual_seed(seed)
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if name.endswith("norm.weight"):
            local.fill_(1.0)
        elif fill_on is None:
            local.normal_(0.0, 0.02, generator=g)
        else:
            local.copy_(torch.empty(local.shape, dtype=local.dtype, device=fill_on).normal_(0.0, 0.02, generator=g))


def make_trainer(layout: str, cfg, device: str, world: int, rank: int, pin: bool):
    model = build_on_meta(cfg)
    if layout == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device, (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        materialize(model, torch.device(device, torch.cuda.current_device()) if device == "cuda" else "cpu", seed=rank)
    else:
        materialize(model, "cpu", seed=rank, fill_on="cuda" if device == "cuda" else None)
        if pin and torch.cuda.is_available():
            for p in model.parameters():
                p.data = p.data.pin_memory()
    return model


def stream_of(method: str, model, layout: str, device: str, meter):
    from sgl_rollout.weight_sync.layered import iter_all_at_once, iter_layered

    gather_to = None if layout == "fsdp2" else device  # FSDP2: the mesh's device; offload: moved here
    if method == "all_at_once":
        return iter_all_at_once(model, device=gather_to, meter=meter)
    if method == "layered":
        return iter_layered(model, device=gather_to, meter=meter)
    if method == "direct":
        return iter_layered(model, device=None, meter=meter)
    raise ValueError(method)


class Timed:
    """Wraps a stream and times its first ``next()`` (``first_s``): ``update_weights`` reads one weight
    before it resumes the engine's weights and starts the sender, so an all-at-once stream does its
    whole gather there, outside the sender's own clock. Holds no reference to an item it has passed on."""

    def __init__(self, stream):
        self.first_s = 0.0
        self._it = iter(stream)

    def __iter__(self):
        return self._gen()

    def _gen(self):
        t0 = time.perf_counter()
        try:
            first = next(self._it)
        except StopIteration:
            return
        self.first_s = time.perf_counter() - t0
        yield first
        del first
        while True:
            try:
                yield next(self._it)
            except StopIteration:
                return


def consume(stream, bucket_bytes: int, layered: bool, device: str, meter) -> Dict:
    """The sender's trainer side without an engine: bucket, flatten onto the device, wait, drop."""
    from sgl_rollout.weight_sync.bucket import flatten_bucket, iter_buckets
    from sgl_rollout.weight_sync.layered import layer_index

    flat_device = torch.cuda.current_device() if device == "cuda" else "cpu"
    n_buckets = nbytes = max_flat = 0
    for bucket in iter_buckets(stream, bucket_bytes, group_of=layer_index if layered else None):
        flat = flatten_bucket(bucket, device=flat_device)
        meter.track(flat.flattened_tensor)
        if device == "cuda":
            torch.cuda.synchronize()  # the engine call returns once the bucket is loaded
        n_buckets += 1
        nbytes += sum(m.end_idx - m.start_idx for m in flat.metadata)
        max_flat = max(max_flat, flat.nbytes)
        del flat, bucket
    return {"n_buckets": n_buckets, "bytes": nbytes, "max_flat_bytes": max_flat}


def timeline_peaks(records) -> Dict:
    """From the worker's timeline records of one ``update_weights`` (:class:`sgl_rollout.memory.MemoryRecord`):
    ``phase_peak_allocated_bytes``, this process's torch peak over those phases (each record resets the
    peak, so ``torch.cuda.max_memory_allocated`` alone sees only the time since the last one), and
    ``device_used_max_bytes``, the most device memory in use (all processes: engine and trainer) at a
    phase's end."""
    return {"phase_peak_allocated_bytes": max((r.peak_allocated_bytes for r in records), default=0),
            "device_used_max_bytes": max((r.used_bytes for r in records), default=None)}


def worker_takes_group_of() -> bool:
    """Whether this package's sender closes buckets at layers for ``RolloutConfig.layered_summon``."""
    import inspect

    from sgl_rollout.weight_sync import sender

    return "group_of" in inspect.signature(sender.send_flattened_buckets).parameters


def start_worker(args, cfg, rank: int):
    from sgl_rollout.bench import gpu_engine_flags
    from sgl_rollout.config import RolloutConfig
    from sgl_rollout.worker import RolloutWorker

    model_dir = os.path.join(args.workdir, f"qwen2-{'tiny' if args.tiny else '7b'}-shape-{cfg.num_hidden_layers}l-r{rank}")
    os.makedirs(model_dir, exist_ok=True)
    cfg.save_pretrained(model_dir)  # config only (one folder per rank): the engine loads dummy weights
    kwargs = dict(gpu_engine_flags(), base_gpu_id=torch.cuda.current_device(), port=30000 + 1000 * rank)
    rcfg = RolloutConfig(model_path=model_dir, tensor_model_parallel_size=1, gpu_memory_utilization=args.mem_fraction,
                         load_format="dummy", sleep_level=2, enforce_eager=args.enforce_eager,
                         update_weights_bucket_megabytes=int(args.bucket_mb), engine_kwargs=kwargs)
    return RolloutWorker(rcfg)


def one_sync(method: str, model, args, layout: str, worker=None) -> Dict:
    from sgl_rollout.weight_sync.layered import LiveBytes

    dist = torch.distributed if torch.distributed.is_initialized() else None
    cuda = args.device == "cuda"
    if worker is not None:
        worker.sleep()  # level 2: weights and KV cache released
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    meter = LiveBytes()
    if dist is not None:
        dist.barrier()
    t0 = time.perf_counter()
    timed = Timed(stream_of(method, model, layout, args.device, meter))
    layered = method != "all_at_once"
    rec: Dict = {}
    if worker is None:
        rec.update(consume(iter(timed), args.bucket_bytes, layered, args.device, meter))
    else:
        worker.config.layered_summon = layered
        n_records = len(worker.timeline.records)
        stats = worker.update_weights(iter(timed))
        rec.update(timeline_peaks(worker.timeline.records[n_records:]))
        phases = worker.last_phase_seconds
        rec.update(n_buckets=stats.n_buckets, bytes=stats.bytes, max_flat_bytes=stats.max_bucket_bytes,
                   sender_s=stats.seconds, resume_weights_s=phases.get("resume_weights", 0.0),
                   switch_s=phases.get("switch_total"))
    if cuda:
        torch.cuda.synchronize()
    rec["seconds"] = time.perf_counter() - t0
    # the sync: the whole consumption without an engine; with one, the sender's time plus the first
    # weight's gather, which update_weights does before it resumes the weights and starts the sender
    rec["sync_s"] = rec["seconds"] if worker is None else rec["sender_s"] + timed.first_s
    # the worker's timeline resets torch's peak at each phase it records: the max over those phases
    peak = max(torch.cuda.max_memory_allocated(), rec.pop("phase_peak_allocated_bytes", 0)) if cuda else None
    rec["peak_bytes"] = (peak - base) if cuda else None
    rec["counted_peak_bytes"] = meter.peak
    if dist is not None:  # slowest rank's time, largest rank's peak
        vals = torch.tensor([rec["seconds"], rec["sync_s"], float(rec["peak_bytes"] or 0), float(meter.peak)],
                            dtype=torch.float64, device=f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        rec["seconds"], rec["sync_s"] = vals[0].item(), vals[1].item()
        peak, rec["counted_peak_bytes"] = int(vals[2].item()), int(vals[3].item())
        rec["peak_bytes"] = peak if cuda else None
    return rec


def run_layout(layout: str, args, rank: int = 0, world: int = 1) -> Dict:
    from sgl_rollout.weight_sync.layered import group_nbytes, named_weights

    cfg = qwen2_config(args)
    t0 = time.perf_counter()
    model = make_trainer(layout, cfg, args.device, world, rank, args.pin)
    build_s = time.perf_counter() - t0
    print(f"[rank {rank}] {layout} trainer built in {build_s:.1f} s", flush=True)
    groups = group_nbytes(model)
    sizes = [p.numel() * p.element_size() for _, p in named_weights(model)]
    bucket = args.bucket_bytes
    info = {"layout": layout, "world": world, "build_s": build_s, "weight_bytes": sum(groups.values()),
            "layer_bytes": max(groups.values()), "decoder_layer_bytes": max(v for k, v in groups.items() if ".layers." in str(k)),
            "biggest_tensor_bytes": max(sizes), "bucket_bytes": bucket,
            "trainer_resident_bytes": (torch.cuda.memory_allocated() if args.device == "cuda" else None)}
    # the goal: one layer + one bucket (a tensor larger than a bucket travels alone, so one
    # bucket's buffer is at least the biggest tensor); "strict" adds the tensor iter_buckets reads ahead
    info["bound_bytes"] = info["layer_bytes"] + max(bucket, info["biggest_tensor_bytes"])
    info["strict_bound_bytes"] = info["bound_bytes"] + info["biggest_tensor_bytes"]
    worker = start_worker(args, cfg, rank) if args.engine else None
    if worker is not None:
        info["worker_closes_buckets_at_layers"] = worker_takes_group_of()
    runs: Dict[str, List[Dict]] = {m: [] for m in args.methods if m in METHODS[layout]}
    try:
        for i in range(args.warmup + args.repeats):
            for m in runs:  # methods alternate within each repeat
                rec = one_sync(m, model, args, layout, worker)
                if i >= args.warmup:
                    runs[m].append(rec)
        if worker is not None:
            worker.generate([[1, 17, 42]], {"temperature": 0.0, "max_new_tokens": 4})
            info["generate_after_sync"] = "ok"
    finally:
        if worker is not None:
            worker.shutdown()
    info["methods"] = {m: summarize(recs) for m, recs in runs.items()}
    return info


def summarize(recs: List[Dict]) -> Dict:
    out = {"runs": recs}
    for key in ("seconds", "sync_s", "peak_bytes", "counted_peak_bytes", "sender_s", "resume_weights_s", "switch_s",
                "device_used_max_bytes"):
        vals = [r[key] for r in recs if r.get(key) is not None]
        if vals:
            out[key] = statistics.median(vals)
    out["bytes"] = recs[0]["bytes"] if recs else 0
    out["n_buckets"] = recs[0]["n_buckets"] if recs else 0
    out["max_flat_bytes"] = max((r["max_flat_bytes"] for r in recs), default=0)
    out["gb_per_s"] = out["bytes"] / out["sync_s"] / GB if out.get("sync_s") else 0.0
    return out


def _rank_main(rank: int, world: int, layout: str, args, init_file: str, out_file: str) -> None:
    import torch.distributed as dist

    if args.device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        info = run_layout(layout, args, rank, world)
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(info, f)
    finally:
        dist.destroy_process_group()


def run_spawned(layout: str, args) -> Dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out_file = os.path.join(d, "rank0.json")
        mp.spawn(_rank_main, args=(args.nproc, layout, args, os.path.join(d, "pg"), out_file), nprocs=args.nproc, join=True)
        with open(out_file) as f:
            return json.load(f)


def sync_seconds(s: Dict) -> float:
    """The sync's own seconds (first weight asked for to the last sent, without the weights' resume)."""
    return s["sync_s"]


def print_table(results: Dict) -> None:
    small = all(info["weight_bytes"] < 1e9 for info in results["layouts"].values())
    unit, scale = ("MB", 1e6) if small else ("GB", GB)
    head = (f"{'layout':<8} {'method':<12} {'target':<9} {'sync s':>8} {'GB/s':>7} {'switch s':>8} "
            f"{'extra peak ' + unit:>14} {'counted ' + unit:>11} {'layer+bucket ' + unit:>16} {'peak/bound':>10} "
            f"{'time/all':>9}")
    print(head)
    print("-" * len(head))
    for layout, info in results["layouts"].items():
        base = info["methods"].get("all_at_once")
        base_t = sync_seconds(base) if base else None
        for m, s in info["methods"].items():
            peak = s.get("peak_bytes")
            shown = peak if peak is not None else s.get("counted_peak_bytes", 0)
            t = sync_seconds(s)
            print(f"{layout:<8} {m:<12} {results['target']:<9} {t:>8.3f} {s['bytes'] / t / GB:>7.2f} "
                  f"{s.get('switch_s', float('nan')):>8.3f} "
                  f"{(peak / scale if peak is not None else float('nan')):>14.2f} "
                  f"{s.get('counted_peak_bytes', 0) / scale:>11.2f} {info['bound_bytes'] / scale:>16.2f} "
                  f"{shown / info['bound_bytes']:>10.2f} {(t / base_t if base_t else float('nan')):>9.2f}")
        print(f"{'':<8} weights {info['weight_bytes'] / scale:.2f} {unit}, largest layer group "
              f"{info['layer_bytes'] / scale:.2f} {unit} (decoder layer {info['decoder_layer_bytes'] / scale:.2f} {unit}), "
              f"biggest tensor {info['biggest_tensor_bytes'] / scale:.2f} {unit}, bucket {info['bucket_bytes'] / scale:.2f} "
              f"{unit}, world {info['world']}, device {results['args']['device']}")
        if info.get("worker_closes_buckets_at_layers") is False:
            print(f"{'':<8} note: this worker does not pass group_of to the sender yet: layered buckets may span layers")


def _env() -> Dict:
    env = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["gpu_total_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return env


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--layout", nargs="+", choices=("fsdp2", "offload"), default=["fsdp2", "offload"])
    p.add_argument("--methods", nargs="+", choices=("all_at_once", "layered", "direct"),
                   default=["all_at_once", "layered", "direct"])
    p.add_argument("--nproc", type=int, default=2, help="FSDP2 ranks (GPUs, or gloo processes on the CPU)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen2 instead of the 7B shape")
    p.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own), for size searches")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--engine", action="store_true", help="sync into a real SGLang engine (RolloutWorker)")
    target.add_argument("--no-engine", dest="engine", action="store_false", help="trainer side only (default)")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="bucket size in MiB (default: RolloutConfig's 2048; 0.25 with --tiny)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--pin", action="store_true", help="offload layout: pin the CPU parameters")
    p.add_argument("--mem-fraction", type=float, default=0.5, help="engine's gpu_memory_utilization")
    p.add_argument("--enforce-eager", action="store_true", help="engine without CUDA graphs")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "sgl_rollout_layered"))
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    if args.bucket_mb is None:
        args.bucket_mb = 0.25 if args.tiny else 2048
    args.bucket_bytes = int(args.bucket_mb * (1 << 20))
    if args.bucket_bytes < 1:
        p.error("--bucket-mb too small")
    if args.engine and (args.bucket_mb != int(args.bucket_mb) or args.bucket_mb < 1):
        p.error("--engine takes a whole number of MiB for --bucket-mb (RolloutConfig.update_weights_bucket_megabytes)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda without a CUDA GPU (use --device cpu)")
    if args.engine and args.device != "cuda":
        p.error("--engine needs --device cuda")
    if args.device == "cuda" and "fsdp2" in args.layout and torch.cuda.device_count() < args.nproc:
        p.error(f"--nproc {args.nproc} needs {args.nproc} GPUs, {torch.cuda.device_count()} visible")
    results = {"args": vars(args), "env": _env(), "target": "engine" if args.engine else "no-engine",
               "shape": qwen2_config(args).to_dict(), "layouts": {}}
    for layout in args.layout:
        results["layouts"][layout] = run_spawned(layout, args) if layout == "fsdp2" else run_layout(layout, args)
    print_table(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
