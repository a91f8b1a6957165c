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

    import sgl_rollout.engine as engine_mod

    try:
        import sglang.srt.managers.io_struct  # noqa: F401
    except Exception:  # noqa: BLE001
        engine_mod._req = lambda name, **fields: types.SimpleNamespace(**fields)


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

    async def flush_cache(self):
        await self.engine._alive()
        self.engine.calls.append(("flush_cache",))

    def abort_request(self, rid="", abort_all=False):
        e = self.engine
        e.calls.append(("abort", "*" if abort_all else rid))
        if abort_all:
            e.aborted |= set(e.running)
        elif rid in e.running:
            e.aborted.add(rid)


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
        self.on_update = None
        self.mixed_weight_generates = 0
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

    async def async_generate(self, input_ids, sampling_params, return_logprob, rid=None):
        await self._alive()
        rid = rid or [f"r{i}" for i in range(len(input_ids))]
        self.calls.append(("generate", len(input_ids)))
        self.last_sampling_params = dict(sampling_params)
        if self.released:
            await self._die("generate on released memory")
        self.running |= set(rid)
        try:
            if self.block is not None:
                self.entered.set()
                while not self.block.is_set() and not (set(rid) <= self.aborted):
                    await asyncio.sleep(0.002)
                    await self._alive()
            n = sampling_params.get("max_new_tokens", 2)
            return [
                {"output_ids": [p[-1] + 1 + k for k in range(n)],
                 "meta_info": {"output_token_logprobs": [(-0.5, p[-1] + 1 + k, None) for k in range(n)],
                               "finish_reason": {"type": "abort" if r in self.aborted else "length"}}}
                for p, r in zip(input_ids, rid)
            ]
        finally:
            self.running -= set(rid)

    def shutdown(self):
        self.calls.append(("sglang_shutdown",))


#: Older name kept for the tests that use it.
FakeAsyncSGLangEngine = FakeSGLangEngine
