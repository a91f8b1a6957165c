"""A PEFT (LoRA) policy under sgl_rollout's TRL trainer, on the CPU with an engine double: the engine gets the
merged weights under the base model's names, as TRL's vLLM colocate mode sends them, bit for bit PEFT's own
merge; the trainer's parameters are never touched (TRL merges in place and unmerges, which moves them by the
rounding of ``W + d - d``), also when the sync fails; DoRA is refused in one line."""

import copy

import pytest
import torch

pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

from test_trl import WorkerDouble, _trainer  # noqa: E402

from sgl_rollout.errors import SyncValidationError  # noqa: E402
from sgl_rollout.integrations import trl_peft  # noqa: E402


def _lora():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0,
                           task_type="CAUSAL_LM")


def _state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from sgl_rollout.bench.chat_tokenizer import build_chat_model_dir

    return build_chat_model_dir(tmp_path_factory.mktemp("trl-peft"), with_weights=True)


def test_peft_policy_syncs_merged_weights_under_base_names_and_trains_on(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    worker = WorkerDouble(model_dir)
    trainer = _trainer(model_dir, tmp_path, worker, peft_config=_lora())
    worker.trainer = None  # its check compares with the trainer's own (PEFT) names; this test checks below
    trainer.train()
    assert trainer.state.global_step == 2 and worker.events == ["sync", "generate", "sleep"] * 2
    model = trainer.accelerator.unwrap_model(trainer.model)
    base_names = [n for n, _ in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()]
    assert all([n for n in synced] == base_names for synced in worker.synced)
    # an adapter that changes the weights for sure, then the sync of the step's weights
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    before = _state(model)
    trainer.sgl.awake = False
    trainer.sgl.wake(trainer.state.global_step, trainer._trainer_weights)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    sent = worker.synced[-1]
    assert set(sent) == set(expected)
    assert all(torch.equal(sent[n], expected[n]) for n in sent)  # PEFT's merge, bit for bit
    q = "model.layers.0.self_attn.q_proj.weight"
    base_q = before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert (sent[q] - base_q).abs().max() > 1e-3  # the adapter is in what the engine got
    after = _state(model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # and not in what the trainer trains on


def test_a_failed_sync_leaves_the_trainer_unmerged(model_dir, tmp_path):
    worker = WorkerDouble(model_dir, refuse=True)
    trainer = _trainer(model_dir, tmp_path, worker, peft_config=_lora())
    worker.trainer = None
    model = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    before = _state(model)
    with pytest.raises(SyncValidationError, match="up_proj"):
        trainer.sgl.wake(0, trainer._trainer_weights)
    assert not any(getattr(m, "merged", False) for m in model.modules())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_dora_is_refused_in_one_line(model_dir, tmp_path):
    lora = _lora()
    lora.use_dora = True
    with pytest.raises(ValueError, match="LoRA variant .*DoRA"):
        _trainer(model_dir, tmp_path, WorkerDouble(model_dir), peft_config=lora)


def test_base_names_follow_trls_vllm_rules():
    assert trl_peft._base_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight", "lora_") == \
        "model.layers.0.mlp.up_proj.weight"
    assert trl_peft._base_name("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight", "lora_") is None
    assert trl_peft._base_name("base_model.model.lm_head.modules_to_save.default.weight", "lora_") == "lm_head.weight"
    assert trl_peft._base_name("base_model.model.lm_head.original_module.weight", "lora_") is None
