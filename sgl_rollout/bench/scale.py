"""Scale on paper: what a weight sync and a train -> rollout switch cost at 8, 64 and 1,000 GPUs for 7B, 70B
and 400B-class models, from the model shapes, this package's sync format and measured figures.

``python -m sgl_rollout.bench scale`` prints the table (and ``--out FILE`` writes it as JSON); no GPU needed.

What is computed, per model and GPU count (GB = 1e9 bytes, bf16 weights):

* the TP size: the smallest power of two whose weight shard fits ``--weight-share`` of a GPU's memory;
  replicas = GPUs // TP, nodes per replica = TP / GPUs per node (more than one: a multi-node replica);
* bytes per GPU: the resident shard (``bytes / TP``) and what one sync moves through each GPU: every TP
  rank's trainer worker gathers *full* tensors bucket by bucket and hands its rank a flattened bucket of
  them over CUDA IPC (``weight_sync/flattened_bucket.py``); SGLang's loader on that rank keeps its shard. So the full
  model passes through every GPU, whatever the TP size;
* the leader's payload list: per bucket, one payload per TP rank goes through the replica's leader
  (SGLang's ``update_weights_from_tensor`` with ``flattened_bucket``): the pickled metadata of the bucket's
  tensors (measured here with SGLang's own ``FlattenedTensorMetadata``) plus one CUDA IPC handle
  (``--ipc-handle-bytes``, an estimate: torch's CUDA storage reduction carries three 64-byte handles and a
  few integers);
* sync time per GPU: the full model's bytes over the bandwidth measured by ``bench sync`` on one H100
  (``examples/bench/sync_h100_s5_hostB.json``: the flattened-bucket path verl uses, ``flat_2048m``, and the
  fast path, ``fast_2048m``); the trainer's all-gather (verl's FSDP) is not in it;
* start-up: weights read at ``--disk-gbps`` per node (assumed) plus the engine's own start measured on
  SGLang 0.5.10 (``--engine-start-s``; 53 s for two nodes of one TP=2 replica, from the issue's run);
* KV-cache room per GPU: ``gpu_memory_utilization`` x GPU memory minus the shard, on 80 GB and 141 GB GPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
from dataclasses import dataclass
from typing import Dict, List

GB = 1e9
BF16 = 2
DEFAULT_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "bench", "sync_h100_s5_hostB.json")


@dataclass(frozen=True)
class ModelShape:
    """A Llama-shaped decoder (untied embeddings).

    Attributes:
        name: label.
        hidden, layers, intermediate, heads, kv_heads, vocab: the Hugging Face config's sizes.
    """

    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    def tensors(self) -> Dict[str, tuple]:
        """Name -> shape of every weight, as a Hugging Face Llama checkpoint names them."""
        kv = self.hidden * self.kv_heads // self.heads
        out = {"model.embed_tokens.weight": (self.vocab, self.hidden), "model.norm.weight": (self.hidden,),
               "lm_head.weight": (self.vocab, self.hidden)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out.update({p + "self_attn.q_proj.weight": (self.hidden, self.hidden),
                        p + "self_attn.k_proj.weight": (kv, self.hidden),
                        p + "self_attn.v_proj.weight": (kv, self.hidden),
                        p + "self_attn.o_proj.weight": (self.hidden, self.hidden),
                        p + "mlp.gate_proj.weight": (self.intermediate, self.hidden),
                        p + "mlp.up_proj.weight": (self.intermediate, self.hidden),
                        p + "mlp.down_proj.weight": (self.hidden, self.intermediate),
                        p + "input_layernorm.weight": (self.hidden,),
                        p + "post_attention_layernorm.weight": (self.hidden,)})
        return out

    def params(self) -> int:
        """Number of parameters."""
        return sum(math.prod(s) for s in self.tensors().values())


SHAPES = (
    ModelShape("7B (Llama-2-7B)", 4096, 32, 11008, 32, 32, 32000),
    ModelShape("70B (Llama-3-70B)", 8192, 80, 28672, 64, 8, 128256),
    ModelShape("400B-class (Llama-3.1-405B)", 16384, 126, 53248, 128, 8, 128256),
)


def choose_tp(model_bytes: float, gpu_bytes: float, weight_share: float = 0.5, max_tp: int = 64) -> int:
    """Smallest power of two ``tp`` with ``model_bytes / tp <= weight_share * gpu_bytes``.

    Raises:
        ValueError: no TP up to ``max_tp`` fits.
    """
    tp = 1
    while model_bytes / tp > weight_share * gpu_bytes:
        tp *= 2
        if tp > max_tp:
            raise ValueError(f"{model_bytes / GB:.0f} GB does not fit {weight_share:.0%} of {gpu_bytes / GB:.0f} GB "
                             f"GPUs at TP <= {max_tp}")
    return tp


def metadata_bytes(shape: ModelShape) -> int:
    """Pickled bytes of SGLang's ``FlattenedTensorMetadata`` for every tensor of ``shape`` (the metadata a
    sync's payloads carry per TP rank, all buckets together), measured with SGLang's own class."""
    import torch
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    metas, start = [], 0
    for name, dims in shape.tensors().items():
        n = math.prod(dims) * BF16
        metas.append(FlattenedTensorMetadata(name=name, shape=torch.Size(dims), dtype=torch.bfloat16,
                                             start_idx=start, end_idx=start + n, numel=math.prod(dims)))
        start += n
    return len(pickle.dumps(metas))


def measured_gbps(path: str) -> Dict[str, float]:
    """``{"flat": GB/s, "fast": GB/s, "device": str}`` from a ``bench sync`` JSON (``flat_2048m``, ``fast_2048m``)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    res = data["results"]
    return {"flat": res["flat_2048m"]["gb_per_s"], "fast": res["fast_2048m"]["gb_per_s"], "device": data["device"]}


