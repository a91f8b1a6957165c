"""Prompt log-probabilities (issue 38 item 3): the engine passes SGLang's ``logprob_start_len`` /
``top_logprobs_num`` and returns ``meta_info["input_token_logprobs"]`` / ``["input_top_logprobs"]`` as
:class:`~sgl_rollout.engine.Generation` fields, and :class:`VerlRolloutServer.generate` serves verl's
``prompt_logprobs`` the way verl 0.9.1's own SGLang server does
(``verl/workers/rollout/sglang_rollout/async_sglang_server.py``), checked against verl's own code: its
extractor (read from verl's installed source; its module needs SGLang's GPU stack to import) and its
teacher consumer (``AsyncTeacherLLMServerManager.compute_teacher_logprobs_single``). SGLang is the engine
double of ``tests/fakes.py``; its "model" is :func:`fakes.fake_logprob`."""

import ast
import asyncio
import pathlib
import types

import pytest

from fakes import FakeSGLangEngine, fake_logprob, input_logprobs_meta, run_on_server, verl_server
from sgl_rollout.config import RolloutConfig
from sgl_rollout.engine import Generation, RolloutEngine


@pytest.fixture
def plain_requests(monkeypatch):
    """SGLang's io_struct needs its serving stack; the double reads only the request objects' fields."""
    import sgl_rollout.engine.io_struct as engine_mod

    monkeypatch.setattr(engine_mod, "make", lambda name, **fields: types.SimpleNamespace(**fields))


# ------------------------------------------------------------------------------------------ engine
def test_engine_returns_prompt_logprobs_aligned_with_the_prompt(plain_requests):
    eng = RolloutEngine(RolloutConfig(model_path="/fake", enforce_eager=True), engine_factory=FakeSGLangEngine)
    fake = eng._engine
    prompts = [[5, 6, 9], [3, 4]]

    async def scenario():
        plain = await eng.async_generate(prompts, {"max_new_tokens": 1})
        assert fake.last_logprob_args == {}  # SGLang keeps its defaults
        for g in (plain[0][0], plain[1][0]):
            assert (g.prompt_logprobs, g.prompt_token_ids, g.prompt_top_logprobs) == ([], [], [])
        assert plain[0][0].logprobs == [-0.5]

        out = await eng.async_generate(prompts, {"max_new_tokens": 1}, logprob_start_len=0)
        assert fake.last_logprob_args == {"logprob_start_len": 0}
        g0, g1 = out[0][0], out[1][0]
        # entry i: log p(prompt[i] | prompt[:i]); position 0 has none
        assert g0.prompt_logprobs == [None, fake_logprob(5, 6), fake_logprob(6, 9)] == [None, -0.5, -2.5]
        assert g0.prompt_token_ids == [5, 6, 9] and g0.prompt_top_logprobs == []
        assert g1.prompt_logprobs == [None, -0.5] and g1.prompt_token_ids == [3, 4]
        assert g0.output_ids == [10] and g0.logprobs == [-0.5]  # the completion is unchanged

        out = await eng.async_generate(prompts, {"max_new_tokens": 1}, n=2, logprob_start_len=0, top_logprobs_num=2)
        assert fake.last_logprob_args == {"logprob_start_len": 0, "top_logprobs_num": 2}
        for g in out[0]:  # every sample of a prompt carries its prompt's logprobs
            assert g.prompt_logprobs == [None, -0.5, -2.5]
            assert g.prompt_top_logprobs == [None, [(-0.5, 6), (-1.5, 7)], [(-0.5, 7), (-1.5, 8)]]
        assert out[1][1].prompt_top_logprobs == [None, [(-0.5, 4), (-1.5, 5)]]

        out = await eng.async_generate([[5, 6, 9]], {"max_new_tokens": 1}, logprob_start_len=1)
        # SGLang's layout from a later start: the first returned position has no logprob either
        assert out[0][0].prompt_logprobs == [None, -2.5] and out[0][0].prompt_token_ids == [6, 9]

    try:
        asyncio.run(scenario())
    finally:
        eng.shutdown()
    assert not fake.dead


@pytest.mark.parametrize("kwargs, match", [
    ({"logprob_start_len": 0, "return_logprob": False}, "needs return_logprob"),
    ({"top_logprobs_num": 2}, "needs logprob_start_len"),
    ({"logprob_start_len": 4}, "exceeds a prompt of 3 tokens"),
    ({"logprob_start_len": -1}, "int >= 0"),
    ({"logprob_start_len": 0, "top_logprobs_num": -2}, "int >= 0"),
])
def test_engine_refuses_prompt_logprob_arguments_sglang_would_ignore_or_fail(plain_requests, kwargs, match):
    eng = RolloutEngine(RolloutConfig(model_path="/fake", enforce_eager=True), engine_factory=FakeSGLangEngine)
    try:
        with pytest.raises(ValueError, match=match):
            eng.generate([[5, 6, 9]], {"max_new_tokens": 1}, **kwargs)
        assert eng._engine.calls == [] and eng.state.in_flight == 0  # nothing reached SGLang
    finally:
        eng.shutdown()


