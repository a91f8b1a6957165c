"""SGLang's ``update_weights_from_tensor(load_format="flattened_bucket")``: the weights in flattened buckets.

Per bucket: flatten into one GPU buffer (CPU tensors move to the GPU here, one bucket at a time),
serialize the buffer's IPC handle with the device UUID (:mod:`.ipc`), hand SGLang one payload per
TP rank, wait for the call to return (the scheduler has then copied the bucket into its weights), drop
the buffer and ``torch.cuda.ipc_collect()``. So the extra memory on the sending side is one bucket at a
time. SGLang rebuilds each bucket with its ``FlattenedTensorBucket`` (``sglang/srt/weight_sync/
tensor_bucket.py``) and runs the model's ``load_weights`` on the tensors.

* :func:`send_flattened_buckets`: the whole sync in this process (the in-process worker), as bucket
  rounds (:mod:`.protocol`) over a :class:`BucketStream`;
* :class:`BucketStream`: one payload per call, for a sync driven from outside (a Ray driver, verl's TP
  leader).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, List, Mapping, Optional, Protocol, Union

import torch

from .. import trace
from .bucket import NamedTensor, flatten_bucket, iter_buckets
from .ipc import serialize
from .protocol import SyncStats, bucket_rounds


class TensorUpdateTarget(Protocol):
    """What the sender needs of an engine: SGLang's ``Engine`` and :class:`sgl_rollout.engine.RolloutEngine` fit."""

    def update_weights_from_tensor(self, named_tensors: list, load_format: Optional[str] = None, flush_cache: bool = True):
        """Load one payload per TP rank."""

    def flush_cache(self):
        """Drop the prefix cache (stale after new weights)."""


def send_flattened_buckets(
    engine: TensorUpdateTarget,
    named_tensors: Iterable[NamedTensor],
    bucket_bytes: int,
    tp_size: int = 1,
    device: Optional[Union[int, str, torch.device]] = None,
    on_bucket: Optional[Callable[[int, int], None]] = None,
    validator=None,
    group_of: Optional[Callable[[str], object]] = None,
) -> SyncStats:
    """Send ``named_tensors`` to ``engine`` in flattened buckets of at most ``bucket_bytes``.

    Every TP rank gets the same payload (the full tensors; SGLang's weight loaders take each
    rank's shard). With several senders, one per TP rank (as under Ray), use :func:`make_payload`
    on each and gather the payloads in rank order instead.

    Args:
        engine: target with ``update_weights_from_tensor`` and ``flush_cache``.
        named_tensors: (name, tensor) pairs in HF naming; CPU or CUDA, any dtypes, consumed lazily.
        bucket_bytes: most bytes per bucket (a larger tensor travels alone).
        tp_size: number of TP ranks of the engine.
        device: device for the buffers; None: ``torch.cuda.current_device()`` (the CPU without CUDA).
        on_bucket: called after each bucket with (bucket index, bytes) (progress reporting).
        validator: optional :class:`~.manifest.SyncValidator`; each tensor is checked as it is
            bucketed and a bucket with a bad tensor is never sent (see :func:`~.bucket.iter_buckets`).
        group_of: optional function of a name; a bucket closes where its value changes (a layered
            sync passes :func:`~.layered.layer_index`).

    Returns:
        SyncStats of the sync.

    Raises:
        RuntimeError: the engine reports a failed load (its message is included). The engine's
            weights may then be partly updated (SGLang says so too); sync again before generating.
        SyncValidationError: ``validator`` refused a tensor; nothing of that bucket was sent.
    """
    stream = BucketStream(named_tensors, bucket_bytes, device=device, validator=validator, group_of=group_of)
    t0 = time.perf_counter()

    def load(payloads: list, bucket: int) -> None:
        raise_on_failure(engine.update_weights_from_tensor(payloads, load_format="flattened_bucket", flush_cache=False))
        if on_bucket is not None:
            on_bucket(bucket, stream.last_bucket_bytes)

    try:
        bucket_rounds(next_round=lambda _bucket: [stream.next_payload()] * tp_size, load=load,
                      release=lambda _bucket: stream.release())
    finally:
        stream.release()
    if stream.stats.n_buckets:
        engine.flush_cache()
    stats = stream.stats
    stats.seconds = time.perf_counter() - t0
    return stats


