"""Weight sync: trainer tensors to the SGLang engine as flattened buckets over CUDA IPC.

* :mod:`.bucket` groups named tensors into buckets and flattens each in SGLang's format;
* :mod:`.ipc` serializes CUDA tensors as IPC handles keyed by device UUID;
* :mod:`.sender` streams the buckets to the engine, one bucket of extra memory at a time.
"""

from .bucket import ALIGN, FlatBucket, flatten_bucket, iter_buckets, tensor_nbytes
from .ipc import device_uuid, serialize
from .sender import BucketStream, SyncStats, make_payload, send_flattened_buckets

__all__ = [
    "ALIGN",
    "BucketStream",
    "FlatBucket",
    "SyncStats",
    "device_uuid",
    "flatten_bucket",
    "iter_buckets",
    "make_payload",
    "send_flattened_buckets",
    "serialize",
    "tensor_nbytes",
]
