"""Layered weight sync: a trainer's model as a lazily gathered ``(name, tensor)`` stream, one
decoder layer at a time (verl's ``rollout.layered_summon``).

Without it a sync first gathers every full weight (FSDP1's ``summon_full_params`` on the root, or
moving a CPU-offloaded model back to the GPU), so the trainer needs room for a second full copy of
the weights next to its own shards. verl's ``layered_summon`` (``verl/utils/fsdp_utils.py``,
``layered_summon_lora_params``; wired through ``verl/workers/engine/fsdp/transformer_impl.py``
``get_per_tensor_param``) summons one FSDP unit at a time instead (in verl 0.9.1 only for LoRA
parameters; its FSDP2 path for full weights already calls ``full_tensor()`` per parameter lazily,
but no bucket boundary follows the layers). Here the same idea works for any model layout, with
Hugging Face names:

* FSDP2 (``torch.distributed.fsdp.fully_shard``; parameters are ``DTensor``): each parameter is
  all-gathered with ``DTensor.full_tensor()`` only when the consumer asks for it;
* CPU-offloaded parameters (plain tensors on the CPU, or FSDP2 ``CPUOffloadPolicy`` shards): moved
  to ``device`` one tensor at a time, as asked for;
* plain local tensors: yielded as they are (no copy), so the same call works everywhere.

:func:`iter_layered` yields ``(hf_name, tensor)`` in ``model.named_parameters()`` order and keeps
**no** reference to a tensor it has yielded: each gathered tensor lives exactly as long as the
consumer holds it. :func:`layer_index` is the ``group_of`` for :func:`~.bucket.iter_buckets`, which
then closes a bucket at every layer boundary. With the package's consumers (``iter_buckets`` feeding
:func:`~.sender.send_flattened_buckets` or :class:`~.sender.BucketStream`, which hold one bucket at a
time; the verl adapter's pipelined sync holds two, one loading while the next is flattened, and adds a
second flat bucket buffer below), the trainer's extra memory during a sync is at most

    (tensors of one bucket, never more than one layer) + (one flat bucket buffer)
    + (one tensor of look-ahead: ``iter_buckets`` reads the next tensor before it yields a bucket)

bytes of device memory (a tensor larger than a bucket travels alone, so "one bucket" is at least the
largest tensor; allocator rounding and a padded all-gather buffer for unevenly sharded dims come on top)

instead of a full copy of the weights (:func:`iter_all_at_once`, the comparison). The gathers are
issued lazily, per tensor, rather than a whole layer at a time: gathering layer L+1 as soon as its
first tensor is asked for would put two layers in memory while layer L's last bucket is sent.

Every process of an FSDP2 mesh must iterate its stream to the end, in the same order: the gathers
are collectives, and a rank that stops early leaves the others waiting.
"""

from __future__ import annotations

import re
import weakref
from typing import Callable, Dict, Hashable, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from .bucket import NamedTensor

DeviceLike = Union[int, str, torch.device, None]

#: Name segments that wrappers insert between a model's own module names: torch.compile's
#: ``OptimizedModule`` (``_orig_mod``), FSDP1 (``_fsdp_wrapped_module``), activation checkpointing
#: (``_checkpoint_wrapped_module``, torch's ``checkpoint_wrapper``).
WRAPPER_SEGMENTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_WRAPPER_RE = re.compile(r"(?:^|(?<=\.))(?:" + "|".join(WRAPPER_SEGMENTS) + r")\.")
#: ``<prefix>.<stack>.<index>.`` where the stack is a decoder stack's usual Hugging Face name
#: (``model.layers.3.`` Llama/Qwen/Mistral, ``transformer.h.3.`` GPT-2, ``blocks.3.``, ``layer.3.``);
#: the shortest prefix wins, so ``model.layers.3.mlp.experts.7.w1`` belongs to ``model.layers.3``.
_LAYER_RE = re.compile(r"^((?:.*?\.)??(?:layers|layer|h|blocks|block)\.\d+)\.")


