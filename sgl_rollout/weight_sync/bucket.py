"""Group named tensors into buckets and flatten each bucket in SGLang's ``flattened_bucket`` format.

The receiving side is SGLang's ``ModelRunner._update_weights_from_flattened_bucket``
(``sglang/srt/model_executor/model_runner.py``): it rebuilds every tensor as
``flattened_tensor[start_idx:end_idx].view(dtype).reshape(shape)`` from a list of
``FlattenedTensorMetadata`` (``sglang/srt/weight_sync/tensor_bucket.py``). We build the buffer
ourselves instead of with ``torch.cat``: one allocation, one copy per tensor straight from its
source (CPU or GPU, contiguous or not), and each tensor starts on an ``ALIGN``-byte boundary so
``view(dtype)`` is valid for any mix of dtypes (a ``torch.cat`` of raw bytes breaks for an odd-sized
int8 tensor followed by a float32 one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

NamedTensor = Tuple[str, torch.Tensor]

#: Byte alignment of every tensor inside a flattened bucket.
ALIGN = 64


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's elements (``numel * element_size``), whatever its strides."""
    return t.numel() * t.element_size()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _checked_item(item) -> NamedTensor:
    if not (isinstance(item, tuple) and len(item) == 2):
        hint = " (iterating a dict gives its keys: pass dict.items())" if isinstance(item, str) else ""
        raise ValueError(f"expected (str, torch.Tensor) pairs, got {type(item).__name__} {str(item)[:60]!r}{hint}")
    name, tensor = item
    if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
        raise ValueError(f"expected (str, torch.Tensor), got ({type(name).__name__}, {type(tensor).__name__})")
    return name, tensor


def _hand_over(bucket: List[NamedTensor]) -> List[NamedTensor]:
    # A new list with the items, ``bucket`` emptied: ``yield _hand_over(bucket)`` leaves the generator
    # no reference to the yielded items (``yield bucket`` would keep one in its frame while suspended).
    out = list(bucket)
    bucket.clear()
    return out


