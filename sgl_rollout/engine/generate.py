"""The engine's generation calls: admitted only while the memory state allows, aborted in SGLang when
their caller stops waiting."""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ..twin import twin
from .core import EngineCore, sigint_deferred

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    """One sampled completion.

    Attributes:
        output_ids: generated token ids (int), prompt excluded.
        logprobs: log-probability (float, natural log) of each generated token under the engine's
            sampling distribution, same length as ``output_ids``; empty if not requested.
        finish_reason: SGLang's finish reason type, e.g. ``"length"`` or ``"stop"``.
        prompt_logprobs: with ``logprob_start_len=s`` (see :meth:`GenerateCalls.generate`), one entry per
            prompt position ``i = s .. len(prompt) - 1``: ``log p(prompt[i] | prompt[:i])`` (float, natural
            log of the model's softmax: SGLang 0.5.10 scales prompt logprobs by no temperature or top_p);
            the first entry is None (SGLang's ``meta_info["input_token_logprobs"]``, whose first entry has
            no logprob). Length ``len(prompt) - s``. Empty if not requested.
        prompt_token_ids: the token id (int) of each entry of ``prompt_logprobs``: ``prompt[s:]`` as
            SGLang reports it (an id >= the model's ``vocab_size - 1`` as 0), same length. Empty if not
            requested.
        prompt_top_logprobs: with ``top_logprobs_num=k`` as well, one entry per entry of
            ``prompt_logprobs``: the ``k`` most likely tokens at that position as ``(logprob, token id)``
            pairs, most likely first (SGLang's ``meta_info["input_top_logprobs"]``); the first entry is
            None. Empty if not requested.
    """

    output_ids: List[int]
    logprobs: List[float] = field(default_factory=list)
    finish_reason: Optional[str] = None
    prompt_logprobs: List[Optional[float]] = field(default_factory=list)
    prompt_token_ids: List[int] = field(default_factory=list)
    prompt_top_logprobs: List[Optional[List[Tuple[float, int]]]] = field(default_factory=list)


