"""Images and videos (issue 38 item 2, CPU part): what verl's client sends reaches SGLang's
``async_generate`` in SGLang's batch form (``image_data=[[img, ...]]``: one list per request,
``GenerateReqInput._normalize_image_data`` in ``sglang/srt/managers/io_struct.py`` reads a flat list as one
image per request), through the engine, :class:`VerlRolloutServer` and verl 0.9.1's real
``LLMServerClient`` (which hands SGLang servers the processor-output dict instead of raw video frames).
SGLang is the engine double of ``tests/fakes.py``; no model looks at the pixels here (the GPU test does)."""

import asyncio
import types

import numpy as np
import pytest
from PIL import Image

from fakes import FakeSGLangEngine, run_on_server, verl_server
from sgl_rollout.config import RolloutConfig
from sgl_rollout.engine import RolloutEngine


@pytest.fixture
def plain_requests(monkeypatch):
    import sgl_rollout.engine.io_struct as engine_mod

    monkeypatch.setattr(engine_mod, "make", lambda name, **fields: types.SimpleNamespace(**fields))


def _image(seed: int, size=(28, 28)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(*size, 3), dtype=np.uint8))


def _video_payload():
    """verl's ``build_sglang_video_payload`` shape: one dict of processor features for all the prompt's videos."""
    import torch

    return {"format": "processor_output", "pixel_values_videos": torch.zeros(8, 1176),
            "video_grid_thw": torch.tensor([[2, 2, 2]])}


def _engine():
    return RolloutEngine(RolloutConfig(model_path="/fake", enforce_eager=True), engine_factory=FakeSGLangEngine)


def test_engine_sends_each_prompts_images_per_request_and_repeats_them_for_every_sample(plain_requests):
    eng = _engine()
    fake = eng._engine
    a, b, c = _image(0), _image(1), _image(2)
    video = _video_payload()

    async def scenario():
        out = await eng.async_generate([[1, 2], [3, 4], [5]], {"max_new_tokens": 1}, n=2,
                                       image_data=[[a, b], None, [c]], video_data=[None, [video], None])
        assert len(out) == 3 and all(len(g) == 2 for g in out)
        sent = fake.requests[-1]
        assert sent["input_ids"] == [[1, 2], [1, 2], [3, 4], [3, 4], [5], [5]]
        # SGLang's batch form: one list per request; the same objects, not copies or re-encodings
        assert [[id(x) for x in r] for r in sent["image_data"]] == [[id(a), id(b)]] * 2 + [[]] * 2 + [[id(c)]] * 2
        assert sent["video_data"] == [[], [], [video], [video], [], []]
        assert sent["video_data"][2][0] is video

        await eng.async_generate([[1, 2]], {"max_new_tokens": 1})
        assert fake.requests[-1]["image_data"] is None and fake.requests[-1]["video_data"] is None
        await eng.async_generate([[1, 2]], {"max_new_tokens": 1}, image_data=[None], video_data=[[]])
        # nothing to send: SGLang keeps its default (no multimodal processing for a text batch)
        assert fake.requests[-1]["image_data"] is None and fake.requests[-1]["video_data"] is None

    try:
        asyncio.run(scenario())
    finally:
        eng.shutdown()


def test_a_text_only_batch_of_one_goes_to_sglang_as_one_request_and_the_rest_as_a_batch(plain_requests):
    """SGLang's batch path costs a batch of one more on its way in than one request (verl's agent loop
    sends one call per sample), so a text-only request goes as verl's built-in server sends it; a batch,
    several samples or images keep the batch form, whose per-request modalities SGLang sets only there."""
    eng = _engine()
    fake = eng._engine

    async def scenario():
        one = await eng.async_generate([[1, 2]], {"max_new_tokens": 2})
        assert fake.forms[-1] == "single" and fake.requests[-1]["input_ids"] == [[1, 2]]
        assert [g.output_ids for g in one[0]] == [[3, 4]]
        await eng.async_generate([[1, 2], [5]], {"max_new_tokens": 1})
        await eng.async_generate([[1, 2]], {"max_new_tokens": 1}, n=2)
        await eng.async_generate([[1, 2]], {"max_new_tokens": 1}, image_data=[[_image(0)]])
        await eng.async_generate([[1, 2]], {"max_new_tokens": 1}, video_data=[[_video_payload()]])
        assert fake.forms[-4:] == ["batch"] * 4

    try:
        asyncio.run(scenario())
    finally:
        eng.shutdown()


def test_an_empty_prompt_is_refused_before_anything_reaches_sglang(plain_requests):
    eng = _engine()
    fake = eng._engine

    async def scenario():
        for batch in ([[]], [[1, 2], []]):
            with pytest.raises(ValueError, match=f"prompt {len(batch) - 1} has no token ids"):
                await eng.async_generate(batch, {"max_new_tokens": 1})
        assert fake.forms == [] and fake.requests == [] and eng.state.in_flight == 0
        assert len(await eng.async_generate([[1]], {"max_new_tokens": 1})) == 1  # still serving

    try:
        asyncio.run(scenario())
    finally:
        eng.shutdown()


@pytest.mark.parametrize("kwargs, match", [
    ({"image_data": [[_image(0)]]}, r"image_data takes one entry per prompt \(2\), got 1"),
    ({"image_data": [_image(0), _image(1)]}, "each prompt's entry is a list of items or None, got Image"),
    ({"video_data": "clip.mp4"}, r"video_data takes one entry per prompt \(2\), got str"),
])
def test_engine_refuses_multimodal_data_that_is_not_one_list_per_prompt(plain_requests, kwargs, match):
    eng = _engine()
    try:
        with pytest.raises(ValueError, match=match):
            eng.generate([[1, 2], [3]], {"max_new_tokens": 1}, **kwargs)
        assert eng._engine.requests == []  # refused before SGLang
        assert eng.generate([[1, 2]], {"max_new_tokens": 1})[0][0].output_ids == [3]  # and the engine serves on
    finally:
        eng.shutdown()


