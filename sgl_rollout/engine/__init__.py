"""The guarded SGLang engine, in parts:

* :mod:`.lifecycle`: the engine's processes and the host around them (the environment they are spawned
  with, death, SIGQUIT, shutdown of only the engine's own children);
* :mod:`.core`: the started engine, the event loop its calls run on, death and restart;
* :mod:`.generate`, :mod:`.memory_calls`, :mod:`.weight_calls`, :mod:`.lora_calls`: the calls into
  SGLang, each checked before it reaches the scheduler and written once for blocking and async callers;
* :mod:`.rollout_engine`: :class:`RolloutEngine`, the parts put together;
* :mod:`.io_struct`: SGLang's request objects;
* :mod:`.layout`: which TP ranks, GPUs and ports each node of a replica gets (:class:`ReplicaLayout`),
  for replicas that span nodes.
"""

from ..memory import MemoryStateError
from .core import engine_tags
from .generate import Generation
from .layout import NodeSlot, ReplicaLayout, plan_replicas
from .lifecycle import (EngineClosedError, EngineDeadError, engine_env_updates, install_sigquit_handler,
                        patched_environ, strip_expandable_segments)
from .lora_calls import LoraAdapter
from .rollout_engine import RolloutEngine

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