def _model_dir(tmp_path, vocab):
    (tmp_path / "config.json").write_text(f'{{"vocab_size": {vocab}, "num_attention_heads": 2}}')
    return str(tmp_path)


def test_engine_refuses_more_top_logprobs_than_the_vocabulary_before_sglang(plain_requests, tmp_path):
    """SGLang's ``topk`` over more logits than the model has raises inside its scheduler, which dies and
    takes the host process with it (issue 46): the engine refuses such a request in Python, naming the
    limit, and the engine still serves."""
    eng = RolloutEngine(RolloutConfig(model_path=_model_dir(tmp_path, 16), enforce_eager=True),
                        engine_factory=FakeSGLangEngine)
    try:
        with pytest.raises(ValueError, match="top_logprobs_num=17 exceeds the model's vocabulary of 16 tokens"):
            eng.generate([[5, 6, 9]], {"max_new_tokens": 1}, logprob_start_len=0, top_logprobs_num=17)
        assert eng._engine.calls == [] and eng.state.in_flight == 0  # nothing reached SGLang
        out = eng.generate([[5, 6, 9]], {"max_new_tokens": 1}, logprob_start_len=0, top_logprobs_num=16)
        assert len(out[0][0].prompt_top_logprobs) == 3
    finally:
        eng.shutdown()


def test_verl_teacher_asking_more_top_logprobs_than_the_vocabulary_gets_an_error_not_a_dead_server(
        plain_requests, tmp_path):
    srv = verl_server(response_length=7, model_path=_model_dir(tmp_path, 16))

    async def scenario(fake):
        with pytest.raises(ValueError, match="exceeds the model's vocabulary of 16 tokens"):
            await srv.generate(prompt_ids=[7, 8, 12], sampling_params={"prompt_logprobs": 17, "max_tokens": 1},
                               request_id="r1")
        assert not fake.dead and fake.calls == []
        out = await srv.generate(prompt_ids=[7, 8, 12], sampling_params={"prompt_logprobs": 2, "max_tokens": 1},
                                 request_id="r2")
        assert len(out.extra_fields["prompt_ids"]) == 3

    _run(srv, scenario)


# ------------------------------------------------------------------------------------------ verl server
def _verl_extractor():
    """verl 0.9.1's ``_extract_prompt_logprobs_sglang``, taken from its installed source file (the module
    imports SGLang's engine, which needs packages absent on the CPU test machine)."""
    import verl

    path = pathlib.Path(verl.__file__).parent / "workers/rollout/sglang_rollout/async_sglang_server.py"
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_extract_prompt_logprobs_sglang")
    namespace = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["_extract_prompt_logprobs_sglang"]


def _server():
    return verl_server(response_length=7)


def _run(srv, scenario):
    run_on_server(srv, scenario)


def _teacher(topk):
    """verl's teacher request (``_get_teacher_sampling_params``) and its consumer, whose client the test sets."""
    from verl.experimental.teacher_loop.teacher_manager import AsyncTeacherLLMServerManager, _get_teacher_sampling_params

    teacher_cfg = types.SimpleNamespace(inference=types.SimpleNamespace(temperature=1.0))
    loss_cfg = types.SimpleNamespace(topk=topk, loss_settings=types.SimpleNamespace(use_topk=topk > 0))
    params = _get_teacher_sampling_params(teacher_cfg, loss_cfg)
    manager = object.__new__(AsyncTeacherLLMServerManager)  # its __init__ needs the whole trainer config
    manager.teacher_model_configs = {"t": teacher_cfg}
    manager.distillation_loss_config = loss_cfg
    return params, manager


class _Client:
    """What ``LLMServerClient.generate`` does for one server: call its ``generate`` with these arguments."""

    def __init__(self, srv):
        self.srv, self.outputs = srv, []

    async def generate(self, request_id, *, prompt_ids, sampling_params, image_data=None, video_data=None,
                       audio_data=None, mm_processor_kwargs=None, mm_processor_output=None):
        out = await self.srv.generate(prompt_ids=prompt_ids, sampling_params=sampling_params, request_id=request_id,
                                      image_data=image_data, video_data=video_data)
        self.outputs.append(out)
        return out