class GenerateCalls:
    """Generation on :class:`~.core.EngineCore`: ``generate`` / ``async_generate`` and aborts.

    A generate whose caller is interrupted or cancelled is aborted in SGLang by request id and stays
    counted (:class:`~sgl_rollout.memory.MemoryState`) until SGLang has ended it, so a release cannot
    trip the scheduler's idle assertion. The first generate SGLang answers after each start sends its
    ``freeze_gc`` (``RolloutConfig.freeze_gc``).
    """

    def _on_start(self: EngineCore) -> None:
        super()._on_start()
        self._gc_freeze_due = bool(self.config.freeze_gc)

    def _freeze_gc_once(self: EngineCore, exc: Optional[BaseException]) -> None:
        """After the first generate SGLang answered since this start: ask SGLang to freeze the GC of its
        processes and of the one hosting its tokenizer manager (``RolloutConfig.freeze_gc``), without
        waiting. Never raises: it runs in the generate's done-callback, and a freeze that fails or is
        missing (an SGLang without ``freeze_gc``) only costs the longer collections."""
        if exc is not None or not getattr(self, "_gc_freeze_due", False):
            return
        self._gc_freeze_due = False
        try:
            freeze = getattr(self._tm(), "freeze_gc", None)
            if freeze is None:
                logger.info("this SGLang has no freeze_gc: the garbage collector stays as it is")
                return
            def report(f: concurrent.futures.Future) -> None:
                if not f.cancelled() and f.exception() is not None:
                    logger.warning("SGLang's freeze_gc failed (nothing else changes): %r", f.exception())

            self._submit(freeze).add_done_callback(report)
        except Exception as e:  # noqa: BLE001 - a dead engine or a missing manager: the generate's own path reports it
            logger.warning("SGLang's freeze_gc not sent: %r", e)

    @functools.cached_property
    def vocab_size(self: EngineCore) -> Optional[int]:
        """The served model's vocabulary size, from its ``config.json`` (read once); None where unknown.
        Bounds ``top_logprobs_num`` before a request reaches the scheduler (:func:`_prompt_logprob_args`)."""
        from ..config import vocab_size_of_model_path

        return vocab_size_of_model_path(self.config.model_path)

    def _start_generate(self: EngineCore, input_ids, sampling_params, n, return_logprob, lora_path=None,
                        request_args=None):
        batch = _expand(input_ids, n)
        self.check_alive()
        if lora_path is not None and not isinstance(lora_path, str):
            raise TypeError(f"lora_path must be an adapter name (str) or None, got {type(lora_path).__name__}")
        rids = [new_rid() for _ in batch]
        sent = None
        try:
            with sigint_deferred():  # counted and sent, or neither
                self.state.admit_request()
                try:
                    extra = dict(request_args or {})  # only when asked: SGLang's defaults otherwise
                    if lora_path is not None:
                        # read after admission: adapters change only inside a sync, which no request overlaps
                        extra["lora_path"] = [self._adapter_for_request(lora_path).sglang_name] * len(batch)
                    ids, rid, form = _request_form(batch, rids, extra)
                    sent = self._submit(
                        functools.partial(self._engine.async_generate, input_ids=ids,
                                          sampling_params=dict(sampling_params or {}),
                                          return_logprob=return_logprob, rid=rid, **form),
                        self._generate_done, private=True,  # its caller alone waits for it
                    )
                except BaseException:
                    self.state.request_done()
                    raise
        except BaseException:
            if sent is not None:  # a Ctrl-C held off while the batch was sent: it runs, so abort it
                self._abort(rids)
            raise
        return sent, rids

    def _generate_done(self: EngineCore, exc: Optional[BaseException]) -> None:
        """A generate's requests have ended in SGLang (``exc``: None, or how the call failed)."""
        self.state.request_done()
        self._freeze_gc_once(exc)

    def _abort(self: EngineCore, rids: List[str]) -> None:
        """Abort ``rids`` in SGLang (from the engine's loop); they stay counted until SGLang ends them."""
        if not self.alive:
            return
        tm = self._tm()

        def abort():
            for rid in rids:
                tm.abort_request(rid=rid)

        self._loop.call_soon_threadsafe(abort)
        logger.warning("generate interrupted: aborting %d request(s) in SGLang", len(rids))

    def _generate(
        self,
        input_ids: List[List[int]],
        sampling_params: Optional[Dict[str, Any]] = None,
        n: int = 1,
        return_logprob: bool = True,
        lora_path: Optional[str] = None,
        logprob_start_len: Optional[int] = None,
        top_logprobs_num: int = 0,
        image_data: Optional[List[Optional[List[Any]]]] = None,
        video_data: Optional[List[Optional[List[Any]]]] = None,
    ):
        """Sample ``n`` completions for each prompt.

        Concurrent calls (``async_generate`` from one loop, or several threads) are batched by SGLang's
        scheduler. An interrupted or cancelled call aborts its requests in SGLang.

        Args:
            input_ids: prompts as token-id lists, batch of B.
            sampling_params: SGLang sampling params (``temperature``, ``top_p``, ``max_new_tokens``, ...).
            n: samples per prompt, >= 1.
            return_logprob: also return each sampled token's log-probability.
            lora_path: name of a loaded LoRA adapter (``load_lora_adapter_from_tensors``) to apply;
                None: the base weights alone.
            logprob_start_len: also return the prompt's log-probabilities from this prompt position on
                (:attr:`Generation.prompt_logprobs`; SGLang's ``logprob_start_len``, 0: every position).
                Needs ``return_logprob``. None: none (SGLang's default, -1).
            top_logprobs_num: with ``logprob_start_len``, also the ``k`` most likely tokens at each of
                those prompt positions (:attr:`Generation.prompt_top_logprobs`; SGLang's
                ``top_logprobs_num``). 0: none.
            image_data: None, or one entry per prompt (B): None or that prompt's images, in the order of
                their placeholder runs in its ids (anything SGLang's ``load_image`` takes: ``PIL.Image``,
                bytes, a path, a URL, base64; ``sglang/srt/utils/common.py``). Each of the prompt's ``n``
                samples gets them. The prompt's ids carry the model's image placeholders (Qwen2.5-VL:
                ``<|vision_start|><|image_pad|>...<|vision_end|>``); SGLang's multimodal processor expands
                each run again from the image (``sglang/srt/multimodal/processors/``).
            video_data: the same for videos: a path, URL, bytes or base64 per video, or the one
                ``{"format": "processor_output", ...}`` dict of processor features that verl 0.9.1 sends
                (``build_sglang_video_payload`` in ``verl/experimental/agent_loop/agent_loop.py``).

        Returns:
            B lists of ``n`` :class:`Generation` each, in prompt order.

        Raises:
            MemoryStateError: a memory region is released, a release/resume/sync is in progress, or the
                last weight sync did not complete.
            EngineDeadError: the engine died (before or during the call); EngineClosedError: shut down.
            ValueError: ``n`` < 1, an empty batch or prompt, ``lora_path`` names no loaded adapter,
                ``logprob_start_len`` / ``top_logprobs_num`` out of range (``top_logprobs_num`` above the
                model's vocabulary size, which would kill SGLang's scheduler) or without what they need, or
                ``image_data`` / ``video_data`` not one list (or None) per prompt, an item an array or
                tensor, or a processor-output item's grid not ``N x 3`` (:func:`_check_media_item`).
            KeyboardInterrupt: re-raised after the batch's requests were aborted in SGLang.
        """
        args = _prompt_logprob_args(input_ids, return_logprob, logprob_start_len, top_logprobs_num,
                                    self.vocab_size)
        args.update(_multimodal_args(len(input_ids), n, image_data=image_data, video_data=video_data))
        fut, rids = self._start_generate(input_ids, sampling_params, n, return_logprob, lora_path, args)
        outs = yield self.waiting(fut, functools.partial(self._abort, rids))
        return _group(outs, n, return_logprob, logprob_start_len is not None, top_logprobs_num > 0)

    generate, async_generate = twin(_generate, before_sync=EngineCore._check_not_on_loop)

    def abort_all(self: EngineCore) -> None:
        """Abort every request running in SGLang (``abort_request(abort_all=True)``); they end shortly after.

        Raises:
            EngineDeadError, EngineClosedError: as every call.
        """
        self.check_alive()
        self._loop.call_soon_threadsafe(lambda: self._tm().abort_request(abort_all=True))


