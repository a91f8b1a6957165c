"""verl plugin: make verl's rollout registries answer ``rollout.name=sglang`` with this package.

verl (0.9.x) imports every entry point of the group ``verl.plugins`` at ``import verl``
(``verl/__init__.py``), in the driver and in every Ray worker, and only *imports* it: nothing is
called. So this module registers at import time; :func:`register` is idempotent and can be called
again. verl logs a failing plugin at DEBUG only, which would surface much later as "Rollout sglang
not found"; :func:`register` therefore logs its own failures at WARNING, with the cause.

Overriding verl's built-in "sglang" is deliberate: the user's config keeps ``rollout.name=sglang``.
``VERL_USE_EXTERNAL_PLUGINS=none`` (verl's own switch) skips plugins and restores verl's built-in.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Optional

logger = logging.getLogger("sgl_rollout")

#: What verl's ``_ROLLOUT_REGISTRY[("sglang", "async")]`` holds once registered (a class path).
ROLLOUT_CLASS = "sgl_rollout.integrations.verl_rollout.SglRollout"
REPLICA_CLASS = "sgl_rollout.integrations.verl_server.SglRolloutReplica"
NAME = "sglang"


def _load_replica():
    from .verl_server import SglRolloutReplica

    return SglRolloutReplica


#: The TRL class verl 0.9.x imports whenever ``trl`` is importable (``apply_monkey_patch`` in
#: ``verl/models/transformers/monkey_patch.py``, from ``trl.experimental.ppo``, else from ``trl``).
VERL_TRL_CLASS = "AutoModelForCausalLMWithValueHead"


def trl_conflict() -> Optional[str]:
    """Why the installed TRL breaks verl's FSDP workers, or None.

    verl 0.9.1 builds every FSDP actor and reference model through ``apply_monkey_patch``, which imports
    :data:`VERL_TRL_CLASS` whenever ``trl`` can be found. TRL 1.x no longer has it (neither in
    ``trl/__init__.py`` nor as ``trl/experimental/ppo``), so with TRL 1.16 (this package's ``trl`` extra)
    in the same environment both verl's built-in rollout and this one die at the first model build with
    an ImportError (seen on 2×H200, 2026-11-28). Read from TRL's installed files, without importing it.
    """
    try:
        dist = importlib.metadata.distribution("trl")
    except importlib.metadata.PackageNotFoundError:
        return None
    files = {str(f) for f in dist.files or ()}
    if "trl/experimental/ppo/__init__.py" in files:
        return None
    try:
        init = dist.locate_file("trl/__init__.py").read_text(encoding="utf-8")
    except OSError:
        return None
    if VERL_TRL_CLASS in init:
        return None
    return (f"trl {dist.version} is installed and has no {VERL_TRL_CLASS}, which verl imports whenever trl "
            "is importable (verl/models/transformers/monkey_patch.py): verl's FSDP workers will fail with an "
            "ImportError. Run verl and TRL in separate environments (pip uninstall trl here).")


def register() -> bool:
    """Point verl's ("sglang", "async") rollout and "sglang" replica at this package, register its
    checkpoint-engine backend ``sgl_rollout`` (:mod:`.verl_checkpoint_engine`), and hook verl's agent-loop
    workers so that their heap is frozen once built (:mod:`.verl_agent_loop`).

    Returns:
        True when registered; False when verl's registries could not be reached (logged at WARNING
        with the cause; verl's built-in then answers, or the lookup fails).
    """
    try:
        from verl.workers.rollout.base import _ROLLOUT_REGISTRY
        from verl.workers.rollout.replica import RolloutReplicaRegistry

        _ROLLOUT_REGISTRY[(NAME, "async")] = ROLLOUT_CLASS
        RolloutReplicaRegistry.register(NAME, _load_replica)
    except Exception as e:  # noqa: BLE001 - any failure must be loud, verl would swallow it
        logger.warning("sgl-rollout could not register with verl (rollout.name=%s stays verl's built-in): %r",
                       NAME, e, exc_info=True)
        return False
    try:
        from . import verl_checkpoint_engine  # noqa: F401 - registers checkpoint_engine.backend=sgl_rollout on import
    except Exception as e:  # noqa: BLE001 - the rollout is registered; only this backend is missing
        logger.warning("sgl-rollout could not register checkpoint_engine.backend=sgl_rollout with verl: %r", e,
                       exc_info=True)
    try:
        from . import verl_agent_loop

        verl_agent_loop.install(NAME)  # freeze verl's agent-loop workers' heap once built (verl_agent_loop.py)
    except Exception as e:  # noqa: BLE001 - the rollout is registered; only the workers' freeze is missing
        logger.warning("sgl-rollout could not hook verl's agent-loop workers: %r", e, exc_info=True)
    conflict = trl_conflict()
    if conflict:
        logger.warning("sgl-rollout: %s", conflict)
    logger.info("rollout.name=%s is answered by sgl-rollout (%s); VERL_USE_EXTERNAL_PLUGINS=none restores "
                "verl's built-in", NAME, ROLLOUT_CLASS)
    return True


def resolved_implementation() -> str:
    """Class path verl resolves ("sglang", "async") to now (imports verl)."""
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY

    return _ROLLOUT_REGISTRY.get((NAME, "async"), "<none>")


register()
