"""Weight sync: trainer tensors into the SGLang engine over CUDA IPC, one bucket of extra memory at a time.

* :mod:`.protocol`: one sync, whoever drives it: begin -> bucket rounds -> finish, and its rules;
* :mod:`.path`: which transport a sync takes, and the weight manifest both read (:mod:`.manifest`);
* the transports, one module each, named after what they feed SGLang's ``update_weights_from_tensor``:
  :mod:`.flattened_bucket` (``load_format="flattened_bucket"``) and :mod:`.fast_path` (this package's
  copy-plan loader, :mod:`.receiver` inside the scheduler, :mod:`.plan`);
* :mod:`.bucket` groups named tensors into buckets and flattens them; :mod:`.ipc` serializes CUDA
  tensors as IPC handles keyed by device UUID;
* :mod:`.layered` (layer-by-layer gathers) and :mod:`.lora` (adapters over base weights the engine keeps).
"""

from .bucket import ALIGN, FlatBucket, flatten_bucket, iter_buckets, tensor_nbytes
from .flattened_bucket import BucketStream, make_payload, send_flattened_buckets
from .ipc import device_uuid, serialize
from .protocol import SyncStats

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
