"""TRL's tool-call loop through sgl_rollout's TRL trainer (issue 48 item 1), on the CPU: TRL's real
GRPOTrainer with ``tools=[add]`` and an engine double that answers like a model that calls the tool. TRL
parses the tool call, runs the tool, appends its result and asks the engine to go on (the same
``_generate_single_turn`` seam); the engine stays awake through the loop and sleeps once, after it.

The tokenizer gets TRL's own Qwen2.5 chat template (``trl.chat_template_utils.qwen2_5_chat_template``),
one of those TRL can parse tool calls from (``add_response_schema``).
"""

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from test_trl import WorkerDouble  # noqa: E402

from sgl_rollout.bench.chat_tokenizer import build_chat_model_dir  # noqa: E402
from sgl_rollout.engine import Generation  # noqa: E402
from sgl_rollout.integrations import trl as sgl_trl  # noqa: E402

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
ANSWER = "5<|im_end|>"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


class ToolCallingWorker(WorkerDouble):
    """The engine double of ``test_trl`` answering like a model that calls ``add`` first and answers after
    the tool's result: its completion is :data:`CALL` for a prompt without a tool response, :data:`ANSWER`
    for one with, cut at ``max_new_tokens``; each token's logprob is the Hugging Face model's (teacher-forced,
    float32), as an engine would report under the synced weights."""

    def __init__(self, model_dir):
        from transformers import AutoTokenizer

        super().__init__(model_dir)
        self.tok, self.prompts = AutoTokenizer.from_pretrained(model_dir), []

    def _logprobs(self, prompt, ids):
        with torch.no_grad():
            logits = self.model(torch.tensor([list(prompt) + ids])).logits[0, len(prompt) - 1:-1].float()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()

    def generate(self, input_ids, sampling_params, n=1, return_logprob=True):
        assert not self.asleep, "generate while asleep"
        out = []
        for prompt in input_ids:
            text = self.tok.decode(prompt)
            self.prompts.append(text)
            reply = ANSWER if "<tool_response>" in text else CALL
            ids = self.tok.encode(reply, add_special_tokens=False)[: sampling_params["max_new_tokens"]]
            out.append([Generation(ids, self._logprobs(prompt, ids), "stop")])
        self.events.append("generate")
        return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    folder = build_chat_model_dir(tmp_path_factory.mktemp("trl-tools"), with_weights=True)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = qwen2_5_chat_template
    tok.save_pretrained(folder)
    return folder


def test_tool_loop_runs_on_the_engine_and_sleeps_once_per_step(model_dir, tmp_path):
    from trl import GRPOConfig

    seen = []

    def reward(completions, **kwargs):
        seen.extend(completions)
        return [float(any(m["role"] == "tool" for m in c)) for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=160, max_steps=2, report_to="none", use_cpu=True, bf16=False,
                      gradient_checkpointing=False, logging_steps=1, save_strategy="no", beta=0.0,
                      learning_rate=1e-2)
    ds = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in
                                                ("What is 2+3?", "Add 2 and 3.", "2 plus 3?", "Sum of 2, 3?")]})
    worker = ToolCallingWorker(model_dir)
    trainer = sgl_trl.SglGRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=ds,
                                     tools=[add], rollout=worker)
    trainer.train()
    assert trainer.state.global_step == 2
    # per step: the wake with the trainer's weights, the first turn, the turn after the tool's result, then
    # the sleep: the engine is not put to sleep inside TRL's tool loop
    assert worker.events == ["sync", "generate", "generate", "sleep"] * 2
    followups = [p for p in worker.prompts if "<tool_response>" in p]
    assert len(followups) == 4 and all("<tool_response>\n5\n</tool_response>" in p for p in followups)
    # TRL scored conversations holding the tool call, the tool's result (run by TRL) and the answer after it
    assert len(seen) == 4
    for messages in seen:
        roles = [m["role"] for m in messages]
        assert roles == ["assistant", "tool", "assistant"], roles
        assert messages[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
        assert messages[1]["content"] == "5" and messages[2]["content"].strip() == "5"
    logged = [h["tools/call_frequency"] for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert logged == [1.0, 1.0]  # TRL's own count: one tool call per completion, each step
