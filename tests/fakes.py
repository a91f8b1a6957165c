"""An engine double that behaves as SGLang 0.5.10 does where it matters to this package.

* Release/resume/update requests take effect when they are *sent*, and are answered
  ``answer_delay_s`` later: a caller interrupted in between has still changed the engine.
* A generate keeps running when its caller is cancelled, until ``abort_request(rid)``.
* A call that would kill SGLang's scheduler (double release, resume of a resident tag, release while
  requests run, a copy into released weights, generate on released memory, a wrong-shape tensor)
  "kills" it: the double's scheduler process (a real child process) is SIGKILLed, the call never
  answers, and ``dead`` is set. Tests assert ``dead`` stays False for bad calls.
"""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading


def _plain_request_objects():
    """SGLang's ``io_struct`` imports its serving stack (torchvision, ...), absent on the CPU test
    machine; the double only reads the request objects' fields, so plain namespaces stand in for
    them, in whichever process (a Ray actor's too) builds the double."""
    import types

    import sgl_rollout.engine.io_struct as engine_mod

    try:
        import sglang.srt.managers.io_struct  # noqa: F401
    except Exception:  # noqa: BLE001
        engine_mod.make = lambda name, **fields: types.SimpleNamespace(**fields)


class FakeTokenizerManager:
    """The tokenizer-manager coroutines :class:`sgl_rollout.engine.RolloutEngine` calls."""

    def __init__(self, engine):
        self.engine = engine
        self._subprocess_watchdog = None

    async def _answer(self):
        if self.engine.answer_delay_s:
            await asyncio.sleep(self.engine.answer_delay_s)

    async def release_memory_occupation(self, obj, request):
        e = self.engine
        await e._alive()
        e.calls.append(("release", tuple(obj.tags)))
        if e.running:
            await e._die("release while busy: is_fully_idle() assertion")
        if e.released & set(obj.tags):
            await e._die("torch-memory-saver exit(1)")
        e.released |= set(obj.tags)
        await self._answer()

    async def resume_memory_occupation(self, obj, request):
        e = self.engine
        await e._alive()
        e.calls.append(("resume", tuple(obj.tags)))
        if set(obj.tags) - e.released:
            await e._die("KeyError in offload_tags.remove")
        e.released -= set(obj.tags)
        await self._answer()

    async def update_weights_from_tensor(self, obj, request):
        e = self.engine
        await e._alive()
        if "weights" in e.released:
            await e._die("copy into freed weights")
        e.calls.append(("update_weights", obj.load_format, len(obj.serialized_named_tensors), obj.flush_cache))
        if obj.flush_cache and e.prefix_cache is not None:
            e.prefix_cache.clear()
        if e.running:
            e.mixed_weight_generates += len(e.running)
        if e.on_update is not None:
            e.on_update(obj.serialized_named_tensors)
            await e._alive()  # a scheduler killed by on_update never answers
        await self._answer()
        if e.fail_next_update:
            e.fail_next_update = False
            return False, "injected load failure"
        return True, "Success"

    async def freeze_gc(self):
        """SGLang's: tells the scheduler to ``gc.freeze()`` and freezes this process (the double only counts,
        in ``engine.gc_freezes``, apart from ``calls``; ``freeze_error`` makes it raise)."""
        await self.engine._alive()
        if self.engine.freeze_error is not None:
            raise self.engine.freeze_error
        self.engine.gc_freezes += 1

    async def flush_cache(self):
        await self.engine._alive()
        self.engine.calls.append(("flush_cache",))
        if self.engine.prefix_cache is not None:
            self.engine.prefix_cache.clear()

    async def load_lora_adapter_from_tensors(self, obj, request):
        """SGLang 0.5.10's path: refusals come back as ``success=False``; an unreadable payload kills the
        scheduler (``TpModelWorker`` deserializes outside any try); tensors that do not fit the LoRA
        memory pool kill it when a batch first uses the adapter (the double: at that generate)."""
        e = self.engine
        await e._alive()
        if not e.server_args.get("enable_lora"):
            return _lora_out(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        try:
            tensors = _read_adapter_payload(obj.serialized_tensors, obj.load_format)
        except Exception as exc:  # noqa: BLE001 - what the real scheduler dies of
            await e._die(f"unreadable adapter payload: {exc!r}")
        nbytes = len(obj.serialized_tensors)
        e.calls.append(("load_lora", obj.lora_name, len(tensors), nbytes))
        if e.on_lora is not None:
            e.on_lora(obj.lora_name, tensors, dict(obj.config_dict))
        await self._answer()
        if e.fail_next_lora:
            e.fail_next_lora = False
            return _lora_out(False, "injected adapter load failure")
        if obj.lora_name in e.lora:
            return _lora_out(False, f"Failed to load LoRA adapter {obj.lora_name} because it is already loaded")
        e.lora[obj.lora_name] = {"config": dict(obj.config_dict), "tensors": tensors,
                                 "bad": _adapter_misfit(e, tensors, obj.config_dict)}
        return _lora_out(True)

    async def unload_lora_adapter(self, obj, request):
        e = self.engine
        await e._alive()
        e.calls.append(("unload_lora", obj.lora_name))
        if obj.lora_name not in e.lora:
            return _lora_out(False, f"LoRA with name {obj.lora_name} does not exist.")
        del e.lora[obj.lora_name]
        return _lora_out(True)

    def abort_request(self, rid="", abort_all=False):
        e = self.engine
        e.calls.append(("abort", "*" if abort_all else rid))
        if abort_all:
            e.aborted |= set(e.running)
        elif rid in e.running:
            e.aborted.add(rid)


def _lora_out(success, error_message=""):
    import types

    return types.SimpleNamespace(success=success, error_message=error_message)


def _read_adapter_payload(data, load_format):
    """The adapter's tensors as SGLang's scheduler reads them (its own deserializer and bucket class)."""
    from sglang.srt.utils.common import MultiprocessingSerializer

    obj = MultiprocessingSerializer.deserialize(data)
    if load_format != "flattened_bucket":
        return dict(obj)
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"])
    return dict(bucket.reconstruct_tensors())


def _adapter_misfit(e, tensors, config):
    """Why SGLang's LoRA memory pool would assert on these tensors (None: they fit)."""
    import re

    r = config.get("r")
    if r is None or r > (e.server_args.get("max_lora_rank") or 0):
        return f"rank {r} above max_lora_rank"
    for name, t in tensors.items():
        if re.search(r"\.(q|k|v|o|gate|up|down)_proj\.lora_[AB]\.weight$", name) is None:
            return f"{name}: no target module"
        if t.dim() != 2:
            return f"{name}: not 2-D"
        module = name[len("base_model.model."):].rsplit(".lora_", 1)[0]
        ab = "A" if ".lora_A." in name else "B"
        if ab == "A" and t.shape[0] != r or ab == "B" and t.shape[1] != r:
            return f"{name}: rank dim of {tuple(t.shape)} is not {r}"
        if e.lora_base_shapes is not None:
            out_in = e.lora_base_shapes.get(module)
            if out_in is None:
                return f"{name}: no base module {module}"
            if (ab == "A" and t.shape[1] != out_in[1]) or (ab == "B" and t.shape[0] != out_in[0]):
                return f"{name}: shape {tuple(t.shape)} does not fit base {out_in}"
    return None


class FakeSGLangEngine:
    """``sglang.Engine`` double: ``tokenizer_manager`` coroutines, ``async_generate``, a scheduler process."""

    def __init__(self, **server_args):
        _plain_request_objects()
        self.server_args = server_args
        self.env_at_start = dict(os.environ)
        self.calls = []
        self.released = set()
        self.running = set()
        self.aborted = set()
        self.dead = False
        self.death_reason = None
        self.block = None  # threading.Event: generates wait on it (or on an abort) when set
        self.entered = threading.Event()
        self.answer_delay_s = 0.0
        self.fail_next_update = False
        self.gc_freezes, self.freeze_error = 0, None  # SGLang's freeze_gc calls (FakeTokenizerManager.freeze_gc)
        self.on_update = None
        self.mixed_weight_generates = 0
        # decode model (None: a generate answers at once, or when ``block`` is set, with all its tokens):
        # one token per request every ``decode_step_s`` seconds; an aborted request ends at once with the
        # tokens it has so far and finish reason "abort" (SGLang's partial output)
        self.decode_step_s = None
        # prefix (radix) cache model, off while None (a test sets ``set()``): every prefix of each prompt
        # + output seen since the last flush; ``cached_tokens`` lists, per request, its prompt's longest
        # cached prefix (0: a miss), and ``meta_info["cached_tokens"]`` carries it as SGLang's does
        self.prefix_cache = None
        self.cached_tokens = []
        # LoRA: adapters by SGLang name; base module shapes (module path -> (out, in)) to check against
        self.lora = {}
        self.lora_base_shapes = None
        self.on_lora = None
        self.fail_next_lora = False
        self.last_lora_path = None
        # every generate's batch as SGLang got it (input_ids, image_data, video_data, sampling_params)
        self.requests = []
        self.forms = []  # "single" / "batch": the form of each async_generate (SGLang takes both)
        # None, or a function of a prompt's ids giving the whole answer's ids (finish reason "stop")
        self.reply = None
        self.decoded_tokens = 0  # decode steps of the scripted model, for tests that act mid-answer
        self.tokenizer_manager = FakeTokenizerManager(self)
        # the "scheduler": a real child process, so that death is seen the way a real one is
        self.scheduler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def _alive(self):
        if self.dead:
            await asyncio.Event().wait()  # a dead scheduler never answers

    async def _die(self, reason):
        self.dead, self.death_reason = True, reason
        os.kill(self.scheduler.pid, signal.SIGKILL)
        await asyncio.Event().wait()

    def kill_scheduler(self):
        """What ``kill -9`` of the scheduler does."""
        self.dead, self.death_reason = True, "killed"
        os.kill(self.scheduler.pid, signal.SIGKILL)

    async def async_generate(self, input_ids, sampling_params, return_logprob, rid=None, lora_path=None, **kw):
        """SGLang's two forms (``GenerateReqInput``): one request (bare ids, ``rid`` and ``lora_path`` a
        string) is answered with one dict, a batch (lists) with a list; :attr:`forms` records which came."""
        single = bool(input_ids) and isinstance(input_ids[0], int)
        self.forms.append("single" if single else "batch")
        if not single:
            return await self._generate_batch(input_ids, sampling_params, return_logprob, rid, lora_path, **kw)
        if not isinstance(rid, (str, type(None))) or not isinstance(lora_path, (str, type(None))):
            raise ValueError("one request takes a string rid and lora_path (SGLang's single form)")
        outs = await self._generate_batch([input_ids], sampling_params, return_logprob,
                                          None if rid is None else [rid],
                                          None if lora_path is None else [lora_path], **kw)
        return outs[0]

    async def _generate_batch(self, input_ids, sampling_params, return_logprob, rid=None, lora_path=None,
                              logprob_start_len=None, top_logprobs_num=None, image_data=None, video_data=None):
        await self._alive()
        rid = rid or [f"r{i}" for i in range(len(input_ids))]
        self.calls.append(("generate", len(input_ids)))
        self.requests.append({"input_ids": [list(p) for p in input_ids], "image_data": image_data,
                              "video_data": video_data, "sampling_params": dict(sampling_params)})
        self.last_sampling_params = dict(sampling_params)
        self.last_lora_path = lora_path
        self.last_logprob_args = {k: v for k, v in (("logprob_start_len", logprob_start_len),
                                                    ("top_logprobs_num", top_logprobs_num)) if v is not None}
        if self.released:
            await self._die("generate on released memory")
        for name in sorted({p for p in (lora_path or []) if p is not None}):
            if name not in self.lora:  # the tokenizer manager refuses it (no death)
                raise ValueError(f"The following requested LoRA adapters are not loaded: {name}")
            if self.lora[name]["bad"]:
                await self._die(f"LoRA buffer shape assertion: {self.lora[name]['bad']}")
        cached = [self._prefix_hit(p) for p in input_ids]
        self.cached_tokens += cached
        self.running |= set(rid)
        try:
            n = sampling_params.get("max_new_tokens", 2)
            made = {r: n for r in rid}
            if self.block is not None:
                self.entered.set()
                while not self.block.is_set() and not (set(rid) <= self.aborted):
                    await asyncio.sleep(0.002)
                    await self._alive()
            elif self.decode_step_s is not None:
                made = {r: 0 for r in rid}
                while any(made[r] < n and r not in self.aborted for r in rid):
                    await asyncio.sleep(self.decode_step_s)
                    await self._alive()
                    for r in rid:
                        if made[r] < n and r not in self.aborted:
                            made[r] += 1
            if self.reply is not None:
                return await self._scripted(input_ids, rid, sampling_params.get("max_new_tokens"))
            outs = [
                {"output_ids": [p[-1] + 1 + k for k in range(made[r])],
                 "meta_info": {"output_token_logprobs": [(-0.5, p[-1] + 1 + k, None) for k in range(made[r])],
                               "cached_tokens": c,
                               "finish_reason": {"type": "abort" if r in self.aborted and (
                                   self.decode_step_s is None or self.block is not None or made[r] < n)
                                   else "length"}}}
                for p, r, c in zip(input_ids, rid, cached)
            ]
            for p, out in zip(input_ids, outs):
                self._cache(list(p) + out["output_ids"])
            if return_logprob and logprob_start_len is not None and logprob_start_len >= 0:
                for p, out in zip(input_ids, outs):
                    out["meta_info"].update(input_logprobs_meta(p, logprob_start_len, top_logprobs_num or 0))
            return outs
        finally:
            self.running -= set(rid)

    async def _scripted(self, input_ids, rid, max_new_tokens) -> list:
        """The scripted "model" (``reply``): each request's whole answer at once, or with ``decode_step_s``
        one token per step, an aborted request ending with the tokens it has (finish reason "abort")."""
        answers = [list(self.reply(list(p)))[:max_new_tokens] for p in input_ids]
        made = [len(a) if self.decode_step_s is None else 0 for a in answers]
        while any(m < len(a) and r not in self.aborted for m, a, r in zip(made, answers, rid)):
            await asyncio.sleep(self.decode_step_s)
            await self._alive()
            made = [m + (m < len(a) and r not in self.aborted) for m, a, r in zip(made, answers, rid)]
            self.decoded_tokens += 1
        return [{"output_ids": a[:m], "meta_info": {
            "output_token_logprobs": [(-0.25, t, None) for t in a[:m]], "cached_tokens": 0,
            "finish_reason": {"type": "abort" if m < len(a) else ("stop" if len(a) < (max_new_tokens or 1 << 30)
                                                                  else "length")}}}
            for a, m in zip(answers, made)]

    def _prefix_hit(self, prompt) -> int:
        if self.prefix_cache is None:
            return 0
        for i in range(len(prompt), 0, -1):
            if tuple(prompt[:i]) in self.prefix_cache:
                return i
        return 0

    def _cache(self, seq) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.update(tuple(seq[:i]) for i in range(1, len(seq) + 1))

    def shutdown(self):
        self.calls.append(("sglang_shutdown",))


#: Older name kept for the tests that use it.
FakeAsyncSGLangEngine = FakeSGLangEngine


def fake_logprob(prev: int, tok: int) -> float:
    """The double's "model": after token ``prev``, ``prev + 1 + d`` has logprob ``-0.5 - |d|`` (its greedy
    next token, ``prev + 1`` at -0.5, is what it generates)."""
    return -0.5 - abs(tok - prev - 1)


def input_logprobs_meta(prompt, start: int, top: int) -> dict:
    """``meta_info``'s prompt logprobs as SGLang 0.5.10 returns them (``scheduler_output_processor_mixin``
    ``_process_input_token_logprobs`` / ``_process_input_top_logprobs``, ``tokenizer_manager``
    ``detokenize_logprob_tokens``, text None): one ``(logprob, token id, None)`` per prompt position from
    ``start``, the first with logprob None; with ``top`` > 0 also ``input_top_logprobs``: per position
    the ``top`` likeliest ``(logprob, token id, None)``, best first, the first position None."""
    meta = {"input_token_logprobs": [(None if i == start else fake_logprob(prompt[i - 1], prompt[i]), prompt[i], None)
                                     for i in range(start, len(prompt))]}
    if top > 0:
        meta["input_top_logprobs"] = [None if i == start else
                                      [(fake_logprob(prompt[i - 1], prompt[i - 1] + 1 + r), prompt[i - 1] + 1 + r, None)
                                       for r in range(top)]
                                      for i in range(start, len(prompt))]
    return meta


def hf_sample(model, prompt, sampling_params, generator):
    """One completion of ``prompt`` (token ids) by a Hugging Face causal LM, as an engine double samples:
    greedy at temperature 0, else multinomial with ``generator``; stops at ``max_new_tokens`` or a
    ``stop_token_ids`` token. Returns (completion ids, their logprobs, finish reason "length"/"stop")."""
    import torch

    temp = sampling_params.get("temperature", 1.0)
    stops = set(sampling_params.get("stop_token_ids", []))
    ids, lps, finish = list(prompt), [], "length"
    with torch.no_grad():
        for _ in range(sampling_params["max_new_tokens"]):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            if temp == 0:
                tok = int(logits.argmax())
                lp = float(torch.log_softmax(logits, -1)[tok])
            else:
                logp = torch.log_softmax(logits / temp, -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=generator))
                lp = float(logp[tok])
            ids.append(tok)
            lps.append(lp)
            if tok in stops:
                finish = "stop"
                break
    return ids[len(prompt):], lps, finish