def hf_name(name: str) -> str:
    """The Hugging Face name of a parameter name seen through wrappers.

    Removes every :data:`WRAPPER_SEGMENTS` segment (``_orig_mod.``, ``_fsdp_wrapped_module.``,
    ``_checkpoint_wrapped_module.``), wherever it sits: ``_orig_mod.model._fsdp_wrapped_module.
    layers.0._checkpoint_wrapped_module.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj.weight``
    (verl strips ``_fsdp_wrapped_module.`` the same way in ``layered_summon_lora_params``).
    Renames a checkpoint format needs beyond that (transformers' ``_checkpoint_conversion_mapping``,
    verl's ``convert_weight_keys`` in ``verl/utils/model.py``) go in ``iter_layered(rename=...)``.
    """
    return _WRAPPER_RE.sub("", name)


def layer_index(name: str) -> Hashable:
    """Group key of a Hugging Face parameter name: its decoder layer, for ``iter_buckets(group_of=)``.

    Returns:
        for a parameter inside a decoder layer, the layer's module path (``"model.layers.3"`` for
        ``model.layers.3.self_attn.q_proj.weight``; ``"transformer.h.3"``, ``"model.visual.blocks.0"``
        for other stacks), so two stacks never share a key; for anything else (embeddings, final
        norm, ``lm_head``) the owning module's path (``"model.embed_tokens"``, ``"model.norm"``,
        ``"lm_head"``), so each of those travels in buckets of its own and a weight and its bias stay
        together. Never raises.
    """
    m = _LAYER_RE.match(name)
    if m:
        return m.group(1)
    return name.rsplit(".", 1)[0] if "." in name else name


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module under ``DistributedDataParallel`` (``.module``) and ``torch.compile``
    (``._orig_mod``) wrappers, however nested. FSDP1/FSDP2 and checkpoint wrappers stay (their
    names are cleaned by :func:`hf_name`)."""
    seen = 0
    while seen < 16:
        seen += 1
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            break
    return model


def named_weights(model: nn.Module, rename: Optional[Callable[[str], str]] = None) -> List[Tuple[str, torch.Tensor]]:
    """``(hf_name, parameter)`` for every parameter, in ``model.named_parameters()`` order, not gathered.

    Tied parameters (``lm_head.weight`` is ``model.embed_tokens.weight``) come once, under the first
    name, as Hugging Face's ``named_parameters()`` gives them. Buffers are not included (a Hugging
    Face checkpoint's weights are parameters; rotary ``inv_freq`` buffers are not synced).

    Args:
        model: the trainer's module: plain, FSDP2 (``fully_shard``), FSDP1 with
            ``use_orig_params=True``, under DDP or ``torch.compile``.
        rename: optional extra ``str -> str`` applied after :func:`hf_name`.

    Returns:
        list of (name, parameter); parameters may be ``DTensor`` shards or CPU tensors.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: a parameter is FSDP1's ``FlatParameter`` (``use_orig_params=False``: no per-weight
            names exist), a parameter is on the meta device (not materialized), or two parameters
            map to the same name.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    model = unwrap_model(model)
    out: List[Tuple[str, torch.Tensor]] = []
    seen: Dict[str, str] = {}
    for raw, p in model.named_parameters():
        if type(p).__name__ == "FlatParameter" or raw.rsplit(".", 1)[-1] == "_flat_param":
            raise ValueError(f"{raw}: FSDP1 FlatParameter (use_orig_params=False) has no per-weight names; "
                             f"wrap with use_orig_params=True or use FSDP2 (fully_shard)")
        if p.device.type == "meta":
            raise ValueError(f"{raw} is on the meta device: materialize the model (to_empty + init) first")
        name = hf_name(raw)
        if rename is not None:
            name = rename(name)
        if name in seen:
            raise ValueError(f"two parameters map to the name {name!r}: {seen[name]!r} and {raw!r}")
        seen[name] = raw
        out.append((name, p))
    return out


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return False
    return isinstance(t, DTensor)


