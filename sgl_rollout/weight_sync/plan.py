"""The fast-path copy plan: where each Hugging Face weight's bytes go inside SGLang's model.

A plan is computed once per engine and TP rank from the :class:`~.manifest.WeightManifest` (names,
shapes, dtypes): the receiver (:mod:`.receiver`, inside SGLang's scheduler) runs the model's own
``load_weights`` on *meta* tensors of those shapes and records every ``copy_`` that would land in a
parameter. Each record is a :class:`Chunk`: a strided view of one Hugging Face tensor (for TP > 1
a shard of it) whose elements go, in order, to one contiguous range of one parameter (rows of a
fused ``qkv_proj``/``gate_up_proj``, the unpadded rows of a vocab-padded embedding, one expert's
gate or up rows of a mixture-of-experts layer's stacked ``w13_weight`` or its slice of ``w2_weight``:
SGLang's ``FusedMoE.weight_loader``, ``sglang/srt/layers/moe/fused_moe_triton/layer.py``). Tied
weights and names the loader skips (under expert parallelism, the experts of other ranks) have no
chunks on that rank and are not sent to it.

Chunks are kept in the order of the model's parameters and, inside one, by destination offset,
then packed into buckets of at most ``bucket_bytes`` (:func:`layout`); a chunk that does not fit
is split between rows. Sender and receiver run the same :func:`layout` on the same chunks, so the
payload needs only the plan id and the bucket index: the sender writes bucket ``b`` into its
persistent buffer in layout order (one batched copy), the receiver scatters it into the
parameters (one batched copy). Nothing in this module needs CUDA or SGLang.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

#: Wire-format version; both sides refuse anything else.
VERSION = 1
#: Byte alignment of each piece inside a bucket buffer.
PIECE_ALIGN = 16
#: Size of the status block the receiver answers in (bytes): a 32-byte header and a UTF-8 JSON body.
STATUS_BYTES = 1 << 20
#: Name of the payload item that carries the status block.
STATUS_NAME = "sgl_rollout/status"
#: Status codes (header word 1).
OK, FAILED = 1, 2


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the attribute name on ``torch``)."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`.

    Raises:
        ValueError: ``name`` is not a torch dtype.
    """
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dt


@dataclass(frozen=True)
class Chunk:
    """One copy of the plan: a strided view of a Hugging Face tensor to a contiguous parameter range.

    Attributes:
        name: Hugging Face name of the source tensor.
        offset: element offset of the view inside the (contiguous) source tensor.
        sizes: view sizes; dim 0 is the one a chunk may be split along.
        strides: view strides in elements of the contiguous source tensor.
        dtype: dtype of the destination parameter (the sender casts into it).
        param: index of the destination parameter in the receiver's parameter list (order of
            ``model.named_parameters()``); opaque to the sender.
        dst_offset: element offset of the destination range inside that parameter (flattened).
    """

    name: str
    offset: int
    sizes: Tuple[int, ...]
    strides: Tuple[int, ...]
    dtype: str
    param: int
    dst_offset: int

    @property
    def numel(self) -> int:
        """Elements copied."""
        return math.prod(self.sizes)

    @property
    def nbytes(self) -> int:
        """Bytes in the destination dtype."""
        return self.numel * dtype_of(self.dtype).itemsize

    def rows(self, start: int, stop: int) -> "Chunk":
        """The sub-chunk of rows ``[start, stop)`` along dim 0."""
        inner = self.numel // self.sizes[0] if self.sizes[0] else 0
        return Chunk(self.name, self.offset + start * self.strides[0], (stop - start,) + tuple(self.sizes[1:]),
                     self.strides, self.dtype, self.param, self.dst_offset + start * inner)

    def to_list(self) -> list:
        """JSON form."""
        return [self.name, self.offset, list(self.sizes), list(self.strides), self.dtype, self.param, self.dst_offset]

    @classmethod
    def from_list(cls, v: Sequence) -> "Chunk":
        """Inverse of :meth:`to_list`."""
        return cls(str(v[0]), int(v[1]), tuple(int(x) for x in v[2]), tuple(int(x) for x in v[3]), str(v[4]),
                   int(v[5]), int(v[6]))


@dataclass(frozen=True)
class Piece:
    """A chunk (or rows of one) at byte ``start`` of a bucket buffer."""

    chunk: Chunk
    start: int

    @property
    def end(self) -> int:
        """Byte just past the piece."""
        return self.start + self.chunk.nbytes


def _aligned(n: int) -> int:
    return (n + PIECE_ALIGN - 1) // PIECE_ALIGN * PIECE_ALIGN


def layout(chunks: Sequence[Chunk], bucket_bytes: int) -> List[List[Piece]]:
    """Pack ``chunks`` in order into buckets of at most ``bucket_bytes`` bytes.

    Every piece starts on a ``PIECE_ALIGN``-byte boundary. A chunk that does not fit in what is left
    of a bucket is split between rows (dim 0), so every bucket but the last is nearly full.

    Returns:
        one list of :class:`Piece` per bucket.

    Raises:
        ValueError: ``bucket_bytes`` cannot hold one row of some chunk (plus alignment).
    """
    buckets: List[List[Piece]] = [[]]
    used = 0
    for chunk in chunks:
        rows = chunk.sizes[0] if chunk.sizes else 1
        if chunk.numel == 0:
            continue
        if not chunk.sizes:  # a 0-d tensor: one element, never split
            chunk = Chunk(chunk.name, chunk.offset, (1,), (1,), chunk.dtype, chunk.param, chunk.dst_offset)
        row_bytes = chunk.nbytes // rows
        if row_bytes + PIECE_ALIGN > bucket_bytes:
            raise ValueError(f"bucket of {bucket_bytes} bytes cannot hold one row ({row_bytes} bytes) of {chunk.name}")
        done = 0
        while done < rows:
            start = _aligned(used)
            fit = (bucket_bytes - start) // row_bytes if start < bucket_bytes else 0
            if fit == 0:
                buckets.append([])
                used = 0
                continue
            take = min(fit, rows - done)
            piece = chunk if (done == 0 and take == rows) else chunk.rows(done, done + take)
            buckets[-1].append(Piece(piece, start))
            used = start + piece.nbytes
            done += take
    return [b for b in buckets if b]


