"""Serialize CUDA tensors as CUDA IPC handles that open on the right GPU in the receiving process.

torch's ``reduce_tensor`` (``torch/multiprocessing/reductions.py``) records the *device index* of
a CUDA tensor. Device indices are per process: under Ray, or with different
``CUDA_VISIBLE_DEVICES``, index 0 in the trainer can be index 3 in SGLang's scheduler. SGLang
therefore patches the receiving side (``sglang/srt/utils/patch_torch.py``,
``monkey_patch_torch_reductions``) so that ``rebuild_cuda_tensor`` accepts a device *UUID* string in
that argument and maps it to its own index. We do the matching half on the sending side, with our
own pickler, without patching torch globally: the device index in each CUDA tensor's reduce
arguments is replaced by ``str(torch.cuda.get_device_properties(index).uuid)``.

The bytes this module makes are what ``MultiprocessingSerializer.deserialize``
(``sglang/srt/utils/common.py``) reads with its ``SafeUnpickler``: only torch types and SGLang
classes may appear in the payload.
"""

from __future__ import annotations

import functools
import io
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing import reductions

#: Index of the device argument in the tuple torch's reduce_tensor returns for a CUDA tensor
#: (type, size, stride, offset, storage type, dtype, DEVICE, handle, ...). It has not moved since
#: torch 1.x; :func:`_with_uuid` checks the type at run time and refuses anything unexpected.
DEVICE_ARG_INDEX = 6


@functools.lru_cache(maxsize=None)
def device_uuid(index: int) -> str:
    """UUID string of CUDA device ``index`` of this process (e.g. ``"GPU-1b2c..."``-style)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def _with_uuid(args: tuple) -> tuple:
    dev = args[DEVICE_ARG_INDEX]
    if isinstance(dev, str):  # already a UUID (SGLang's patch is active in this process)
        return args
    if not isinstance(dev, int):
        raise TypeError(f"unexpected CUDA reduce argument at index {DEVICE_ARG_INDEX}: {dev!r}")
    return args[:DEVICE_ARG_INDEX] + (device_uuid(dev),) + args[DEVICE_ARG_INDEX + 1 :]


class _UuidPickler(ForkingPickler):
    """ForkingPickler whose CUDA tensors carry the device UUID instead of the local index."""

    def reducer_override(self, obj: Any):
        """Reduce CUDA tensors with the device UUID; everything else the usual way."""
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            fn, args = reductions.reduce_tensor(obj)
            return fn, _with_uuid(args)
        return NotImplemented


def serialize(obj: Any) -> bytes:
    """Pickle ``obj`` with CUDA tensors as IPC handles keyed by device UUID.

    The sender must keep the CUDA tensors alive until the receiver has copied them, then call
    ``torch.cuda.ipc_collect()`` to free blocks the receiver has closed.

    Args:
        obj: any picklable object; CUDA tensors in it are shared, not copied.

    Returns:
        bytes for ``MultiprocessingSerializer.deserialize`` in another process on the same node.

    Raises:
        TypeError: a CUDA tensor's reduce arguments are not laid out as this torch version should.
    """
    buf = io.BytesIO()
    _UuidPickler(buf).dump(obj)
    return buf.getvalue()
