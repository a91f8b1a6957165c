"""The rollout worker: one engine, its switch (:mod:`sgl_rollout.switch`) and its weight sync.

:meth:`RolloutWorker.update_weights` is the staged wake (:meth:`~sgl_rollout.switch.Switch.wake`) with
the weight sync and the trainer's offload as its hooks: resume ``weights`` (on the fast path the first
bucket is gathered meanwhile, :meth:`FastPathSender.gather_ahead`) -> stream the new weights over
CUDA IPC (the copy-plan fast path when ``config.fast_sync``, CUDA and the weight manifest allow it, else
SGLang's flattened buckets; with ``free_cache_engine`` the fast path's buffer is freed right after) ->
offload the trainer -> empty the cache -> resume the KV cache.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import ItemsView, Mapping
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .config import RolloutConfig
from .engine import Generation, RolloutEngine
from .memory import WEIGHTS, MemoryTimeline, freeze_long_lived
from .switch import Hook, Switch
from .weight_sync import SyncStats, send_flattened_buckets
from .weight_sync.bucket import NamedTensor
from .weight_sync.driver import EngineFence, sync_fenced
from .weight_sync.fast_path import FastPathError, FastPathSender
from .weight_sync.layered import layer_index
from .weight_sync.manifest import SyncValidationError, SyncValidator, WeightManifest
from .weight_sync.path import SyncPath

logger = logging.getLogger(__name__)


class RolloutWorker:
    """One rollout engine and its memory life cycle.

    Args:
        config: rollout settings (``free_cache_engine``, ``sleep_level``, bucket size, ...).
        engine: a started :class:`RolloutEngine`; None starts one from ``config``.
        timeline: where phases are recorded; None makes a new :class:`MemoryTimeline`.

    Attributes:
        timeline: device memory after each phase (``sleep``, ``resume_weights``, ``sync``,
            ``offload_trainer``, ``empty_cache``, ``resume_kv_cache``, ``wake_up``).
        last_phase_seconds: seconds each phase of the last sleep or wake took; on the fast path also
            ``sync.gather`` (within it ``sync.gather.alloc``, ``.read``, ``.copy``, ``.serialize`` and ``.wait``),
            ``sync.call`` (split into ``sync.call.request``, ``sync.call.loader`` and
            ``sync.call.reply``) and ``sync.check`` (the sender's
            :attr:`~sgl_rollout.weight_sync.fast_path.FastPathSender.timings`), and ``empty_cache.*``.
    """

    def __init__(
        self,
        config: RolloutConfig,
        engine: Optional[RolloutEngine] = None,
        timeline: Optional[MemoryTimeline] = None,
    ):
        self.config = config
        self.engine = engine if engine is not None else RolloutEngine(config)
        self.timeline = timeline if timeline is not None else MemoryTimeline()
        self.switch = Switch(self.engine, config, self.timeline)
        self.sync_path = SyncPath(config)
        self._fast: Optional[FastPathSender] = None
        self.timeline.record("engine_ready")
        freeze_long_lived()  # torch/SGLang/transformers objects leave later full collections (memory.py)
        self._frozen_trainer = False

    @property
    def last_phase_seconds(self) -> Dict[str, float]:
        """Seconds of each phase of the last sleep or wake (:attr:`Switch.last_phase_seconds`)."""
        return self.switch.last_phase_seconds

    @last_phase_seconds.setter
    def last_phase_seconds(self, value: Dict[str, float]) -> None:
        self.switch.last_phase_seconds = value

    @property
    def last_empty_cache(self) -> Dict:
        """The last wake's empty-cache rounds (:attr:`Switch.last_empty_cache`)."""
        return self.switch.last_empty_cache

    @property
    def manifest(self) -> Optional[WeightManifest]:
        """The model's weight manifest (:attr:`SyncPath.manifest <sgl_rollout.weight_sync.path.SyncPath.manifest>`:
        read once from ``config.model_path``), or None when ``validate_sync`` is off or it cannot be read."""
        return self.sync_path.manifest

    @manifest.setter
    def manifest(self, value: Optional[WeightManifest]) -> None:
        self.sync_path.manifest = value

    def _fast_sender(self) -> Optional[FastPathSender]:
        """The fast-path sender, or None (then the flattened path) as :class:`SyncPath` decides: ``fast_sync``
        off, no CUDA, no manifest, or a TP rank's GPU not visible to this process."""
        if self._fast is not None:
            return self._fast
        args = self.config.engine_kwargs
        base, step = int(args.get("base_gpu_id", 0)), int(args.get("gpu_id_step", 1))
        ids = [base + r * step for r in range(self.config.tensor_model_parallel_size)]
        if not self.sync_path.fast(ids):
            return None
        self._fast = FastPathSender(self.engine, self.manifest, self.config.bucket_bytes,
                                    devices=[torch.device("cuda", i) for i in ids])
        return self._fast

    @property
    def asleep(self) -> bool:
        """True while any memory region is released."""
        return bool(self.engine.state.released)

    # ----------------------------------------------------------------- API
    def generate(self, input_ids: List[List[int]], sampling_params: Optional[dict] = None, n: int = 1,
                 return_logprob: bool = True, lora_path: Optional[str] = None,
                 image_data: Optional[List[Optional[list]]] = None) -> List[List[Generation]]:
        """Sample ``n`` completions per prompt; see :meth:`RolloutEngine.generate` (``lora_path``: a loaded
        adapter's name, e.g. :meth:`update_adapter`'s ``name``; ``image_data``: None, or per prompt None or
        its images, in the order of their placeholder runs in its ids)."""
        mm = {} if image_data is None else {"image_data": image_data}
        return self.engine.generate(input_ids, sampling_params, n=n, return_logprob=return_logprob,
                                    lora_path=lora_path, **mm)

    def update_adapter(self, adapter, peft_config, base_weights=None, offload_trainer=None, name: str = "policy"):
        """Staged wake with a LoRA adapter sync; base weights travel only when the engine lacks them
        (:func:`sgl_rollout.weight_sync.lora.update_adapter`, where the rule and its errors are).

        Returns:
            AdapterSyncStats.
        """
        from .weight_sync.lora import update_adapter

        return update_adapter(self, adapter, peft_config, base_weights=base_weights,
                              offload_trainer=offload_trainer, name=name)

    def sleep(self) -> List[str]:
        """Release GPU memory per ``sleep_level``; nothing when ``free_cache_engine`` is False
        (:meth:`Switch.sleep <sgl_rollout.switch.Switch.sleep>`).

        Returns:
            the tags released.

        Raises:
            MemoryStateError: already asleep, or requests are running.
            FastPathError: before a level-2 release, the engine could not close the fast path's
                buffers (nothing was released; the engine refuses generates until a complete sync).
        """
        return self.switch.sleep(before_release=self._free_sync_buffers_before)

    def _free_sync_buffers_before(self, tags: List[str]) -> Optional[str]:
        """Before the weights are released: free buffers a sync whose close failed has left (a good
        sync freed them already). Returns the phase name when it freed something."""
        return "release_sync_buffers" if WEIGHTS in tags and self._release_sync_buffers() else None

    def _release_sync_buffers(self) -> bool:
        """Free the fast path's buffers, if held: the engine closes its IPC handles first (op ``release``;
        2 ms for a 2 GiB buffer on an H100), then the sender drops them. True when it freed them."""
        if self._fast is None or not self._fast.holds_buffers:
            return False
        sync_fenced(EngineFence(self.engine), self._fast.release)
        return True

    def wake_up(self) -> List[str]:
        """Resume every released region without a weight sync (weights first, then KV cache).

        With ``sleep_level=2`` and no ``enable_weights_cpu_backup`` the weights come back with
        undefined contents: use :meth:`update_weights` instead, which syncs between the stages. After an
        :meth:`update_weights` that resumed them and then failed or was interrupted, generates are
        refused (MemoryStateError) until a complete sync.

        Returns:
            the tags resumed.
        """
        before = set(self.engine.state.released)
        if WEIGHTS in before and not self.config.enable_weights_cpu_backup:
            logger.warning("waking up released weights without a sync or CPU backup: their contents are undefined")
        self.switch.wake(empty_cache=False)
        return [t for t in self.engine.tags if t in before and t not in self.engine.state.released]

    def update_weights(
        self,
        named_tensors: Iterable[NamedTensor],
        offload_trainer: Optional[Callable[[], None]] = None,
        partial: bool = False,
        after_sync: Sequence[Hook] = (),
    ) -> SyncStats:
        """Staged wake with a weight sync (see the module docstring for the order).

        Works asleep or awake: stages whose tags are resident are skipped, so with
        ``free_cache_engine=False`` nothing is released or resumed, only synced.

        Every tensor is checked against :attr:`manifest` before any byte of it reaches the engine: a
        list, tuple or ``dict.items()`` is checked whole before anything is resumed or sent; a lazy
        iterator bucket by bucket (a refused bucket is never sent, but earlier buckets were). From
        the first byte sent until the sync completes, no generate is admitted; a sync that fails after
        sending leaves the engine refusing generates until a complete sync.

        Args:
            named_tensors: (name, tensor) in Hugging Face naming (a transformers >= 5 model's own names
                are renamed to its checkpoint's, :meth:`SyncPath.renamed`), CPU or CUDA, consumed lazily. With
                ``config.layered_summon``, pass :func:`~sgl_rollout.weight_sync.layered.iter_layered`
                of the trainer's model (a generator: a list would gather everything first); buckets
                then close at decoder-layer boundaries.
            offload_trainer: called once the engine holds the new weights and before the KV cache
                returns; it should move the trainer's parameters, gradients and optimizer state off
                the GPU.
            partial: allow a sync of only some of the weights (default: every weight must come).
            after_sync: more ``(phase name, fn)`` hooks of the staged wake, run after the sync and
                before ``offload_trainer`` (the LoRA path loads its adapter there).

        Returns:
            SyncStats of the sync; per-phase seconds are in ``last_phase_seconds``.

        Raises:
            TypeError: ``named_tensors`` is a dict (pass ``.items()``).
            ValueError: an item is not a (str, Tensor) pair.
            SyncValidationError: unknown names, wrong shapes, non-floating dtypes, or (full sync)
                missing names, all listed; or an empty sync while the weights are released (they
                would come back undefined). The engine keeps serving its previous weights when the
                refusal came before the first byte.
            RuntimeError: SGLang failed to load a bucket (its weights may be partly new); on the fast
                path :class:`~sgl_rollout.weight_sync.fast_path.FastPathError` (the engine lives).
            MemoryStateError: requests run, or another operation is in progress.
        """
        if isinstance(named_tensors, Mapping):
            raise TypeError("named_tensors is a dict: pass dict.items() (or model.named_parameters())")
        self.engine.settle()  # a release/resume an interrupted caller sent is answered first
        materialised = isinstance(named_tensors, (list, tuple, ItemsView))
        renamed = self.sync_path.renamed(named_tensors)  # transformers >= 5 names -> the checkpoint's
        items = list(renamed) if materialised else renamed
        first = (items[0] if items else None) if materialised else next(items, None)
        if first is None and WEIGHTS in self.engine.state.released:
            raise SyncValidationError(
                ["empty weight sync (an empty or already consumed iterator?) while the weights are released: "
                 "they would come back with undefined contents; the engine stays asleep"])
        if not materialised and first is not None:
            items = itertools.chain([first], items)
        manifest = self.manifest
        validator = SyncValidator(manifest, partial=partial) if manifest is not None else None
        if materialised and validator is not None:
            validator.validate_all(items)  # everything refused before anything is resumed or sent
            validator = None
        hooks, overlap = self._sync_hooks(items, validator, partial)
        hooks += list(after_sync)
        if offload_trainer is not None:
            hooks.append(("offload_trainer", offload_trainer))
        stats = self.switch.wake(hooks, weights_undefined=True, while_resuming=overlap)["sync"]
        if not self._frozen_trainer:  # the trainer's model and optimizer exist now: freeze them too, once
            freeze_long_lived()
            self._frozen_trainer = True
        logger.info(
            "weight sync: %d tensors, %d buckets, %.1f MB in %.1f ms (%.1f GB/s)",
            stats.n_tensors, stats.n_buckets, stats.bytes / 1e6, stats.seconds * 1e3, stats.gb_per_s,
        )
        return stats

    def _sync_hooks(self, items, validator, partial: bool) -> Tuple[List[Hook], Optional[Callable[[], Optional[int]]]]:
        """The weight sync's hooks of :meth:`update_weights`' staged wake (``sync``; with ``free_cache_engine``
        on the fast path also ``release_sync_buffers``, which frees what a load-path sync kept: its buffer
        goes before the KV cache is back, not while the trainer runs), and on the fast path the work to run
        while the weights resume (:meth:`Switch.wake`'s ``while_resuming``): the first bucket gathered
        (:meth:`FastPathSender.gather_ahead`), returning the device memory that took."""
        fast = self._fast_sender()
        release = self.config.free_cache_engine and fast is not None
        ahead: list = [None]

        def gather_ahead() -> Optional[int]:
            before = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
            ahead[0] = fast.gather_ahead(items, validator)
            return torch.cuda.memory_reserved() - before if torch.cuda.is_available() else None

        hooks: List[Hook] = [("sync", lambda: self._send(items, validator, partial, release, ahead[0]))]
        if release:
            hooks.append(("release_sync_buffers", self._release_sync_buffers_kept_on_error))
        return hooks, (gather_ahead if fast is not None and not partial else None)

    def _send(self, items, validator, partial: bool, release: bool = False, ahead=None) -> SyncStats:
        """The sync hook of :meth:`update_weights`: every bucket inside the engine's sync fence, on the
        fast path (its timings land in ``last_phase_seconds`` as ``sync.*``; ``release``: its buffers freed
        with the last bucket; ``ahead``: its first bucket gathered while the weights resumed,
        :meth:`FastPathSender.send`) or SGLang's flattened one."""
        fast = self._fast_sender()
        group_of = layer_index if self.config.layered_summon else None

        def body() -> SyncStats:
            if fast is not None:
                return fast.send(items, validator=validator, partial=partial, group_of=group_of, release=release,
                                 ahead=ahead)
            return send_flattened_buckets(self.engine, items, bucket_bytes=self.config.bucket_bytes,
                                          tp_size=self.config.tensor_model_parallel_size,
                                          validator=validator, group_of=group_of)

        stats = sync_fenced(EngineFence(self.engine), body)
        if fast is not None:  # sync.gather / sync.call / sync.check: where the fast path's time went
            self.last_phase_seconds.update({f"sync.{k}": v for k, v in fast.timings.items()})
        return stats

    def _release_sync_buffers_kept_on_error(self) -> None:
        try:
            self._release_sync_buffers()
        except FastPathError as exc:  # the weights are in: keep the buffer, the sleep tries again
            logger.warning("fast-path buffers kept until the next sleep: %s", exc)

    def restart(self) -> None:
        """Start a fresh engine after a death (:class:`~sgl_rollout.engine.EngineDeadError`); all tags
        come back resident with the weights ``config.load_format`` gives: call :meth:`update_weights`
        with the trainer's weights before generating."""
        self.engine.restart()
        if self._fast is not None:
            self._fast.reset()
        self.timeline.record("engine_restarted")

    def shutdown(self) -> None:
        """Stop the engine (only its own processes) and free the sync buffers."""
        self.engine.shutdown()
        if self._fast is not None:
            self._fast.release(notify=False)
