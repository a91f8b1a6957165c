"""Multi-turn tool agents through this package (issue 38 item 1, CPU part).

verl 0.9.1's real ``AgentLoopWorker`` (what ``AgentLoopManager`` runs in each Ray worker) drives
``tool_agent`` (``ToolAgentLoop``), ``single_turn_agent`` and a custom loop registered by name through
verl's real ``LLMServerClient`` into this package's :class:`VerlRolloutServer` and engine, with one function
tool (``function_tool_path``) and one ``BaseTool`` subclass (``tool_config_path``), as verl's own tests
under ``tests/experimental/agent_loop/`` set them up. SGLang is the engine double of ``tests/fakes.py``
with a scripted "model" (a function of the prompt's text), so the turns are deterministic; the tokenizer is
the byte-level ChatML one of ``sgl_rollout/bench/chat_tokenizer.py``, read by verl's real ``hermes`` parser. The GPU
test compares the turns' token ids with verl's built-in server under greedy decoding."""

import asyncio
import json
import os
import textwrap
import types

import numpy as np
import pytest

pytest.importorskip("verl")
pytest.importorskip("ray")

from sgl_rollout.bench.chat_tokenizer import build_chat_model_dir, build_chat_tokenizer  # noqa: E402
from fakes import verl_server  # noqa: E402
from test_multimodal import _verl_client  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput  # noqa: E402
from verl.tools.base_tool import BaseTool  # noqa: E402
from verl.tools.schemas import ToolResponse  # noqa: E402

WEATHER = "Sunny, 21 C, wind 3 m/s from the west, humidity 40 percent, no rain expected until the weekend."
MAX_TOOL_CHARS = 40
MAX_ASSISTANT_TURNS = 3

#: Every BaseTool call seen: (event, instance kwargs or parameters).
TOOL_EVENTS = []


class LetterCounter(BaseTool):
    """A ``BaseTool`` with verl's lifecycle (create -> execute -> release); counts a letter in a word."""

    async def create(self, instance_id=None, **kwargs):
        TOOL_EVENTS.append(("create", kwargs.get("create_kwargs", {})))
        return await super().create(instance_id, **kwargs)

    async def execute(self, instance_id, parameters, **kwargs):
        TOOL_EVENTS.append(("execute", dict(parameters)))
        return ToolResponse(text=str(parameters["word"].count(parameters["letter"]))), 0.5, {}

    async def release(self, instance_id, **kwargs):
        TOOL_EVENTS.append(("release", instance_id))


class TwoPassLoop(AgentLoopBase):
    """A user's agent loop, registered by name in ``agent_loop_config_path``: it drafts, then asks the
    server again with the draft and a fixed follow-up appended (masked out of training)."""

    async def run(self, sampling_params, **kwargs) -> AgentLoopOutput:
        prompt = list(await self.ct_build_initial_tokens(list(kwargs["raw_prompt"])))
        first = await self.server_manager.generate(request_id="two-pass", prompt_ids=prompt,
                                                   sampling_params=sampling_params)
        follow = self.tokenizer.encode("\n<|im_start|>user\nShorter.<|im_end|>\n<|im_start|>assistant\n",
                                       add_special_tokens=False)
        second = await self.server_manager.generate(request_id="two-pass",
                                                    prompt_ids=prompt + first.token_ids + follow,
                                                    sampling_params=sampling_params)
        response = first.token_ids + follow + second.token_ids
        return AgentLoopOutput(
            prompt_ids=prompt, response_ids=response,
            response_mask=[1] * len(first.token_ids) + [0] * len(follow) + [1] * len(second.token_ids),
            response_logprobs=first.log_probs + [0.0] * len(follow) + second.log_probs,
            num_turns=4, metrics={})


def _reply(tok):
    """The scripted model: what it answers, from the prompt's text (its last turn decides)."""

    def answer(prompt_ids):
        text = tok.decode(prompt_ids, skip_special_tokens=False)
        last_user = text.rsplit("<|im_start|>user", 1)[-1]
        if "Shorter." in last_user:
            out = "Hi.<|im_end|>"
        elif "Use the atlas" in last_user:  # a tool the worker does not have
            out = '<tool_call>\n{"name": "atlas", "arguments": {"place": "Paris"}}\n</tool_call><|im_end|>'
        elif "Keep checking" in text:  # never satisfied: stopped by max_assistant_turns
            out = '<tool_call>\n{"name": "count_letters", "arguments": {"word": "loop", "letter": "o"}}\n</tool_call><|im_end|>'
        elif "<tool_response>" in last_user:
            out = "Paris is sunny; banana has 3 a.<|im_end|>"
        elif "Paris" in last_user:
            out = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                   '<tool_call>\n{"name": "count_letters", "arguments": {"word": "banana", "letter": "a"}}\n'
                   '</tool_call><|im_end|>')
        else:
            out = "Hello there!<|im_end|>"
        return tok.encode(out, add_special_tokens=False)

    return answer


