"""verl classes that answer ``rollout.name=sglang``: the in-worker adapter, the replica, the server actor.

Interfaces implemented (verl 0.9.1, read from its source):

* :class:`SglRolloutAdapter` is verl's ``BaseRollout`` (``verl/workers/rollout/base.py``). verl builds it
  in two places:

  - in each hybrid trainer worker (``verl/workers/engine_workers.py``) as
    ``cls(config=..., model_config=..., device_mesh=...)`` with an ``infer_tp`` mesh dimension; its
    ``update_weights`` calls ``resume(["weights"])`` (skipped when ``sleep_level == 1``),
    ``update_weights(gen, peft_config=, base_sync_done=, global_steps=)``, offloads the actor, then
    ``resume(["kv_cache"])``: the staged wake;
  - in each ``CheckpointEngineWorker`` (``verl/checkpoint_engine/base.py``; standalone and colocated
    replicas, ``checkpoint_engine.backend`` other than ``naive``) as
    ``cls(config=, model_config=, device_mesh=None, replica_rank=)`` *before* torch.distributed is
    initialised, with ``update_weights(async generator, global_steps=, wire_format=)`` and reads of
    ``is_leader_rank`` and ``replica_rank``. Without a mesh the TP group is made on the first weight
    sync: consecutive global ranks, as verl lays replicas out.

* :class:`SglRolloutReplica` is verl's ``RolloutReplica`` (``verl/workers/rollout/replica.py``): its
  ``launch_servers`` starts one :class:`VerlRolloutServer` actor per replica on the node of its
  workers, with :mod:`sgl_rollout.ray`'s ``runtime_env``.
* :class:`VerlRolloutServer` adds to :class:`sgl_rollout.ray.RolloutServer` what verl's replica,
  ``LLMServerClient`` (``verl/workers/rollout/llm_server.py``) and ``CheckpointEngineManager`` call:
  ``generate`` returning ``TokenOutput``, ``abort_all_requests``, ``resume_generation``,
  ``clear_kv_cache``, ``release_kv_cache``, ``resume_kv_cache``, ``start_profile``, ``stop_profile``,
  ``get_server_address``, ``set_global_steps``.

Weight syncs go as flattened buckets, pipelined (:meth:`SglRolloutAdapter._send_buckets`), or with
``engine_kwargs.sgl_rollout.fast_sync`` on the copy-plan fast path, each trainer worker writing its own
TP rank's shard (:meth:`SglRolloutAdapter._send_fast`, :class:`_FastPathRound`).

Server addresses: verl keys its request load balancer (``verl/workers/rollout/router.py``) and its
metrics by ``server_address``, so every replica needs its own. Each server actor reserves a free TCP
port on its node (bound, never listening) and reports ``"<node-ip>:<port>"``: unique per node and
stable for the actor's life. There is no HTTP server behind it (verl's token-in/token-out path calls
the actor, not HTTP): a connection to it is refused at once. The verl features that need HTTP
(GenRM's reward router, Prometheus, rl-insight metrics) are refused at start-up instead.

LoRA served as an adapter (verl's ``model.lora_rank`` or ``model.lora.rank`` > 0 without
``model.lora.merge``), as verl 0.9.1's own SGLang rollout serves it: the engine starts with LoRA
(``lora_rank``, ``lora_alpha``, ``lora_target_modules`` from verl's model config), sleeps at level 1 (the
base weights stay resident; only the KV cache is released), and every request carries the adapter.
verl's trainer then calls ``update_weights(base, peft_config=, base_sync_done=False)`` while its own
``base_sync_done`` is False (a dummy load's first step) and ``update_weights(adapter, peft_config=,
base_sync_done=True)`` every step. The base is sent only when
:func:`~sgl_rollout.weight_sync.lora.needs_base_sync` says the engine lacks it (asked of the engine
actor, which records its syncs, releases and restarts); otherwise every rank drains verl's generator
and nothing is sent. The adapter goes to SGLang's ``load_lora_adapter_from_tensors`` as one checked,
by-value ``flattened_bucket`` payload from the TP leader, replacing the previous version.

Not supported (refused at start-up with the verl key to change, :mod:`.verl_config`): multi-node
replicas, ``checkpoint_engine.backend=delta_sharded``, prefill/decode disaggregation, MTP rollout,
routing replay, generative reward models, distillation teachers (prompt log-probabilities),
image/audio/video inputs; with a LoRA adapter also FP8 rollout, regex ``target_modules`` and
checkpoint-engine backends other than ``naive`` (they send the base only).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Tuple

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from ..config import RolloutConfig, check_tp_layout, model_heads
from ..memory import CUDA_GRAPH, KV_CACHE, WEIGHTS
from ..ray import NodeEngineHost, RolloutServer, launch_replica, launch_rollout_server, merge_visible_devices
from ..weight_sync import BucketStream
from ..weight_sync import lora as lora_sync
from ..weight_sync.sender import FastPathSender
from .verl_config import (
    MODEL_PREFIX,
    ROLLOUT_PREFIX,
    VERL_BUILTIN,
    UnsupportedVerlFeature,
    _get,
    check_verl_features,
    fp8_quant_config,
    lora_as_adapter,
    max_position_embeddings,
    model_path_of,
    resolve_local_model,
    rollout_config_from_verl,
    with_fp8_override,
)

logger = logging.getLogger(__name__)

#: Logger of the per-replica request counts (one line per replica at every sleep: once per training
#: step). verl sets the root logger to WARNING in every process (``verl/__init__.py``:
#: ``set_basic_config(logging.WARNING)``), which would hide INFO; this logger's own level is INFO, so
#: the line reaches verl's console (Ray forwards the actor's stderr) unless the user sets it otherwise.
requests_logger = logging.getLogger("sgl_rollout.requests")
if requests_logger.level == logging.NOTSET:
    requests_logger.setLevel(logging.INFO)

__all__ = [
    "SglRolloutAdapter",
    "SglRolloutReplica",
    "UnsupportedVerlFeature",
    "VerlRolloutServer",
    "rollout_config_for_verl",
    "rollout_config_from_verl",
    "server_name",
    "verl_lora_settings",
]

#: Name of the policy adapter the verl integration loads and every request carries.
VERL_ADAPTER_NAME = "verl_policy"


class _WithoutLora:
    """A view of verl's model config without its LoRA keys, for :func:`check_verl_features` and
    :func:`rollout_config_from_verl`, which refuse LoRA served as an adapter; this module serves it."""

    _HIDDEN = ("lora_rank", "lora")

    def __init__(self, model_config):
        self._cfg = model_config

    def get(self, key, default=None):
        return default if key in self._HIDDEN else _get(self._cfg, key, default)

    def __getattr__(self, key):
        if key.startswith("_"):
            raise AttributeError(key)
        return self.get(key)


def verl_lora_settings(model_config, rollout_cfg=None) -> Optional[dict]:
    """The LoRA settings of :class:`~sgl_rollout.config.RolloutConfig` for verl's model config, or None
    when verl does not serve LoRA as an adapter (no rank, or ``lora.merge=True``).

    Read as verl 0.9.1's SGLang server reads them (``lora_rank_of``, ``sglang_lora_target_modules``):
    the rank from ``model.lora_rank`` (FSDP) or ``model.lora.rank`` (Megatron), ``lora_alpha`` (or
    ``lora.alpha``), ``target_modules`` (``"all-linear"`` or a list).

    Raises:
        UnsupportedVerlFeature: a regex ``target_modules`` (SGLang takes names), FP8 rollout with an
            adapter, or a checkpoint-engine backend other than ``naive`` (verl's checkpoint engines send
            the base weights only, never the adapter); the message names the key.
    """
    if model_config is None or not lora_as_adapter(model_config):
        return None
    lora = _get(model_config, "lora", None) or {}
    rank = max(int(_get(model_config, "lora_rank", 0) or 0), int(_get(lora, "rank", 0) or 0))
    alpha = _get(model_config, "lora_alpha", None) or _get(lora, "alpha", None) or 16
    targets = _get(model_config, "target_modules", None) or _get(lora, "target_modules", None) or "all-linear"
    problems = []
    if isinstance(targets, str) and targets not in ("all-linear", "all"):
        problems.append(f"{MODEL_PREFIX}.target_modules={targets!r}: SGLang serves adapters on named modules, "
                        "not a regex; use all-linear or list the module names")
    elif not isinstance(targets, str):
        targets = [str(t) for t in targets]
    backend = _get(_get(rollout_cfg, "checkpoint_engine", None), "backend", "naive") if rollout_cfg is not None else "naive"
    if backend != "naive":
        problems.append(f"{ROLLOUT_PREFIX}.checkpoint_engine.backend={backend!r} with a LoRA adapter: verl's checkpoint "
                        "engines send get_per_tensor_param()'s base weights only (no peft_config), so the adapter "
                        f"would never reach the engine; use backend=naive (hybrid), or {MODEL_PREFIX}.lora.merge=True")
    if rollout_cfg is not None and _get(rollout_cfg, "quantization", None) == "fp8":
        problems.append(f"{ROLLOUT_PREFIX}.quantization='fp8' with a LoRA adapter: not served by sgl-rollout; use "
                        f"{MODEL_PREFIX}.lora.merge=True, quantization=null, or {VERL_BUILTIN}")
    if problems:
        raise UnsupportedVerlFeature("sgl-rollout (rollout.name=sglang) does not serve:\n  " + "\n  ".join(problems))
    return {"lora_rank": rank, "lora_alpha": float(alpha), "lora_target_modules": targets}


def _check_features(cfg, model_config) -> None:
    """:func:`check_verl_features`, with LoRA served as an adapter accepted (and its keys checked)."""
    verl_lora_settings(model_config, cfg)
    view = _WithoutLora(model_config) if model_config is not None and lora_as_adapter(model_config) else model_config
    check_verl_features(cfg, view)


def rollout_config_for_verl(cfg, model_path: str, model_config=None, hf_config=None,
                            rollout_mode: Optional[str] = None, prefix: str = ROLLOUT_PREFIX) -> RolloutConfig:
    """:func:`~.verl_config.rollout_config_from_verl`, plus LoRA served as an adapter: the LoRA settings
    of :func:`verl_lora_settings` and ``sleep_level=1`` (verl's adapter mode: the base weights stay in
    the engine, only the KV cache is released, so the base is sent at most once)."""
    settings = verl_lora_settings(model_config, cfg)
    if settings is None:
        return rollout_config_from_verl(cfg, model_path, model_config=model_config, hf_config=hf_config,
                                        rollout_mode=rollout_mode, prefix=prefix)
    rc = rollout_config_from_verl(cfg, model_path, model_config=_WithoutLora(model_config), hf_config=hf_config,
                                  rollout_mode=rollout_mode, prefix=prefix)
    return RolloutConfig(**{**rc.model_dump(), **settings, "sleep_level": 1})

def check_verl_tp(cfg, model_config, gpus: Optional[int] = None) -> None:
    """Refuse a rollout TP size SGLang cannot run with this model (attention or KV heads not split
    evenly) or that needs more GPUs than ``gpus``, before any engine starts (:func:`~sgl_rollout.config.
    tp_layout_problem`; verl's own server would lose its actor to an assertion in SGLang's scheduler).

    Args:
        cfg: verl's rollout config (``tensor_model_parallel_size``, ``data_parallel_size``).
        model_config: verl's model config (its ``hf_config`` gives the heads), or None.
        gpus: GPUs of the trainer world (verl colocates a replica's ranks on them), or None.

    Raises:
        TPLayoutError: one line naming the numbers and the verl key.
    """
    tp = int(_get(cfg, "tensor_model_parallel_size", 1) or 1)
    dp = int(_get(cfg, "data_parallel_size", 1) or 1)
    key = f"{ROLLOUT_PREFIX}.tensor_model_parallel_size"
    hf_config = _get(model_config, "hf_config", None) if model_config is not None else None
    check_tp_layout(tp, model_heads(hf_config) if hf_config is not None else None, key=key)
    if gpus is not None:
        check_tp_layout(tp * dp, gpus=gpus, key=f"{key} x data_parallel_size")


#: Replica roles (verl's ``is_reward_model`` / ``is_teacher_model`` flags) -> name part.
ROLES = ("rollout", "reward", "teacher")


def server_name(replica_rank: int, node_rank: int = 0, role: str = "rollout", name_suffix: str = "") -> str:
    """Ray actor name of a replica's engine server.

    Unique across what verl starts in one job: the replica rank, the node rank, the role (``"rollout"``,
    ``"reward"`` for a GenRM replica, ``"teacher"`` for a distillation teacher) and verl's
    ``name_suffix`` (a teacher's key), as verl names its own servers (``sglang_server_reward_{rank}_{node}``,
    ``verl/workers/rollout/sglang_rollout/async_sglang_server.py``).

    Raises:
        ValueError: unknown role.
    """
    if role not in ROLES:
        raise ValueError(f"unknown replica role {role!r}; one of {ROLES}")
    kind = "" if role == "rollout" else f"{role}_"
    suffix = f"_{name_suffix.lstrip('_')}" if name_suffix else ""
    return f"sgl_rollout_server_{kind}{replica_rank}_{node_rank}{suffix}"


def format_address(host: str, port: int) -> str:
    """``"host:port"``, or ``"[host]:port"`` for an IPv6 host (verl's form)."""
    host = host.strip("[]")
    try:
        v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        v6 = False
    return f"[{host}]:{port}" if v6 else f"{host}:{port}"


def reserve_port(host: str = "") -> Tuple[socket.socket, int]:
    """Bind a TCP socket to a free port (not listening: connections to it are refused).

    Keep the socket open to keep the port: no other process can bind it meanwhile.

    Returns:
        (socket, port).
    """
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind(("", 0))
    return sock, sock.getsockname()[1]


# ======================================================================= server actor
class VerlRolloutServer(RolloutServer):
    """The engine actor, with the methods verl's replica, server client and checkpoint manager call.

    Args:
        config: rollout settings (dict or :class:`~sgl_rollout.config.RolloutConfig`).
        max_model_len: context length in tokens; None: the model's ``max_position_embeddings`` once
            the model config is resolved (verl's default), else unbounded.
        response_length: default ``max_new_tokens`` (verl's ``rollout.response_length``).
        prompt_length: verl's ``rollout.prompt_length``; the default ``max_new_tokens`` is also bounded
            by ``prompt_length + response_length - len(prompt)``, as in verl's server. None: no bound.
        model_config: verl's model config; resolved to a local folder on this node at :meth:`start`
            (:func:`~.verl_config.resolve_local_model`). None: ``config.model_path`` as it is.
        rollout_mode: verl's ``RolloutMode`` value, for logs.
    """

    def __init__(self, config, max_model_len: Optional[int] = None, response_length: int = 512,
                 prompt_length: Optional[int] = None, model_config=None, rollout_mode: Optional[str] = None):
        super().__init__(config)
        self.max_model_len = max_model_len
        self.response_length = response_length
        self.prompt_length = prompt_length
        self.rollout_mode = rollout_mode
        self._model_config = model_config
        self._model_resolved = model_config is None
        self._host = ray.util.get_node_ip_address().strip("[]")
        self._port_sock, self._port = reserve_port(self._host)
        self._accepting: Optional[asyncio.Event] = None
        self._reject = False
        self._served = {"total": 0, "since_sleep": 0}

    # -------------------------------------------------------------- start-up
    def _resolve_model(self) -> None:
        """Local model folder on this node, its context length, FP8 overrides (once)."""
        if self._model_resolved:
            return
        hf_config = _localize(self.config, self._model_config)
        limit = max_position_embeddings(hf_config)
        if self.max_model_len is None:
            self.max_model_len = limit
        elif limit is not None and self.max_model_len > limit:
            raise ValueError(f"{ROLLOUT_PREFIX}.max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={limit}; lower it or leave it null")
        self._model_resolved = True

    async def start(self, layout=None, node_hosts=()) -> List[str]:
        """Resolve the model's local folder on this node (hdfs copy, ``use_shm``), then start the engine
        (with the other nodes' for a replica over several nodes: ``layout`` and ``node_hosts`` as in
        :meth:`RolloutServer.start`).

        Idempotent, as :meth:`RolloutServer.start`.

        Raises:
            ValueError: ``max_model_len`` exceeds the model's ``max_position_embeddings``.
        """
        if self.worker is None:
            self._resolve_model()
        return await super().start(layout, node_hosts)

    async def model_path(self) -> str:
        """The model folder the engine was started with."""
        return self.config.model_path

    async def get_server_address(self) -> Tuple[str, int]:
        """``(node ip, port)``: the port this actor reserved, unique on its node (no HTTP behind it)."""
        return self._host, self._port

    # -------------------------------------------------------------- admission
    def _gate(self) -> asyncio.Event:
        if self._accepting is None:
            self._accepting = asyncio.Event()
            self._accepting.set()
        return self._accepting

    async def _admit(self) -> None:
        gate = self._gate()
        if gate.is_set():
            return
        if self._reject:
            raise RuntimeError("this replica's generation is paused with reject_request=True "
                               "(abort_all_requests); send the request to another replica")
        await gate.wait()

    # -------------------------------------------------------------- generation
    def _max_new_tokens(self, params: dict, prompt_len: int) -> int:
        max_new_tokens, max_tokens = params.pop("max_new_tokens", None), params.pop("max_tokens", None)
        value = max_new_tokens if max_new_tokens is not None else max_tokens  # vLLM's key is dropped either way
        if value is None:
            value = self.response_length
            if self.prompt_length:
                value = min(value, self.prompt_length + self.response_length - prompt_len)
            value = max(value, 0)
        else:
            value = int(value)
            if value < 0:
                raise ValueError(f"max_new_tokens must be >= 0, got {value}")
        if self.max_model_len:
            room = self.max_model_len - prompt_len - 1
            if room < 0:
                raise ValueError(f"prompt of {prompt_len} tokens exceeds max_model_len={self.max_model_len}")
            value = min(value, room)
        return value

    async def generate(self, prompt_ids, sampling_params: dict, request_id: str, image_data=None,
                       video_data=None, audio_data=None, mm_processor_kwargs=None, **kwargs) -> TokenOutput:
        """One request, as ``LLMServerClient.generate`` sends it; returns verl's ``TokenOutput``.

        Args:
            prompt_ids: prompt token ids (list, tensor or array of ints).
            sampling_params: SGLang sampling params, plus verl's ``logprobs`` (bool: return each
                generated token's log-probability) and ``max_new_tokens`` or vLLM-style ``max_tokens``
                (``max_new_tokens`` wins and ``max_tokens`` never reaches SGLang). Without either,
                ``min(response_length, prompt_length + response_length - len(prompt))`` (verl's
                default). 0 generates nothing. Every count is bounded by ``max_model_len``.
            request_id: verl's request id (for logs; SGLang gets its own).

        Returns:
            ``TokenOutput`` with ``token_ids``, ``log_probs`` (None unless ``logprobs``),
            ``stop_reason`` (SGLang's finish reason: ``"length"``, ``"stop"``, ``"abort"``) and
            ``extra_fields["global_steps"]``: the trainer step whose weights the engine holds. A
            request arriving while :meth:`abort_all_requests` paused generation waits for
            :meth:`resume_generation` (SGLang's behaviour), or fails with ``reject_request=True``.

        Raises:
            NotImplementedError: image, video or audio input, ``prompt_logprobs`` (verl's
                distillation teacher), or any other argument this server does not serve.
            ValueError: negative ``max_new_tokens``, or the prompt does not fit the context.
            RuntimeError: paused with ``reject_request=True``.
            MemoryStateError, EngineDeadError, EngineClosedError: from the engine, unchanged.
        """
        if image_data or video_data or audio_data or mm_processor_kwargs:
            raise NotImplementedError("sgl-rollout does not take image, video or audio inputs yet; "
                                      f"use {VERL_BUILTIN} for multimodal rollouts")
        extra = sorted(k for k, v in kwargs.items() if v is not None)
        if extra:
            raise NotImplementedError(f"sgl-rollout's generate does not take {extra}")
        params = dict(sampling_params)
        if params.pop("prompt_logprobs", None) is not None:
            raise NotImplementedError("prompt_logprobs (verl's distillation teacher) are not returned by sgl-rollout; "
                                      f"use {VERL_BUILTIN} for the teacher")
        return_logprob = bool(params.pop("logprobs", False))
        ids = prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else list(prompt_ids)
        params["max_new_tokens"] = self._max_new_tokens(params, len(ids))
        await self._admit()
        self._served["total"] += 1
        self._served["since_sleep"] += 1
        lora_path = self._request_adapter()
        if lora_path is None:
            gen = (await self.generate_batch([ids], params, n=1, return_logprob=return_logprob))[0][0]
        else:
            gen = (await self._engine.async_generate([ids], params, n=1, return_logprob=return_logprob,
                                                     lora_path=lora_path))[0][0]
        token_ids, log_probs = list(gen.output_ids), (list(gen.logprobs) if return_logprob else None)
        if return_logprob and len(log_probs) != len(token_ids):
            # SGLang can report a logprob without a token (max_new_tokens=0) or none on an abort;
            # verl's server then returns neither, and so does this one.
            logger.error("request %s: %d logprobs for %d tokens; returning none of either",
                         request_id, len(log_probs), len(token_ids))
            token_ids, log_probs = [], []
        return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason=gen.finish_reason,
                           extra_fields={"global_steps": self.global_steps})

    # -------------------------------------------------------------- LoRA adapter
    def _request_adapter(self) -> Optional[str]:
        """The adapter every request carries (verl's adapter mode), once one is loaded; None before
        (the base alone; PEFT initialises ``lora_B`` to zero, so an untrained adapter changes nothing)."""
        if not self.config.lora_enabled:
            return None
        if VERL_ADAPTER_NAME in self._engine.lora_adapters:
            return VERL_ADAPTER_NAME
        if not getattr(self, "_warned_no_adapter", False):
            self._warned_no_adapter = True
            logger.warning("LoRA is on but no adapter is loaded yet: serving the base weights alone")
        return None

    async def base_sync_needed(self) -> bool:
        """:func:`~sgl_rollout.weight_sync.lora.needs_base_sync` for this engine, from what it recorded
        (syncs, releases of the weights tag, restarts)."""
        await self._engine.async_settle()
        return lora_sync.engine_needs_base_sync(self._engine)

    async def load_lora_adapter(self, name: str, payload: bytes, config_dict: dict) -> dict:
        """Load (or replace) adapter ``name`` from a serialized payload
        (:func:`~sgl_rollout.weight_sync.lora.build_adapter_payload`), inside its own sync fence, then
        flush the prefix cache.

        Returns:
            ``{"name", "version", "nbytes"}``.

        Raises:
            BaseWeightsMissing: the engine lacks its base weights (send them first); nothing was sent.
            MemoryStateError: weights released, requests running, or another operation in progress.
            ValueError, SyncValidationError: the config cannot be served by this engine.
            RuntimeError: SGLang refused the adapter (the previous version still serves).
        """
        engine = self._engine
        await engine.async_settle()
        if lora_sync.engine_needs_base_sync(engine):
            raise lora_sync.BaseWeightsMissing(
                f"the engine lacks its base weights (load_format={self.config.load_format!r}, synced="
                f"{engine.weights_synced}, weights released since={engine.weights_released_since_sync}, engine "
                f"start {engine.generation}): the base must be synced before adapter {name!r}; nothing was sent")
        await engine.async_begin_sync()
        ok = False
        try:
            record = await engine.async_load_lora_adapter_from_tensors(name, payload, config_dict)
            ok = True
        finally:
            engine.end_sync(ok)
        await engine.async_flush_cache()
        return {"name": record.name, "version": record.version, "nbytes": record.nbytes}

    async def lora_status(self) -> dict:
        """``{"adapters": {name: version}, "base_sync_needed": bool, "weights_synced": bool,
        "weights_released_since_sync": bool, "generation": int}``."""
        e = self._engine
        return {"adapters": {n: a.version for n, a in e.lora_adapters.items()},
                "base_sync_needed": lora_sync.engine_needs_base_sync(e), "weights_synced": e.weights_synced,
                "weights_released_since_sync": e.weights_released_since_sync, "generation": e.generation}

    async def abort_all_requests(self, reject_request: bool = False, timeout_s: float = 60.0) -> None:
        """Pause generation and abort what runs (verl's partial rollout, before a checkpoint-engine sync).

        Aborted requests return with ``stop_reason="abort"`` and what they generated so far. New
        requests wait until :meth:`resume_generation`, or fail at once when ``reject_request``. Returns
        once no request runs in the engine, so a release or weight sync that follows is admitted.

        Raises:
            TimeoutError: requests still run after ``timeout_s`` seconds.
            EngineDeadError, EngineClosedError: from the engine.
        """
        self._reject = bool(reject_request)
        self._gate().clear()
        self._engine.abort_all()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        next_abort = loop.time() + 0.2
        while self._engine.state.in_flight:
            now = loop.time()
            if now > deadline:
                raise TimeoutError(f"{self._engine.state.in_flight} request(s) still run {timeout_s} s after abort")
            if now > next_abort:
                # a request admitted just before the gate closed may have reached SGLang after the
                # abort: abort again until none runs (aborting an aborted request does nothing)
                self._engine.abort_all()
                next_abort = now + 0.2
            await asyncio.sleep(0.005)

    async def resume_generation(self) -> None:
        """Let requests run again after :meth:`abort_all_requests` (waiting ones start now)."""
        self._reject = False
        self._gate().set()

    async def clear_kv_cache(self) -> None:
        """Drop the prefix cache (nothing to drop while the KV cache is released)."""
        await self.flush_cache()

    async def sleep(self) -> List[str]:
        """Log how many requests this replica served since its last sleep (so a multi-replica run
        shows that every replica generated), then release per ``sleep_level``."""
        requests_logger.info("sgl-rollout replica %s (%s): served %d requests since the last sleep (%d in all)",
                             self._replica_label(), format_address(self._host, self._port),
                             self._served["since_sleep"], self._served["total"])
        self._served["since_sleep"] = 0
        return await super().sleep()

    def _replica_label(self) -> str:
        """This actor's name (``sgl_rollout_server_<replica>_<node>``), or its address outside Ray."""
        try:
            return ray.get_runtime_context().get_actor_name() or "?"
        except Exception:  # noqa: BLE001 - outside an actor (tests)
            return "?"

    def request_counts(self) -> Dict[str, int]:
        """Requests admitted by :meth:`generate`: ``{"total", "since_sleep"}``."""
        return dict(self._served)

    async def release_kv_cache(self) -> List[str]:
        """Release the KV cache (and CUDA-graph memory) if resident, keeping the weights; nothing when
        ``free_cache_engine`` is False (verl's server does the same)."""
        if not self.config.free_cache_engine:
            return []
        released = set(self._engine.state.released)
        tags = [t for t in (KV_CACHE, CUDA_GRAPH) if t in self._engine.tags and t not in released]
        return await self._engine.async_release(tags) if tags else []

    async def resume_kv_cache(self) -> List[str]:
        """Resume the KV cache (and CUDA-graph memory) if released."""
        return await self.resume_stage(KV_CACHE)

    async def start_profile(self, **kwargs) -> None:
        """No-op, as verl's SGLang server outside discrete profiling (which is refused at start-up)."""

    async def stop_profile(self) -> None:
        """See :meth:`start_profile`."""

    async def shutdown(self) -> None:
        """Stop the engine's processes and give the reserved port back."""
        try:
            await super().shutdown()
        finally:
            self._port_sock.close()


# ======================================================================= replica
class VerlNodeHost(NodeEngineHost):
    """:class:`~sgl_rollout.ray.NodeEngineHost` that also answers the calls verl's replica makes on every
    server of a replica (``wake_up``, ``sleep``, ``abort_all_requests``, ...), each a no-op: the
    leader's SGLang call reaches every node's schedulers, as verl's own ``SGLangHttpServer`` does on a
    node rank other than 0 (``verl/workers/rollout/sglang_rollout/async_sglang_server.py``)."""

    def __init__(self, config, node_rank: int, model_config=None):
        super().__init__(config, node_rank)
        self._model_config = model_config

    async def start(self, layout, leader_host: str) -> List[int]:
        """Resolve the model's local folder on this node (as the leader does on its own), then start."""
        if self._model_config is not None:
            _localize(self.config, self._model_config)
        return await super().start(layout, leader_host)

    async def _leader_does_it(self, *args, **kwargs) -> None:
        return None

    wake_up = sleep = abort_all_requests = resume_generation = clear_kv_cache = _leader_does_it
    release_kv_cache = resume_kv_cache = start_profile = stop_profile = _leader_does_it


class SglRolloutReplica(RolloutReplica):
    """verl ``RolloutReplica`` whose server is a :class:`VerlRolloutServer` actor (plus a :class:`VerlNodeHost` per
    other node when the replica spans nodes).

    Refuses at construction (verl builds replicas before any resources) what sgl-rollout does not
    serve: generative reward models (their router posts HTTP to each replica), distillation teachers
    (prompt log-probabilities), rl-insight metrics (HTTP), and the rollout features of
    :func:`~.verl_config.check_verl_features`.

    Attributes:
        server_class: the actor body; a subclass may swap it (tests use an engine double).

    Raises:
        UnsupportedVerlFeature: on construction, naming the verl key to change.
        TPLayoutError: on construction, a TP size the model's heads do not split over (:func:`check_verl_tp`).
    """

    server_class = VerlRolloutServer
    node_host_class = VerlNodeHost

    def __init__(self, replica_rank: int, config, model_config, gpus_per_node: int = 8,
                 is_reward_model: bool = False, is_teacher_model: bool = False, name_suffix: str = ""):
        super().__init__(replica_rank, config, model_config, gpus_per_node, is_reward_model, is_teacher_model,
                         name_suffix)
        self.role = "reward" if is_reward_model else "teacher" if is_teacher_model else "rollout"
        self._name_suffix = name_suffix
        if is_reward_model:
            raise UnsupportedVerlFeature(
                "reward.reward_model.rollout.name='sglang': verl's reward router sends HTTP requests to every "
                "generative reward model replica and sgl-rollout serves no HTTP; use "
                f"reward.reward_model.rollout.name=vllm, or {VERL_BUILTIN}")
        if is_teacher_model:
            raise UnsupportedVerlFeature(
                "distillation.teacher_models.<teacher>.inference.name='sglang': the teacher needs prompt "
                "log-probabilities, which sgl-rollout does not return; set that inference.name=vllm, or "
                f"{VERL_BUILTIN}")
        if os.environ.get("VERL_RL_INSIGHT_ENABLE") == "1":
            raise UnsupportedVerlFeature(
                "VERL_RL_INSIGHT_ENABLE=1: rl-insight scrapes rollout metrics over HTTP from each replica's "
                f"address and sgl-rollout serves no HTTP; unset it, or {VERL_BUILTIN}")
        _check_features(self.config, self.model_config)
        check_verl_tp(self.config, self.model_config)

    @property
    def name(self) -> str:
        """Ray actor name of this replica's server (:func:`server_name`)."""
        return server_name(self.replica_rank, 0, self.role, self._name_suffix)

    async def launch_servers(self):
        """Start the engine actor on the node of this replica's workers, on the GPUs they use; for a
        replica over several nodes (``tensor_model_parallel_size`` x ``data_parallel_size`` above the
        GPUs per node), one actor per node: the leader (:class:`VerlRolloutServer`, node rank 0, which
        verl's clients and the trainer's adapter talk to) and a :class:`VerlNodeHost` on each other node,
        placed where verl placed the replica's workers (worker ``k`` holds TP rank ``k``), ports from
        :func:`~sgl_rollout.engine.layout.replica_layout` (a block per replica rank).

        ``servers`` lists them in node-rank order, as verl's own replica does; ``server_handle`` and
        ``server_address`` are the leader's.

        Raises:
            RuntimeError: the workers of one node rank are not on one node, or a node fails to start.
        """
        infos = await asyncio.gather(*[
            w.__ray_call__.remote(lambda self: (ray.get_runtime_context().get_node_id(),
                                                os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                                                [str(g) for g in ray.get_gpu_ids()]))
            for w in self.workers
        ])
        mode = self.rollout_mode.value if self.rollout_mode is not None else None
        cfg = rollout_config_for_verl(self.config, model_path_of(self.model_config), model_config=self.model_config,
                                      rollout_mode=mode)
        server_cls = _bind_server(self.server_class, self.config, self.model_config, mode)
        if self.nnodes > 1:
            server = await self._launch_nodes(cfg, infos, server_cls)
        else:
            devices = merge_visible_devices([cvd or ",".join(gpus) for _node, cvd, gpus in infos])
            server = launch_rollout_server(cfg, devices, node_id=infos[0][0], name=self.name,
                                           max_concurrency=self.max_concurrency, actor_cls=server_cls)
            self.servers = [server]
            await server.start.remote()
        self._server_handle = server
        ip, port = await server.get_server_address.remote()
        self._server_address = format_address(ip, port)
        logger.info("sgl-rollout replica %d (%s): engine %s over %d node(s), address %s", self.replica_rank, mode,
                    self.name, self.nnodes, self._server_address)

    async def _launch_nodes(self, cfg: RolloutConfig, infos: list, server_cls):
        from ..engine.layout import replica_layout

        per = self.gpus_per_replica_node
        groups = [infos[k * per:(k + 1) * per] for k in range(self.nnodes)]
        for rank, group in enumerate(groups):
            if len({node for node, _cvd, _gpus in group}) != 1:
                raise RuntimeError(f"replica {self.replica_rank}: the workers of node rank {rank} are on several "
                                   f"Ray nodes {sorted({node for node, _c, _g in group})}; verl places them per node")
        gpu_ids = [[int(d) for d in merge_visible_devices([cvd or ",".join(gpus) for _n, cvd, gpus in group]).split(",")]
                   for group in groups]
        world = self.world_size
        n_replicas = max(self.replica_rank + 1, int(ray.cluster_resources().get("GPU", 0)) // world)
        layout = replica_layout(self.replica_rank, cfg.tensor_model_parallel_size, gpu_ids, n_replicas=n_replicas)
        leader, hosts = launch_replica(cfg, layout, [group[0][0] for group in groups], name=self.name,
                                       max_concurrency=self.max_concurrency, actor_cls=server_cls,
                                       host_cls=_with_settings(self.node_host_class,
                                                               {"model_config": _plain_model_config(self.model_config)}))
        self.servers = [leader, *hosts]
        await leader.start.remote(layout, hosts)
        return leader

def _localize(config: RolloutConfig, model_config):
    """Point ``config`` at the model's folder on this node (verl's hdfs copy, ``use_shm``) and add the FP8
    overrides it needs; returns the model's Hugging Face config (None when unreadable)."""
    local_path, hf_config = resolve_local_model(model_config)
    if local_path:
        config.model_path = local_path
    if config.engine_kwargs.get("quantization") == "fp8" and hf_config is not None:
        config.engine_kwargs = with_fp8_override(config.engine_kwargs, hf_config)
    return hf_config


def _plain_model_config(model_config):
    """A DictConfig node resolved into a plain dict (its interpolations need the root config, which
    stays in the driver); anything else as it is."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(model_config, DictConfig):
        return OmegaConf.to_container(model_config, resolve=True)
    return model_config


def _bind_server(cls, verl_cfg, model_config=None, rollout_mode: Optional[str] = None):
    """Subclass of ``cls`` whose constructor also gets verl's length limits and model config."""
    settings = dict(
        max_model_len=_get(verl_cfg, "max_model_len", None),
        response_length=int(_get(verl_cfg, "response_length", 512) or 512),
        prompt_length=_get(verl_cfg, "prompt_length", None),
        model_config=_plain_model_config(model_config),
        rollout_mode=rollout_mode,
    )

    return _with_settings(cls, settings)


def _with_settings(cls, settings: dict):
    """Subclass of the actor body ``cls`` whose constructor also gets ``settings`` (keyword arguments)."""

    class _Bound(cls):
        def __init__(self, *args):
            super().__init__(*args, **settings)

    _Bound.__name__ = cls.__name__
    _Bound.__qualname__ = cls.__qualname__
    return _Bound


# ======================================================================= in-worker adapter
_UNSET = object()
_ERR = "__sgl_rollout_error__"
_DONE, _LOAD = "done", "load"
#: First element of a TP rank's item in a fast-path round when that rank has ended the sync.
_LEFT = "__sgl_rollout_left__"


class _PeerLeft(RuntimeError):
    """Another TP rank ended the fast-path weight sync (it failed); raised from the round that heard it."""


class _FastPathRound:
    """The engine as one trainer worker's :class:`~sgl_rollout.weight_sync.sender.FastPathSender` sees
    it under verl, where each TP rank's worker owns its own rank's buffer: one round over the replica's
    TP group per call.

    :meth:`update_weights_from_tensor` all-gathers every worker's payloads; the leader hands them to
    the engine actor's ``update_weights_from_payloads(fast_path=True)`` and broadcasts the outcome, so
    every worker returns (or raises) once the engine has answered for every rank. :meth:`share` is the
    sender's all-gather. :meth:`close` is the round every worker ends a sync with. A worker that fails
    between rounds (its generator, the manifest check) goes straight to it, with its error; workers
    still in a sync round meet that closing item there, raise :class:`_PeerLeft` and end without a
    closing round of their own, so no worker waits for a round the others never enter. With TP size 1
    every round is local.

    Args:
        adapter: the worker's :class:`SglRolloutAdapter` (its TP group and engine actor).
    """

    def __init__(self, adapter: "SglRolloutAdapter"):
        self.adapter = adapter
        self.config = adapter.rollout_config  # the sender checks the engine registers its loader

    def _round(self, item) -> List[Any]:
        got = self.adapter._all_gather((None, item))
        left = [f"TP rank {r}: {why}" for r, (mark, why) in enumerate(got) if mark == _LEFT]
        if left:
            raise _PeerLeft("the weight sync ended on another TP rank: " + "; ".join(left))
        return [x for _, x in got]

    def share(self, obj) -> List[Any]:
        """Every worker's ``obj``, in TP rank order.

        Raises:
            _PeerLeft: another worker has ended the sync.
        """
        return self._round(obj)

    def update_weights_from_tensor(self, payloads: list, load_format: Optional[str] = None, flush_cache: bool = False):
        """Load this round's payloads of every TP rank (``payloads``: this worker's); ``(True, "Success")``.

        Raises:
            _PeerLeft: another worker has ended the sync (nothing was loaded).
            RuntimeError: the engine actor refused or failed the call (every worker raises it).
        """
        everyone = [p for part in self._round(list(payloads)) for p in part]
        error = None
        if self.adapter.is_leader_rank:
            try:
                ray.get(self.adapter.server.update_weights_from_payloads.remote(everyone, fast_path=True))
            except Exception as exc:  # noqa: BLE001 - every TP rank must hear of it
                error = f"{type(exc).__name__}: {exc}"
        error = self.adapter._broadcast(error)
        if error:
            raise RuntimeError(f"the engine failed a fast-path weight sync call: {error}")
        return True, "Success"

    def flush_cache(self) -> None:
        """Nothing: ``finish_weight_sync`` flushes the prefix cache."""

    def close(self, error: Optional[BaseException]) -> List[str]:
        """The closing round of a sync: every worker's error (``"TP rank r: ..."``), empty when all succeeded."""
        why = f"{type(error).__name__}: {error}" if error is not None else ""
        got = self.adapter._all_gather((_LEFT, why))
        return [f"TP rank {r}: {w}" for r, (_, w) in enumerate(got) if w]


class _AsyncToSyncIterator:
    """A sync iterator over an async iterator that runs on ``loop``; used from another thread only."""

    def __init__(self, aiterator, loop: asyncio.AbstractEventLoop, loop_thread: threading.Thread):
        self._it, self._loop, self._loop_thread = aiterator, loop, loop_thread

    def __iter__(self):
        return self

    def __next__(self):
        if threading.current_thread() is self._loop_thread:
            raise RuntimeError("_AsyncToSyncIterator used on its own event loop's thread (would deadlock)")

        async def step():
            return await self._it.__anext__()

        try:
            return asyncio.run_coroutine_threadsafe(step(), self._loop).result()
        except StopAsyncIteration:
            raise StopIteration from None


async def _renamed_async(weights):
    async for name, tensor in weights:
        yield name.replace(".base_layer.", "."), tensor


async def _checked_fp8(helper, quantized):
    """verl's FP8 quantizer yields a weight unquantized when quantizing it fails (logged only): that
    bf16 tensor would be loaded into an FP8 layer. Refuse it instead."""
    async for name, tensor in quantized:
        if helper.should_quantize_param(name) and tensor.element_size() != 1:
            raise RuntimeError(f"FP8 quantization of {name} failed (verl's quantizer returned it as {tensor.dtype}); "
                               "see the error verl logged just before (torch.distributed must be initialised)")
        yield name, tensor


async def _aclose(named) -> None:
    """Close a (possibly half-consumed) async generator; never raises."""
    if hasattr(named, "aclose"):
        try:
            await named.aclose()
        except Exception:  # noqa: BLE001 - closing must not mask the sync's own outcome
            logger.debug("closing the weights generator failed", exc_info=True)


def _renamed_sync(weights):
    for name, tensor in weights:
        yield name.replace(".base_layer.", "."), tensor


class SglRolloutAdapter(BaseRollout):
    """verl ``BaseRollout`` living in each trainer (or checkpoint-engine) worker; talks to the replica's
    engine actor.

    The TP leader (TP rank 0) makes the calls; every TP rank flattens its buckets on its own GPU and
    the leader gathers one payload per TP rank for each bucket. TP ranks come from the ``infer_tp``
    dimension of ``device_mesh``, or without one from the global rank: ranks ``[k*T, (k+1)*T)`` form
    replica ``k``'s TP group of size ``T = tensor_model_parallel_size * data_parallel_size`` (verl's
    layout), created with ``torch.distributed.new_group`` on the first weight sync.

    Args:
        config: verl's rollout config.
        model_config: verl's model config (``HFModelConfig``, or a config verl converts to one).
        device_mesh: verl's rollout mesh with an ``infer_tp`` dimension, or None.
        replica_rank: the replica this worker belongs to; -1: ``RANK // T``.

    Attributes:
        sleep_level: read by verl's trainer (2: weights and KV cache are released).
        replica_rank: read by verl's ``CheckpointEngineWorker.get_replica_rank``.
        tp_rank: this worker's TP rank in its replica.

    Raises:
        UnsupportedVerlFeature: a verl feature sgl-rollout refuses (see :mod:`.verl_config`).
        TPLayoutError: a TP size the model's heads do not split over, or larger than the trainer world
            (:func:`check_verl_tp`).
    """

    def __init__(self, config, model_config, device_mesh=None, *args, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        world = os.environ.get("WORLD_SIZE", "")
        check_verl_tp(self.config, self.model_config, int(world) if world.isdigit() else None)
        self.rollout_config = rollout_config_for_verl(self.config, model_path_of(self.model_config),
                                                      model_config=self.model_config)
        self.sleep_level = self.rollout_config.sleep_level
        self.tp_size = self.rollout_config.tensor_model_parallel_size
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = replica_rank if replica_rank is not None and replica_rank >= 0 else rank // self.tp_size
        self._tp_group = None
        if device_mesh is not None and "infer_tp" in (device_mesh.mesh_dim_names or ()):
            self.tp_rank = device_mesh["infer_tp"].get_local_rank()
            self._tp_group = device_mesh["infer_tp"].get_group()
        else:
            self.tp_rank = rank % self.tp_size
        self._fp8 = _get(self.config, "quantization", None) == "fp8"
        self._manifest = _UNSET
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._server = None
        self._fast: Optional[FastPathSender] = None
        self._fast_off_logged = False
        #: weight syncs of this rank: full (base) syncs sent, base syncs verl offered and the rule
        #: skipped, adapter syncs
        self.base_syncs = self.base_syncs_skipped = self.adapter_syncs = 0
        logger.info("rollout.name=sglang answered by sgl-rollout (replica %d, TP rank %d of %d)",
                    self.replica_rank, self.tp_rank, self.tp_size)

    @property
    def is_leader_rank(self) -> bool:
        """True on TP rank 0 of the replica: the rank that calls the engine actor (read by verl's
        ``CheckpointEngineWorker.is_leader_rank``)."""
        return self.tp_rank == 0

    @property
    def server(self):
        """The replica's engine actor (looked up by name on first use)."""
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    # -------------------------------------------------------------- TP group
    def _ensure_tp_group(self) -> None:
        """Make the TP group from global ranks when verl gave no mesh (collective over all ranks).

        Raises:
            RuntimeError: TP size > 1 and torch.distributed is not initialised.
            ValueError: the world size is not a multiple of the TP size.
        """
        if self._tp_group is not None or self.tp_size == 1:
            return
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"TP size {self.tp_size} without a device mesh needs torch.distributed initialised "
                               "(verl's CheckpointEngineWorker does it) to gather one payload per TP rank")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % self.tp_size:
            raise ValueError(f"world size {world} is not a multiple of the rollout TP size {self.tp_size}")
        mine = None
        for start in range(0, world, self.tp_size):  # every rank makes every group, in the same order
            group = dist.new_group(ranks=list(range(start, start + self.tp_size)))
            if start <= rank < start + self.tp_size:
                mine = group
        if rank % self.tp_size != self.tp_rank:
            logger.warning("TP rank from RANK (%d) differs from torch.distributed's (%d); using the latter",
                           self.tp_rank, rank % self.tp_size)
        self.tp_rank, self._tp_group = rank % self.tp_size, mine

    def _leader_global_rank(self) -> int:
        return torch.distributed.get_global_rank(self._tp_group, 0)

    def _gather(self, payload) -> Optional[List[Any]]:
        """Every TP rank's object at the leader (None elsewhere)."""
        if self._tp_group is None or self.tp_size == 1:
            return [payload]
        out = [None] * self.tp_size if self.is_leader_rank else None
        torch.distributed.gather_object(payload, out, dst=self._leader_global_rank(), group=self._tp_group)
        return out

    def _all_gather(self, item) -> List[Any]:
        """Every TP rank's ``item``, in TP rank order, on every rank."""
        if self._tp_group is None or self.tp_size == 1:
            return [item]
        out = [None] * self.tp_size
        torch.distributed.all_gather_object(out, item, group=self._tp_group)
        return out

    def _broadcast(self, status):
        """The leader's ``status`` on every TP rank."""
        if self._tp_group is None or self.tp_size == 1:
            return status
        box = [status]
        torch.distributed.broadcast_object_list(box, src=self._leader_global_rank(), group=self._tp_group)
        return box[0]

    # -------------------------------------------------------------- memory
    async def resume(self, tags: List[str]):
        """Resume a stage of the staged wake: ``["weights"]`` or ``["kv_cache"]`` (the TP leader asks the
        engine actor; the other ranks return at once).

        Nothing is collected or emptied here: verl's ``update_weights`` (``verl/workers/engine_workers.py``)
        has already synchronized, emptied torch's cache and passed a barrier of every trainer rank
        before it resumes the KV cache, so a collection here would only add its cost (a full
        ``gc.collect()`` over the trainer process's objects).
        """
        if not self.rollout_config.free_cache_engine or not self.is_leader_rank:
            return
        for stage in (WEIGHTS, KV_CACHE):
            if stage in tags:
                await self.server.resume_stage.remote(stage)

    async def release(self):
        """Release per ``sleep_level`` (weights and KV cache at level 2)."""
        if self.rollout_config.free_cache_engine and self.is_leader_rank:
            await self.server.sleep.remote()

    # -------------------------------------------------------------- weight sync
    def _sync_manifest(self):
        """The model's :class:`~sgl_rollout.weight_sync.manifest.WeightManifest`, built once; None when
        validation is off, the weights are FP8-quantized on the way (their names and dtypes differ from
        the checkpoint's), or it cannot be built (logged once)."""
        if self._manifest is _UNSET:
            self._manifest = None
            if self._fp8 or not self.rollout_config.validate_sync:
                return None
            path = model_path_of(self.model_config)
            try:
                from ..weight_sync.manifest import WeightManifest

                self._manifest = WeightManifest.from_pretrained(
                    path, trust_remote_code=bool(_get(self.model_config, "trust_remote_code", False)))
            except Exception as exc:  # noqa: BLE001 - a sync without validation beats no sync
                logger.warning("no weight manifest for %s (%r): weight syncs are not validated", path, exc)
        return self._manifest

    def _named_tensors(self, weights):
        """``weights`` with LoRA ``.base_layer.`` names folded, FP8-quantized when configured; a sync
        or an async iterator as ``weights`` (and the quantizer) make it."""
        weights = _renamed_async(weights) if hasattr(weights, "__aiter__") else _renamed_sync(weights)
        if self._fp8:
            from verl.utils.sglang.sglang_fp8_utils import SGLangFP8QuantizerHelper

            hf_config = _get(self.model_config, "hf_config", None)
            dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.bfloat16
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype)
            helper = SGLangFP8QuantizerHelper(fp8_quant_config(hf_config))
            weights = _checked_fp8(helper, helper.quant_weights_by_name(weights, dtype=dtype))
        return weights

    def _bucket_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else None

            def init():
                if device is not None:
                    torch.cuda.set_device(device)

            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="sgl-rollout-buckets", initializer=init)
        return self._executor

    def _payload_source(self, named) -> Tuple[BucketStream, Any]:
        """A BucketStream over ``named`` and an async ``next_payload()`` for it.

        A sync iterator is bucketed on this thread (verl's generators may run collectives that must stay
        on it). An async one is bucketed on a helper thread that pulls each item from this event loop,
        so the stream may read ahead as far as it needs (the manifest check reads to the end on a bad
        tensor) while the loop keeps running the generator.
        """
        from ..weight_sync.layered import layer_index

        kwargs = dict(manifest=self._sync_manifest(), partial=False, max_held=2,
                      group_of=layer_index if self.rollout_config.layered_summon else None)
        if not hasattr(named, "__aiter__"):
            stream = BucketStream(named, self.rollout_config.bucket_bytes, **kwargs)

            async def next_sync():
                return stream.next_payload()

            return stream, next_sync
        loop = asyncio.get_running_loop()
        stream = BucketStream(_AsyncToSyncIterator(named, loop, threading.current_thread()),
                              self.rollout_config.bucket_bytes, **kwargs)
        executor = self._bucket_executor()

        async def next_async():
            return await loop.run_in_executor(executor, stream.next_payload)

        return stream, next_async

    def _decide(self, payloads: List[Any], bucket: int, engine_errors: Sequence[str] = ()) -> str:
        """What every TP rank does after a round: stop (``_ERR: why``), end (``_DONE``) or load."""
        if engine_errors:
            return f"{_ERR}: " + "; ".join(engine_errors)
        errors = [f"TP rank {r}: {p[1]}" for r, p in enumerate(payloads) if isinstance(p, tuple) and p[:1] == (_ERR,)]
        if errors:
            return f"{_ERR}: bucket {bucket} failed on " + "; ".join(errors)
        done = [p is None for p in payloads]
        if all(done):
            return _DONE
        if any(done):
            return f"{_ERR}: TP ranks ran out of buckets at different times (bucket {bucket}: done={done})"
        return _LOAD

    async def update_weights(self, weights, wire_format: str = "named_tensors", peft_config=None,
                             base_sync_done: bool = True, global_steps: Optional[int] = None, **kwargs):
        """Stream ``weights`` to the engine in flattened buckets (or on the fast path, :meth:`_send_fast`,
        with ``engine_kwargs.sgl_rollout.fast_sync``), one weight sync.

        Every TP rank must call this and consume its generator (verl's full-tensor gathers are
        collective). The leader brackets the sync with the engine actor's ``begin_weight_sync`` /
        ``finish_weight_sync`` (no generate runs between buckets; the prefix cache is flushed at the
        end); a failure anywhere (a rank's generator, the manifest check, the engine) ends it with
        ``finish_weight_sync(ok=False)`` and raises on every TP rank. The buckets are pipelined: the
        engine loads bucket k while every rank flattens bucket k+1 (:meth:`_send_buckets`), so each
        rank holds up to two buckets (``rollout.update_weights_bucket_megabytes`` each) of extra GPU
        memory during the sync.

        Args:
            weights: ``(name, tensor)`` pairs in Hugging Face naming: a sync iterable or an async
                iterable (verl's checkpoint engines' ``receive_weights``); tensors of any dtype on this
                worker's GPU (or CPU).
            wire_format: only ``"named_tensors"``.
            peft_config: verl's LoRA adapter config (dict or ``peft.LoraConfig``) when it serves LoRA as
                an adapter, else None (full or merged weights).
            base_sync_done: with ``peft_config``: True: ``weights`` is the adapter (PEFT names), loaded
                as this replica's adapter (:data:`VERL_ADAPTER_NAME`), replacing the previous version;
                False: ``weights`` is the base model, sent only when the engine lacks it
                (:func:`~sgl_rollout.weight_sync.lora.needs_base_sync`, asked of the engine actor),
                else drained on every rank and dropped. Ignored without ``peft_config``.
            global_steps: the trainer step of these weights, reported in ``TokenOutput.extra_fields``.

        Raises:
            NotImplementedError: ``wire_format`` other than ``"named_tensors"``, or ``peft_config`` for an
                engine started without LoRA (``model.lora.merge=True``).
            BaseWeightsMissing: an adapter for an engine that lacks its base weights (it restarted, say);
                nothing was sent.
            SyncValidationError: the weights do not match the model's manifest (names, shapes, dtypes).
            RuntimeError: another TP rank failed, or the ranks disagree on the number of buckets.
            MemoryStateError, EngineDeadError, EngineClosedError: from the engine actor, unchanged.
        """
        if wire_format != "named_tensors":
            raise NotImplementedError(f"wire_format={wire_format!r} is not supported by sgl-rollout; set "
                                      f"{ROLLOUT_PREFIX}.checkpoint_engine.backend to a full-weight backend")
        if isinstance(weights, Mapping):
            raise TypeError("weights is a dict: pass dict.items() (verl passes a generator of (name, tensor))")
        if peft_config is not None:
            if not self.rollout_config.lora_enabled:
                raise NotImplementedError(
                    "verl passed a LoRA adapter (peft_config) but this engine serves no adapters: it was started "
                    f"without LoRA; set {MODEL_PREFIX}.lora_rank > 0 without lora.merge, or lora.merge=True")
            self._ensure_tp_group()
            if base_sync_done:
                await self._update_adapter(weights, peft_config, global_steps)
                return
            if not await self._base_needed():
                await _drain(weights)  # verl's generator may run collectives: every rank reads it
                self.base_syncs_skipped += 1
                logger.info("base weights not resent: the engine kept them (sleep level %d, free_cache_engine=%s)",
                            self.sleep_level, self.rollout_config.free_cache_engine)
                return
        self._ensure_tp_group()
        fast = self._fast_sender()
        if fast is not None:
            await self._send_fast(fast, self._named_tensors(weights), global_steps)
        else:
            await self._send_buckets(self._named_tensors(weights), global_steps)

    def _fast_sender(self) -> Optional[FastPathSender]:
        """This worker's fast-path sender (made on the first weight sync), or None: the flattened buckets.

        None when ``engine_kwargs.sgl_rollout.fast_sync`` is off, and (logged once) without CUDA or
        without the model's weight manifest (``validate_sync`` off, FP8, or unreadable), or when another
        TP rank of the replica lacks one of those (all TP ranks take the same path).
        """
        if self._fast is not None or not self.rollout_config.fast_sync:
            return self._fast
        reason = ""
        if not torch.cuda.is_available():
            reason = "no CUDA device in this trainer worker"
        elif self._sync_manifest() is None:
            reason = "no weight manifest (validate_sync off, FP8, or unreadable): the copy plan is made from it"
        reasons = [r for r in self._all_gather(reason) if r]
        if reasons:
            if not self._fast_off_logged:
                self._fast_off_logged = True
                logger.warning("fast_sync is on but weight syncs go through flattened buckets: %s", reasons[0])
            return None
        rnd = _FastPathRound(self)
        self._fast = FastPathSender(rnd, self._sync_manifest(), self.rollout_config.bucket_bytes,
                                    devices=[torch.device("cuda", torch.cuda.current_device())],
                                    tp_size=self.tp_size, tp_ranks=[self.tp_rank],
                                    share=rnd.share if self.tp_size > 1 else None)
        return self._fast

    async def _send_fast(self, sender: FastPathSender, named, global_steps: Optional[int]) -> None:
        """One weight sync on the fast path (``engine_kwargs.sgl_rollout.fast_sync``).

        Each TP rank's worker writes its own rank's shard of each bucket of the copy plan
        (:mod:`sgl_rollout.weight_sync.receiver`) into its buffer on its GPU, and the engine scatters
        every rank's buffer into its parameters in one call per bucket (:class:`_FastPathRound`). After
        the last bucket the engine closes the buffers' IPC handles and the workers free them, so no
        trainer memory is held while the trainer runs. A failure anywhere raises on every TP rank and
        ends the sync with ``finish_weight_sync(ok=False)``; the sender then asks for the copy plan
        again at the next sync (the engine may have restarted).
        """
        from ..weight_sync.manifest import SyncValidator

        began = False
        error: Optional[BaseException] = None
        try:
            if self.is_leader_rank:
                await self.server.begin_weight_sync.remote()
                began = True
            validator = SyncValidator(self._sync_manifest())
            if hasattr(named, "__aiter__"):  # items are pulled from this loop by a helper thread
                loop = asyncio.get_running_loop()
                items = _AsyncToSyncIterator(named, loop, threading.current_thread())
                await loop.run_in_executor(self._bucket_executor(), _fast_send, sender, items, validator)
            else:  # verl's sync generators may run collectives that must stay on this thread
                _fast_send(sender, named, validator)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the closing round
            error = exc
        peers = [] if isinstance(error, _PeerLeft) else sender.engine.close(error)
        if error is None and peers:
            error = RuntimeError("the weight sync failed on " + "; ".join(peers))
        ok = error is None
        if not ok:
            sender.reset(new_key=False)
        else:
            self.base_syncs += 1
        await self._end_sync(named, began, ok, global_steps)
        if error is not None:
            raise error

    async def _end_sync(self, named, began: bool, ok: bool, global_steps: Optional[int]) -> None:
        """Close verl's weights generator; the leader then ends the engine's sync (``finish_weight_sync``)
        if it began one. A failing ``finish_weight_sync`` is raised after a good sync and logged after a
        failed one (whose own error is the one to raise)."""
        await _aclose(named)
        if self.is_leader_rank and began:
            try:
                await self.server.finish_weight_sync.remote(ok=ok, global_steps=global_steps if ok else None)
            except Exception:
                if ok:
                    raise
                logger.exception("finish_weight_sync(ok=False) failed after a failed weight sync")

    def _submit(self, method: str, *args):
        """Start a call of the engine actor's ``method`` now; an awaitable of its answer, which raises
        what the call raised, or what starting it raised (the actor not found, say), so the leader
        still takes part in the round that reports it."""
        try:
            return getattr(self.server, method).remote(*args)
        except Exception as exc:  # noqa: BLE001 - raised where the answer is awaited
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            return failed

    async def _send_buckets(self, named, global_steps: Optional[int]) -> None:
        """One bucketed weight sync, pipelined: every TP rank flattens bucket k+1 while the engine loads
        bucket k.

        Each round, every rank flattens its next bucket (or finds none, or fails), the leader then waits
        for the engine's step in flight (``begin_weight_sync`` in the first round, bucket k-1's load
        after), and one all-gather gives every rank every rank's payload and the leader's answer. Every
        rank then drops all but its newest buffer (the engine is done with them), and all decide the
        same: stop on any failure, end when no rank has a bucket, else the leader starts the load of the
        round's payloads. So a rank holds at most two buckets, and no buffer is freed before the engine
        load that reads it has answered; on any exit the leader waits for a load in flight before the
        buffers go.
        """
        leader = self.is_leader_rank
        stream, next_payload = self._payload_source(named)
        pending, step = (self._submit("begin_weight_sync"), "begin a weight sync") if leader else (None, "")
        began = ok = False
        try:
            bucket = 0
            while True:
                local_exc: Optional[BaseException] = None
                try:
                    payload = await next_payload()
                except Exception as exc:  # noqa: BLE001 - reported to every TP rank, re-raised below
                    local_exc, payload = exc, (_ERR, f"{type(exc).__name__}: {exc}")
                engine_exc, engine_error = None, None
                if pending is not None:
                    try:
                        await pending
                        began = True
                    except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it
                        engine_exc, engine_error = exc, f"the engine refused to {step}: {exc}"
                    pending = None
                rounds = self._all_gather((payload, engine_error))
                stream.release(keep_newest=True)
                payloads = [p for p, _ in rounds]
                status = self._decide(payloads, bucket, [e for _, e in rounds if e])
                if status.startswith(_ERR):
                    raise local_exc or engine_exc or RuntimeError(status[len(_ERR) + 2:])
                if status == _DONE:
                    break
                if leader:
                    pending, step = self._submit("update_weights_from_payloads", payloads), f"load bucket {bucket}"
                bucket += 1
            ok = True
            self.base_syncs += 1
        finally:
            if pending is not None:  # left with a load in flight: its buffers stay until it answered
                try:
                    await pending
                    began = True
                except Exception:  # noqa: BLE001 - the sync has failed already; this is its cleanup
                    logger.exception("the engine failed to %s while the weight sync was failing", step)
            stream.release()
            await self._end_sync(named, began, ok, global_steps)

    async def _base_needed(self) -> bool:
        """The engine actor's answer to the base-resend rule, the same on every TP rank."""
        need, exc = None, None
        if self.is_leader_rank:
            try:
                need = bool(await self.server.base_sync_needed.remote())
            except Exception as e:  # noqa: BLE001 - the other ranks must hear of it
                exc, need = e, f"{_ERR}: the engine could not tell whether it holds its base weights: {e}"
        need = self._broadcast(need)
        if isinstance(need, str):
            if exc is not None:
                raise exc
            raise RuntimeError(need[len(_ERR) + 2:])
        return need

    async def _update_adapter(self, weights, peft_config, global_steps: Optional[int]) -> None:
        """Every rank reads verl's adapter tensors; the leader checks them (against the model's manifest and
        the engine's LoRA settings) and hands the engine actor one by-value payload; a failure on any rank
        or in the engine raises on every rank."""
        leader = self.is_leader_rank
        status, local_exc, payload = None, None, None
        try:
            items = await _collect(weights)
            if leader:
                payload = lora_sync.build_adapter_payload(items, peft_config, manifest=self._sync_manifest(),
                                                          engine_config=self.rollout_config)
            del items
        except Exception as exc:  # noqa: BLE001 - reported to every TP rank, re-raised below
            local_exc, status = exc, (_ERR, f"{type(exc).__name__}: {exc}")
        statuses = self._gather(status)
        engine_exc = None
        if leader:
            errors = [f"TP rank {r}: {p[1]}" for r, p in enumerate(statuses) if isinstance(p, tuple) and p[:1] == (_ERR,)]
            if errors:
                status = f"{_ERR}: the adapter sync failed on " + "; ".join(errors)
            else:
                try:
                    await self.server.load_lora_adapter.remote(VERL_ADAPTER_NAME, payload.data, payload.config)
                    status = _DONE
                except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it
                    engine_exc, status = exc, f"{_ERR}: the engine refused the adapter: {exc}"
        status = self._broadcast(status)
        if status != _DONE:
            if local_exc is not None:
                raise local_exc
            if engine_exc is not None:
                raise engine_exc
            raise RuntimeError(status[len(_ERR) + 2:])
        self.adapter_syncs += 1
        if leader and global_steps is not None:
            await self.server.set_global_steps.remote(global_steps)


def _fast_send(sender: FastPathSender, items, validator) -> None:
    """One fast-path sync of ``items`` by ``sender``, then the buffers freed (the engine closes its handles)."""
    sender.send(items, validator=validator)
    sender.release()


async def _collect(weights) -> list:
    """All ``(name, tensor)`` pairs of a sync or async iterable."""
    if hasattr(weights, "__aiter__"):
        return [item async for item in weights]
    return list(weights)


async def _drain(weights) -> None:
    """Read a sync or async iterable to its end, keeping nothing; then close it."""
    if hasattr(weights, "__aiter__"):
        async for _ in weights:
            pass
        await _aclose(weights)
    else:
        for _ in weights:
            pass
