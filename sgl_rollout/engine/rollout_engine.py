""":class:`RolloutEngine`: the SGLang engine for rollouts, put together from its parts."""

from __future__ import annotations

from .core import EngineCore
from .generate import GenerateCalls
from .lora_calls import LoraCalls
from .memory_calls import MemoryCalls
from .weight_calls import WeightCalls


class RolloutEngine(GenerateCalls, MemoryCalls, WeightCalls, LoraCalls, EngineCore):
    """SGLang engine for rollouts: generation, guarded release/resume and weight sync, contained death.

    Every call is written once and has a blocking face (``release``) and an awaiting one
    (``async_release``) (:mod:`sgl_rollout.twin`). Its parts:

    * :class:`~.core.EngineCore`: start, the event loop SGLang's coroutines run on (the engine's own
      thread, or a borrowed loop with ``loop=``), death (:class:`~.lifecycle.EngineDeadError` for every
      call in flight and after), :meth:`restart`, :meth:`shutdown`;
    * :class:`~.generate.GenerateCalls`: ``generate``; a caller that stops waiting aborts its requests
      in SGLang, and they stay counted until SGLang has ended them;
    * :class:`~.memory_calls.MemoryCalls`: ``release`` / ``resume`` / ``flush_cache``, refused before
      SGLang sees them when the memory state (:class:`~sgl_rollout.memory.MemoryState`) forbids them;
      the state changes when SGLang *answers*, even if its caller was interrupted (a Ctrl-C that lands
      while a call is handed to the loop is held off until it is recorded,
      :func:`~.core.sigint_deferred`);
    * :class:`~.weight_calls.WeightCalls`: the sync fence (``begin_sync`` / ``end_sync``) and
      ``update_weights_from_tensor``;
    * :class:`~.lora_calls.LoraCalls`: with ``lora_rank > 0``, ``load_lora_adapter_from_tensors`` /
      ``unload_lora_adapter`` under the same fence.

    Args:
        config: the rollout settings.
        engine_factory: ``(**server_args) -> engine``; defaults to ``sglang.Engine``. Tests pass a
            double with the same ``tokenizer_manager`` coroutines and ``async_generate``.
        disable_tp_imbalance_check: switch SGLang's TP memory-imbalance start-up check off (default),
            so that colocated workers that loaded in any order do not stop the engine from starting.
        watch_interval_s: seconds between two looks of the watchdog at the engine's processes.
        loop: a running event loop, not the main thread's, to run SGLang's coroutines on instead of
            the engine's own thread (the loop of a Ray async actor). Its thread may then call only the
            ``async_`` methods and the ones that do not wait for SGLang (``end_sync``, ``abort_all``,
            ``fail``, ``restart``, ``shutdown``); a blocking method raises RuntimeError there. A death
            or shutdown cancels this engine's coroutines on it, never the loop.

    Raises:
        ImportError: SGLang is not installed.
        TPLayoutError: the TP size does not split the model's attention or KV heads, or exceeds the
            GPUs this process sees (checked before SGLang starts anything).
        RuntimeError: SGLang fails to start (its own error).
    """
