"""Every ``bench verl`` command is one verl accepts (issue 45, item 2).

For each trainer (``sync``, ``one_step_off``, ``fully_async``) and task (``arith``, ``shapes``, ``tools``),
both sides' full commands are composed into verl's config (hydra, the trainer's own yaml), and then
everything verl itself does with that config before it starts a worker runs here, on the CPU, as the
trainer's ``main`` does it (verl 0.9.1):

* ``sync`` (``verl/trainer/main_ppo.py``): ``validate_config``, then the v1 trainer's constructor
  (``get_trainer_cls(trainer.v1.trainer_mode)``), its tokenizer and its dataloaders;
* ``one_step_off`` (``verl/experimental/one_step_off_policy/main_ppo.py``): ``validate_config``, the
  worker mapping and resource pools, verl's RL datasets, ``OneStepOffRayTrainer.__init__``, and the dump
  of generations its ``fit`` makes where the config names a folder (its first GPU run died there);
* ``fully_async`` (``verl/experimental/fully_async_policy/fully_async_main.py``): ``main``'s own config
  changes, then ``FullyAsyncTrainer.__init__`` and ``FullyAsyncRollouter.__init__`` (their asserts:
  ``train_batch_size must be zero`` failed both sides of the first GPU run), the rollouter's dump of
  generations, and its count of trainer steps.

Each must end with the number of training steps the command asked for.
"""

import asyncio
import types

import pytest

pytest.importorskip("verl")
pytest.importorskip("ray")

from omegaconf import OmegaConf  # noqa: E402
from verl_helpers import trainer_config  # noqa: E402

from sgl_rollout.bench import verl_compare  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def task_dirs(tmp_path_factory):
    """Per task: (model folder, run folder with ``data/``), made offline and small: the tiny ChatML model
    (config and tokenizer; no weights: nothing here loads them) for the sums and the tool turns, the
    tiny Qwen2.5-VL for the shapes (without its processor, which needs torchvision: verl then reads the
    rows as text, and the config checks are the same)."""
    from sgl_rollout.bench.agent_task import write_tools_task
    from sgl_rollout.bench.chat_tokenizer import build_chat_model_dir
    from sgl_rollout.bench.vlm import make_qwen2_5_vl_dir, write_shapes_parquet
    from sgl_rollout.workloads import write_parquet

    root = tmp_path_factory.mktemp("verl_accepts")
    chat = root / "chat-model"
    build_chat_model_dir(chat, with_weights=False)
    vl = root / "vl-model"
    make_qwen2_5_vl_dir(str(vl), with_processor=False)
    dirs = {}
    for task in ("arith", "shapes", "tools"):
        run = root / f"run-{task}"
        if task == "arith":
            write_parquet(run / "data", n_train=64, n_val=8)
        elif task == "shapes":
            write_shapes_parquet(run / "data", n_train=64, n_val=8)
        else:
            write_tools_task(run / "data", n_train=64, n_val=8)
        dirs[task] = (vl if task == "shapes" else chat, run)
    return dirs


def _tokenizer_and_data(cfg, model_dir):
    from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler
    from verl.utils import hf_processor, hf_tokenizer

    tok = hf_tokenizer(str(model_dir))
    proc = hf_processor(str(model_dir), use_fast=True)
    train = create_rl_dataset(cfg.data.train_files, cfg.data, tok, proc, max_samples=-1)
    val = create_rl_dataset(cfg.data.val_files, cfg.data, tok, proc, max_samples=-1)
    return tok, proc, train, val, create_rl_sampler(cfg.data, train)


def _validate(cfg):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


def _sync(cfg, model_dir):
    from verl.trainer.ppo.v1 import get_trainer_cls

    OmegaConf.resolve(cfg)
    _validate(cfg)
    trainer = get_trainer_cls(cfg.trainer.v1.trainer_mode)(config=cfg)
    trainer._init_tokenizer()
    trainer._init_dataloader()
    return trainer.total_training_steps


def _one_step_off(cfg, model_dir):
    from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer
    from verl.experimental.separation.utils import create_resource_pool_manager, create_role_worker_mapping
    from verl.utils.dataset.rl_dataset import collate_fn

    OmegaConf.resolve(cfg)
    mapping, wg_cls = create_role_worker_mapping(cfg)
    _validate(cfg)
    tok, proc, train, val, sampler = _tokenizer_and_data(cfg, model_dir)
    trainer = OneStepOffRayTrainer(
        config=cfg, tokenizer=tok, processor=proc, role_worker_mapping=mapping,
        resource_pool_manager=create_resource_pool_manager(cfg, mapping.keys()), ray_worker_group_cls=wg_cls,
        train_dataset=train, val_dataset=val, collate_fn=collate_fn, train_sampler=sampler,
        device_name=cfg.trainer.device)
    _dump_as_fit_does(trainer, cfg)
    return trainer.total_training_steps