def _files(tmp_path):
    tools_py = tmp_path / "weather_tool.py"
    tools_py.write_text(textwrap.dedent(f'''
        from verl.tools.function_tool import function_tool

        @function_tool
        def get_weather(city: str) -> str:
            """The weather now in a city.

            Args:
                city: The city's name.
            """
            return {WEATHER!r}
    '''))
    schema = {"type": "function", "function": {
        "name": "count_letters", "description": "How often a letter occurs in a word.",
        "parameters": {"type": "object", "required": ["word", "letter"], "properties": {
            "word": {"type": "string", "description": "the word"},
            "letter": {"type": "string", "description": "one letter"}}}}}
    tool_yaml = tmp_path / "tools.json"
    tool_yaml.write_text(json.dumps({"tools": [{"class_name": f"{__name__}.LetterCounter",
                                                "config": {"type": "native"}, "tool_schema": schema}]}))
    loops_yaml = tmp_path / "agent_loops.yaml"
    loops_yaml.write_text(f"- name: two_pass\n  _target_: {__name__}.TwoPassLoop\n")
    return tools_py, tool_yaml, loops_yaml


def _verl_config(tmp_path, model_dir):
    import verl
    from hydra import compose, initialize_config_dir

    tools_py, tool_yaml, loops_yaml = _files(tmp_path)
    r = "actor_rollout_ref.rollout"
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}", f"{r}.name=sglang", f"{r}.prompt_length=4096",
        f"{r}.response_length=1024", f"{r}.calculate_log_probs=true", f"{r}.temperature=0",
        f"{r}.multi_turn.enable=true", f"{r}.multi_turn.format=hermes",
        f"{r}.multi_turn.function_tool_path={tools_py}", f"{r}.multi_turn.tool_config_path={tool_yaml}",
        f"{r}.multi_turn.max_parallel_calls=2", f"{r}.multi_turn.max_tool_response_length={MAX_TOOL_CHARS}",
        f"{r}.multi_turn.tool_response_truncate_side=right",
        f"{r}.multi_turn.max_assistant_turns={MAX_ASSISTANT_TURNS}",
        f"{r}.agent.agent_loop_config_path={loops_yaml}",
    ]
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


@pytest.fixture(autouse=True)
def fresh_function_tools():
    """verl registers function tools process-wide by name; each test loads its own file."""
    from verl.tools.function_tool import FUNCTION_TOOL_REGISTRY

    saved = dict(FUNCTION_TOOL_REGISTRY)
    yield
    FUNCTION_TOOL_REGISTRY.clear()
    FUNCTION_TOOL_REGISTRY.update(saved)


@pytest.fixture
def plain_requests(monkeypatch):
    import sgl_rollout.engine.io_struct as engine_mod

    monkeypatch.setattr(engine_mod, "make", lambda name, **fields: types.SimpleNamespace(**fields))


def _rows():
    prompts = [
        [{"role": "user", "content": "Weather in Paris, and how many a in banana?"}],
        [{"role": "user", "content": "Say hello."}],
        [{"role": "user", "content": "Greet me."}],
        [{"role": "user", "content": "Keep checking the letters."}],
        [{"role": "user", "content": "Use the atlas for Paris."}],
    ]
    return prompts, ["tool_agent", "single_turn_agent", "two_pass", "tool_agent", "tool_agent"]


def _segments(tok, ids, mask):
    """The response as (mask value, text) runs."""
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            runs.append((int(mask[start]), tok.decode(ids[start:i], skip_special_tokens=False)))
            start = i
    return runs


