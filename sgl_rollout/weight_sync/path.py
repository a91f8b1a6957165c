"""Which transport a weight sync takes, and the weight manifest both transports and validation read.

One :class:`SyncPath` per sender (the in-process worker, each verl trainer worker) reads the model's
:class:`~.manifest.WeightManifest` once and decides, once, between

* the copy-plan fast path (:mod:`.fast_path`: SGLang's ``update_weights_from_tensor`` with this
  package's in-scheduler loader as ``load_format``), which needs CUDA, the manifest (the copy plan is
  made from it) and every TP rank's GPU; and
* SGLang's flattened buckets (:mod:`.flattened_bucket`: ``update_weights_from_tensor`` with
  ``load_format="flattened_bucket"``), which need neither.

Every TP rank of a replica must take the same path: a sender whose ranks live in several processes
passes ``agree`` (an all-gather of each rank's reason), so one rank's refusal sends them all the
flattened way.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Iterator, List, Optional, Sequence

from ..checkpoint_names import checkpoint_mappings
from .manifest import WeightManifest

logger = logging.getLogger(__name__)


class SyncPath:
    """The manifest of a model and the choice of the weight sync's transport, made once.

    Args:
        config: the :class:`~sgl_rollout.config.RolloutConfig` (``validate_sync``, ``fast_sync``,
            ``model_path``).
        model_path: where the manifest is read from; None: ``config.model_path``.
        trust_remote_code: passed to :meth:`WeightManifest.from_pretrained`.
        no_manifest: a reason the weights on the wire do not match the checkpoint (verl's FP8
            quantization on the way renames and re-types them): no manifest, so no validation and no
            fast path.
    """

    def __init__(self, config, model_path: Optional[str] = None, trust_remote_code: bool = False,
                 no_manifest: Optional[str] = None):
        self.config = config
        self.model_path = model_path or config.model_path
        self.trust_remote_code = trust_remote_code
        self.no_manifest = no_manifest
        self._manifest: Optional[WeightManifest] = None
        self._manifest_read = False
        self._fast: Optional[bool] = None
        self._renamer: Optional[Callable[[str], str]] = None
        self._tensor_renamer = None
        self._renamer_read = False

    def _read_renamers(self) -> None:
        """Read the checkpoint-name mappings of the model once (:func:`checkpoint_mappings`, never raises)."""
        if not self._renamer_read:
            self._renamer_read = True
            self._renamer, self._tensor_renamer = checkpoint_mappings(
                self.model_path, trust_remote_code=self.trust_remote_code)
            if self._tensor_renamer is not None:
                logger.info("weight syncs to %s rename transformers' parameter names (and split fused experts) "
                            "to the checkpoint's", self.model_path)

    def checkpoint_name(self, name: str) -> str:
        """``name`` as the checkpoint (and the manifest and SGLang's loader) spell it: a transformers >= 5
        runtime name renamed back (:mod:`sgl_rollout.checkpoint_names`, e.g. Qwen2.5-VL's ``model.visual.*`` ->
        ``visual.*``); unchanged for models whose names need no change. The mapping is read once. A fused
        expert parameter is no one name: :meth:`renamed` splits it."""
        self._read_renamers()
        return name if self._renamer is None else self._renamer(name)

    def renamed(self, named_tensors: Iterable) -> Iterator:
        """``named_tensors`` lazily, each ``(str, tensor)`` pair under its checkpoint name
        (:meth:`checkpoint_name`), and a transformers >= 5 fused expert parameter (Qwen3-MoE's
        ``mlp.experts.gate_up_proj`` ``(E, 2*I, H)``, ``down_proj`` ``(E, H, I)``) as its per-expert
        checkpoint tensors, views of it (:func:`~sgl_rollout.checkpoint_names.tensor_renamer`); any other
        item passes unchanged (the bucketing refuses it with its reason).

        Raises:
            ValueError: a fused parameter whose shape does not fit transformers' fusion of it.
        """
        self._read_renamers()
        for item in named_tensors:
            ok = isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
            if ok and self._tensor_renamer is not None:
                yield from self._tensor_renamer(item[0], item[1])
            else:
                yield item

    @property
    def manifest(self) -> Optional[WeightManifest]:
        """The model's weight manifest, read once; None when ``validate_sync`` is off, ``no_manifest``
        was given, or it cannot be read (logged once: a sync without validation beats no sync)."""
        if not self._manifest_read:
            self._manifest_read = True
            if self.config.validate_sync and not self.no_manifest:
                try:
                    self._manifest = WeightManifest.from_pretrained(self.model_path,
                                                                    trust_remote_code=self.trust_remote_code)
                except Exception as exc:  # noqa: BLE001 - a sync without validation beats no sync
                    logger.warning("no weight manifest for %s (%r): weight syncs are not validated",
                                   self.model_path, exc)
        return self._manifest

    @manifest.setter
    def manifest(self, value: Optional[WeightManifest]) -> None:
        self._manifest, self._manifest_read = value, True
        self._fast = None

    def fast_refusal(self, device_ids: Sequence[int] = ()) -> Optional[str]:
        """Why this sender cannot take the fast path (None: it can): ``fast_sync`` off, no CUDA, no
        manifest, or one of ``device_ids`` (the TP ranks' GPUs this sender writes to) not visible."""
        import torch

        if not self.config.fast_sync:
            return "fast_sync is off"
        if not torch.cuda.is_available():
            return "no CUDA device in this process"
        if self.manifest is None:
            why = self.no_manifest or "validate_sync off or unreadable"
            return f"no weight manifest ({why}): the copy plan is made from it"
        if device_ids and max(device_ids) >= torch.cuda.device_count():
            return f"TP ranks' GPUs {list(device_ids)} are not all visible here"
        return None

    def fast(self, device_ids: Sequence[int] = (), agree: Optional[Callable[[str], List[str]]] = None) -> bool:
        """True when the sync takes the fast path; decided on the first call, the reason logged once.

        Args:
            device_ids: the TP ranks' GPUs this sender writes to.
            agree: ``(this rank's reason or "") -> every rank's``, for a replica whose TP ranks send from
                several processes (a collective: every rank must call :meth:`fast` together; not
                called when ``fast_sync`` is off, which every rank's config says alike).
        """
        if self._fast is None:
            if not self.config.fast_sync:  # the same on every rank: no collective needed to agree
                self._fast = False
                logger.info("weight syncs go through SGLang's flattened buckets: fast_sync is off")
                return False
            reason = self.fast_refusal(device_ids) or ""
            reasons = [r for r in (agree(reason) if agree is not None else [reason]) if r]
            self._fast = not reasons
            if reasons:  # the fast path was asked for (the default) and cannot be had
                logger.warning("weight syncs go through SGLang's flattened buckets: %s", reasons[0])
        return self._fast
