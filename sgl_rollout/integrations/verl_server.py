"""The engine side of ``rollout.name=sglang`` under verl: the replica and its server actors.

Interfaces implemented (verl 0.9.1, read from its source):

* :class:`SglRolloutReplica` is verl's ``RolloutReplica`` (``verl/workers/rollout/replica.py``): its
  ``launch_servers`` starts one :class:`VerlRolloutServer` actor per replica on the node of its
  workers, with :mod:`sgl_rollout.server`'s ``runtime_env`` (and a :class:`VerlNodeHost` on each other node
  of a replica over several nodes).
* :class:`VerlRolloutServer` adds to :class:`sgl_rollout.server.RolloutServer` what verl's replica,
  ``LLMServerClient`` (``verl/workers/rollout/llm_server.py``) and ``CheckpointEngineManager`` call:
  ``generate`` returning ``TokenOutput``, ``abort_all_requests``, ``resume_generation``,
  ``clear_kv_cache``, ``release_kv_cache``, ``resume_kv_cache``, ``start_profile``, ``stop_profile``,
  ``get_server_address``, ``set_global_steps``. The trainer side, which sends the weights to it, is
  :mod:`.verl_rollout`.

Server addresses: verl keys its request load balancer (``verl/workers/rollout/router.py``) and its
metrics by ``server_address``, so every replica needs its own. Each server actor reserves a free TCP
port on its node (bound, never listening) and reports ``"<node-ip>:<port>"``: unique per node and
stable for the actor's life. There is no HTTP server behind it (verl's token-in/token-out path calls
the actor, not HTTP): a connection to it is refused at once. The verl features that need HTTP
(GenRM's reward router, Prometheus, rl-insight metrics) are refused at start-up instead.

LoRA served as an adapter (verl's ``model.lora_rank`` or ``model.lora.rank`` > 0 without
``model.lora.merge``), as verl 0.9.1's own SGLang rollout serves it: the engine starts with LoRA
(:func:`~.verl_config.verl_lora_settings`), sleeps at level 1 (the base weights stay resident; only the
KV cache is released), and every request carries the adapter (:data:`~.verl_config.VERL_ADAPTER_NAME`)
once the trainer has loaded one (:meth:`VerlRolloutServer.load_lora_adapter`).

A replica wider than a node runs as one actor per node, the leader and a :class:`VerlNodeHost` on each
other node, hosting that node's SGLang schedulers (:meth:`SglRolloutReplica.launch_servers`).

Not supported (refused at start-up with the verl key to change, :mod:`.verl_config`):
``checkpoint_engine.backend=delta_sharded``, prefill/decode disaggregation, MTP rollout,
routing replay, generative reward models, distillation teacher replicas (not yet run end to end
here, though :meth:`VerlRolloutServer.generate` returns the ``prompt_logprobs`` a teacher asks for),
image/audio/video inputs; with a LoRA adapter also FP8 rollout, regex ``target_modules`` and
checkpoint-engine backends other than ``naive`` (they send the base only).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from typing import Dict, List, Optional, Tuple

import ray
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from .. import trace
from ..config import RolloutConfig
from ..memory import KV_CACHE
from ..server import NodeEngineHost, RolloutServer, launch_replica, launch_rollout_server, merge_visible_devices
from ..switch import sleep_stages
from ..weight_sync import lora as lora_sync
from ..weight_sync.driver import EngineFence, async_sync_fenced
from .verl_config import (
    ROLLOUT_PREFIX,
    VERL_ADAPTER_NAME,
    VERL_BUILTIN,
    UnsupportedVerlFeature,
    _get,
    check_served_features,
    check_verl_tp,
    max_position_embeddings,
    model_path_of,
    resolve_local_model,
    rollout_config_for_verl,
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

__all__ = ["SglRolloutReplica", "VerlNodeHost", "VerlRolloutServer", "server_name"]


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


# ======================================================================= prompt logprobs
def _prompt_logprobs_arg(params: dict) -> Optional[int]:
    """Pop verl's ``prompt_logprobs`` (vLLM's key: K top tokens per prompt position, 0: the prompt token
    alone) from ``params``; with it, vLLM's ``detokenize`` too (the teacher sends ``detokenize=False``,
    a key SGLang's ``SamplingParams`` refuses). None: not asked for.

    Raises:
        ValueError: K is not an int >= 0.
    """
    k = params.pop("prompt_logprobs", None)
    if k is None:
        return None
    params.pop("detokenize", None)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"prompt_logprobs must be an int >= 0 (top tokens per prompt position), got {k!r}")
    return k


def teacher_prompt_logprobs(gen, k: int, prompt: List[int]) -> Dict[str, list]:
    """The ``extra_fields`` verl's distillation teacher reads, from a generation asked for prompt logprobs
    from position 0 (``logprob_start_len=0``, ``top_logprobs_num=k``).

    verl's consumer (``AsyncTeacherLLMServerManager.compute_teacher_logprobs_single``,
    ``verl/experimental/teacher_loop/teacher_manager.py``) turns them into
    ``torch.tensor(prompt_ids, dtype=torch.int32)`` and ``torch.tensor(prompt_logprobs)`` (float32) and
    asserts both have ``len(prompt)`` rows. The layout is vLLM's (``extract_prompt_logprobs``,
    ``verl/workers/rollout/vllm_rollout/utils.py``), which verl's SGLang server reproduces
    (``_extract_prompt_logprobs_sglang``, ``verl/workers/rollout/sglang_rollout/async_sglang_server.py``):

    * ``"prompt_ids"``: ``[len(prompt)][max(k, 1)]`` ints; ``"prompt_logprobs"``: the same shape of floats
      (natural log);
    * row ``j < len(prompt) - 1`` is about prompt position ``j + 1``, predicted from ``prompt[:j + 1]``:
      with ``k = 0`` the token ``prompt[j + 1]`` and its logprob; with ``k > 0`` the ``k`` most likely
      tokens and their logprobs, most likely first (they need not contain ``prompt[j + 1]``);
    * the last row is padding: ids 0, logprobs 0.0 (position 0 has no logprob: nothing predicts it).

    With ``k = 0`` the ids are ``prompt``'s own (verl's server takes SGLang's, which are the same but for an
    id >= ``vocab_size - 1``, reported as 0).

    Raises:
        RuntimeError: SGLang's prompt logprobs do not cover the prompt (e.g. a request aborted before its
            prefill), or a position has not ``k`` top tokens.
    """
    prompt_len = len(prompt)
    if len(gen.prompt_logprobs) != prompt_len or (k and len(gen.prompt_top_logprobs) != prompt_len):
        raise RuntimeError(f"SGLang returned prompt logprobs for {len(gen.prompt_logprobs)} of {prompt_len} prompt "
                           f"positions (top-{k}: {len(gen.prompt_top_logprobs)}; finish reason {gen.finish_reason!r})")
    ids, logprobs = [], []
    for pos in range(1, prompt_len):
        if k == 0:
            ids.append([int(prompt[pos])])
            logprobs.append([float(gen.prompt_logprobs[pos])])
            continue
        top = gen.prompt_top_logprobs[pos] or []
        if len(top) != k:
            raise RuntimeError(f"SGLang returned {len(top)} top logprobs at prompt position {pos}, expected {k}")
        ids.append([int(tok) for _lp, tok in top])
        logprobs.append([float(lp) for lp, _tok in top])
    if prompt_len:
        ids.append([0] * max(k, 1))
        logprobs.append([0.0] * max(k, 1))
    return {"prompt_ids": ids, "prompt_logprobs": logprobs}


# ======================================================================= server actor
def _refuse_unserved(audio_data, mm_processor_kwargs, kwargs: dict) -> None:
    """Refuse what :meth:`VerlRolloutServer.generate` does not serve (audio, per-request processor
    settings, any other argument that is not None).

    Raises:
        NotImplementedError: naming it.
    """
    if audio_data:
        raise NotImplementedError("sgl-rollout takes images and videos but not audio_data "
                                  "(verl's built-in SGLang server takes no audio either)")
    if mm_processor_kwargs:
        raise NotImplementedError(
            "sgl-rollout takes images and videos but not mm_processor_kwargs (SGLang's requests carry no "
            "processor settings, nor does verl's built-in server pass them): set data.mm_processor_kwargs "
            "to null and put the processor's settings in the model folder's preprocessor_config.json")
    extra = sorted(k for k, v in kwargs.items() if v is not None)
    if extra:
        raise NotImplementedError(f"sgl-rollout's generate does not take {extra}")


def _items(data) -> list:
    """One request's images or videos as a list: a list or tuple as is, a single item (one image, one path,
    one processor-output dict) as a list of one."""
    return list(data) if isinstance(data, (list, tuple)) else [data]


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
        #: why requests parked at a pause must end instead of waiting for resume_generation (a failed
        #: weight sync, a shutdown); None while nothing went wrong. Woken through _parked_wake.
        self._pause_failure: Optional[str] = None
        self._parked_wake: Optional[asyncio.Event] = None
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
        if self.engine is None:
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

    #: Seconds between a parked request's looks at the engine (dead, restarted, shut down).
    PARKED_POLL_S = 0.5

    async def _admit(self) -> None:
        """Return once generation is not paused (:meth:`abort_all_requests`).

        The gate is checked again after every wake-up (issue 39): :meth:`resume_generation` wakes the
        held requests, but they run only at the loop's next turn; a pause begun before then (the next
        weight update's ``abort_all_requests`` right after the resume) must hold them again, or they
        would reach the engine during that update's weight sync and fail with ``MemoryStateError``.

        A parked request does not wait for a resume that will not come (issue 46): it ends with the
        reason when the weight sync of the pause fails (:meth:`finish_weight_sync` with ``ok=False``:
        verl's checkpoint manager then never calls :meth:`resume_generation`), when the engine dies or
        restarts (seen within :data:`PARKED_POLL_S`), or when the server shuts down.

        Raises:
            RuntimeError: paused with ``reject_request=True``; the pause's weight sync failed, or the
                engine restarted while the request waited.
            EngineDeadError, EngineClosedError: the engine died or was shut down while it waited.
        """
        gate = self._gate()
        if gate.is_set():
            return
        engine = self._engine
        started = engine.generation
        wake = self._parked_wakeup()
        while not gate.is_set():
            if self._reject:
                raise RuntimeError("this replica's generation is paused with reject_request=True "
                                   "(abort_all_requests); send the request to another replica")
            if self._pause_failure is not None:
                raise RuntimeError(f"this request waited for resume_generation, which will not come: "
                                   f"{self._pause_failure}")
            engine.check_alive()
            if engine.generation != started:
                raise RuntimeError("the engine restarted while this request waited for resume_generation; "
                                   "its weights are the checkpoint's until the next weight sync")
            waits = [asyncio.ensure_future(gate.wait()), asyncio.ensure_future(wake.wait())]
            try:
                await asyncio.wait(waits, timeout=self.PARKED_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    def _parked_wakeup(self) -> asyncio.Event:
        if self._parked_wake is None:
            self._parked_wake = asyncio.Event()
        return self._parked_wake

    def _end_parked(self, why: str) -> None:
        """End every request parked at the pause with ``why`` (:meth:`_admit`), and every later one
        until the next :meth:`abort_all_requests` or :meth:`resume_generation`."""
        if self._accepting is not None and not self._accepting.is_set():
            self._pause_failure = why
            self._parked_wakeup().set()

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

    @trace.traced("server.generate")
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
                ``prompt_logprobs=K`` (int >= 0; verl's distillation teacher,
                ``verl/experimental/teacher_loop/teacher_manager.py``) also returns the prompt's
                log-probabilities (:func:`teacher_prompt_logprobs`); vLLM's ``detokenize`` (sent with
                it) is dropped, as SGLang's sampling params have no such key.
            request_id: verl's request id (for logs; SGLang gets its own).
            image_data: this request's images (verl's agent loop sends ``PIL.Image``s, every image of the
                conversation so far, in the order of their placeholder runs in ``prompt_ids``); they reach
                SGLang's multimodal processor as verl's built-in server sends them
                (``async_sglang_server.py``, ``GenerateReqInput.image_data``).
            video_data: this request's videos; from verl 0.9.1's client, one
                ``{"format": "processor_output", ...}`` dict of the processor's features
                (``verl/workers/rollout/llm_server.py``), which SGLang takes as is.
            audio_data, mm_processor_kwargs: refused (see Raises).

        Returns:
            ``TokenOutput`` with ``token_ids``, ``log_probs`` (None unless ``logprobs`` or
            ``prompt_logprobs``, which need SGLang's ``return_logprob`` as in verl's server),
            ``stop_reason`` (SGLang's finish reason: ``"length"``, ``"stop"``, ``"abort"``) and
            ``extra_fields["global_steps"]``: the step when the request reached the engine (no sync changes
            the weights while it runs); with ``prompt_logprobs``, also ``extra_fields["prompt_ids"]`` and
            ``["prompt_logprobs"]``. A request arriving while :meth:`abort_all_requests` paused generation
            waits for :meth:`resume_generation` (SGLang's behaviour), or fails with ``reject_request=True``.

        Raises:
            NotImplementedError: audio input or per-request ``mm_processor_kwargs`` (neither reaches
                SGLang through verl's built-in server either), or any other argument this server does
                not serve.
            ValueError: negative ``max_new_tokens`` or ``prompt_logprobs``, ``prompt_logprobs`` above the
                vocabulary size, the prompt does not fit the context, or an image or video SGLang cannot
                take (an array or tensor, a processor-output grid not ``N x 3``), in one line naming it.
            RuntimeError: paused with ``reject_request=True``; SGLang's prompt logprobs do not cover the
                prompt (:func:`teacher_prompt_logprobs`).
            MemoryStateError, EngineDeadError, EngineClosedError: from the engine, unchanged.
        """
        if audio_data or mm_processor_kwargs or kwargs:
            _refuse_unserved(audio_data, mm_processor_kwargs, kwargs)
        params = dict(sampling_params)
        top_k = _prompt_logprobs_arg(params)
        return_logprob = bool(params.pop("logprobs", False)) or top_k is not None
        ids = prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else list(prompt_ids)
        params["max_new_tokens"] = self._max_new_tokens(params, len(ids))
        if not self._gate().is_set():  # paused (abort_all_requests): wait for resume_generation
            await self._admit()
        extra_fields = {"global_steps": self.global_steps}  # on admission: an abort may answer after the next step
        self._served["total"] += 1
        self._served["since_sleep"] += 1
        prompt = {} if top_k is None else {"logprob_start_len": 0, "top_logprobs_num": top_k}
        mm = {} if image_data is None and video_data is None else {
            k: [_items(v)] for k, v in (("image_data", image_data), ("video_data", video_data)) if v is not None}
        gen = (await self._engine.async_generate([ids], params, n=1, return_logprob=return_logprob,
                                                 lora_path=self._request_adapter(), **prompt, **mm))[0][0]
        token_ids, log_probs = gen.output_ids, (gen.logprobs if return_logprob else None)  # ours, fresh: no copy
        if return_logprob and len(log_probs) != len(token_ids):
            # SGLang can report a logprob without a token (max_new_tokens=0) or none on an abort;
            # verl's server then returns neither, and so does this one.
            logger.error("request %s: %d logprobs for %d tokens; returning none of either",
                         request_id, len(log_probs), len(token_ids))
            token_ids, log_probs = [], []
        if top_k is not None:
            extra_fields.update(teacher_prompt_logprobs(gen, top_k, ids))
        return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason=gen.finish_reason,
                           extra_fields=extra_fields)

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
        record = await async_sync_fenced(
            EngineFence(engine), lambda: engine.async_load_lora_adapter_from_tensors(name, payload, config_dict))
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
        self._pause_failure = None
        self._parked_wakeup().clear()
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
        self._pause_failure = None
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
        if KV_CACHE not in sleep_stages(self.config):
            return []
        return await self._switch.async_release_stage(KV_CACHE)

    async def resume_kv_cache(self) -> List[str]:
        """Resume the KV cache (and CUDA-graph memory) if released."""
        return await self.resume_stage(KV_CACHE)

    async def start_profile(self, **kwargs) -> None:
        """No-op, as verl's SGLang server outside discrete profiling (which is refused at start-up)."""

    async def stop_profile(self) -> None:
        """See :meth:`start_profile`."""

    async def finish_weight_sync(self, ok: bool = True, global_steps: Optional[int] = None) -> None:
        """:meth:`RolloutServer.finish_weight_sync`; a failed sync during a pause also ends the requests
        parked at it (verl's checkpoint manager raises and never calls :meth:`resume_generation`)."""
        try:
            await super().finish_weight_sync(ok, global_steps)
        finally:
            if not ok:
                self._end_parked("the weight sync of this pause failed; the engine refuses generates until a "
                                 "weight sync completes")

    async def shutdown(self) -> None:
        """Stop the engine's processes and give the reserved port back; requests parked at a pause end."""
        self._end_parked("the server shut down")
        try:
            await super().shutdown()
        finally:
            self._port_sock.close()