def _mesh_device(t) -> torch.device:
    """The device a DTensor's collectives run on (its mesh's device type, current index for CUDA)."""
    kind = t.device_mesh.device_type
    local = t.to_local().device
    if local.type == kind:
        return local
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def _device(device) -> torch.device:
    """``device`` as a ``torch.device``; a bare ``"cuda"`` gets the current device's index."""
    d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _async_copy(src: torch.device, dst: torch.device) -> bool:
    # Host-to-device copies may be asynchronous (the consumer uses the result on the same stream);
    # a device-to-host copy must not be (the host would read the buffer before the copy lands).
    return src.type == "cpu" and dst.type != "cpu"


@torch.no_grad()
def gather(param: torch.Tensor, device: DeviceLike = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The full value of one parameter, detached, on ``device``.

    * ``DTensor`` (FSDP2): the local shard is moved to ``device`` (default: the mesh's device, which
      brings a ``CPUOffloadPolicy`` shard to the GPU, as verl's
      ``param.to(device, non_blocking=True).full_tensor()`` does), cast to ``dtype`` if given (before
      the all-gather, so fewer bytes travel), then ``full_tensor()``: a new tensor of the full shape.
      A collective: every rank of the mesh must call it for the same parameter.
    * a plain tensor: ``param.detach()`` itself (no copy) when ``device`` and ``dtype`` are None or
      already its own, else a copy on ``device`` in ``dtype`` (``non_blocking`` from the CPU).

    Args:
        param: a parameter or tensor (any dtype, shape; CPU or CUDA; sharded or not).
        device: target device; None keeps the tensor where it is (a DTensor: its mesh's device).
        dtype: target dtype; None keeps it.

    Returns:
        a plain ``torch.Tensor`` with the full (unsharded) shape.

    Raises:
        RuntimeError: whatever the collective or the copy raises (an out-of-memory, a mesh mismatch).
    """
    if _is_dtensor(param):
        target = _device(device) if device is not None else _mesh_device(param)
        t = param.detach()
        if t.device != target:
            t = t.to(target, non_blocking=_async_copy(t.device, target))
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return t.full_tensor()
    t = param.detach()
    target = _device(device) if device is not None else t.device
    if t.device == target and (dtype is None or t.dtype == dtype):
        return t
    return t.to(device=target, dtype=dtype or t.dtype, non_blocking=_async_copy(t.device, target))


class LiveBytes:
    """Bytes of tensors alive that a sync allocated (gathered weights, bucket buffers), and their peak.

    Device-agnostic (works on the CPU, where no allocator statistics exist): each tracked tensor's
    storage is counted until it is garbage (``weakref.finalize``). Pass one as ``meter=`` to
    :func:`iter_layered` / :func:`iter_all_at_once`; a consumer may :meth:`track` its own buffers
    (a flat bucket) too. Not thread-safe.

    Attributes:
        live: bytes alive now.
        peak: most bytes alive at once since creation or :meth:`reset`.
        tracked: tensors counted so far.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.tracked = 0

    def reset(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak = self.live

    def track(self, t: torch.Tensor, source: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Count ``t``'s storage bytes until ``t`` is freed; nothing when it shares ``source``'s
        storage (a gather that returned the parameter itself). Returns ``t``."""
        storage = _storage(t)
        if storage is None or (source is not None and _same_storage(storage, source)):
            return t
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.tracked += 1
        weakref.finalize(t, self._free, nbytes)
        return t

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def _storage(t: torch.Tensor):
    try:
        if _is_dtensor(t):
            t = t.to_local()
        inner = getattr(t, "elem", None)  # funcol's AsyncCollectiveTensor wraps the real tensor
        if isinstance(inner, torch.Tensor):
            t = inner
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _same_storage(storage, source: torch.Tensor) -> bool:
    other = _storage(source)
    return other is not None and other.data_ptr() == storage.data_ptr() and other.device == storage.device


def iter_layered(
    model: nn.Module,
    device: DeviceLike = None,
    dtype: Optional[torch.dtype] = None,
    rename: Optional[Callable[[str], str]] = None,
    meter: Optional[LiveBytes] = None,
) -> Iterator[NamedTensor]:
    """The model's weights as ``(hf_name, full tensor)``, each gathered only when asked for.

    Pair it with ``iter_buckets(..., group_of=layer_index)`` (``RolloutConfig.layered_summon``) so
    no bucket spans two decoder layers; the trainer's extra memory is then bounded as the module
    docstring says (one layer's bucket, one flat buffer, one tensor of look-ahead).

    The generator keeps no reference to anything it has yielded: a gathered tensor is freed as soon
    as the consumer drops it (``iter_buckets`` drops a bucket once it is sent). Plain tensors on
    their own device are the live parameters (no copy): do not modify them while syncing.

    Args:
        model: trainer module (see :func:`named_weights`).
        device: where gathered tensors go (``"cuda"``: CPU-offloaded weights move to the GPU one
            tensor at a time); None: where they are (a CPU-offloaded weight then streams straight
            from host memory and the sender copies it into its GPU bucket buffer: no extra layer at all).
        dtype: cast each tensor to this dtype (e.g. ``torch.bfloat16`` for fp32 master weights);
            None keeps each tensor's own dtype.
        rename: optional extra rename after :func:`hf_name`.
        meter: optional :class:`LiveBytes` that counts every gathered tensor (not the parameters
            yielded as they are) until it is freed.

    Yields:
        (name, tensor): Hugging Face name; full shape; dtype ``dtype`` or the parameter's own.

    Raises:
        TypeError, ValueError: as :func:`named_weights`, at the call (before any gather).
        RuntimeError: a gather failed (see :func:`gather`).
    """
    plan = named_weights(model, rename)
    return _lazy(plan, device, dtype, meter)


def _gathered(param, device, dtype, meter):
    t = gather(param, device, dtype)
    return meter.track(t, param) if meter is not None else t


def _lazy(plan: List[Tuple[str, torch.Tensor]], device, dtype, meter) -> Iterator[NamedTensor]:
    for name, param in plan:
        # The tuple goes straight to the consumer: no local holds the gathered tensor across the yield.
        yield name, _gathered(param, device, dtype, meter)


def iter_all_at_once(
    model: nn.Module,
    device: DeviceLike = None,
    dtype: Optional[torch.dtype] = None,
    rename: Optional[Callable[[str], str]] = None,
    meter: Optional[LiveBytes] = None,
) -> Iterator[NamedTensor]:
    """The same stream as :func:`iter_layered`, but every weight is gathered before the first is
    yielded: the behaviour without ``layered_summon`` (verl: FSDP1's ``summon_full_params`` on the
    root, or ``load_fsdp_model_to_gpu`` of an offloaded model, then ``state_dict()``), kept for
    comparisons. Its extra memory is a full copy of the (gathered or moved) weights. Tensors are
    handed over in order and dropped by the generator as they go, so memory falls as the consumer
    frees them; the peak is at the first item.

    Args, Yields, Raises: as :func:`iter_layered`; the first ``next()`` does all the gathering.
    """
    plan = named_weights(model, rename)
    return _all_at_once(plan, device, dtype, meter)


def _all_at_once(plan, device, dtype, meter) -> Iterator[NamedTensor]:
    gathered = [(name, _gathered(param, device, dtype, meter)) for name, param in plan]
    gathered.reverse()
    while gathered:
        yield gathered.pop()


def group_nbytes(
    model: nn.Module,
    group_of: Callable[[str], Hashable] = layer_index,
    dtype: Optional[torch.dtype] = None,
    rename: Optional[Callable[[str], str]] = None,
) -> Dict[Hashable, int]:
    """Full (gathered) bytes of each group of weights, in stream order, without gathering anything.

    Args:
        model: trainer module (see :func:`named_weights`).
        group_of: group key of a name (:func:`layer_index`).
        dtype: the dtype the stream casts to (None: each parameter's own).
        rename: as in :func:`iter_layered`.

    Returns:
        ``{group key: bytes}`` (numel of the full shape times element size); the largest value is
        "one layer" in the bound of the module docstring.
    """
    out: Dict[Hashable, int] = {}
    for name, p in named_weights(model, rename):
        size = torch.empty((), dtype=dtype or p.dtype).element_size()
        key = group_of(name)
        out[key] = out.get(key, 0) + p.numel() * size  # DTensor.numel() is the full tensor's
    return out
