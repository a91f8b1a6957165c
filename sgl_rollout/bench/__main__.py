"""``python -m sgl_rollout.bench {verl,trl,sync,lora,gather,p2p,scale,requests}``: see :mod:`sgl_rollout.bench`."""

from __future__ import annotations

import argparse
import sys

from . import write_result


def build_parser() -> argparse.ArgumentParser:
    """The benchmarks' command line."""
    from . import p2p, requests, scale, trl_compare, verl_compare

    p = argparse.ArgumentParser(prog="python -m sgl_rollout.bench",
                                description="Benchmarks of sgl-rollout (GPU; verl compares in verl's own trainer).")
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verl", help="verl's built-in SGLang rollout vs sgl-rollout in verl's own GRPO run")
    verl_compare.add_arguments(v)
    t = sub.add_parser("trl", help="TRL's GRPOTrainer generating on SGLang (sgl-rollout) vs TRL's transformers generation")
    trl_compare.add_arguments(t)
    s = sub.add_parser("sync", help="time the weight sync methods into one engine")
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--mem-fraction", type=float, default=0.5)
    s.add_argument("--workdir", default="/tmp/sgl_rollout_bench")
    s.add_argument("--out", default="bench_sync.json", help="JSON file, or a folder to write the default name in")
    lo = sub.add_parser("lora", help="time an adapter sync against a full sync (demo model and 1.1B)")
    lo.add_argument("--rank", type=int, default=16)
    lo.add_argument("--repeats", type=int, default=5)
    lo.add_argument("--mem-fraction", type=float, default=0.4)
    lo.add_argument("--workdir", default="/tmp/sgl_rollout_bench")
    lo.add_argument("--out", default="bench_lora.json", help="JSON file, or a folder to write the default name in")
    g = sub.add_parser("gather", help="time the sender's gather primitives (no engine)")
    g.add_argument("--repeats", type=int, default=10)
    g.add_argument("--out", default="bench_gather.json", help="JSON file, or a folder to write the default name in")
    pp = sub.add_parser("p2p", help="the sgl_rollout checkpoint engine's wire, 0.1 to 16 GB, vs a plain GPU-to-GPU copy")
    p2p.add_arguments(pp)
    sc = sub.add_parser("scale", help="scale on paper: sync and switch cost at 8, 64 and 1,000 GPUs (no GPU)")
    scale.add_arguments(sc)
    rq = sub.add_parser("requests", help="the guarded engine's own cost per generate request (CPU, engine double)")
    requests.add_arguments(rq)
    return p


def main(argv=None) -> int:
    """Run one benchmark; exit status 2 (one line) where its GPU, verl or SGLang is missing."""
    args = build_parser().parse_args(argv)
    if args.cmd == "verl":
        from . import verl_compare

        return verl_compare.main(args)
    if args.cmd == "trl":
        from . import trl_compare

        return trl_compare.main(args)
    if args.cmd == "p2p":
        from . import p2p

        return p2p.main(args)
    if args.cmd == "scale":
        from . import scale

        return scale.main(args)
    if args.cmd == "requests":
        from . import requests

        return requests.main(args)
    import torch

    from . import sync

    if not torch.cuda.is_available():
        print(f"bench {args.cmd} needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.cmd == "lora":
        res = sync.bench_lora(args)
        sync.print_lora_table(res)
    elif args.cmd == "gather":
        res = sync.bench_gather(args)
        sync.print_gather_table(res)
    else:
        res = sync.bench_sync(args)
        sync.print_table(res)
    print(f"wrote {write_result(res, args.out, f'bench_{args.cmd}.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