# ======================================================================= replica
class VerlNodeHost(NodeEngineHost):
    """:class:`~sgl_rollout.server.NodeEngineHost` that also answers the calls verl's replica makes on every
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
    serve: generative reward models (their router posts HTTP to each replica), distillation teacher
    replicas (not yet run end to end; their ``prompt_logprobs`` requests are served by
    :meth:`VerlRolloutServer.generate`), rl-insight metrics (HTTP), and the rollout features of
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
                "distillation.teacher_models.<teacher>.inference.name='sglang': sgl-rollout returns the prompt "
                "log-probabilities a teacher asks for, but a teacher replica (started colocated on its own GPUs "
                "from the teacher's model path, never synced) has not been run through sgl-rollout yet; set that "
                "inference.name=vllm (verl 0.9.1's built-in SGLang server hands the teacher's detokenize=False "
                "to SGLang 0.5.10's SamplingParams, which refuses it)")
        if os.environ.get("VERL_RL_INSIGHT_ENABLE") == "1":
            raise UnsupportedVerlFeature(
                "VERL_RL_INSIGHT_ENABLE=1: rl-insight scrapes rollout metrics over HTTP from each replica's "
                f"address and sgl-rollout serves no HTTP; unset it, or {VERL_BUILTIN}")
        check_served_features(self.config, self.model_config)
        check_verl_tp(self.config, self.model_config)

    @property
    def name(self) -> str:
        """Ray actor name of this replica's server (:func:`server_name`)."""
        return server_name(self.replica_rank, 0, self.role, self._name_suffix)

    async def launch_servers(self):
        """Start the engine actor on the node of this replica's workers, on the GPUs they use; for a
        replica over several nodes (``tensor_model_parallel_size`` x ``data_parallel_size`` above the
        GPUs per node), one actor per node: the leader (:class:`VerlRolloutServer`, node rank 0, which
        verl's clients and the trainer's rollout talk to) and a :class:`VerlNodeHost` on each other node,
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
