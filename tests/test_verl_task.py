"""The demo's task as verl data, reward and config (sgl_rollout.demo.verl_task), checked against verl's
own code on CPU: its RL dataset reads the parquet, its reward manager scores with the reward function
it loads from the config keys, hydra composes verl's ppo_trainer config with exactly the script's
overrides, and the plot reads what verl's file logger writes."""

import inspect
import json
import math
import os
import re

import numpy as np
import pytest
import torch
import verl
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from sgl_rollout.bench import LLAMA_TINY, make_llama_dir
from sgl_rollout.demo import task, verl_task
from sgl_rollout.demo.model import save_byte_level_tokenizer

VERL_CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A Llama-shaped config (no weights) with the byte-level ChatML tokenizer: a model folder verl's
    HFModelConfig and RLHFDataset accept, made here (no hub)."""
    path = tmp_path_factory.mktemp("tiny_model")
    make_llama_dir(str(path), LLAMA_TINY)
    tok = save_byte_level_tokenizer(path, LLAMA_TINY["vocab_size"])
    return path, tok


def compose_verl(overrides):
    """verl's ppo_trainer config composed with ``overrides`` (hydra node included)."""
    with initialize_config_dir(config_dir=VERL_CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides), return_hydra_config=True)


def trainer_config(overrides):
    cfg = compose_verl(overrides)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


# ------------------------------------------------------------------------------------------- data
def test_parquet_round_trips_through_verls_rl_dataset(tmp_path, tiny_model):
    from verl.trainer.ppo.utils import create_rl_dataset

    model_dir, tok = tiny_model
    run = tmp_path / "run"
    train_path, val_path = verl_task.write_parquet(run / "data", n_train=48, n_val=16, seed=3)
    cfg = trainer_config(verl_task.grpo_overrides(model_dir, run))
    assert cfg.data.train_files == str(train_path) and cfg.data.val_files == str(val_path)
    data_cfg = cfg.data
    with open_dict(data_cfg):
        # verl's own length filter on the byte-level tokenizer (one token per UTF-8 byte): a byte-level
        # BPE tokenizer such as SmolLM2's never needs more tokens, so every prompt fits the limit
        data_cfg.filter_overlong_prompts = True
        data_cfg.cache_dir = str(tmp_path / "verl_cache")
    train = create_rl_dataset(data_cfg.train_files, data_cfg, tok, None, is_train=True)
    val = create_rl_dataset(data_cfg.val_files, data_cfg, tok, None, is_train=False)
    assert (len(train), len(val)) == (48, 16)

    problems = task.make_problems(3, 48, "train", verl_task.DEFAULT_DIGITS)
    for i in (0, 17, 47):
        row = train[i]
        p = problems[i]
        assert row["data_source"] == verl_task.DATA_SOURCE and row["ability"] == verl_task.ABILITY
        assert row["raw_prompt"] == task.chat_messages(p)  # what verl's agent loop templates
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(p.answer)}
        assert row["index"] == i and row["extra_info"]["answer"] == p.answer
        assert (row["extra_info"]["a"], row["extra_info"]["op"], row["extra_info"]["b"]) == (p.a, p.op, p.b)
    def triple(row):
        return row["extra_info"]["op"], row["extra_info"]["a"], row["extra_info"]["b"]

    val_keys = {triple(val[i]) for i in range(16)}
    train_keys = {triple(train[i]) for i in range(48)}
    assert not val_keys & train_keys
    assert all(task.split_of(*k) == "eval" for k in val_keys)
    assert all(val[i]["extra_info"]["split"] == "val" for i in range(16))


def test_write_parquet_rejects_empty_files(tmp_path):
    with pytest.raises(ValueError, match="at least one row"):
        verl_task.write_parquet(tmp_path, n_train=0)


# ----------------------------------------------------------------------------------------- reward
@pytest.mark.parametrize("text, gt, score, acc", [
    ("23 + 45 = 68. Answer: 68", "68", 1.1, 1.0),
    ("23 + 45 = 68", "68", 1.0, 1.0),          # right number, no 'Answer:' -> no format bonus
    ("Answer: 67", "68", 0.1, 0.0),            # wrong number, format bonus only
    ("I like apples", 68, 0.0, 0.0),           # ground truth as int works too
    ("Answer: 5. No wait, the answer is 7", " 7 ", 1.1, 1.0),  # the last 'answer' wins
])
def test_compute_score_matches_demo_reward(text, gt, score, acc):
    out = verl_task.compute_score(verl_task.DATA_SOURCE, text, gt, extra_info={"index": 0})
    assert out == {"score": pytest.approx(score), "acc": acc}
    assert out["score"] == pytest.approx(task.reward(text, int(str(gt)), finished=True))
    assert verl_task.compute_score(verl_task.DATA_SOURCE, text, gt, format_weight=0.0)["score"] == acc


