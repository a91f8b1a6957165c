"""Node-scale staged wake: Qwen2-32B-shaped model, Ray trainer workers + one TP engine, per-phase peaks.

Per GPU, one Ray trainer worker holds a dim-0 shard of every tensor of a Qwen2-shaped model with random
bf16 weights (an FSDP-like sharded state dict, no download), plus bf16 grads and fp32 AdamW moments while
it "trains". Workers start in shuffled order with staggered loads. One TP=N engine (this package,
``load_format="dummy"``, ``gpu_memory_utilization`` = ``--mem-fraction``) runs through
:mod:`sgl_rollout.server`. For each step: generate a batch, sleep, train, wake with a weight sync from all
workers (each all-gathers full tensors bucket by bucket and sends its TP rank's payload), generate again.

``--mode staged``: resume weights, sync, trainers offload to CPU, empty cache, resume KV cache.
``--mode single``: resume everything, sync, then offload (the order without staged wake).

A sampler thread reads every GPU's used memory through NVML every 5 ms and keeps the peak per phase.
Results go to ``--out`` (JSON) and a table on stdout. Example, 2 GPUs, a 16-layer model of 32B width:

    python examples/scale/run_scale.py --gpus 2 --layers 16 --mode staged --out staged.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import threading
import time

QWEN2_32B = dict(hidden=5120, intermediate=27648, layers=64, heads=40, kv_heads=8, vocab=152064)


def model_config_dir(path: str, layers: int) -> str:
    """config.json of a Qwen2-32B-shaped model with ``layers`` layers (for ``load_format="dummy"``)."""
    from transformers import Qwen2Config

    s = QWEN2_32B
    cfg = Qwen2Config(hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=layers,
                      num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], vocab_size=s["vocab"],
                      max_position_embeddings=4096, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"],
                      torch_dtype="bfloat16")
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    return path


def param_shapes(layers: int):
    """(name, full shape) of every tensor, Hugging Face Qwen2 names."""
    s = QWEN2_32B
    h, i, v = s["hidden"], s["intermediate"], s["vocab"]
    kv = s["kv_heads"] * h // s["heads"]
    out = [("model.embed_tokens.weight", (v, h))]
    for L in range(layers):
        p = f"model.layers.{L}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
                (p + "self_attn.o_proj.weight", (h, h)), (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)), (p + "mlp.down_proj.weight", (h, i)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


class TrainerWorker:
    """One trainer worker on one GPU: a dim-0 shard of every tensor, AdamW-like state while training."""

    def __init__(self, rank: int, world: int, layers: int, init_method: str, delay_s: float):
        import torch
        import torch.distributed as dist

        time.sleep(delay_s)  # staggered start
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world)
        self.rank, self.world = rank, world
        g = torch.Generator(device="cuda").manual_seed(rank)
        self.shapes = param_shapes(layers)
        self.params = {}
        for name, shape in self.shapes:
            local = (shape[0] // world,) + tuple(shape[1:])
            t = torch.empty(local, dtype=torch.bfloat16, device="cuda")
            t.normal_(0, 0.02, generator=g) if len(shape) > 1 else t.fill_(1.0)
            self.params[name] = t
        self.state = {}  # grads and moments, made by train()
        self.stream = None
        torch.cuda.synchronize()

    def info(self):
        import ray
        import torch

        return {"rank": self.rank, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "node": ray.get_runtime_context().get_node_id(), "free_bytes": torch.cuda.mem_get_info()[0],
                "shard_bytes": sum(t.numel() * 2 for t in self.params.values())}

    def train(self):
        """Bring parameters back to the GPU and run an AdamW-shaped update: bf16 grads, fp32 moments.

        Returns this worker's torch peak allocated bytes.
        """
        import torch

        self.params = {k: p.cuda(non_blocking=True) for k, p in self.params.items()}
        if self.state:
            self.state = {k: tuple(x.cuda(non_blocking=True) for x in st) for k, st in self.state.items()}
        else:
            self.state = {k: (torch.zeros_like(p), torch.zeros_like(p, dtype=torch.float32),
                              torch.zeros_like(p, dtype=torch.float32)) for k, p in self.params.items()}
        for name, p in self.params.items():
            grad, m, v = self.state[name]
            grad.normal_(0, 1e-3)
            m.mul_(0.9).add_(grad, alpha=0.1)
            v.mul_(0.999).addcmul_(grad, grad, value=0.001)
            p.add_((m / (v.sqrt() + 1e-8)).to(torch.bfloat16), alpha=-1e-6)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    def _full_tensors(self):
        import torch
        import torch.distributed as dist

        for name, _shape in self.shapes:
            shard = self.params[name]
            full = torch.empty((shard.shape[0] * self.world,) + tuple(shard.shape[1:]), dtype=shard.dtype, device="cuda")
            dist.all_gather_into_tensor(full, shard)
            yield name, full

    def start_sync(self, bucket_bytes: int):
        from sgl_rollout.weight_sync import BucketStream

        self.stream = BucketStream(self._full_tensors(), bucket_bytes)

    def next_weight_payload(self):
        return self.stream.next_payload()

    def release_weight_payload(self):
        self.stream.release()

    def offload(self):
        """Parameters, grads and moments to CPU; cached blocks back to the driver."""
        import torch

        from sgl_rollout.memory import aggressive_empty_cache

        self.params = {k: v.to("cpu", non_blocking=True) for k, v in self.params.items()}
        self.state = {k: tuple(x.to("cpu", non_blocking=True) for x in st) for k, st in self.state.items()}
        torch.cuda.synchronize()
        self.stream = None
        return aggressive_empty_cache()


class PeakSampler:
    """Background NVML sampler: peak used bytes per GPU for the current phase."""

    def __init__(self, n_gpus: int, period_s: float = 0.005):
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n_gpus)]
        self._period = period_s
        self._phase = None
        self._peaks = {}
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop:
            used = [self._nvml.nvmlDeviceGetMemoryInfo(h).used for h in self._handles]
            with self._lock:
                if self._phase is not None:
                    cur = self._peaks.setdefault(self._phase, [0] * len(used))
                    self._peaks[self._phase] = [max(a, b) for a, b in zip(cur, used)]
            time.sleep(self._period)

    def phase(self, name):
        with self._lock:
            self._phase = name
        time.sleep(2 * self._period)

    def peaks(self):
        with self._lock:
            return {k: list(v) for k, v in self._peaks.items()}

    def stop(self):
        self._stop = True
        self._thread.join()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args) -> dict:
    import ray

    def get(refs, timeout=args.call_timeout_s):
        return ray.get(refs, timeout=timeout)

    from sgl_rollout.config import RolloutConfig
    from sgl_rollout.server import RolloutServer, launch_rollout_server, merge_visible_devices, sync_weights_from_workers

    n = args.gpus
    model_dir = model_config_dir(os.path.join(args.workdir, f"qwen2-32b-shape-{args.layers}l"), args.layers)
    ray.init(num_gpus=n, num_cpus=max(8, 2 * n), include_dashboard=False, log_to_driver=True)
    sampler = PeakSampler(n)
    result = {"mode": args.mode, "gpus": n, "layers": args.layers, "mem_fraction": args.mem_fraction,
              "steps": [], "error": None}
    try:
        sampler.phase("trainer_init")
        init = f"tcp://127.0.0.1:{_free_port()}"
        order = list(range(n))
        random.Random(args.seed).shuffle(order)
        Actor = ray.remote(num_gpus=1)(TrainerWorker)
        handles = {}
        for k, rank in enumerate(order):  # shuffled start order, staggered loads
            handles[rank] = Actor.remote(rank, n, args.layers, init, delay_s=1.5 * k)
        workers = [handles[r] for r in range(n)]
        infos = get([w.info.remote() for w in workers])
        result["start_order"] = order
        result["workers"] = infos
        result["free_gb_at_engine_start"] = [i["free_bytes"] / 1e9 for i in infos]
        sampler.phase("engine_start")
        cfg = RolloutConfig(model_path=model_dir, tensor_model_parallel_size=n, gpu_memory_utilization=args.mem_fraction,
                            load_format="dummy", enforce_eager=args.enforce_eager,
                            update_weights_bucket_megabytes=args.bucket_mb,
                            engine_kwargs=dict(attention_backend="triton", sampling_backend="pytorch",
                                               grammar_backend="none", skip_tokenizer_init=True, log_level="error"))
        server = launch_rollout_server(cfg, merge_visible_devices([i["cuda_visible_devices"] for i in infos]),
                                       actor_cls=RolloutServer)
        t0 = time.perf_counter()
        get(server.start.remote())
        result["engine_start_s"] = time.perf_counter() - t0
        prompts = [[1] + [random.Random(i).randrange(3, 30000) for _ in range(64)] for i in range(args.batch)]
        params = {"temperature": 1.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
        weight_bytes = sum(i["shard_bytes"] for i in infos)
        for step in range(args.steps):
            rec = {"step": step}
            sampler.phase(f"s{step}:generate")
            t = time.perf_counter()
            get(server.generate_batch.remote(prompts, params))
            rec["generate_s"] = time.perf_counter() - t
            sampler.phase(f"s{step}:sleep")
            get(server.sleep.remote())
            sampler.phase(f"s{step}:train")
            get([w.train.remote() for w in workers])
            t_switch = time.perf_counter()
            if args.mode == "staged":
                sampler.phase(f"s{step}:resume_weights")
                get(server.resume_stage.remote("weights"))
            else:
                sampler.phase(f"s{step}:resume_all")
                get(server.wake_up.remote())
            sampler.phase(f"s{step}:sync")
            t = time.perf_counter()
            get([w.start_sync.remote(cfg.bucket_bytes) for w in workers])
            sync_weights_from_workers(server, workers)
            rec["sync_s"] = time.perf_counter() - t
            rec["sync_gb_per_s"] = weight_bytes / rec["sync_s"] / 1e9
            sampler.phase(f"s{step}:offload")
            get([w.offload.remote() for w in workers])
            if args.mode == "staged":
                sampler.phase(f"s{step}:resume_kv_cache")
                get(server.resume_stage.remote("kv_cache"))
            rec["switch_s"] = time.perf_counter() - t_switch
            sampler.phase(f"s{step}:generate_after")
            get(server.generate_batch.remote(prompts, params))
            result["steps"].append(rec)
            print(json.dumps(rec), flush=True)
        get(server.shutdown.remote())
    except Exception as e:  # noqa: BLE001 - the single-stage run is expected to fail; record how
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        print(f"run failed: {result['error']}", flush=True)
    finally:
        sampler.phase(None)
        result["peak_gb"] = {k: [round(b / 1e9, 2) for b in v] for k, v in sampler.peaks().items()}
        result["weight_bytes"] = weight_bytes if "weight_bytes" in locals() else None
        sampler.stop()
        ray.shutdown()
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--mode", choices=("staged", "single"), default="staged")
    p.add_argument("--mem-fraction", type=float, default=0.9)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--bucket-mb", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--call-timeout-s", type=float, default=240.0, help="a call that hangs (an OOM in resume) fails after this")
    p.add_argument("--workdir", default="/tmp/sgl_rollout_scale")
    p.add_argument("--out", default="scale.json")
    args = p.parse_args(argv)
    res = run(args)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    print(f"\n{args.mode}: error={res['error']}")
    for phase, peaks in res["peak_gb"].items():
        print(f"{phase:<26}" + " ".join(f"{g:8.1f}" for g in peaks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
