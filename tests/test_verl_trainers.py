"""``bench verl --trainer`` (``sgl_rollout.bench.verl_trainers``): each trainer's command composes into
its own verl config (hydra, verl 0.9.1's yaml files) with the layout and keys that trainer needs, and
bad layouts are refused before anything starts. Checked on CPU; the runs need 2 GPUs."""

import pytest

from sgl_rollout.bench import verl_compare, verl_trainers
from verl_helpers import trainer_config


@pytest.mark.parametrize("trainer", ["one_step_off", "fully_async"])
def test_async_trainer_commands_compose_with_their_own_layout(tmp_path, trainer):
    cmd = verl_compare.side_command("ours", tmp_path / "m", tmp_path / "run", 2, 1, 4, 0.5, python="python",
                                    trainer=trainer, rollout_gpus=1)
    keys = [o.split("=", 1)[0].lstrip("+") for o in cmd[3:]]
    assert len(keys) == len(set(keys))
    cfg = trainer_config(trainer, cmd)
    arr = cfg.actor_rollout_ref
    assert cfg.trainer.n_gpus_per_node == 1 and cfg.rollout.n_gpus_per_node == 1 and cfg.rollout.nnodes == 1
    assert arr.hybrid_engine is False and arr.rollout.free_cache_engine is False
    assert arr.rollout.calculate_log_probs is True and arr.rollout.checkpoint_engine.backend == "nccl"
    assert arr.rollout.name == "sglang" and cfg.trainer.rollout_data_dir is None
    assert arr.model.use_remove_padding is False  # no flash-attn on the GPU host: ours wins over the yaml's
    assert arr.actor.ppo_micro_batch_size_per_gpu == 128  # the trainer's one GPU takes the whole mini-batch
    if trainer == "fully_async":
        a = cfg.async_training
        assert a.partial_rollout is True and a.staleness_threshold == 0.5
        assert a.require_batches == 1 and a.trigger_parameter_sync_step == 1
        assert cfg.data.gen_batch_size == 1 and cfg.rollout.n == arr.rollout.n == 8
        assert cfg.rollout.total_rollout_steps == 4 * arr.actor.ppo_mini_batch_size  # 4 trainer steps


def test_sync_trainer_is_the_colocated_command(tmp_path):
    cmd = verl_compare.side_command("ours", tmp_path / "m", tmp_path / "run", 2, 1, 4, 0.5, python="python")
    cfg = trainer_config("sync", cmd)
    assert cfg.trainer.n_gpus_per_node == 2 and cfg.actor_rollout_ref.hybrid_engine is True
    assert not [o for o in cmd if o.startswith(("rollout.", "async_training."))]


@pytest.mark.parametrize("trainer, ngpus, rollout_gpus, nnodes, match", [
    ("one_step_off", 2, 0, 1, "none on one side"),
    ("fully_async", 2, 2, 1, "none on one side"),
    ("fully_async", 2, 1, 2, "one node"),
])
def test_bad_layouts_are_refused(trainer, ngpus, rollout_gpus, nnodes, match):
    with pytest.raises(verl_compare.SetupError, match=match):
        verl_compare.check_trainer(trainer, ngpus, rollout_gpus, nnodes)
    verl_compare.check_trainer("sync", 2, 0, 2)
    with pytest.raises(ValueError, match="unknown trainer"):
        verl_trainers.split_gpus("ppo", 2, 1)


def test_the_report_reads_the_async_trainers_metrics():
    from sgl_rollout.bench import verl_report

    for trainer, key in verl_trainers.SYNC_KEYS.items():
        assert key in verl_report.TIMING_KEYS, trainer
    assert "timing_s/generate_async" in verl_report.TABLE_KEYS and "perf/throughput" in verl_report.TABLE_KEYS


@pytest.mark.parametrize("trainer", ["one_step_off", "fully_async"])
def test_ours_checkpoint_engine_goes_to_sgl_rollouts_side_only(tmp_path, trainer):
    kw = dict(python="python", trainer=trainer, rollout_gpus=1, ours_backend="sgl_rollout")
    ours = verl_compare.side_command("ours", tmp_path / "m", tmp_path / "o", 2, 1, 4, 0.5, **kw)
    builtin = verl_compare.side_command("builtin", tmp_path / "m", tmp_path / "b", 2, 1, 4, 0.5, **kw)
    keys = [o.split("=", 1)[0].lstrip("+") for o in ours[3:]]
    assert len(keys) == len(set(keys))
    assert trainer_config(trainer, ours).actor_rollout_ref.rollout.checkpoint_engine.backend == "sgl_rollout"
    assert trainer_config(trainer, builtin).actor_rollout_ref.rollout.checkpoint_engine.backend == "nccl"
    assert any("sgl_rollout" in d for d in verl_compare.differences(None, "sgl_rollout"))