def test_compute_score_errors_and_other_sources():
    with pytest.raises(ValueError, match="ground_truth"):
        verl_task.compute_score(verl_task.DATA_SOURCE, "Answer: 3", "three")
    # another data source goes to verl's default scorer (GSM8K's wants '#### <answer>')
    assert verl_task.compute_score("openai/gsm8k", "so #### 72", "72") == 1.0
    assert verl_task.compute_score("openai/gsm8k", "so #### 71", "72") == 0.0


def test_verls_reward_manager_loads_and_scores_with_it(tiny_model, tmp_path):
    """The reward keys of the override list, loaded by verl's own loader into its naive reward
    manager, score decoded token ids as the demo does."""
    from verl import DataProto
    from verl.trainer.ppo.reward import load_reward_manager

    model_dir, tok = tiny_model
    cfg = trainer_config(verl_task.grpo_overrides(model_dir, tmp_path))
    manager = load_reward_manager(cfg, tok)
    assert type(manager).__name__ == "NaiveRewardManager"

    def item(prompt: str, response: str, gt: str, resp_width: int = 40):
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        r = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        pad = resp_width - len(r)
        ids = torch.tensor([p + r + [tok.pad_token_id] * pad])
        mask = torch.tensor([[1] * (len(p) + len(r)) + [0] * pad])
        return DataProto.from_dict(
            tensors={"prompts": ids[:, :len(p)], "responses": ids[:, len(p):], "attention_mask": mask},
            non_tensors={"data_source": np.array([verl_task.DATA_SOURCE], dtype=object),
                         "reward_model": np.array([{"style": "rule", "ground_truth": gt}], dtype=object),
                         "extra_info": np.array([{"index": 0}], dtype=object)})

    async def score(d):
        return await manager.run_single(d)

    good = manager.loop.run_until_complete(score(item("Q: 2+3?", "2 + 3 = 5. Answer: 5", "5")))
    bad = manager.loop.run_until_complete(score(item("Q: 2+3?", "Answer: 6", "5")))
    assert good["reward_score"] == pytest.approx(1.1) and good["reward_extra_info"]["acc"] == 1.0
    assert bad["reward_score"] == pytest.approx(0.1) and bad["reward_extra_info"]["acc"] == 0.0


