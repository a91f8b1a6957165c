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

import logging

logger = logging.getLogger("sgl_rollout")

#: What verl's ``_ROLLOUT_REGISTRY[("sglang", "async")]`` holds once registered (a class path).
ROLLOUT_CLASS = "sgl_rollout.integrations.verl_rollout.SglRollout"
REPLICA_CLASS = "sgl_rollout.integrations.verl_server.SglRolloutReplica"
NAME = "sglang"


def _load_replica():
    from .verl_server import SglRolloutReplica

    return SglRolloutReplica


def register() -> bool:
    """Point verl's ("sglang", "async") rollout and "sglang" replica at this package, and register its
    checkpoint-engine backend ``sgl_rollout`` (:mod:`.verl_checkpoint_engine`).

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
    logger.info("rollout.name=%s is answered by sgl-rollout (%s); VERL_USE_EXTERNAL_PLUGINS=none restores "
                "verl's built-in", NAME, ROLLOUT_CLASS)
    return True


def resolved_implementation() -> str:
    """Class path verl resolves ("sglang", "async") to now (imports verl)."""
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY

    return _ROLLOUT_REGISTRY.get((NAME, "async"), "<none>")


register()