def make_payload(bucket: List[NamedTensor], device: Optional[Union[int, str, torch.device]] = None):
    """Flatten one bucket and serialize it for one TP rank.

    Returns:
        (payload bytes, FlatBucket). Keep the FlatBucket alive until the engine call that uses the
        payload has returned.
    """
    flat = flatten_bucket(bucket, device=device)
    return serialize(flat.payload()), flat


def raise_on_failure(result) -> None:
    """Raise when SGLang's ``(success, message)`` answer says the load failed: a failure must not pass
    silently (garbled output).

    Raises:
        RuntimeError: ``success`` is False (SGLang's message included).
    """
    if isinstance(result, tuple) and len(result) >= 2 and result[0] is False:
        raise RuntimeError(f"SGLang failed to load a weight bucket: {result[1]}")


class BucketStream:
    """Trainer side of a sync driven from outside (a Ray driver, a TP leader): one payload per call.

    ``next_payload()`` flattens the next bucket on this process's GPU and returns its serialized payload;
    the buffer stays alive until ``release()``, which the driver calls once the engine has loaded the
    bucket. So this process holds at most ``max_held`` buckets of extra memory: 1 for a driver that
    waits for each load before the next bucket, 2 for one that flattens the next bucket while the
    engine loads the last (it then releases with ``keep_newest=True``).

    Args:
        named_tensors: (name, tensor) pairs, consumed lazily.
        bucket_bytes: most bytes per bucket.
        device: device for the buffers; None: the current CUDA device (the CPU without CUDA).
        manifest: optional :class:`~.manifest.WeightManifest`; every tensor is checked against it as
            it is bucketed, and :meth:`next_payload` raises
            :class:`~.manifest.SyncValidationError` instead of returning a bad bucket.
        partial: with a manifest, allow a sync that leaves some weights out (default: a full sync).
        validator: a :class:`~.manifest.SyncValidator` to check with instead of one made from
            ``manifest`` (the caller keeps its state, e.g. what a full sync still misses).
        group_of: optional function of a name; a bucket closes where its value changes (layered sync).
        max_held: most buckets held (not yet released) at once, >= 1.
    """

    def __init__(self, named_tensors: Iterable[NamedTensor], bucket_bytes: int,
                 device: Optional[Union[int, str, torch.device]] = None, manifest=None, partial: bool = False,
                 group_of: Optional[Callable[[str], object]] = None, max_held: int = 1, validator=None):
        if max_held < 1:
            raise ValueError(f"max_held must be >= 1, got {max_held}")
        if device is None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        if isinstance(named_tensors, Mapping):
            raise TypeError("named_tensors is a dict: pass dict.items() (or model.named_parameters())")
        if validator is None and manifest is not None:
            from .manifest import SyncValidator

            validator = SyncValidator(manifest, partial=partial)
        self._buckets = iter_buckets(named_tensors, bucket_bytes, validator=validator, group_of=group_of)
        self._device = device
        self._max_held = max_held
        self._held: List[torch.Tensor] = []
        self.stats = SyncStats()
        #: tensor bytes (no padding) of the last bucket :meth:`next_payload` returned
        self.last_bucket_bytes = 0

    @property
    def held(self) -> int:
        """Buckets flattened and not yet released."""
        return len(self._held)

    @trace.traced("rollout.bucket")
    def next_payload(self) -> Optional[bytes]:
        """Serialized payload of the next bucket, or None when all were sent.

        Raises:
            RuntimeError: ``max_held`` buckets are held (release one first).
            SyncValidationError: the manifest refused a tensor of the next bucket (nothing returned).
        """
        if len(self._held) >= self._max_held:
            raise RuntimeError(f"release() a bucket first ({len(self._held)} held, at most {self._max_held})")
        bucket = next(self._buckets, None)
        if bucket is None:
            return None
        data, flat = make_payload(bucket, device=self._device)
        self._held.append(flat)
        self.last_bucket_bytes = self.stats.add(flat)
        return data

    def release(self, keep_newest: bool = False) -> None:
        """Drop the held buckets' buffers (the engine has copied them), all or all but the newest, and
        collect closed IPC blocks."""
        dropped = len(self._held) - (1 if keep_newest and self._held else 0)
        if dropped <= 0:
            return
        del self._held[:dropped]
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
