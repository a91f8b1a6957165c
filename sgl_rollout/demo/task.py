"""The demo's task: arithmetic word problems made from a seed, chat prompts, and the reward.

The task is shared with the benchmarks, so it lives in :mod:`sgl_rollout.workloads` (see "the task"
there); this module keeps its names for the demo and its users.
"""

from __future__ import annotations

from ..workloads import (EVAL_FRACTION, SYSTEM_PROMPT, Problem, chat_messages, is_correct, iter_problems,
                         make_problems, parse_answer, prompt_ids, reward, split_of)

__all__ = ["EVAL_FRACTION", "SYSTEM_PROMPT", "Problem", "chat_messages", "is_correct", "iter_problems",
           "make_problems", "parse_answer", "prompt_ids", "reward", "split_of"]
