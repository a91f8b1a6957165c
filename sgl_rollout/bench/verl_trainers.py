"""verl 0.9.1's trainers a ``bench verl`` pair can run, and what each needs on top of the GRPO overrides
(:func:`sgl_rollout.workloads.grpo_overrides`).

* ``sync``: ``verl.trainer.main_ppo``, colocated (the rollout sleeps while the actor trains); the weight
  sync is ``timing_s/update_weights``.
* ``one_step_off``: ``verl.experimental.one_step_off_policy.main_ppo`` (config
  ``one_step_off_ppo_trainer.yaml``): the rollout on GPUs of its own generates step k+1 while the actor
  trains on step k; weights go over verl's checkpoint engine (``nccl``); the sync is
  ``timing_s/sync_rollout_weights``, generation ``timing_s/generate_async``.
* ``fully_async``: ``verl.experimental.fully_async_policy.fully_async_main`` (config
  ``fully_async_ppo_trainer.yaml``): a rollouter streams samples, one prompt at a time
  (``data.gen_batch_size=1``), into a queue the trainer takes mini-batches from; an update aborts the
  running requests and, with ``async_training.partial_rollout``, resumes them on the new weights; samples
  older than ``staleness_threshold`` are dropped; the sync is ``timing_s/param_sync``.

For the two asynchronous ones, ``--ngpus`` splits into trainer GPUs and rollout GPUs
(``trainer.n_gpus_per_node`` and verl's top-level ``rollout.n_gpus_per_node``), and the rollout neither
sleeps nor frees its cache (``hybrid_engine=False``, ``free_cache_engine=False``).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

TRAINERS = ("sync", "one_step_off", "fully_async")

#: The module ``python -m`` runs for each trainer.
MODULES: Dict[str, str] = {
    "sync": "verl.trainer.main_ppo",
    "one_step_off": "verl.experimental.one_step_off_policy.main_ppo",
    "fully_async": "verl.experimental.fully_async_policy.fully_async_main",
}

#: verl's metric of the weight sync, per trainer.
SYNC_KEYS: Dict[str, str] = {
    "sync": "timing_s/update_weights",
    "one_step_off": "timing_s/sync_rollout_weights",
    "fully_async": "timing_s/param_sync",
}

#: Metrics only the asynchronous trainers log (their generation, sync and waiting), for the report.
ASYNC_KEYS = ("timing_s/generate_async", "timing_s/sync_rollout_weights", "timing_s/param_sync",
              "timing_s/wait_for_enough_samples")


def split_gpus(trainer: str, ngpus: int, rollout_gpus: int) -> Tuple[int, int]:
    """``(trainer GPUs, rollout GPUs)`` of a node of ``ngpus``: all of them both ways for ``sync``
    (colocated), else ``ngpus - rollout_gpus`` and ``rollout_gpus``.

    Raises:
        ValueError: an unknown trainer, or an asynchronous one without a GPU on each side.
    """
    if trainer not in TRAINERS:
        raise ValueError(f"unknown trainer {trainer!r}; one of {TRAINERS}")
    if trainer == "sync":
        return ngpus, ngpus
    if not 1 <= rollout_gpus < ngpus:
        raise ValueError(f"the {trainer} trainer needs GPUs for the trainer and for the rollout: --rollout-gpus "
                         f"{rollout_gpus} of --ngpus {ngpus} leaves none on one side")
    return ngpus - rollout_gpus, rollout_gpus


def trainer_overrides(trainer: str, rollout_gpus: int, steps: int, mini_batch: int, rollout_n: int,
                      staleness_threshold: float = 0.5) -> List[str]:
    """The overrides ``trainer`` needs after :func:`sgl_rollout.workloads.grpo_overrides` (which was given
    the trainer's GPUs); none for ``sync``.

    Args:
        rollout_gpus: GPUs of the rollout's own pool (one node).
        steps: trainer steps; for ``fully_async`` the rollouter stops after ``steps * mini_batch`` prompts
            (one sync per mini-batch: ``require_batches=1``, ``trigger_parameter_sync_step=1``).
        mini_batch: prompts per PPO mini-batch (``actor.ppo_mini_batch_size``).
        rollout_n: samples per prompt (``fully_async`` reads its own ``rollout.n`` too).
        staleness_threshold: ``fully_async``'s ``async_training.staleness_threshold``.
    """
    if trainer == "sync":
        return []
    common = [
        f"rollout.nnodes=1", f"rollout.n_gpus_per_node={rollout_gpus}",
        "actor_rollout_ref.hybrid_engine=False",
        "actor_rollout_ref.rollout.free_cache_engine=False",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        "trainer.rollout_data_dir=null",  # verl 0.9.1's one-step-off trainer fails in _dump_generations (below)
    ]
    if trainer == "one_step_off":
        # its config's searchpath is file://verl/trainer/config, relative to verl's source tree. verl 0.9.1's
        # OneStepOffRayTrainer never makes the executor _dump_generations writes with, so the validation
        # dump failed both sides' first validation on the GPUs: no dump (the report's greedy comparison
        # of the validation answers is then n/a for this trainer)
        return ["hydra.searchpath=[pkg://verl.trainer.config]", *common, "trainer.validation_data_dir=null"]
    return [*common,
            # the rollouter streams one prompt at a time and the trainer takes mini-batches from the queue:
            # verl 0.9.1's FullyAsyncRollouter asserts train_batch_size == 0 and gen_batch_size == 1
            "data.train_batch_size=0", "data.gen_batch_size=1", f"rollout.n={rollout_n}", f"rollout.total_rollout_steps={steps * mini_batch}",
            "async_training.partial_rollout=True", f"async_training.staleness_threshold={staleness_threshold}",
            "async_training.require_batches=1", "async_training.trigger_parameter_sync_step=1"]


def _key(override: str) -> str:
    """The config key of a hydra override (``+a.b=1`` -> ``a.b``)."""
    return override.split("=", 1)[0].lstrip("+~")


def with_overrides(base, extra):
    """``base`` hydra overrides with those of ``extra`` put in: an entry of ``extra`` replaces the one of
    ``base`` with the same key (so the command gives each key once), the others are appended."""
    keys = {_key(o) for o in extra}
    return [o for o in base if _key(o) not in keys] + list(extra)


def override_value(overrides, key: str):
    """The value (a string) ``overrides`` give ``key`` last, or None."""
    found = None
    for o in overrides:
        if _key(o) == key:
            found = o.partition("=")[2]
    return found