def test_verls_agent_loop_worker_runs_tool_single_turn_and_custom_loops_through_this_package(
        tmp_path, plain_requests):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto

    TOOL_EVENTS.clear()
    tok = build_chat_tokenizer()
    cfg = _verl_config(tmp_path, build_chat_model_dir(tmp_path / "model"))
    srv = verl_server(1024, max_model_len=8192, model_path=str(tmp_path / "model"))
    prompts, agents = _rows()
    batch = DataProto(non_tensor_batch={
        "raw_prompt": np.array([np.array(p, dtype=object) for p in prompts] + [], dtype=object),
        "agent_name": np.array(agents, dtype=object),
        "data_source": np.array(["t"] * len(agents), dtype=object),
        "tools_kwargs": np.array([{"count_letters": {"create_kwargs": {"row": i}}} for i in range(len(agents))],
                                 dtype=object),
    }, meta_info={"global_steps": 5, "validate": False})

    async def body():
        await srv.start()
        try:
            srv._engine._engine.reply = _reply(tok)
            worker = AgentLoopWorker(cfg, _verl_client(srv))
            return await worker.generate_sequences(batch), list(srv._engine._engine.requests)
        finally:
            await srv.shutdown()

    out, requests = asyncio.run(body())
    turns = out.non_tensor_batch["__num_turns__"].tolist()
    # tool_agent: user, assistant (2 calls), tools, assistant; single turn; the custom loop's own count;
    # the never-satisfied agent: stopped after max_assistant_turns assistant turns (2 tool turns between)
    # an unknown tool: verl's loop answers the model with the tools it has (masked out), then the model answers
    assert turns == [4, 2, 4, 1 + MAX_ASSISTANT_TURNS + (MAX_ASSISTANT_TURNS - 1), 4]

    responses, mask = out.batch["responses"], out.batch["response_mask"]
    logprobs = out.batch["rollout_log_probs"]
    row0 = _segments(tok, responses[0].tolist(), mask[0].tolist())
    model_text = "".join(t for m, t in row0 if m == 1)
    tool_text = "".join(t for m, t in row0 if m == 0 and not t.startswith("<|endoftext|>"))
    assert model_text.startswith('<tool_call>\n{"name": "get_weather"')
    assert model_text.endswith("Paris is sunny; banana has 3 a.<|im_end|>")
    # tool responses are masked out of training, in call order, the function tool's cut to the limit
    assert f"<tool_response>\n{WEATHER[:MAX_TOOL_CHARS]}...(truncated)\n</tool_response>" in tool_text
    assert "<tool_response>\n3\n</tool_response>" in tool_text
    assert WEATHER[MAX_TOOL_CHARS:] not in tool_text
    # every model token has the engine's logprob, every tool token 0
    n = int(mask[0].sum())
    valid = out.batch["attention_mask"][0, -responses.shape[1]:].bool()
    assert logprobs[0][mask[0].bool()].tolist() == [-0.25] * n
    assert set(logprobs[0][valid & ~mask[0].bool()].tolist()) == {0.0}
    # the BaseTool's lifecycle, with the row's tools_kwargs
    assert ("create", {"row": 0}) in TOOL_EVENTS and ("execute", {"word": "banana", "letter": "a"}) in TOOL_EVENTS
    assert sum(e == "release" for e, _ in TOOL_EVENTS) == sum(e == "create" for e, _ in TOOL_EVENTS)

    row4 = _segments(tok, out.batch["responses"][4].tolist(), out.batch["response_mask"][4].tolist())
    assert any(m == 0 and "Unknown function 'atlas'" in t and "get_weather" in t for m, t in row4), row4
    assert [m for m, t in row4 if not t.startswith("<|endoftext|>")] == [1, 0, 1], row4

    row1 = _segments(tok, responses[1].tolist(), mask[1].tolist())
    assert row1[0] == (1, "Hello there!<|im_end|>")
    row2 = _segments(tok, responses[2].tolist(), mask[2].tolist())
    assert [m for m, t in row2 if not t.startswith("<|endoftext|>")] == [1, 0, 1]
    assert row2[0][1] == "Hello there!<|im_end|>" and row2[2][1] == "Hi.<|im_end|>"

    # each turn asks SGLang for the whole conversation so far: earlier prompt + its answer + what came between
    by_text = [(r["input_ids"][0], tok.decode(r["input_ids"][0], skip_special_tokens=False)) for r in requests]
    paris = [ids for ids, text in by_text if "banana" in text]
    assert len(paris) == 2
    first_answer = _reply(tok)(paris[0])
    assert paris[1][:len(paris[0]) + len(first_answer)] == paris[0] + first_answer
    loops = [ids for ids, text in by_text if "Keep checking" in text]
    assert len(loops) == MAX_ASSISTANT_TURNS
    for a, b in zip(loops, loops[1:]):
        assert b[:len(a)] == a
    # greedy sampling reached SGLang (rollout.temperature=0) with a budget inside the response length
    for r in requests:
        assert r["sampling_params"]["temperature"] == 0
        assert 0 < r["sampling_params"]["max_new_tokens"] <= 1024


def _continuing(answer, tok):
    """The scripted model as a resumed request sees it: the prompt may end with part of the answer
    (a partial rollout resent after an abort); it answers the rest, so an interrupted turn that is
    resumed ends with the same tokens as an uninterrupted one."""
    start = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)

    def reply(prompt_ids):
        cut = max(i for i in range(len(prompt_ids) - len(start) + 1) if prompt_ids[i:i + len(start)] == start)
        base, partial = prompt_ids[:cut + len(start)], prompt_ids[cut + len(start):]
        full = answer(base)
        assert full[:len(partial)] == partial, "a resumed request must carry its own partial answer"
        return full[len(partial):]

    return reply


