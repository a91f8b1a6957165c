"""Stream named tensors to an SGLang engine as flattened buckets over CUDA IPC.

Per bucket: flatten into one GPU buffer (CPU tensors move to the GPU here, one bucket at a time),
serialize the buffer's IPC handle with the device UUID (:mod:`.ipc`), hand SGLang one payload per
TP rank (``update_weights_from_tensor(load_format="flattened_bucket")``), wait for the call to
return (the scheduler has then copied the bucket into its weights), drop the buffer and
``torch.cuda.ipc_collect()``. So the extra memory on the sending side is one bucket at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, List, Mapping, Optional, Protocol, Union

import torch

from .bucket import NamedTensor, flatten_bucket, iter_buckets
from .ipc import serialize


class TensorUpdateTarget(Protocol):
    """What the sender needs of an engine: SGLang's ``Engine`` and :class:`sgl_rollout.engine.RolloutEngine` fit."""

    def update_weights_from_tensor(self, named_tensors: list, load_format: Optional[str] = None, flush_cache: bool = True):
        """Load one payload per TP rank."""

    def flush_cache(self):
        """Drop the prefix cache (stale after new weights)."""


@dataclass
class SyncStats:
    """Figures of one weight sync.

    Attributes:
        n_tensors: tensors sent.
        n_buckets: buckets sent.
        bytes: bytes of tensor data sent (no padding).
        seconds: wall time of the whole sync, flush included.
        max_bucket_bytes: largest flat buffer allocated, padding included (the sender's extra peak).
    """

    n_tensors: int = 0
    n_buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0
    max_bucket_bytes: int = 0

    def add(self, flat) -> int:
        """Count one sent :class:`~.bucket.FlatBucket`; returns its tensor bytes (no padding)."""
        nbytes = sum(m.end_idx - m.start_idx for m in flat.metadata)
        self.n_buckets += 1
        self.n_tensors += len(flat.metadata)
        self.bytes += nbytes
        self.max_bucket_bytes = max(self.max_bucket_bytes, flat.nbytes)
        return nbytes

    @property
    def gb_per_s(self) -> float:
        """Throughput in GB/s (1e9 bytes), 0 when nothing was timed."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def send_flattened_buckets(
    engine: TensorUpdateTarget,
    named_tensors: Iterable[NamedTensor],
    bucket_bytes: int,
    tp_size: int = 1,
    device: Optional[Union[int, str, torch.device]] = None,
    on_bucket: Optional[Callable[[int, int], None]] = None,
    validator=None,
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

    Returns:
        SyncStats of the sync.

    Raises:
        RuntimeError: the engine reports a failed load (its message is included). The engine's
            weights may then be partly updated (SGLang says so too); sync again before generating.
        SyncValidationError: ``validator`` refused a tensor; nothing of that bucket was sent.
    """
    if device is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    stats = SyncStats()
    t0 = time.perf_counter()
    for i, bucket in enumerate(iter_buckets(named_tensors, bucket_bytes, validator=validator)):
        data, flat = make_payload(bucket, device=device)
        result = engine.update_weights_from_tensor([data] * tp_size, load_format="flattened_bucket", flush_cache=False)
        _raise_on_failure(result)
        nbytes = stats.add(flat)
        del flat, data, bucket
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
        if on_bucket is not None:
            on_bucket(i, nbytes)
    if stats.n_buckets:
        engine.flush_cache()
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


def _raise_on_failure(result) -> None:
    # SGLang's Engine returns (success, message); a failure must not pass silently (garbled output).
    if isinstance(result, tuple) and len(result) >= 2 and result[0] is False:
        raise RuntimeError(f"SGLang failed to load a weight bucket: {result[1]}")


class BucketStream:
    """Trainer side of a sync driven from outside (a Ray driver, a TP leader): one payload per call.

    ``next_payload()`` flattens the next bucket on this process's GPU and returns its serialized payload;
    the buffer stays alive until ``release()``, which the driver calls once the engine has loaded the
    bucket. So this process holds at most one bucket of extra memory.

    Args:
        named_tensors: (name, tensor) pairs, consumed lazily.
        bucket_bytes: most bytes per bucket.
        device: device for the buffers; None: the current CUDA device (the CPU without CUDA).
        manifest: optional :class:`~.manifest.WeightManifest`; every tensor is checked against it as
            it is bucketed, and :meth:`next_payload` raises
            :class:`~.manifest.SyncValidationError` instead of returning a bad bucket.
        partial: with a manifest, allow a sync that leaves some weights out (default: a full sync).
    """

    def __init__(self, named_tensors: Iterable[NamedTensor], bucket_bytes: int,
                 device: Optional[Union[int, str, torch.device]] = None, manifest=None, partial: bool = False):
        if device is None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        if isinstance(named_tensors, Mapping):
            raise TypeError("named_tensors is a dict: pass dict.items() (or model.named_parameters())")
        validator = None
        if manifest is not None:
            from .manifest import SyncValidator

            validator = SyncValidator(manifest, partial=partial)
        self._buckets = iter_buckets(named_tensors, bucket_bytes, validator=validator)
        self._device = device
        self._held = None
        self.stats = SyncStats()

    def next_payload(self) -> Optional[bytes]:
        """Serialized payload of the next bucket, or None when all were sent.

        Raises:
            RuntimeError: the previous bucket was not released.
            SyncValidationError: the manifest refused a tensor of the next bucket (nothing returned).
        """
        if self._held is not None:
            raise RuntimeError("release() the previous bucket first")
        bucket = next(self._buckets, None)
        if bucket is None:
            return None
        data, self._held = make_payload(bucket, device=self._device)
        self.stats.add(self._held)
        return data

    def release(self) -> None:
        """Drop the current bucket's buffer (the engine has copied it) and collect closed IPC blocks."""
        self._held = None
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