@pytest.mark.parametrize("topk", [0, 3])
def test_verl_teacher_request_gets_what_verls_sglang_server_returns(plain_requests, topk):
    import torch

    params, manager = _teacher(topk)
    assert params["prompt_logprobs"] == topk and params["detokenize"] is False and params["max_tokens"] == 1
    extract = _verl_extractor()
    srv = _server()
    client = _Client(srv)
    manager.teacher_client = {"t": client}
    seq = [7, 8, 12, 13, 14, 20]

    async def scenario(fake):
        ids, logprobs = await manager.compute_teacher_logprobs_single(sequence_ids=seq)
        out = client.outputs[-1]
        # SGLang got what verl's server sends it: logprobs from position 0, top-k only when k > 0,
        # sampling params without verl's and vLLM's keys
        assert fake.last_logprob_args == ({"logprob_start_len": 0, "top_logprobs_num": 3} if topk else
                                          {"logprob_start_len": 0})
        assert fake.last_sampling_params == {"max_new_tokens": 1, "temperature": 1.0}
        # verl's extractor on SGLang's meta_info for the same request gives the same fields
        expected = {}
        extract(meta_info=input_logprobs_meta(seq, 0, topk), num_prompt_logprobs=topk, sequence_length=len(seq),
                result_dict=expected)
        assert {k: out.extra_fields[k] for k in ("prompt_ids", "prompt_logprobs")} == expected
        assert out.extra_fields["global_steps"] is None
        # as verl's server: return_logprob is on, so the one generated token comes with its logprob
        assert out.token_ids == [21] and out.log_probs == [-0.5] and out.stop_reason == "length"
        # verl's consumer: [len(seq), max(k, 1)], int32 ids and float32 logprobs
        width = max(topk, 1)
        assert ids.shape == logprobs.shape == (len(seq), width)
        assert ids.dtype == torch.int32 and logprobs.dtype == torch.float32
        assert ids[-1].tolist() == [0] * width and logprobs[-1].tolist() == [0.0] * width
        for j in range(len(seq) - 1):  # row j: position j + 1, predicted from seq[:j + 1]
            if topk == 0:
                assert ids[j].tolist() == [seq[j + 1]]
                assert logprobs[j].tolist() == [fake_logprob(seq[j], seq[j + 1])]
            else:
                assert ids[j].tolist() == [seq[j] + 1 + r for r in range(topk)]
                assert logprobs[j].tolist() == [-0.5 - r for r in range(topk)]

    _run(srv, scenario)


def test_a_request_without_prompt_logprobs_is_unchanged(plain_requests):
    srv = _server()

    async def scenario(fake):
        out = await srv.generate([1, 2, 3], {"temperature": 1.0}, request_id="r0")
        assert out.token_ids == [4 + k for k in range(7)] and out.log_probs is None
        assert out.extra_fields == {"global_steps": None}
        assert fake.last_logprob_args == {} and fake.last_sampling_params == {"temperature": 1.0, "max_new_tokens": 7}
        out = await srv.generate([1, 2], {"logprobs": True, "max_tokens": 2}, request_id="r1")
        assert out.token_ids == [3, 4] and out.log_probs == [-0.5, -0.5]
        assert out.extra_fields == {"global_steps": None} and fake.last_logprob_args == {}
        # vLLM's detokenize is dropped only with the teacher's prompt_logprobs: otherwise SGLang sees it
        await srv.generate([1], {"detokenize": False, "max_new_tokens": 1}, request_id="r2")
        assert fake.last_sampling_params == {"detokenize": False, "max_new_tokens": 1}

    _run(srv, scenario)


def test_bad_prompt_logprobs_and_other_refusals_never_reach_the_engine(plain_requests):
    srv = _server()

    async def scenario(fake):
        for bad in (-1, "3", True, 1.5):
            with pytest.raises(ValueError, match="prompt_logprobs must be an int >= 0"):
                await srv.generate([1, 2], {"prompt_logprobs": bad}, request_id="bad")
        with pytest.raises(NotImplementedError, match="audio"):
            await srv.generate([1, 2], {"prompt_logprobs": 0}, request_id="a", audio_data=[b"x"])
        assert [c for c in fake.calls if c[0] == "generate"] == []
        out = await srv.generate([4], {"prompt_logprobs": 2, "max_tokens": 1}, request_id="one")
        # a one-token prompt: nothing predicts its only position, so the padding row alone
        assert out.extra_fields["prompt_ids"] == [[0, 0]] and out.extra_fields["prompt_logprobs"] == [[0.0, 0.0]]

    _run(srv, scenario)


def test_prompt_logprobs_that_do_not_cover_the_prompt_are_an_error():
    pytest.importorskip("verl")
    from sgl_rollout.integrations.verl_server import teacher_prompt_logprobs

    aborted = Generation(output_ids=[], finish_reason="abort")  # aborted before its prefill: no input logprobs
    with pytest.raises(RuntimeError, match="for 0 of 3 prompt positions"):
        teacher_prompt_logprobs(aborted, 0, [1, 2, 3])
    short_top = Generation(output_ids=[4], prompt_logprobs=[None, -0.5, -0.5], prompt_token_ids=[1, 2, 3],
                           prompt_top_logprobs=[None, [(-0.5, 3)], [(-0.5, 4), (-1.5, 5)]])
    with pytest.raises(RuntimeError, match="1 top logprobs at prompt position 1, expected 2"):
        teacher_prompt_logprobs(short_top, 2, [1, 2, 3])
    fields = teacher_prompt_logprobs(short_top, 0, [1, 2, 3])
    assert fields == {"prompt_ids": [[2], [3], [0]], "prompt_logprobs": [[-0.5], [-0.5], [0.0]]}