# -------------------------------------------------------------------------------------- overrides
@pytest.mark.parametrize("ngpus, tp", [(1, 1), (2, 1), (2, 2)])
def test_overrides_compose_into_verls_config(tmp_path, tiny_model, ngpus, tp):
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from sgl_rollout.integrations.verl_config import rollout_config_from_verl

    model_dir, _ = tiny_model
    run = tmp_path / "run"
    overrides = verl_task.overrides_from_env(model_dir, run, {"NGPUS": str(ngpus), "TP": str(tp), "STEPS": "21"})
    full = compose_verl(overrides)
    assert full.hydra.run.dir == str(run.resolve() / "hydra")
    cfg = trainer_config(overrides)
    arr = cfg.actor_rollout_ref

    assert cfg.algorithm.adv_estimator == "grpo" and not cfg.algorithm.use_kl_in_reward
    assert arr.hybrid_engine is True and cfg.trainer.use_v1 and cfg.trainer.v1.trainer_mode == "sync"
    assert arr.model.path == str(model_dir) and arr.model.override_config.attn_implementation == "sdpa"
    assert arr.model.use_remove_padding is False and arr.actor.use_remove_padding is False
    assert arr.actor.strategy == "fsdp" and arr.actor.use_kl_loss and arr.actor.kl_loss_type == "low_var_kl"
    r = arr.rollout
    assert (r.name, r.mode, r.tensor_model_parallel_size, r.n) == ("sglang", "async", tp, 8)
    assert r.gpu_memory_utilization == 0.5 and r.free_cache_engine is True
    assert (r.prompt_length, r.response_length) == (256, 128)  # interpolated from data.*
    assert r.val_kwargs.do_sample is False and r.val_kwargs.n == 1  # greedy held-out accuracy
    assert r.n_gpus_per_node == ngpus and cfg.trainer.n_gpus_per_node == ngpus and cfg.trainer.nnodes == 1
    assert ngpus // (r.tensor_model_parallel_size * r.data_parallel_size) == ngpus // tp  # replicas
    assert cfg.reward.custom_reward_function.path == "pkg://sgl_rollout.demo.verl_task"
    assert cfg.reward.custom_reward_function.name == "compute_score"
    t = cfg.trainer
    assert list(t.logger) == ["console", "file"] and t.val_before_train is True
    assert t.total_training_steps == 21 and t.test_freq == 5 and t.save_freq == -1 and t.resume_mode == "disable"
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH == str(run.resolve() / "metrics.jsonl")
    assert cfg.data.train_batch_size == 32 and arr.actor.ppo_mini_batch_size == 16
    # one micro-batch per PPO mini-batch (16 prompts x 8 samples over the GPUs): verl's per-micro-batch
    # overhead, not the GPU, set the step time on the H100 (examples/verl/h100-run)
    assert arr.actor.ppo_micro_batch_size_per_gpu == 128 // ngpus
    assert arr.rollout.log_prob_micro_batch_size_per_gpu == arr.ref.log_prob_micro_batch_size_per_gpu == 128 // ngpus

    # what verl's main() checks before starting Ray
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert need_reference_policy(cfg) and not need_critic(cfg)
    # the dataclasses the trainer and workers build
    assert omega_conf_to_dataclass(arr.actor).use_kl_loss
    model_cfg = omega_conf_to_dataclass(arr.model)
    assert model_cfg.hf_config._attn_implementation == "sdpa"
    rollout = omega_conf_to_dataclass(arr.rollout)
    # what this package's replica makes of it (engine_kwargs checked against SGLang's ServerArgs)
    ours = rollout_config_from_verl(rollout, str(model_dir))
    assert ours.tensor_model_parallel_size == tp and ours.gpu_memory_utilization == 0.5 and ours.free_cache_engine
    assert ours.engine_kwargs["attention_backend"] == "triton" and ours.engine_kwargs["grammar_backend"] == "none"
    assert get_custom_reward_fn(cfg)(data_source=verl_task.DATA_SOURCE, solution_str="Answer: 4",
                                     ground_truth="4")["acc"] == 1.0


def _has_key(cfg, dotted: str) -> bool:
    """Whether ``dotted`` names a node of ``cfg`` (a MISSING value such as rollout.name's ??? counts)."""
    node = cfg
    for part in dotted.split("."):
        if not OmegaConf.is_dict(node) or part not in node.keys():  # `in node` is False for ???
            return False
        node = node._get_node(part)
    return True


def test_plus_keys_only_extend_open_dicts(tmp_path):
    """'+' adds a key that the config lacks; allowed only under the dict-valued nodes meant for it,
    so a typo cannot hide behind a '+'. Every other key must already exist in verl's config."""
    base = trainer_config([])
    allowed_parents = {"actor_rollout_ref.model.override_config", "actor_rollout_ref.rollout.engine_kwargs.sglang",
                       "ray_kwargs.ray_init.runtime_env"}
    for o in verl_task.grpo_overrides("/m", tmp_path):
        key = o.split("=", 1)[0]
        if key.startswith("hydra."):
            continue
        if key.startswith("+"):
            assert any(key[1:].startswith(p + ".") for p in allowed_parents), key
            assert not _has_key(base, key[1:]), f"{key} exists already: drop the '+'"
            assert _has_key(base, key[1:].rsplit(".", 1)[0].split(".env_vars")[0]), key
        else:
            assert _has_key(base, key), key


def test_override_errors():
    with pytest.raises(ValueError, match="multiple of TP"):
        verl_task.grpo_overrides("/m", "/r", ngpus=3, tp=2)
    with pytest.raises(ValueError, match="does not split"):
        verl_task.grpo_overrides("/m", "/r", ngpus=3, tp=1)
    with pytest.raises(ValueError, match="rollout_n"):
        verl_task.grpo_overrides("/m", "/r", rollout_n=1)
    with pytest.raises(ValueError, match="NGPUS must be an integer"):
        verl_task.overrides_from_env("/m", "/r", {"NGPUS": "two"})