# ------------------------------------------------------------------------------------- verl server
def _server():
    return verl_server(response_length=4)


def _run(srv, scenario):
    run_on_server(srv, scenario)


class _Remote:
    """A Ray actor handle's face (``handle.method.remote(...)`` gives an awaitable) over a local object."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        fn = getattr(self._obj, name)

        async def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            return await out if asyncio.iscoroutine(out) else out

        return types.SimpleNamespace(remote=lambda *a, **k: asyncio.ensure_future(call(*a, **k)))


class _OneServerBalancer:
    """verl's global load balancer reduced to one server (``verl/workers/rollout/llm_server.py`` asks it)."""

    def __init__(self, server):
        self.server = server

    def require_acquire_fields(self):
        return []

    def require_release_fields(self):
        return []

    def acquire_server(self, request_id, **_fields):
        return "replica-0", self.server

    def release_server(self, server_id, **_fields):
        return None


def _verl_client(srv):
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import LLMServerClient

    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "sglang"}}})
    return LLMServerClient(config=cfg, load_balancer_handle=_Remote(_OneServerBalancer(_Remote(srv))))


def test_verls_client_images_and_video_reach_sglang_as_verls_builtin_server_sends_them(plain_requests):
    srv = _server()
    client = _verl_client(srv)
    a, b = _image(3), _image(4, size=(56, 28))
    video = _video_payload()

    async def scenario(fake):
        # the agent loop's call (tool_agent_loop.py): every image so far, raw frames plus their processor output
        frames = [(np.zeros((2, 3, 28, 28), dtype=np.uint8), {"fps": 2.0})]
        out = await client.generate("traj-1", prompt_ids=[1, 2, 3], sampling_params={"temperature": 0.0},
                                    image_data=[a, b], video_data=frames, mm_processor_output=[video])
        sent = fake.requests[-1]
        assert sent["input_ids"] == [[1, 2, 3]]
        assert len(sent["image_data"]) == 1 and [id(x) for x in sent["image_data"][0]] == [id(a), id(b)]
        # verl's client swaps the raw frames for the processor output on an SGLang server; SGLang gets that
        assert sent["video_data"] == [[video]] and sent["video_data"][0][0] is video
        assert out.token_ids == [4, 5, 6, 7] and out.extra_fields["min_global_steps"] is None

        await client.generate("traj-2", prompt_ids=[1, 2], sampling_params={}, image_data=None)
        assert fake.requests[-1]["image_data"] is None and fake.requests[-1]["video_data"] is None
        # one item rather than a list (a caller other than verl's agent loop): still one request's list
        await srv.generate([1, 2], {}, request_id="r", image_data=a, video_data=video)
        assert fake.requests[-1]["image_data"] == [[a]] and fake.requests[-1]["video_data"] == [[video]]

    _run(srv, scenario)


@pytest.mark.parametrize("kwargs, match", [
    ({"audio_data": [b"RIFF"]}, "not audio_data"),
    ({"mm_processor_kwargs": {"max_pixels": 4096}}, "not mm_processor_kwargs"),
])
def test_server_refuses_audio_and_per_request_processor_kwargs_before_sglang(plain_requests, kwargs, match):
    srv = _server()

    async def scenario(fake):
        with pytest.raises(NotImplementedError, match=match):
            await srv.generate([1, 2], {}, request_id="r", image_data=[_image(0)], **kwargs)
        assert fake.requests == []
        assert (await srv.generate([1, 2], {}, request_id="r")).token_ids == [3, 4, 5, 6]

    _run(srv, scenario)


def _video(grid):
    import torch

    return {"format": "processor_output", "pixel_values_videos": torch.zeros(4, 8), "video_grid_thw": grid}


def _tensor():
    import torch

    return torch.zeros(3, 8, 8)


@pytest.mark.parametrize("make, match", [
    # an array or tensor as the request's images, or as one of them: the truth test of `if image_data`
    # raised "Boolean value of Tensor ... is ambiguous" (issue 46), naming nothing
    (lambda: {"image_data": np.zeros((8, 8, 3), dtype=np.uint8)}, r"image_data: an item is a ndarray of shape \(8, 8, 3\)"),
    (lambda: {"image_data": _tensor()}, r"image_data: an item is a Tensor of shape \(3, 8, 8\)"),
    (lambda: {"image_data": [_tensor()]}, r"image_data: an item is a Tensor"),
    # a processor-output video whose grid is not N x 3: SGLang's side reshaped it without naming the field
    (lambda: {"video_data": [_video([1, 2, 2, 2])]}, r"video_grid_thw must be N x 3 .*got shape \(4,\)"),
    (lambda: {"video_data": [_video([[1, 2], [2, 2]])]}, r"video_grid_thw must be N x 3 .*got shape \(2, 2\)"),
])
def test_server_refuses_media_sglang_cannot_take_with_the_field_named(plain_requests, make, match):
    kwargs = make()
    srv = _server()

    async def scenario(fake):
        with pytest.raises(ValueError, match=match):
            await srv.generate([1, 2], {}, request_id="r", **kwargs)
        assert fake.requests == []
        ok = {"video_data": [_video([[1, 2, 2]])]} if "video_data" in kwargs else {"image_data": [_image(0)]}
        assert (await srv.generate([1, 2], {}, request_id="r", **ok)).token_ids == [3, 4, 5, 6]

    _run(srv, scenario)