def iter_buckets(
    named_tensors: Iterable[NamedTensor],
    bucket_bytes: int,
    validator=None,
    group_of: Optional[Callable[[str], Hashable]] = None,
) -> Iterator[List[NamedTensor]]:
    """Yield consecutive groups of ``(name, tensor)`` whose flattened size fits ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` travels alone in its own bucket. Order is kept. The input
    is consumed lazily, so a generator that materialises tensors (an FSDP full-tensor gather, say)
    holds at most one bucket of them at a time. Empty input yields nothing.

    While a bucket is out (the consumer flattens and loads it), the generator holds no reference to
    its tensors, so they are freed as soon as the consumer drops the list. The one tensor it does hold
    then is the look-ahead, the first tensor of the next bucket, which it had to read to close this one
    (by size or by ``group_of``); it holds that tensor once, and nothing after the last bucket.

    Args:
        named_tensors: (name, tensor) pairs; tensors of any dtype, device, shape and strides.
        bucket_bytes: most bytes in one bucket, counting the ``ALIGN`` padding; must be >= 1.
        validator: an optional :class:`~.manifest.SyncValidator`. Each tensor is checked as it is
            bucketed; a bucket holding a bad tensor is never yielded: the rest of the input is then
            checked too (names and shapes only, nothing is kept) and one
            :class:`~.manifest.SyncValidationError` lists every problem. Names a full sync lacks are
            reported before the last bucket is yielded.
        group_of: optional function of a tensor's name; a bucket closes whenever its value changes
            from one tensor to the next (a layered sync passes the decoder-layer index, so no bucket
            spans two layers and a layer's gathered tensors can be freed once its buckets are sent).

    Raises:
        ValueError: ``bucket_bytes`` < 1, or an item is not a (str, Tensor) pair.
        SyncValidationError: ``validator`` found problems (before the bucket that holds them is yielded).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    items = iter(named_tensors)
    bucket: List[NamedTensor] = []
    used = 0
    group = None

    def refuse_if_bad() -> None:
        if validator is not None and not validator.ok:
            for rest in items:  # report everything at once; each item is dropped right away
                validator.check(*_checked_item(rest))
            validator.finish()
            validator.raise_if_failed()

    for item in items:
        name, tensor = _checked_item(item)
        del item  # `tensor` is the one reference this frame keeps to the look-ahead
        if validator is not None:
            validator.check(name, tensor)
        size = _aligned(tensor_nbytes(tensor))
        new_group = False
        if group_of is not None:
            g = group_of(name)
            new_group, group = bool(bucket) and g != group, g
        if bucket and (new_group or used + size > bucket_bytes):
            refuse_if_bad()
            yield _hand_over(bucket)
            used = 0
        bucket.append((name, tensor))
        used += size
        tensor = None  # now held by `bucket` only
    refuse_if_bad()
    if validator is not None:
        validator.finish()
    if bucket:
        yield _hand_over(bucket)


def bucket_layout(named_tensors: Sequence[NamedTensor]) -> Tuple[List[Tuple[int, int]], int]:
    """Byte ranges ``[(start, end), ...]`` of each tensor in the flat buffer, and the buffer size."""
    ranges = []
    offset = 0
    for _name, t in named_tensors:
        n = tensor_nbytes(t)
        ranges.append((offset, offset + n))
        offset = _aligned(offset + n)
    return ranges, offset


def _metadata_class():
    # SGLang's SafeUnpickler only rebuilds SGLang's own classes and torch types, so the metadata must
    # be SGLang's dataclass.
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    return FlattenedTensorMetadata


@dataclass
class FlatBucket:
    """One flattened bucket.

    Attributes:
        flattened_tensor: 1-D ``torch.uint8`` tensor of ``nbytes`` bytes on the target device.
        metadata: one SGLang ``FlattenedTensorMetadata`` per tensor (name, shape, dtype, byte range).
    """

    flattened_tensor: torch.Tensor
    metadata: list

    @property
    def nbytes(self) -> int:
        """Size of the flat buffer in bytes (with alignment padding)."""
        return self.flattened_tensor.numel()

    def payload(self) -> dict:
        """The dict SGLang expects per TP rank: ``{"flattened_tensor", "metadata"}``."""
        return {"flattened_tensor": self.flattened_tensor, "metadata": self.metadata}

    def tensors(self) -> List[NamedTensor]:
        """Rebuild ``(name, tensor)`` views of the buffer, as the receiver does (for checks)."""
        return [
            (m.name, self.flattened_tensor[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape))
            for m in self.metadata
        ]


def flatten_bucket(
    named_tensors: Sequence[NamedTensor],
    device: Optional[Union[str, torch.device]] = None,
    out: Optional[torch.Tensor] = None,
) -> FlatBucket:
    """Copy ``named_tensors`` into one flat byte buffer with SGLang's metadata.

    Each source is copied once, straight into its slot (``slot.copy_(src)``): CPU tensors go to the
    GPU here, one bucket at a time; views and non-contiguous tensors need no ``.contiguous()`` first.

    Args:
        named_tensors: (name, tensor) pairs, at least one; any dtypes mixed.
        device: where the buffer lives; None: the first tensor's device.
        out: an optional ``torch.uint8`` buffer of at least the bucket's size to fill instead of a new
            allocation (its first ``nbytes`` bytes are used).

    Returns:
        FlatBucket whose ``flattened_tensor`` is a 1-D uint8 tensor.

    Raises:
        ValueError: empty input, or ``out`` of the wrong dtype or too small.
    """
    if not named_tensors:
        raise ValueError("cannot flatten an empty bucket")
    meta_cls = _metadata_class()
    ranges, total = bucket_layout(named_tensors)
    if device is None:
        device = named_tensors[0][1].device
    if out is None:
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    else:
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < total:
            raise ValueError(f"out must be a 1-D uint8 tensor of >= {total} bytes")
        flat = out[:total]
    metadata = []
    for (name, src), (start, end) in zip(named_tensors, ranges):
        if end > start:
            slot = flat[start:end].view(src.dtype).view(src.shape)
            slot.copy_(src, non_blocking=src.is_pinned() if src.device.type == "cpu" else True)
        metadata.append(
            meta_cls(name=name, shape=src.shape, dtype=src.dtype, start_idx=start, end_idx=end, numel=end - start)
        )
    return FlatBucket(flat, metadata)
