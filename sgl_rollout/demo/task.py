"""The demo's task: arithmetic word problems made from a seed, chat prompts, and the reward.

Problems are two- and three-digit additions and subtractions dressed as one-sentence word problems
("Mia has 23 stickers and gets 45 more. How many stickers does Mia have now?"). The answer is
always a non-negative integer.

Train/eval split: every problem is assigned to a split by a stable hash of its canonical form
(operation and operands), so the held-out set is disjoint from the training set for any seed and
any number of problems drawn.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

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