def test_an_answer_carries_the_step_of_the_weights_that_served_it_not_a_later_one():
    """``extra_fields["global_steps"]`` is the step when the request reached the engine (no weight sync starts
    while it runs). Read when the answer came back, an aborted turn whose answer was still on its way when verl's
    next update set the new step took that step (the test below failed so once under load, seventeenth session)."""
    import threading

    srv = verl_server(8)

    async def scenario():
        await srv.start()
        try:
            fake = srv._engine._engine
            fake.block = threading.Event()
            await srv.set_global_steps(5)
            task = asyncio.ensure_future(srv.generate([1, 2], {"max_new_tokens": 3}, request_id="r"))
            while not fake.entered.is_set():
                await asyncio.sleep(0.001)
            await srv.set_global_steps(6)  # the step moves on while the answer is on its way
            fake.block.set()
            out = await task
            assert out.extra_fields["global_steps"] == 5 and len(out.token_ids) == 3
            later = await srv.generate([1, 2], {"max_new_tokens": 3}, request_id="s")
            assert later.extra_fields["global_steps"] == 6
        finally:
            await srv.shutdown()

    asyncio.run(scenario())


def test_a_turn_cut_by_a_weight_update_comes_back_partial_and_the_episode_continues_after_resume(
        tmp_path, plain_requests):
    """verl's fully-async client (``FullyAsyncLLMServerClient``, partial rollout) with ``tool_agent``: an
    ``abort_all_requests`` mid-turn returns the turn's tokens so far, the client resends prompt + partial
    after ``resume_generation``, and the episode ends exactly as an uninterrupted one, its weight
    versions spanning the update (``min_global_steps`` / ``max_global_steps``)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    from test_multimodal import _OneServerBalancer, _Remote

    tok = build_chat_tokenizer()
    cfg = _verl_config(tmp_path, build_chat_model_dir(tmp_path / "model"))
    prompt = [{"role": "user", "content": "Weather in Paris, and how many a in banana?"}]
    batch = DataProto(non_tensor_batch={
        "raw_prompt": np.array([np.array(prompt, dtype=object)], dtype=object),
        "agent_name": np.array(["tool_agent"], dtype=object), "data_source": np.array(["t"], dtype=object),
    }, meta_info={"global_steps": 5, "validate": False})

    async def episode(interrupt: bool):
        srv = verl_server(1024, max_model_len=8192, model_path=str(tmp_path / "model"))
        await srv.start()
        try:
            fake = srv._engine._engine
            fake.reply, fake.decode_step_s = _continuing(_reply(tok), tok), 0.001
            await srv.set_global_steps(5)
            client = FullyAsyncLLMServerClient(config=cfg,
                                               load_balancer_handle=_Remote(_OneServerBalancer(_Remote(srv))))
            task = asyncio.ensure_future(AgentLoopWorker(cfg, client).generate_sequences(batch))
            if interrupt:
                while fake.decoded_tokens < 30:  # inside the first answer (about 150 tokens)
                    await asyncio.sleep(0.001)
                await srv.abort_all_requests()  # what verl does before a weight update
                await srv.set_global_steps(6)  # the update lands
                await srv.resume_generation()
            return await task, list(fake.requests)
        finally:
            await srv.shutdown()

    plain, _ = asyncio.run(episode(interrupt=False))
    cut, requests = asyncio.run(episode(interrupt=True))
    for key in ("responses", "response_mask", "rollout_log_probs", "prompts"):
        assert cut.batch[key].tolist() == plain.batch[key].tolist(), key
    assert cut.non_tensor_batch["__num_turns__"].tolist() == plain.non_tensor_batch["__num_turns__"].tolist() == [4]
    # the resent request: the first prompt plus the partial answer, neither lost nor repeated
    first = requests[0]["input_ids"][0]
    resent = requests[1]["input_ids"][0]
    full = _reply(tok)(first)
    assert resent[:len(first)] == first and 0 < len(resent) - len(first) < len(full)
    assert resent[len(first):] == full[:len(resent) - len(first)]
    # its budget is what the response length leaves after the partial tokens
    assert requests[1]["sampling_params"]["max_new_tokens"] == 1024 - (len(resent) - len(first))
    assert plain.non_tensor_batch["min_global_steps"].tolist() == [5]
    assert plain.non_tensor_batch["max_global_steps"].tolist() == [5]
    assert cut.non_tensor_batch["min_global_steps"].tolist() == [5]
    assert cut.non_tensor_batch["max_global_steps"].tolist() == [6]
