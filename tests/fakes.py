"""An engine double that records calls and fails the way SGLang 0.5.10 does on a bad call."""

import threading


class EngineDied(SystemExit):
    """What the host would see: SGLang's scheduler dies and SIGQUITs the host process."""


class FakeSGLangEngine:
    def __init__(self, **server_args):
        import os

        self.server_args = server_args
        self.env_at_start = dict(os.environ)
        self.calls = []
        self.released = set()
        self.dead = False
        self.block = None  # threading.Event: generate waits on it when set
        self.entered = threading.Event()

    def _alive(self):
        if self.dead:
            raise EngineDied("scheduler is dead")

    def generate(self, input_ids, sampling_params, return_logprob):
        self._alive()
        self.calls.append(("generate", len(input_ids)))
        self.last_sampling_params = dict(sampling_params)
        if self.released:
            self.dead = True
            raise EngineDied("generate on released memory")
        if self.block is not None:
            self.entered.set()
            self.block.wait(10)
        n = sampling_params.get("max_new_tokens", 2)
        return [
            {"output_ids": [p[-1] + 1 + k for k in range(n)],
             "meta_info": {"output_token_logprobs": [(-0.5, p[-1] + 1 + k, None) for k in range(n)],
                           "finish_reason": {"type": "length"}}}
            for p in input_ids
        ]

    def release_memory_occupation(self, tags):
        self._alive()
        self.calls.append(("release", tuple(tags)))
        if self.block is not None and not self.block.is_set():
            self.dead = True
            raise EngineDied("release while busy: is_fully_idle() assertion")
        if self.released & set(tags):
            self.dead = True
            raise EngineDied("torch-memory-saver exit(1)")
        self.released |= set(tags)

    def resume_memory_occupation(self, tags):
        self._alive()
        self.calls.append(("resume", tuple(tags)))
        if set(tags) - self.released:
            self.dead = True
            raise EngineDied("KeyError in offload_tags.remove")
        self.released -= set(tags)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self._alive()
        if "weights" in self.released:
            self.dead = True
            raise EngineDied("copy into freed weights")
        self.calls.append(("update_weights", load_format, len(named_tensors), flush_cache))
        return True, "Success"

    def flush_cache(self):
        self._alive()
        self.calls.append(("flush_cache",))

    def shutdown(self):
        self.calls.append(("sglang_shutdown",))


class _FakeTokenizerManager:
    """The coroutines RolloutEngine's async methods call, delegating to the sync fake."""

    def __init__(self, engine):
        self.engine = engine

    async def release_memory_occupation(self, obj, request):
        self.engine.release_memory_occupation(obj.tags)

    async def resume_memory_occupation(self, obj, request):
        self.engine.resume_memory_occupation(obj.tags)

    async def update_weights_from_tensor(self, obj, request):
        return self.engine.update_weights_from_tensor(obj.serialized_named_tensors, obj.load_format, obj.flush_cache)

    async def flush_cache(self):
        self.engine.flush_cache()


class FakeAsyncSGLangEngine(FakeSGLangEngine):
    def __init__(self, **server_args):
        super().__init__(**server_args)
        self.tokenizer_manager = _FakeTokenizerManager(self)

    async def async_generate(self, input_ids, sampling_params, return_logprob):
        return self.generate(input_ids, sampling_params, return_logprob)