class FakeNodeEngine:
    """``sglang.Engine`` double for a node other than the leader (``node_rank >= 1``): like SGLang's with
    ``SGLANG_BLOCK_NONZERO_RANK_CHILDREN=0``, it has no tokenizer manager, only its schedulers (one real
    child process here)."""

    def __init__(self, **server_args):
        self.server_args = server_args
        self.env_at_start = dict(os.environ)
        self.scheduler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def shutdown(self):
        raise AssertionError("SGLang's Engine.shutdown kills every child of the host; it must not be called")


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def two_ray_nodes(namespace: str, modules=(), num_cpus: int = 1):
    """A Ray cluster of two raylets on this machine (``ray.cluster_utils.Cluster``) standing for two nodes,
    connected; yields their node ids, node 0 (the head) first. ``modules`` are pickled by value (actors
    cannot import test files)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": num_cpus, "resources": {"node0": 1}})
    cluster.add_node(num_cpus=num_cpus, resources={"node1": 1})
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, namespace=namespace)
    try:
        for mod in (*modules, sys.modules[__name__]):
            ray.cloudpickle.register_pickle_by_value(mod)
        cluster.wait_for_nodes()
        nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: "node1" in n["Resources"])
        yield [n["NodeID"] for n in nodes]
    finally:
        ray.shutdown()
        cluster.shutdown()


class ThreadGroup:
    """An all-gather over ``n`` threads standing for the TP ranks' processes (torch.distributed's
    ``all_gather_object`` semantics: every rank gets every rank's item, in rank order). A rank that never
    comes breaks the barrier after ``timeout_s`` instead of hanging the test; ``rounds`` counts the
    completed all-gathers."""

    def __init__(self, n: int, timeout_s: float = 20.0):
        self.n, self.slots, self.rounds = n, [None] * n, 0
        self._barrier = threading.Barrier(n, timeout=timeout_s)

    def all_gather(self, rank: int, item):
        self.slots[rank] = item
        if self._barrier.wait() == 0:
            self.rounds += 1
        out = list(self.slots)
        self._barrier.wait()
        return out

    def run(self, fn, *args_per_rank):
        """``fn(rank, *args)`` on one thread per rank; each rank's return value or raised exception."""
        results = [None] * self.n

        def body(rank):
            try:
                results[rank] = fn(rank, *(a[rank] for a in args_per_rank))
            except BaseException as exc:  # noqa: BLE001 - handed back to the test
                results[rank] = exc

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results


def verl_server(response_length: int, max_model_len: int = 64, model_path: str = "/fake"):
    """verl's server actor class of this package (:class:`VerlRolloutServer`) on :class:`FakeSGLangEngine`,
    not started; skips the test where Ray or verl is not installed."""
    import pytest

    pytest.importorskip("ray")
    pytest.importorskip("verl")
    from sgl_rollout.integrations.verl_server import VerlRolloutServer

    class Server(VerlRolloutServer):
        engine_factory = FakeSGLangEngine

    return Server({"model_path": model_path, "enforce_eager": True}, max_model_len=max_model_len,
                  response_length=response_length)


def run_on_server(srv, scenario) -> None:
    """Start ``srv``, await ``scenario(engine double)``, shut ``srv`` down (also when the scenario fails)."""

    async def body():
        await srv.start()
        try:
            await scenario(srv._engine._engine)
        finally:
            await srv.shutdown()

    asyncio.run(body())
