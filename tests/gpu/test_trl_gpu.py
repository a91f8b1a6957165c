"""TRL's real GRPOTrainer generating on a real SGLang engine through ``SglGRPOTrainer`` (issue 48): two
training steps, then greedy output after the sync equals Hugging Face's with the trainer's weights.

Written 2026-11-28 without a GPU run (the session's device time was spent); the CPU counterpart is
``tests/test_trl.py``.
"""

import pytest
import torch  # noqa: F401 - the GPU suite imports torch first

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from sgl_rollout.bench import gpu_engine_flags  # noqa: E402
from sgl_rollout.bench.chat_tokenizer import build_chat_model_dir  # noqa: E402
from sgl_rollout.config import RolloutConfig  # noqa: E402

from .greedy import assert_greedy_equal, engine_greedy  # noqa: E402


def test_grpo_steps_on_sglang_then_greedy_equals_hugging_face_with_the_trainers_weights(tmp_path):
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    from sgl_rollout.integrations.trl import SglGRPOTrainer

    model_dir = build_chat_model_dir(tmp_path / "model", with_weights=True)  # tiny Qwen2 + offline ChatML tokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(q, add_special_tokens=False)["input_ids"] for q in ("1+1=", "the answer is", "7 and 8")]
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=2, report_to="none", logging_steps=1, save_strategy="no",
                      bf16=True, gradient_checkpointing=False, beta=0.0, learning_rate=1e-3)
    rollout = RolloutConfig(model_path=model_dir, dtype="bfloat16", gpu_memory_utilization=0.2, enforce_eager=True,
                            engine_kwargs=gpu_engine_flags())
    ds = datasets.Dataset.from_dict({"prompt": ["1+1=", "2+3=", "4+4=", "5+2=", "9+1=", "3+3=", "7+1=", "6+6="]})
    trainer = SglGRPOTrainer(model=model_dir, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                             args=args, train_dataset=ds, rollout=rollout)
    try:
        trainer.train()
        assert trainer.state.global_step == 2 and trainer.sgl.synced_step == 1
        model = trainer.accelerator.unwrap_model(trainer.model).eval()
        trainer.sgl.wake(trainer.state.global_step, trainer._trainer_weights)  # step 2's weights, synced
        got = engine_greedy(trainer.sgl.worker, prompts, 8)
        assert_greedy_equal(model.to(torch.bfloat16), prompts, got)
    finally:
        trainer.sgl.worker.shutdown()