def rows(gpu_counts=(8, 64, 1000), gpus_per_node: int = 8, gpu_gb: float = 80.0, weight_share: float = 0.65,
         bucket_bytes: int = 2048 << 20, ipc_handle_bytes: int = 400, disk_gbps: float = 2.0,
         engine_start_s: float = 53.0, mem_fraction: float = 0.9, bench_path: str = DEFAULT_BENCH) -> List[dict]:
    """The table: one dict per model and GPU count (see the module docstring for each field)."""
    bw = measured_gbps(bench_path)
    out = []
    for shape in SHAPES:
        nbytes = shape.params() * BF16
        tp = choose_tp(nbytes, gpu_gb * GB, weight_share)
        meta = metadata_bytes(shape)
        buckets = math.ceil(nbytes / bucket_bytes)
        for n in gpu_counts:
            fits = n >= tp
            replicas = n // tp if fits else 0
            nodes_per_replica = max(1, tp // gpus_per_node)
            shard = nbytes / tp
            out.append(dict(
                model=shape.name, params_b=shape.params() / 1e9, gpus=n, tp=tp, fits=fits, replicas=replicas,
                nodes_per_replica=nodes_per_replica, shard_gb=shard / GB, sync_gb_per_gpu=nbytes / GB,
                buckets=buckets, leader_bytes_per_bucket=tp * (meta / buckets + ipc_handle_bytes),
                leader_bytes_per_sync=tp * (meta + buckets * ipc_handle_bytes),
                sync_s_flat=nbytes / GB / bw["flat"], sync_s_fast=nbytes / GB / bw["fast"],
                sync_s_shard_only=shard / GB / bw["flat"],
                start_s=engine_start_s + shard * min(tp, gpus_per_node) / GB / disk_gbps,
                kv_room_gb_80=mem_fraction * 80 - shard / GB, kv_room_gb_141=mem_fraction * 141 - shard / GB,
                bandwidth_from=f"{bw['device']}: flat {bw['flat']:.0f} GB/s, fast {bw['fast']:.0f} GB/s",
            ))
    return out


def markdown(table: List[dict]) -> str:
    """The table as Markdown."""
    head = ("| model | GPUs | TP (nodes/replica) | replicas | shard GB/GPU | sync GB through each GPU | buckets | "
            "leader KB per sync | sync s, flat / fast / shard only | start s | KV room GB, 80 / 141 GB GPU |")
    lines = [head, "| --- |" + " ---: |" * 10]
    for r in table:
        if not r["fits"]:
            lines.append(f"| {r['model']} | {r['gpus']} | {r['tp']} | does not fit | | | | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {r['gpus']} | {r['tp']} ({r['nodes_per_replica']}) | {r['replicas']} | "
            f"{r['shard_gb']:.1f} | {r['sync_gb_per_gpu']:.0f} | {r['buckets']} | {r['leader_bytes_per_sync'] / 1e3:.0f} | "
            f"{r['sync_s_flat']:.2f} / {r['sync_s_fast']:.2f} / {r['sync_s_shard_only']:.2f} | {r['start_s']:.0f} | "
            f"{r['kv_room_gb_80']:.0f} / {r['kv_room_gb_141']:.0f} |")
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``bench scale``'s options."""
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory for the TP choice (GB)")
    p.add_argument("--weight-share", type=float, default=0.65, help="largest share of a GPU the weight shard may take")
    p.add_argument("--bucket-mb", type=int, default=2048, help="sync bucket (MiB; the package's default)")
    p.add_argument("--ipc-handle-bytes", type=int, default=400, help="pickled CUDA IPC handle per payload (estimate)")
    p.add_argument("--disk-gbps", type=float, default=2.0, help="weight read bandwidth per node (GB/s, assumed)")
    p.add_argument("--engine-start-s", type=float, default=53.0, help="engine start without the weight read (s)")
    p.add_argument("--bench", default=DEFAULT_BENCH, help="bench sync JSON with flat_2048m and fast_2048m")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")


def main(args: argparse.Namespace) -> int:
    """Print the table (and write ``--out``); 0."""
    table = rows(gpus_per_node=args.gpus_per_node, gpu_gb=args.gpu_gb, weight_share=args.weight_share,
                 bucket_bytes=args.bucket_mb << 20, ipc_handle_bytes=args.ipc_handle_bytes, disk_gbps=args.disk_gbps,
                 engine_start_s=args.engine_start_s, bench_path=args.bench)
    print(markdown(table), end="")
    print(f"bandwidth: {table[0]['bandwidth_from']} (bench sync, 1.1B at TP=1)")
    if args.out:
        from . import write_result

        write_result(table, args.out, "bench_scale.json")
    return 0


__all__ = ["ModelShape", "SHAPES", "add_arguments", "choose_tp", "main", "markdown", "measured_gbps",
           "metadata_bytes", "rows"]

