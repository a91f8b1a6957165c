"""An SGLang engine set up so that release/resume really free memory, guarded against bad calls.

What SGLang 0.5.10 needs for tagged release to work (each learnt from its source):

* ``enable_memory_saver=True``: otherwise ``release_memory_occupation`` silently frees nothing
  (``TorchMemorySaverAdapter`` is a no-op, ``sglang/srt/utils/torch_memory_saver_adapter.py``);
* ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1``: otherwise CUDA-graph memory is not tagged
  (``CudaGraphRunner._capture_graph``, ``sglang/srt/model_executor/cuda_graph_runner.py``);
* piecewise CUDA graphs off: their memory is never released;
* no ``expandable_segments`` in ``PYTORCH_CUDA_ALLOC_CONF`` for the engine's processes:
  torch-memory-saver raises on it. It is removed only while the engine's processes are spawned,
  so a trainer in the host process keeps its own setting.

Shutdown: ``sglang.Engine.shutdown()`` kills *every* child process of the host
(``kill_process_tree(os.getpid(), include_parent=False)``), and SGLang registers it with atexit.
:class:`RolloutEngine` records which children the engine started and ends only those.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from .config import RolloutConfig
from .memory import ALL_TAGS, CUDA_GRAPH, KV_CACHE, WEIGHTS, MemoryState, MemoryStateError

logger = logging.getLogger(__name__)


def strip_expandable_segments(conf: Optional[str]) -> Optional[str]:
    """``PYTORCH_CUDA_ALLOC_CONF`` without its ``expandable_segments`` option; None when nothing is left.

    >>> strip_expandable_segments("expandable_segments:True,max_split_size_mb:128")
    'max_split_size_mb:128'
    """
    if not conf:
        return None
    kept = [opt for opt in conf.split(",") if opt.strip() and not opt.strip().startswith("expandable_segments")]
    return ",".join(kept) or None


def engine_env_updates(
    sglang_version: Optional[str] = None,
    base: Optional[Dict[str, str]] = None,
    disable_tp_imbalance_check: bool = True,
) -> Dict[str, Optional[str]]:
    """Environment changes for the engine's processes (None: remove the variable).

    Args:
        sglang_version: SGLang version for the version-gated patches; None reads the installed one.
        base: environment to start from (``os.environ`` by default); only read.
        disable_tp_imbalance_check: apply ``patches/tp_memory_imbalance.py`` (default). False leaves
            SGLang's own setting, which refuses to start TP on GPUs with unequal free memory.

    Returns:
        dict of variable -> value or None: memory-saver CUDA-graph tagging, the allocator config
        without ``expandable_segments``, and the TP memory-imbalance check switched off
        (``patches/tp_memory_imbalance.py``).
    """
    from .patches import tp_memory_imbalance

    base = os.environ if base is None else base
    updates: Dict[str, Optional[str]] = {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}
    if "PYTORCH_CUDA_ALLOC_CONF" in base:
        updates["PYTORCH_CUDA_ALLOC_CONF"] = strip_expandable_segments(base["PYTORCH_CUDA_ALLOC_CONF"])
    if disable_tp_imbalance_check:
        updates.update(tp_memory_imbalance.env_updates(sglang_version))
    return updates


@contextlib.contextmanager
def patched_environ(updates: Dict[str, Optional[str]]) -> Iterator[None]:
    """Apply ``updates`` to ``os.environ`` (None removes a variable) and restore it on exit."""
    from .patches import apply_env_updates

    saved = {k: os.environ.get(k) for k in updates}
    try:
        apply_env_updates(os.environ, updates)
        yield
    finally:
        apply_env_updates(os.environ, saved)


@dataclass
class Generation:
    """One sampled completion.

    Attributes:
        output_ids: generated token ids (int), prompt excluded.
        logprobs: log-probability (float, natural log) of each generated token under the engine's
            sampling distribution, same length as ``output_ids``; empty if not requested.
        finish_reason: SGLang's finish reason type, e.g. ``"length"`` or ``"stop"``.
    """

    output_ids: List[int]
    logprobs: List[float] = field(default_factory=list)
    finish_reason: Optional[str] = None


def _child_pids() -> set:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=False)}


def _kill_trees(pids: Sequence[int], timeout_s: float = 10.0) -> None:
    import psutil

    procs = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs.extend(root.children(recursive=True))
            procs.append(root)
        except psutil.NoSuchProcess:
            continue
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _gone, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=timeout_s)


def engine_tags(config: RolloutConfig) -> tuple:
    """The tags an engine built from ``config`` has: ``cuda_graph`` only when CUDA graphs are on."""
    return tuple(t for t in ALL_TAGS if t != CUDA_GRAPH or not config.enforce_eager)


class RolloutEngine:
    """SGLang engine for rollouts: generation, guarded release/resume, weight loading, clean shutdown.

    Args:
        config: the rollout settings.
        engine_factory: ``(**server_args) -> engine``; defaults to ``sglang.Engine``. Tests pass a
            double that records calls.
        disable_tp_imbalance_check: switch SGLang's TP memory-imbalance start-up check off (default),
            so that colocated workers that loaded in any order do not stop the engine from starting.

    Raises:
        ImportError: SGLang is not installed.
        RuntimeError: SGLang fails to start (its own error).
    """

    def __init__(
        self,
        config: RolloutConfig,
        engine_factory: Optional[Callable[..., Any]] = None,
        disable_tp_imbalance_check: bool = True,
    ):
        self.config = config
        self.state = MemoryState(engine_tags(config))
        self._child_pids: List[int] = []
        self._closed = False
        if engine_factory is None:
            from sglang.srt.entrypoints.engine import Engine as engine_factory  # noqa: N813

        before = _child_pids()
        with patched_environ(engine_env_updates(disable_tp_imbalance_check=disable_tp_imbalance_check)):
            self._engine = engine_factory(**config.to_server_args())
        self._child_pids = sorted(_child_pids() - before)
        # SGLang registers Engine.shutdown with atexit; it would kill every child of the host.
        shutdown = getattr(self._engine, "shutdown", None)
        if shutdown is not None:
            atexit.unregister(shutdown)
        atexit.register(self.shutdown)
        logger.info("SGLang engine up: tp=%d, child processes %s", config.tensor_model_parallel_size, self._child_pids)

    @property
    def tags(self) -> tuple:
        """Tags of this engine's memory regions."""
        return self.state.tags

    # ----------------------------------------------------------------- generation
    def generate(
        self,
        input_ids: List[List[int]],
        sampling_params: Optional[Dict[str, Any]] = None,
        n: int = 1,
        return_logprob: bool = True,
    ) -> List[List[Generation]]:
        """Sample ``n`` completions for each prompt.

        Args:
            input_ids: prompts as token-id lists, batch of B.
            sampling_params: SGLang sampling params (``temperature``, ``top_p``, ``max_new_tokens``, ...).
            n: samples per prompt, >= 1.
            return_logprob: also return each sampled token's log-probability.

        Returns:
            B lists of ``n`` :class:`Generation` each, in prompt order.

        Raises:
            MemoryStateError: a memory region is released (call wake up first).
            ValueError: ``n`` < 1 or an empty batch.
        """
        batch = _expand(input_ids, n)
        with self.state.request():
            outs = self._engine.generate(
                input_ids=batch, sampling_params=dict(sampling_params or {}), return_logprob=return_logprob
            )
        return _group(outs, n, return_logprob)

    async def async_generate(
        self,
        input_ids: List[List[int]],
        sampling_params: Optional[Dict[str, Any]] = None,
        n: int = 1,
        return_logprob: bool = True,
    ) -> List[List[Generation]]:
        """:meth:`generate` for code that runs inside an event loop (a Ray async actor, say).

        Concurrent calls are batched by SGLang's scheduler. Same arguments, return value and errors
        as :meth:`generate`.
        """
        batch = _expand(input_ids, n)
        with self.state.request():
            outs = await self._engine.async_generate(
                input_ids=batch, sampling_params=dict(sampling_params or {}), return_logprob=return_logprob
            )
        return _group(outs, n, return_logprob)

    async def async_release(self, tags: Optional[Sequence[str]] = None) -> List[str]:
        """:meth:`release` from inside an event loop (SGLang's tokenizer-manager coroutine)."""
        tags = self.state.begin_release(tags)
        await self._engine.tokenizer_manager.release_memory_occupation(_req("ReleaseMemoryOccupationReqInput", tags=tags), None)
        self.state.commit(tags, released=True)
        return tags

    async def async_resume(self, tags: Optional[Sequence[str]] = None) -> List[str]:
        """:meth:`resume` from inside an event loop."""
        tags = self.state.begin_resume(tags)
        await self._engine.tokenizer_manager.resume_memory_occupation(_req("ResumeMemoryOccupationReqInput", tags=tags), None)
        self.state.commit(tags, released=False)
        return tags

    async def async_update_weights_from_tensor(self, payloads: list, load_format: Optional[str] = None, flush_cache: bool = False):
        """:meth:`update_weights_from_tensor` from inside an event loop; returns ``(success, message)``."""
        if self.state.is_released(WEIGHTS):
            raise MemoryStateError("weights are released: resume 'weights' before loading new weights")
        req = _req("UpdateWeightsFromTensorReqInput", serialized_named_tensors=payloads, load_format=load_format,
                   flush_cache=flush_cache)
        return await self._engine.tokenizer_manager.update_weights_from_tensor(req, None)

    async def async_flush_cache(self) -> None:
        """:meth:`flush_cache` from inside an event loop."""
        if not self.state.is_released(KV_CACHE):
            await self._engine.tokenizer_manager.flush_cache()

    # ----------------------------------------------------------------- memory
    def release(self, tags: Optional[Sequence[str]] = None) -> List[str]:
        """Release the memory of ``tags`` (None: all of this engine's tags).

        Returns:
            the tags released.

        Raises:
            MemoryStateError: a tag is already released or unknown, or requests are running. Nothing
                reaches the engine then, so it keeps serving.
        """
        tags = self.state.begin_release(tags)
        self._engine.release_memory_occupation(tags=tags)
        self.state.commit(tags, released=True)
        return tags

    def resume(self, tags: Optional[Sequence[str]] = None) -> List[str]:
        """Resume the memory of ``tags`` (None: all of this engine's tags).

        Returns:
            the tags resumed.

        Raises:
            MemoryStateError: a tag is resident or unknown. Nothing reaches the engine then.
        """
        tags = self.state.begin_resume(tags)
        self._engine.resume_memory_occupation(tags=tags)
        self.state.commit(tags, released=False)
        return tags

    # ----------------------------------------------------------------- weights
    def update_weights_from_tensor(self, named_tensors: list, load_format: Optional[str] = None, flush_cache: bool = True):
        """SGLang's ``Engine.update_weights_from_tensor``, refused while the weights are released.

        Args:
            named_tensors: for ``load_format="flattened_bucket"``, one serialized payload (bytes) per TP
                rank; see :mod:`sgl_rollout.weight_sync`.

        Returns:
            SGLang's ``(success, message)``.

        Raises:
            MemoryStateError: the ``weights`` tag is released (the copy would land in freed memory).
        """
        if self.state.is_released(WEIGHTS):
            raise MemoryStateError("weights are released: resume 'weights' before loading new weights")
        return self._engine.update_weights_from_tensor(named_tensors, load_format=load_format, flush_cache=flush_cache)

    def flush_cache(self) -> None:
        """Drop SGLang's prefix (radix) cache, stale after new weights.

        Skipped while the KV cache is released: SGLang flushed it when it released the KV cache.
        """
        if self.state.is_released(KV_CACHE):
            return  # nothing cached: the KV cache was flushed when it was released
        self._engine.flush_cache()

    def server_info(self) -> Dict[str, Any]:
        """SGLang's ``Engine.get_server_info()``: server args plus scheduler info such as
        ``max_total_num_tokens`` (KV-cache capacity in tokens)."""
        return self._engine.get_server_info()

    # ----------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Stop the engine's processes, and only those. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        tm = getattr(self._engine, "tokenizer_manager", None)
        watchdog = getattr(tm, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        _kill_trees(self._child_pids)
        logger.info("SGLang engine stopped (processes %s)", self._child_pids)

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _req(cls_name: str, **fields):
    """An SGLang request object (``sglang/srt/managers/io_struct.py``) for the tokenizer manager."""
    from sglang.srt.managers import io_struct

    return getattr(io_struct, cls_name)(**fields)


def _expand(input_ids: List[List[int]], n: int) -> List[List[int]]:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not input_ids:
        raise ValueError("empty batch")
    return [list(p) for p in input_ids for _ in range(n)]


def _group(outs: List[Dict[str, Any]], n: int, with_logprob: bool) -> List[List[Generation]]:
    if isinstance(outs, dict):  # SGLang returns a bare dict for a batch of one
        outs = [outs]
    gens = [_to_generation(o, with_logprob) for o in outs]
    return [gens[i : i + n] for i in range(0, len(gens), n)]


def _to_generation(out: Dict[str, Any], with_logprob: bool) -> Generation:
    meta = out.get("meta_info", {})
    finish = meta.get("finish_reason")
    logprobs: List[float] = []
    if with_logprob:
        logprobs = [float(lp) for lp, _tok, *_ in meta.get("output_token_logprobs", [])]
    return Generation(
        output_ids=list(out["output_ids"]),
        logprobs=logprobs,
        finish_reason=finish.get("type") if isinstance(finish, dict) else finish,
    )


__all__ = [
    "Generation",
    "MemoryStateError",
    "RolloutEngine",
    "engine_env_updates",
    "engine_tags",
    "patched_environ",
    "strip_expandable_segments",
]
