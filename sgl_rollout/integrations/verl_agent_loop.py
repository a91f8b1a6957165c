"""Freeze the heap of verl's agent-loop workers once they are built, so that a full garbage collection in one
of them no longer holds up that worker's requests (issue 47, goal 1: the request path).

verl 0.9.1 sends every rollout request from a few ``AgentLoopWorker`` Ray actors
(``verl/experimental/agent_loop/agent_loop.py``; the one-step-off and fully-async trainers subclass it).
Each holds the tokenizer, the processor, the dataset class, the tools and every module of torch,
transformers, Ray and verl: hundreds of thousands of objects that live until the process ends, and that every
full (generation-2) collection walks again. ``bench verl``'s probe timed such collections at 0.31-0.48 s in
these workers, one or two per worker over a 4-step run (2026-11-29, one H200,
``examples/verl/compare/colocated-1b-random-h200/``), on verl's built-in rollout as on this package's. The
worker that collects sends nothing meanwhile: where that falls among a step's requests, the step's last
request reaches SGLang that much later.

:func:`install` registers a post-import hook on verl's agent-loop module (``wrapt``) that wraps
``AgentLoopWorker.__init__`` and ``AgentLoopWorker.generate_sequences``: when the worker serves
``rollout.name=sglang`` (this package's rollout), :func:`sgl_rollout.memory.freeze_long_lived` runs once at the
end of ``__init__`` (before training starts) and once after the worker's first ``generate_sequences`` (what
the first batch loaded lazily: chat templates, tool parsers). Later full collections walk only what was made
since. SGLang does the same in its own processes (``TokenizerManager.freeze_gc``,
``sglang/srt/managers/tokenizer_manager.py``).

What it costs: about one full collection per worker at its start, and one collection of the objects made
since after its first batch. A frozen object that later becomes cyclic garbage is never collected
(``gc.freeze``); the frozen objects are the worker's long-lived state.

``SGLROLLOUT_AGENT_LOOP_FREEZE_GC=0`` (:data:`ENV`) in the workers' environment turns it off. Other rollouts
(``rollout.name`` other than ``sglang``) are left alone.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from ..memory import freeze_long_lived

logger = logging.getLogger(__name__)

#: Set to ``0`` to leave verl's agent-loop workers' garbage collector as it is.
ENV = "SGLROLLOUT_AGENT_LOOP_FREEZE_GC"
#: The module that defines verl's ``AgentLoopWorker``.
MODULE = "verl.experimental.agent_loop.agent_loop"
#: A worker's instance-dict key: the set of freezes done (``"built"``, ``"first batch"``), or None for a worker of
#: another rollout (never frozen).
_FROZEN = "__sgl_rollout_frozen__"
#: Set on :func:`patch`'s ``__init__`` wrapper: the class is patched already.
_WRAPPED = "_sgl_rollout_freeze_gc"

__all__ = ["ENV", "MODULE", "install", "patch", "serves_this_rollout"]


def serves_this_rollout(config: Any, rollout_name: str) -> bool:
    """Whether an agent-loop worker built with verl's ``config`` (the whole trainer config, as
    ``AgentLoopWorker.__init__`` takes it) sends to ``rollout_name`` (this package's:
    :data:`sgl_rollout.integrations.verl.NAME`) and :data:`ENV` allows freezing. Never raises: a config without
    ``actor_rollout_ref.rollout.name`` answers False."""
    if os.environ.get(ENV, "1").strip() == "0":
        return False
    try:
        name = config.actor_rollout_ref.rollout.name
    except Exception:  # noqa: BLE001 - any config shape verl may pass
        return False
    return name == rollout_name


def _freeze(worker: Any, when: str) -> None:
    """Freeze once per ``when`` for this worker; never raises (the worker's job goes on unfrozen)."""
    done = worker.__dict__.setdefault(_FROZEN, set())
    if when in done:
        return
    done.add(when)
    try:
        n = freeze_long_lived()
        logger.info("sgl-rollout: froze %d objects of verl's agent-loop worker (%s)", n, when)
    except Exception:  # noqa: BLE001 - a failed freeze must not fail verl's rollout
        logger.warning("sgl-rollout: could not freeze the agent-loop worker's heap (%s)", when, exc_info=True)


def patch(worker_cls: type, rollout_name: str) -> bool:
    """Wrap ``worker_cls.__init__`` and ``worker_cls.generate_sequences`` (verl's ``AgentLoopWorker``) as the
    module docstring says, for workers of ``rollout_name`` (:func:`serves_this_rollout`); idempotent.

    Returns:
        True when wrapped (now or before); False when the class lacks either method (nothing changed).
    """
    init, gen = worker_cls.__dict__.get("__init__"), worker_cls.__dict__.get("generate_sequences")
    if init is None or gen is None:
        return False
    if getattr(init, _WRAPPED, False):
        return True

    @functools.wraps(init)
    def __init__(self, config, *args, **kwargs):
        init(self, config, *args, **kwargs)
        if serves_this_rollout(config, rollout_name):
            _freeze(self, "built")
        else:
            self.__dict__[_FROZEN] = None  # another rollout: never freeze this worker

    @functools.wraps(gen)
    async def generate_sequences(self, *args, **kwargs):
        out = await gen(self, *args, **kwargs)
        if self.__dict__.get(_FROZEN) is not None:
            _freeze(self, "first batch")
        return out

    setattr(__init__, _WRAPPED, True)
    worker_cls.__init__ = __init__
    worker_cls.generate_sequences = generate_sequences
    return True


def _on_import(module: Any, rollout_name: str) -> None:
    cls = getattr(module, "AgentLoopWorker", None)
    if cls is None or not patch(cls, rollout_name):
        logger.warning("sgl-rollout: verl's %s has no AgentLoopWorker.__init__ and generate_sequences; its "
                       "heap is not frozen", MODULE)


def install(rollout_name: str) -> bool:
    """Register the post-import hook on :data:`MODULE` in this process (run by the verl plugin at ``import
    verl``, in the driver and every Ray worker, with the rollout name it registered); the hook runs at once
    where verl's module is imported already.

    Returns:
        True when registered; False when ``wrapt`` is missing (logged at WARNING; nothing changed).
    """
    try:
        import wrapt
    except ImportError:
        logger.warning("sgl-rollout: wrapt is not installed; verl's agent-loop workers' heap is not frozen")
        return False
    wrapt.register_post_import_hook(functools.partial(_on_import, rollout_name=rollout_name), MODULE)
    return True