def test_overrides_command_prints_the_list(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NGPUS", "2")
    monkeypatch.setenv("TP", "2")
    monkeypatch.delenv("STEPS", raising=False)
    assert verl_task.main(["overrides", "--model", "/m", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == verl_task.grpo_overrides("/m", tmp_path, ngpus=2, tp=2, steps=20)
    monkeypatch.setenv("TP", "3")
    assert verl_task.main(["overrides", "--model", "/m", "--out", str(tmp_path)]) == 2
    assert "multiple of TP" in capsys.readouterr().err


# ------------------------------------------------------------------------------- metrics and plot
def test_metric_keys_are_verls():
    """The keys the plot reads are the ones verl 0.9.1's V1 sync trainer logs."""
    from verl.trainer.ppo import metric_utils
    from verl.trainer.ppo.v1 import trainer_base, trainer_sync

    data_src = inspect.getsource(metric_utils.compute_data_metrics)
    assert f'"{verl_task.SCORE_KEY}"' in data_src and f'"{verl_task.REWARD_KEY}"' in data_src
    assert f'"{verl_task.RESPONSE_LENGTH_KEY}"' in data_src
    from verl.trainer.ppo import rollout_corr_helper
    from verl.utils.debug import metrics as debug_metrics

    assert f'"{verl_task.PROBS_DIFF_KEY}"' in inspect.getsource(debug_metrics.calculate_debug_metrics)
    assert 'f"rollout_corr/{key}"' in inspect.getsource(rollout_corr_helper.compute_rollout_corr_metrics_from_logprobs)
    assert '"' + verl_task.LOG_PPL_DIFF_KEY.split("/", 1)[1] + '"' in inspect.getsource(
        rollout_corr_helper.compute_offpolicy_metrics)
    assert 'f"timing_s/{name}"' in inspect.getsource(metric_utils.compute_timing_metrics)
    assert 'marked_timer("update_weights"' in inspect.getsource(trainer_sync.PPOTrainerSync.on_step_end)
    fit = inspect.getsource(trainer_base.PPOTrainer.fit)
    step_once = inspect.getsource(trainer_base.PPOTrainer._step_once)
    assert 'marked_timer("step"' in fit and 'marked_timer("testing"' in fit
    for name in ("gen", "old_log_prob", "ref", "adv", "update_actor"):
        assert f'marked_timer("{name}"' in step_once, name


def _fake_batch(scores, resp_len=6, width=8):
    from verl import DataProto

    n = len(scores)
    resp_mask = torch.zeros(n, width)
    resp_mask[:, :resp_len] = 1
    tls = torch.zeros(n, width)
    tls[:, resp_len - 1] = torch.tensor(scores)
    return DataProto.from_dict(tensors={
        "prompts": torch.ones(n, 4, dtype=torch.long), "responses": torch.ones(n, width, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(n, 4), resp_mask], dim=1), "response_mask": resp_mask,
        "token_level_scores": tls, "token_level_rewards": tls, "advantages": torch.zeros(n, width),
        "returns": torch.zeros(n, width)})


def test_plot_reads_verls_file_logger(tmp_path, monkeypatch, capsys):
    """Metrics made by verl's own metric functions, written by its file logger, plotted and summed up."""
    from verl import DataProto
    from verl.trainer.ppo.metric_utils import compute_data_metrics, compute_timing_metrics
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_corr_metrics_from_logprobs
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.utils.debug.metrics import calculate_debug_metrics
    from verl.utils.tracking import Tracking

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
    tracker = Tracking(project_name="p", experiment_name="e", default_backend=["file"])

    def val(accs):
        scores = [a + 0.1 for a in accs]
        return PPOTrainer._val_metrics_update(
            None, [verl_task.DATA_SOURCE] * len(accs), [f"u{i}" for i in range(len(accs))],
            {"reward": scores, "score": scores, "acc": accs}, [1] * len(accs))

    tracker.log(val([0.0, 0.0, 1.0, 0.0]), step=0)  # before training
    for step, scores in enumerate(([0.1, 0.2, 0.0, 1.1], [1.1, 1.1, 0.1, 1.0], [1.1, 1.1, 1.1, 1.0]), start=1):
        batch = _fake_batch(scores)
        timing = {"gen": 2.0 + step, "update_actor": 1.5, "update_weights": 0.02 * step, "step": 5.0 + step}
        m = {**compute_data_metrics(batch, use_critic=False), **compute_timing_metrics(batch, timing)}
        # engine (rollout) vs trainer log-probs of the sampled tokens, as verl compares them
        mask = batch.batch["response_mask"]
        trainer_lp = torch.full(mask.shape, -0.5)
        engine_lp = trainer_lp + 0.01 * step * mask
        m.update(calculate_debug_metrics(DataProto.from_dict(tensors={
            "rollout_log_probs": engine_lp, "old_log_probs": trainer_lp, "response_mask": mask,
            "responses": batch.batch["responses"]})))
        m.update(compute_rollout_corr_metrics_from_logprobs(trainer_lp, engine_lp, mask))
        if step == 3:
            m.update(val([1.0, 1.0, 1.0, 0.0]))
        tracker.log(m, step=step)
    tracker.finish()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "data": {"critic/sc')  # a run killed mid-line

    rows = verl_task.load_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert any(verl_task.VAL_ACC_RE.match(k) for k in rows[0])
    assert verl_task.main(["plot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["steps"] == 3
    assert s["reward_first"] == pytest.approx(0.35) and s["reward_last"] == pytest.approx(1.075)
    assert s["val_acc"] == [[0, 0.25], [3, 0.75]]
    assert s["step_s_median"] == pytest.approx(7.0) and s["gen_s_median"] == pytest.approx(4.0)
    assert s["update_weights_s_median"] == pytest.approx(0.04) and s["train_s"] == pytest.approx(21.0)
    assert s["response_length_last"] == pytest.approx(6.0)
    # |exp(-0.5 + 0.01 k) - exp(-0.5)| for k = 1, 2, 3; log-ppl differences 0.01 k nats
    diffs = [math.exp(-0.5 + 0.01 * k) - math.exp(-0.5) for k in (1, 2, 3)]
    assert s["engine_trainer_probs_diff_median"] == pytest.approx(diffs[1], rel=1e-4)
    assert s["engine_trainer_probs_diff_max"] == pytest.approx(diffs[2], rel=1e-4)
    assert s["engine_trainer_log_ppl_diff_median"] == pytest.approx(0.02, rel=1e-4)
    assert "3 steps; rollout reward 0.350 -> 1.075; held-out accuracy 0.250 -> 0.750" in out
    for png in ("reward.png", "timing.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_without_training_steps_fails_cleanly(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "data": {"val-core/x/acc/mean@1": 0.5}}) + "\n")
    assert verl_task.main(["plot", str(tmp_path)]) == 2
    assert "no training step" in capsys.readouterr().err
    assert verl_task.main(["plot", str(tmp_path / "missing")]) == 2


def test_prepare_command_with_a_model_folder(tmp_path, tiny_model, capsys):
    model_dir, _ = tiny_model
    assert verl_task.main(["prepare", "--out", str(tmp_path), "--model", str(model_dir), "--train", "8",
                           "--val", "4"]) == 0
    assert capsys.readouterr().out.strip() == str(model_dir.resolve())
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "data" / "train.parquet").num_rows == 8
    assert pq.read_table(tmp_path / "data" / "val.parquet").num_rows == 4
    assert verl_task.main(["prepare", "--out", str(tmp_path), "--model", str(tmp_path / "nope")]) == 2
    assert re.search(r"no config\.json", capsys.readouterr().err)


def test_nnodes_compose_a_replica_over_two_nodes(tmp_path, tiny_model):
    """NNODES=2 NGPUS=1 TP=2 (issue 39 item 5): verl's trainer on two nodes of one GPU, one rollout replica
    at TP=2 over both, as verl composes and checks it and as this package lays it out."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from sgl_rollout.engine.layout import plan_replicas

    model_dir, _ = tiny_model
    overrides = verl_task.overrides_from_env(model_dir, tmp_path / "run", {"NGPUS": "1", "TP": "2", "NNODES": "2"})
    cfg = trainer_config(overrides)
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (2, 1)
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 64  # 16 prompts x 8 over 2 GPUs
    assert cfg.trainer.experiment_name == "grpo_arith_1gpu_tp2_2nodes"
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    (replica,) = plan_replicas(n_gpus=2, tp_size=2, gpus_per_node=1)
    assert replica.nnodes == 2


def test_nnodes_errors():
    with pytest.raises(ValueError, match="a larger TP needs NNODES > 1"):
        verl_task.grpo_overrides("/m", "/r", ngpus=1, tp=2)
    with pytest.raises(ValueError, match="TP \\(3\\) over nodes must be a multiple of NGPUS \\(2"):
        verl_task.grpo_overrides("/m", "/r", ngpus=2, tp=3, nnodes=2)
    with pytest.raises(ValueError, match="NNODES must be >= 1"):
        verl_task.grpo_overrides("/m", "/r", nnodes=0)
