"""The engine's LoRA calls: adapters loaded and unloaded under the sync fence, replaced version by version.

The adapter arrives built and checked (:func:`sgl_rollout.weight_sync.lora.build_adapter_payload` makes an
:class:`~sgl_rollout.lora_adapter.AdapterPayload`), or as an already serialized payload with its PEFT
config; either way its config is checked against the engine's LoRA settings
(:func:`~sgl_rollout.lora_adapter.check_adapter_config`) before SGLang sees it.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..errors import SyncValidationError
from ..lora_adapter import AdapterPayload, adapter_config_dict, check_adapter_config
from ..memory import WEIGHTS, MemoryStateError
from ..twin import twin
from . import io_struct
from .core import EngineCore

logger = logging.getLogger(__name__)


@dataclass
class LoraAdapter:
    """A LoRA adapter the engine serves (see ``RolloutEngine.load_lora_adapter_from_tensors``).

    Attributes:
        name: the name callers use (``generate(..., lora_path=name)``).
        version: 1 for the first load under ``name``, +1 for each replacement.
        sglang_name: the name SGLang knows this version by (``"<name>@v<version>.<n>"``, ``n`` counting
            this engine object's loads): a replacement is loaded next to the previous version and only
            then is the previous one unloaded.
        config: the PEFT config dict SGLang got.
        n_tensors: tensors of the adapter (-1: a serialized payload sent as it came).
        nbytes: bytes of the serialized payload.
    """

    name: str
    version: int
    sglang_name: str
    config: Dict[str, Any] = field(default_factory=dict)
    n_tensors: int = 0
    nbytes: int = 0


class LoraCalls:
    """Adapter loads and unloads on :class:`~.core.EngineCore` (with ``lora_rank > 0``), inside the sync
    fence of :class:`~.weight_calls.WeightCalls`."""

    def _on_start(self) -> None:
        super()._on_start()
        if not hasattr(self, "_lora_seq"):
            self._lora_seq = 0
        # adapters SGLang serves (name -> LoraAdapter), and versions SGLang still holds that an unload
        # did not remove
        self._lora: Dict[str, LoraAdapter] = {}
        self._lora_orphans: List[str] = []

    @property
    def lora_adapters(self) -> Dict[str, LoraAdapter]:
        """The adapters SGLang serves now, by name (a copy)."""
        return dict(self._lora)

    def _adapter_for_request(self, name: str) -> LoraAdapter:
        """The adapter a generate asks for by name.

        Raises:
            ValueError: no adapter ``name`` is loaded.
        """
        adapter = self._lora.get(name)
        if adapter is None:
            raise ValueError(f"no LoRA adapter {name!r} is loaded (loaded: {sorted(self._lora)})")
        return adapter

    def _check_lora_call(self: EngineCore, what: str) -> None:
        if not self.config.lora_enabled:
            raise ValueError(f"cannot {what}: the engine was started without LoRA (set lora_rank > 0 in the "
                             "rollout config)")
        if self.state.is_released(WEIGHTS):
            raise MemoryStateError(f"cannot {what}: the weights are released; resume 'weights' first")
        if self.state.busy != "sync":
            raise MemoryStateError(f"call begin_sync() before you {what} (no generate may run meanwhile)")

    def _adapter_request(self: EngineCore, name: str, payload, config_dict, load_format):
        if not isinstance(name, str) or not name or "@" in name:
            raise ValueError(f"adapter name must be a non-empty str without '@', got {name!r}")
        if isinstance(payload, AdapterPayload):
            if config_dict is not None and dict(config_dict) != payload.config:
                raise ValueError("config_dict differs from the AdapterPayload's own config; pass one of them")
            data, config, n_tensors = payload.data, payload.config, payload.n_tensors
        elif isinstance(payload, (bytes, str)):
            if load_format != "flattened_bucket":
                raise ValueError("a serialized adapter payload needs load_format='flattened_bucket'")
            if config_dict is None:
                raise ValueError("config_dict is required with a serialized adapter payload")
            data, config, n_tensors = payload, adapter_config_dict(config_dict), -1
        else:
            raise TypeError("pass an AdapterPayload (sgl_rollout.weight_sync.lora.build_adapter_payload builds "
                            f"and checks one from named tensors) or serialized bytes, got {type(payload).__name__}")
        problems = check_adapter_config(config, self.config)
        if problems:
            raise SyncValidationError(problems, f"LoRA adapter {name!r}")
        self._lora_seq += 1
        old = self._lora.get(name)
        record = LoraAdapter(name=name, version=(old.version + 1) if old else 1, sglang_name="",
                             config=dict(config), n_tensors=n_tensors, nbytes=len(data))
        record.sglang_name = f"{name}@v{record.version}.{self._lora_seq}"
        req = io_struct.make("LoadLoRAAdapterFromTensorsReqInput", lora_name=record.sglang_name,
                             config_dict=dict(config), serialized_tensors=data, load_format="flattened_bucket")
        return record, req

    def _start_lora_load(self: EngineCore, name: str, payload, config_dict, load_format) -> concurrent.futures.Future:
        self._check_lora_call(f"load LoRA adapter {name!r}")
        record, req = self._adapter_request(name, payload, config_dict, load_format)
        tm, generation = self._tm(), self._generation

        async def swap():
            # the new version next to the old one, then the old one out: a failed load leaves the old
            # version serving, and no request ever finds the name without an adapter
            out = await tm.load_lora_adapter_from_tensors(req, None)
            if not getattr(out, "success", False):
                return out
            if generation != self._generation:
                return out
            old = self._lora.get(name)
            self._lora[name] = record  # committed on SGLang's answer, whatever became of the caller
            stale = ([old.sglang_name] if old is not None else []) + self._lora_orphans
            self._lora_orphans = []
            for sglang_name in stale:
                res = await tm.unload_lora_adapter(io_struct.make("UnloadLoRAAdapterReqInput", lora_name=sglang_name),
                                                   None)
                if not getattr(res, "success", False):
                    logger.warning("SGLang did not unload LoRA adapter version %s: %s", sglang_name,
                                   getattr(res, "error_message", res))
                    self._lora_orphans.append(sglang_name)
            return out

        return self._submit_sync_op(swap)

    def _load_lora_adapter_from_tensors(self, name: str, payload, config_dict: Optional[Dict[str, Any]] = None,
                                        load_format: Optional[str] = "flattened_bucket"):
        """Load a LoRA adapter into SGLang (``load_lora_adapter_from_tensors``), replacing the version
        loaded under ``name``; inside a sync fence (:mod:`sgl_rollout.weight_sync.driver`).

        Replacement: SGLang 0.5.10 refuses a second adapter under a loaded name, so the new version is
        loaded under its own SGLang name, ``name`` then points to it, and the previous version is
        unloaded. A failed load leaves the previous version serving. The mapping changes when SGLang
        answers, also if this caller was interrupted meanwhile.

        Only CPU memory changes in SGLang (it keeps adapters on the CPU and copies them into its
        LoRA memory pool per batch), so a released KV cache (the staged wake) is no obstacle;
        released weights are.

        Args:
            name: the adapter's name, for ``generate(..., lora_path=name)``; no ``'@'``.
            payload: an :class:`~sgl_rollout.lora_adapter.AdapterPayload` (built and checked by
                :func:`~sgl_rollout.weight_sync.lora.build_adapter_payload`), or an already serialized
                ``flattened_bucket`` payload (bytes), sent as it is.
            config_dict: the adapter's PEFT config (dict or ``peft.LoraConfig``); required with bytes,
                taken from an :class:`AdapterPayload` when None.
            load_format: ``"flattened_bucket"`` (SGLang's flattened format; the only one sent).

        Returns:
            the :class:`LoraAdapter` now served under ``name``.

        Raises:
            MemoryStateError: no sync was begun, or the weights are released. Nothing reached SGLang.
            ValueError: the engine has no LoRA, a bad name, a config the engine cannot serve
                (``SyncValidationError``, a ValueError, lists every problem). Nothing reached SGLang.
            TypeError: ``payload`` is neither an AdapterPayload nor bytes.
            RuntimeError: SGLang refused the adapter (its message); the previous version still serves.
            EngineDeadError, EngineClosedError: as every call.
        """
        out = yield self.waiting(self._start_lora_load(name, payload, config_dict, load_format))
        if not getattr(out, "success", False):
            raise RuntimeError(f"SGLang did not load LoRA adapter {name!r}: {getattr(out, 'error_message', out)}")
        return self._lora[name]

    load_lora_adapter_from_tensors, async_load_lora_adapter_from_tensors = twin(
        _load_lora_adapter_from_tensors, before_sync=EngineCore._check_not_on_loop)

    def _start_lora_unload(self: EngineCore, name: str) -> concurrent.futures.Future:
        self._check_lora_call(f"unload LoRA adapter {name!r}")
        record = self._adapter_for_request(name)
        tm, generation = self._tm(), self._generation

        async def unload():
            out = await tm.unload_lora_adapter(io_struct.make("UnloadLoRAAdapterReqInput",
                                                              lora_name=record.sglang_name), None)
            if getattr(out, "success", False) and generation == self._generation and self._lora.get(name) is record:
                del self._lora[name]
            return out

        return self._submit_sync_op(unload)

    def _unload_lora_adapter(self, name: str):
        """Unload the adapter served under ``name``, inside ``begin_sync`` / ``end_sync``.

        Raises:
            MemoryStateError: no sync was begun, or the weights are released.
            ValueError: no adapter ``name`` is loaded, or the engine has no LoRA. Nothing reached SGLang.
            RuntimeError: SGLang refused (its message).
        """
        out = yield self.waiting(self._start_lora_unload(name))
        if not getattr(out, "success", False):
            raise RuntimeError(f"SGLang did not unload LoRA adapter {name!r}: {getattr(out, 'error_message', out)}")

    unload_lora_adapter, async_unload_lora_adapter = twin(_unload_lora_adapter,
                                                          before_sync=EngineCore._check_not_on_loop)