def _request_form(batch: List[List[int]], rids: List[str], extra: Dict[str, Any]):
    """``(input_ids, rid, other arguments)`` to send SGLang for ``batch`` (after :func:`_expand`) and the
    batch form's other arguments ``extra`` (not changed): a text-only batch of one goes as one request (bare
    ids and rid, ``lora_path`` a name), as
    verl's ``SGLangHttpServer`` sends it (``async_sglang_server.py``); anything else in SGLang's batch form.
    A batch of one would take SGLang's batch path (``TokenizerManager._handle_batch_request``; 0.5.12
    tokenizes it as a batch and sends a ``BatchTokenizedGenerateReqInput``), which costs every request of
    verl's agent loop, one call each, on its way in: 256 concurrent requests were in after 53.5 ms as
    batches of one and 39.6 ms as single requests (one H200, SGLang 0.5.12,
    ``python -m sgl_rollout.bench requests --engine sglang``, ``examples/bench/requests_h200_s14.json``). Requests with
    images or videos keep the batch form, whose per-request ``modalities`` (``"image"``, ``"multi-images"``;
    ``GenerateReqInput._normalize_image_data``, ``sglang/srt/managers/io_struct.py``) SGLang sets only there.
    """
    if len(batch) != 1 or "image_data" in extra or "video_data" in extra:
        return batch, rids, extra
    one = {k: (v[0] if k == "lora_path" else v) for k, v in extra.items()}
    return batch[0], rids[0], one


#: The process's prefix of :func:`new_rid`'s request ids (random, drawn once).
RID_PREFIX = uuid.uuid4().hex[:12]
_rid_numbers = itertools.count()