def bucket_size(pieces: Sequence[Piece]) -> int:
    """Bytes a bucket uses in the buffer (end of its last piece)."""
    return pieces[-1].end if pieces else 0


def manifest_entries(manifest) -> List[list]:
    """``[[name, dtype name, shape], ...]`` of a :class:`~.manifest.WeightManifest`, in its order."""
    return [[n, dtype_name(s.dtype), list(s.shape)] for n, s in manifest.specs.items()]


def plan_id(entries: Sequence[list], bucket_bytes: int, tp_rank: int, tp_size: int) -> str:
    """Stable id of a plan: a hash of the manifest entries, the bucket size and the TP rank."""
    h = hashlib.sha256(json.dumps([VERSION, list(entries), bucket_bytes, tp_rank, tp_size]).encode())
    return h.hexdigest()[:16]


def encode_status(seq: int, code: int, body: dict) -> bytes:
    """Status block bytes: int64 ``seq``, ``code``, body length, version, then the JSON body.

    Raises:
        ValueError: the body does not fit in ``STATUS_BYTES``.
    """
    raw = json.dumps(body).encode()
    if 32 + len(raw) > STATUS_BYTES:
        raise ValueError(f"status body of {len(raw)} bytes does not fit in {STATUS_BYTES}")
    head = torch.tensor([seq, code, len(raw), VERSION], dtype=torch.int64).numpy().tobytes()
    return head + raw


#: Chunk lists whose JSON is longer (bytes) travel compressed in the plan answer (:func:`pack_chunks`).
PACK_ABOVE = 256 << 10


def pack_chunks(chunks: List[list]) -> dict:
    """The chunks of a plan answer (:meth:`Chunk.to_list` each): ``{"chunks": chunks}``, or, when their
    JSON is over :data:`PACK_ABOVE` bytes, ``{"chunks_z": <base64 of the zlib-compressed JSON>}``. A big
    mixture-of-experts model has a chunk per expert and projection, and its plan is regular: Qwen3-30B-A3B's
    18,432 expert chunks are 1.9 MB of JSON and 183 KB packed, so the answer fits the status block
    (:data:`STATUS_BYTES`) up to models about five times larger."""
    raw = json.dumps(chunks).encode()
    if len(raw) <= PACK_ABOVE:
        return {"chunks": chunks}
    return {"chunks_z": base64.b64encode(zlib.compress(raw, 6)).decode("ascii")}


def unpack_chunks(body: dict) -> Optional[List[list]]:
    """The chunk lists of a plan answer (:func:`pack_chunks`), None when it has none (not covered).

    Raises:
        ValueError: ``chunks_z`` is not base64 of zlib-compressed JSON.
    """
    if "chunks_z" not in body:
        return body.get("chunks")
    try:
        return json.loads(zlib.decompress(base64.b64decode(body["chunks_z"], validate=True)))
    except (zlib.error, binascii.Error, json.JSONDecodeError) as exc:
        raise ValueError(f"a packed copy plan that does not unpack: {exc}") from None


#: Bytes :func:`status_room` keeps for what the loader adds to a body after checking it (its timestamps, ``t``).
STAMP_BYTES = 128


def status_room(body: dict) -> int:
    """Bytes of a status block (``STATUS_BYTES``, read when called) left after ``body``'s JSON, the 32-byte
    header and :data:`STAMP_BYTES`; negative when :func:`encode_status` would refuse the body (a plan
    answer of several hundred thousand chunks, even packed by :func:`pack_chunks`)."""
    return STATUS_BYTES - 32 - STAMP_BYTES - len(json.dumps(body).encode())


def decode_header(head: bytes) -> Tuple[int, int, int, int]:
    """(seq, code, body length, version) from the first 32 bytes of a status block."""
    vals = torch.frombuffer(bytearray(head[:32]), dtype=torch.int64).tolist()
    return int(vals[0]), int(vals[1]), int(vals[2]), int(vals[3])


def header_name(header: Dict) -> str:
    """Name of the payload's first item: the JSON request header (SGLang's unpickler accepts only
    builtins and torch types in the payload, so the request travels as a string)."""
    return "sgl_rollout/" + json.dumps(dict(header, v=VERSION), separators=(",", ":"))


def parse_header(name: str) -> Dict:
    """Inverse of :func:`header_name`.

    Raises:
        ValueError: not a header of this wire version.
    """
    if not name.startswith("sgl_rollout/{"):
        raise ValueError(f"not an sgl_rollout request: {name[:60]!r}")
    header = json.loads(name[len("sgl_rollout/"):])
    if header.get("v") != VERSION:
        raise ValueError(f"wire version {header.get('v')} != {VERSION}")
    return header