def _dump_as_fit_does(trainer, cfg):
    """What ``fit`` does with each dump folder the config sets (``_validate`` and the training step call
    verl's ``_dump_generations``, ``verl/trainer/ppo/ray_trainer.py``): verl 0.9.1's one-step-off trainer
    has no dump executor, so a set ``validation_data_dir`` failed its first validation on the GPUs."""
    for key in ("validation_data_dir", "rollout_data_dir"):
        folder = cfg.trainer.get(key)
        if folder:
            trainer.global_steps = 0
            trainer._dump_generations(inputs=["q"], outputs=["a"], gts=["g"], scores=[0.0],
                                      reward_extra_infos_dict={}, dump_path=folder)
            trainer._shutdown_dump_executor()


def _fully_async(cfg, model_dir):
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncRollouter
    from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer
    from verl.experimental.reward_loop import migrate_legacy_reward_impl
    from verl.experimental.separation.utils import create_resource_pool_manager, create_role_worker_mapping
    from verl.trainer.ppo.utils import Role
    from verl.utils import hf_processor, hf_tokenizer

    # fully_async_main.main's own changes, then FullyAsyncTaskRunner's (no validate_config there)
    cfg.actor_rollout_ref.rollout.nnodes = cfg.rollout.nnodes
    cfg.actor_rollout_ref.rollout.n_gpus_per_node = cfg.rollout.n_gpus_per_node
    cfg = migrate_legacy_reward_impl(cfg)
    OmegaConf.resolve(cfg)
    tok = hf_tokenizer(str(model_dir))
    proc = hf_processor(str(model_dir), use_fast=True)
    mapping, wg_cls = create_role_worker_mapping(cfg)
    mapping = {role: cls for role, cls in mapping.items() if role != Role.Rollout}
    FullyAsyncTrainer.__ray_metadata__.modified_class(
        config=cfg, tokenizer=tok, role_worker_mapping=mapping,
        resource_pool_manager=create_resource_pool_manager(cfg, roles=list(mapping.keys())),
        ray_worker_group_cls=wg_cls, device_name=cfg.trainer.device)
    rollouter = FullyAsyncRollouter.__ray_metadata__.modified_class(
        config=cfg, tokenizer=tok, processor=proc, device_name=cfg.trainer.device)
    _dump_as_fit_does(rollouter, cfg)  # the rollouter validates
    # what the task runner asks the rollouter after its workers start: the trainer's steps
    rollouter.llm_server_manager = types.SimpleNamespace(get_active_server_count=lambda: 1)

    async def count():
        rollouter._init_async_objects()  # init_workers' first step: the rollouter's lock
        await rollouter.set_max_required_samples()
    asyncio.run(count())
    return rollouter.get_total_train_steps()


CHECKS = {"sync": _sync, "one_step_off": _one_step_off, "fully_async": _fully_async}


@pytest.mark.parametrize("task", ["arith", "shapes", "tools"])
@pytest.mark.parametrize("trainer", ["sync", "one_step_off", "fully_async"])
@pytest.mark.parametrize("side", ["builtin", "ours"])
def test_verl_accepts_the_command_and_plans_its_steps(task_dirs, trainer, task, side, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # verl's trainers open their file logger under the working directory
    model_dir, run = task_dirs[task]
    kw = dict(python="python", trainer=trainer, task=task)
    if trainer != "sync":
        kw.update(rollout_gpus=1, ours_backend="sgl_rollout")
    cmd = verl_compare.side_command(side, model_dir, run, 2, 1, STEPS, 0.5, **kw)
    cfg = trainer_config(trainer, cmd)
    assert CHECKS[trainer](cfg, model_dir) == STEPS


def test_a_one_step_off_command_that_dumps_validations_fails_here(task_dirs, tmp_path, monkeypatch):
    """The one-step-off command of the first GPU runs (``trainer.validation_data_dir`` set) fails here
    as verl failed it there, after the validation."""
    monkeypatch.chdir(tmp_path)
    model_dir, run = task_dirs["arith"]
    cmd = verl_compare.side_command("ours", model_dir, run, 2, 1, STEPS, 0.5, python="python",
                                    trainer="one_step_off", rollout_gpus=1)
    cmd = [f"trainer.validation_data_dir={tmp_path / 'val'}" if c == "trainer.validation_data_dir=null" else c
           for c in cmd]
    with pytest.raises(AttributeError, match="_dump_executor"):
        _one_step_off(trainer_config("one_step_off", cmd), model_dir)


def test_a_command_verl_refuses_fails_here(task_dirs, tmp_path, monkeypatch):
    """5b3bb3a's fully-async command (without ``data.train_batch_size=0``) is refused as on the GPUs."""
    monkeypatch.chdir(tmp_path)
    model_dir, run = task_dirs["arith"]
    cmd = verl_compare.side_command("ours", model_dir, run, 2, 1, STEPS, 0.5, python="python",
                                    trainer="fully_async", rollout_gpus=1)
    cmd = [c for c in cmd if not c.startswith("data.train_batch_size=")]
    with pytest.raises(AssertionError, match="train_batch_size must be zero"):
        _fully_async(trainer_config("fully_async", cmd), model_dir)
