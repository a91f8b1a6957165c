"""The guarded SGLang engine, in three parts:

* :mod:`.lifecycle`: the engine's processes and the host around them (the environment they are spawned
  with, death, SIGQUIT, shutdown of only the engine's own children);
* :mod:`.guarded`: :class:`RolloutEngine`, every call into SGLang checked before it reaches the
  scheduler, one body per call;
* :mod:`.layout`: which TP ranks, GPUs and ports each node of a replica gets (:class:`ReplicaLayout`),
  for replicas that span nodes.
"""

from .guarded import Generation, LoraAdapter, RolloutEngine, engine_tags
from .layout import NodeSlot, ReplicaLayout, plan_replicas
from .lifecycle import (EngineClosedError, EngineDeadError, engine_env_updates, install_sigquit_handler,
                        patched_environ, strip_expandable_segments)
from ..memory import MemoryStateError

__all__ = [
    "EngineClosedError",
    "EngineDeadError",
    "Generation",
    "LoraAdapter",
    "MemoryStateError",
    "NodeSlot",
    "ReplicaLayout",
    "RolloutEngine",
    "engine_env_updates",
    "engine_tags",
    "install_sigquit_handler",
    "patched_environ",
    "plan_replicas",
    "strip_expandable_segments",
]