def new_rid() -> str:
    """A request id for SGLang (``GenerateReqInput.rid``), unique in this process: :data:`RID_PREFIX`, a dash
    and a counter as 16 hex digits (``itertools.count``: one step per call, atomic under the GIL).

    Every id has the same length, so none is the start of another: SGLang's scheduler aborts every request
    whose rid starts with the aborted one (``req.rid.startswith(recv_req.rid)``,
    ``sglang/srt/managers/scheduler.py``, 0.5.12), and a plain counter would abort request ``...-10`` with
    ``...-1``.

    Not ``uuid.uuid4()`` per request: that reads the OS's random source, a call during which Python lets go
    of the GIL. In a Ray actor the loop that serves the requests shares the GIL with Ray's own threads, and
    each such call may leave it waiting to get the GIL back. Through Ray on a 2-core CPU (``python -m
    sgl_rollout.bench requests --engine ray``, three runs each, medians;
    ``examples/bench/requests_ray_cpu_s16.json``), this package's server actor's loop spent 79 us of CPU per
    request more than a plain actor's with a uuid per request, and 52 us with the counter; its k-th request
    arrived 9.2 and 6.0 ms after the plain actor's.
    """
    return f"{RID_PREFIX}-{next(_rid_numbers):016x}"


def _expand(input_ids: List[List[int]], n: int) -> List[List[int]]:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not input_ids:
        raise ValueError("empty batch")
    for i, p in enumerate(input_ids):
        if not len(p):  # refused here, in one line, not left to SGLang's batch or single path to handle
            raise ValueError(f"prompt {i} has no token ids; SGLang needs at least one")
    return [list(p) for p in input_ids for _ in range(n)]


def _prompt_logprob_args(input_ids, return_logprob: bool, start: Optional[int], top: int,
                         vocab_size: Optional[int] = None) -> Dict[str, int]:
    """SGLang's ``logprob_start_len`` / ``top_logprobs_num`` for a request of prompt logprobs (empty
    when none is asked for, so SGLang keeps its defaults). ``vocab_size`` (None: unknown, unchecked)
    bounds ``top_logprobs_num``: SGLang's ``topk`` over more logits than there are would raise inside
    the scheduler and kill it (:func:`sgl_rollout.config.vocab_size_of_model_path`)."""
    if start is None:
        if top:
            raise ValueError("top_logprobs_num needs logprob_start_len (the prompt positions to return them for)")
        return {}
    if not return_logprob:
        raise ValueError("logprob_start_len needs return_logprob=True (SGLang ignores it otherwise)")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"logprob_start_len must be an int >= 0, got {start!r}")
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"top_logprobs_num must be an int >= 0, got {top!r}")
    if vocab_size is not None and top > vocab_size:
        raise ValueError(f"top_logprobs_num={top} exceeds the model's vocabulary of {vocab_size} tokens "
                         "(SGLang's scheduler would die on it)")
    short = [len(p) for p in input_ids if len(p) < start]
    if short:  # SGLang's scheduler would abort the request with an error
        raise ValueError(f"logprob_start_len={start} exceeds a prompt of {short[0]} tokens")
    args = {"logprob_start_len": start}
    if top:
        args["top_logprobs_num"] = top
    return args


def _multimodal_args(batch: int, n: int, **per_prompt: Optional[list]) -> Dict[str, list]:
    """SGLang's batch form of each multimodal field given (``image_data=[[...], ...]``: one list per
    request, each prompt's entry repeated for its ``n`` samples); a field that is None or holds no
    item is left out, so SGLang keeps its default. A flat list would be read by SGLang as one image
    per request (``GenerateReqInput._normalize_image_data``, ``sglang/srt/managers/io_struct.py``)."""
    args: Dict[str, list] = {}
    for key, entries in per_prompt.items():
        if entries is None:
            continue
        if not isinstance(entries, (list, tuple)) or len(entries) != batch:
            got = len(entries) if isinstance(entries, (list, tuple)) else type(entries).__name__
            raise ValueError(f"{key} takes one entry per prompt ({batch}), got {got}")
        bad = [type(e).__name__ for e in entries if e is not None and not isinstance(e, (list, tuple))]
        if bad:
            raise ValueError(f"{key}: each prompt's entry is a list of items or None, got {bad[0]}")
        for entry in entries:
            for item in entry or ():
                _check_media_item(key, item)
        if any(entries):
            args[key] = [list(e or []) for e in entries for _ in range(n)]
    return args


#: The grid fields of a processor-output item: one ``(t, h, w)`` row per image or video.
GRID_FIELDS = ("image_grid_thw", "video_grid_thw")


def _check_media_item(key: str, item: Any) -> None:
    """Refuse, in one line naming the field, a multimodal item SGLang would fail on later with a message
    that names none: an array or tensor (SGLang's ``load_image`` takes ``PIL.Image``, bytes, a path, a
    URL or base64; ``sglang/srt/utils/common.py``), or a processor-output dict whose ``image_grid_thw`` /
    ``video_grid_thw`` is not ``N x 3`` (the rotary positions read one ``(t, h, w)`` row per item).

    Raises:
        ValueError: as above.
    """
    if isinstance(item, dict):
        if item.get("format") != "processor_output":
            return
        for field_name in GRID_FIELDS:
            grid = item.get(field_name)
            if grid is None:
                continue
            shape = tuple(getattr(grid, "shape", ())) or _list_shape(grid)
            if not (shape == (3,) or (len(shape) == 2 and shape[1] == 3 and shape[0] > 0)):
                raise ValueError(f"{key}: a processor-output item's {field_name} must be N x 3 (t, h, w per "
                                 f"item), got shape {shape}")
        return
    if hasattr(item, "shape") and hasattr(item, "dtype"):
        raise ValueError(f"{key}: an item is a {type(item).__name__} of shape {tuple(item.shape)}; SGLang takes "
                         "a PIL image, bytes, a path, a URL or base64, or a {'format': 'processor_output', ...} dict")


def _list_shape(value: Any) -> Tuple[int, ...]:
    """The shape of nested lists (``[[1, 2, 2]]`` -> ``(1, 3)``; ragged or scalar -> ``()``)."""
    if not isinstance(value, (list, tuple)):
        return ()
    if value and all(isinstance(v, (list, tuple)) for v in value):
        widths = {len(v) for v in value}
        return (len(value), widths.pop()) if len(widths) == 1 else ()
    return (len(value),)


def _group(outs: List[Dict[str, Any]], n: int, with_logprob: bool, with_prompt: bool = False,
           with_top: bool = False) -> List[List[Generation]]:
    if isinstance(outs, dict):  # SGLang returns a bare dict for a batch of one
        outs = [outs]
    gens = [_to_generation(o, with_logprob, with_prompt, with_top) for o in outs]
    return [gens[i : i + n] for i in range(0, len(gens), n)]


def _to_generation(out: Dict[str, Any], with_logprob: bool, with_prompt: bool = False,
                   with_top: bool = False) -> Generation:
    meta = out.get("meta_info", {})
    finish = meta.get("finish_reason")
    logprobs: List[float] = []
    if with_logprob:
        logprobs = [float(lp) for lp, _tok, *_ in meta.get("output_token_logprobs", [])]
    gen = Generation(
        output_ids=list(out["output_ids"]),
        logprobs=logprobs,
        finish_reason=finish.get("type") if isinstance(finish, dict) else finish,
    )
    if with_prompt:
        # SGLang 0.5.10 (tokenizer_manager.detokenize_logprob_tokens): (logprob, token id, text or None)
        entries = meta.get("input_token_logprobs") or []
        gen.prompt_logprobs = [None if lp is None else float(lp) for lp, _tok, *_ in entries]
        gen.prompt_token_ids = [int(tok) for _lp, tok, *_ in entries]
    if with_prompt and with_top:
        gen.prompt_top_logprobs = [None if top is None else [(float(lp), int(tok)) for lp, tok, *_ in top]
                                   for top in meta.get("input_top_logprobs") or []]
    return gen
