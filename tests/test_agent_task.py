"""The tools task of ``bench verl --task tools`` (``sgl_rollout.bench.agent_task``) on CPU, through
verl's own classes: its rows reach verl's RL dataset with their ``agent_name``; verl's ``AgentLoopWorker``
finds the loop by that name in the registry file and runs every episode's turns through this package's
server (``VerlRolloutServer`` on the engine double), each turn on the whole conversation so far, the tool
turns masked out; the side commands compose with the registry file."""

import asyncio
import json
import os
import types

import numpy as np
import pyarrow.parquet as pq
import pytest

pytest.importorskip("verl")
pytest.importorskip("ray")

from fakes import verl_server  # noqa: E402
from sgl_rollout.bench import agent_task, verl_compare  # noqa: E402
from sgl_rollout.bench.chat_tokenizer import build_chat_model_dir, build_chat_tokenizer  # noqa: E402
from test_multimodal import _verl_client  # noqa: E402
from test_verl_task import trainer_config  # noqa: E402


@pytest.fixture
def plain_requests(monkeypatch):
    import sgl_rollout.engine.io_struct as engine_mod

    monkeypatch.setattr(engine_mod, "make", lambda name, **fields: types.SimpleNamespace(**fields))


def test_rows_carry_the_loops_name_and_the_registry_file_names_the_loop(tmp_path):
    train, val, loops = agent_task.write_tools_task(tmp_path / "data", n_train=8, n_val=4)
    for path, n in ((train, 8), (val, 4)):
        rows = pq.read_table(path).to_pylist()
        assert len(rows) == n and {r["agent_name"] for r in rows} == {agent_task.LOOP_NAME}
        assert rows[0]["prompt"][-1]["role"] == "user"
    assert loops.read_text() == (f"- name: {agent_task.LOOP_NAME}\n"
                                 "  _target_: sgl_rollout.bench.agent_task.ToolTurnsLoop\n")


def test_side_command_points_verl_at_the_registry_file(tmp_path):
    cmd = verl_compare.side_command("builtin", tmp_path / "m", tmp_path / "run", 1, 1, 4, 0.5, python="python",
                                    task="tools")
    cfg = trainer_config(cmd[3:])
    assert cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path == str(
        (tmp_path / "run" / "data" / "agent_loops.yaml").resolve())


def test_the_tools_task_makes_its_own_model_with_weights_the_same_each_time(tmp_path):
    import argparse
    import hashlib
    import json

    import torch
    from transformers import AutoModelForCausalLM

    args = argparse.Namespace(task="tools", model=None, gguf=None, random_model=None)
    model_dir = verl_compare.prepare_task(args, tmp_path / "a", n_val=4)
    again = verl_compare.prepare_task(args, tmp_path / "b", n_val=4)
    digest = [hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (model_dir, again)]
    assert digest[0] == digest[1]  # both sides of a comparison run the same weights, wherever they are made
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = build_chat_tokenizer()
    assert cfg["vocab_size"] == len(tok) and cfg["eos_token_id"] == tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) > 10**6 and model.config.num_hidden_layers == 2
    assert len(pq.read_table(tmp_path / "a" / "data" / "val.parquet")) == 4
    assert (tmp_path / "a" / "data" / "agent_loops.yaml").is_file()


def _config(tmp_path, model_dir, loops):
    import verl
    from hydra import compose, initialize_config_dir

    r = "actor_rollout_ref.rollout"
    overrides = [f"actor_rollout_ref.model.path={model_dir}", f"{r}.name=sglang", f"{r}.prompt_length=512",
                 f"{r}.response_length=256", f"{r}.calculate_log_probs=true", f"{r}.temperature=0",
                 *agent_task.tools_overrides(loops)]
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def test_greedy_episodes_are_logged_only_where_asked_and_only_greedy(tmp_path):
    env = {agent_task.TURNS_DIR_ENV: str(tmp_path / "turns")}
    assert not agent_task.log_greedy_episode([1, 2], [[3]], {"temperature": 0.0}, environ={})
    assert not agent_task.log_greedy_episode([1, 2], [[3]], {"temperature": 0.7}, environ=env)
    for unset in ({}, {"temperature": None}):  # SGLang's default temperature, 1.0: sampled, not greedy
        assert not agent_task.log_greedy_episode([1, 2], [[3]], unset, environ=env)
    assert agent_task.log_greedy_episode([1, 2], [[3], [4, 5]], {"temperature": 0}, environ=env)
    (line,) = (tmp_path / "turns" / f"turns-{os.getpid()}.jsonl").read_text().splitlines()
    row = json.loads(line)
    assert row["prompt"] == [1, 2] and row["turns"] == [[3], [4, 5]] and row["t"] > 0
    assert not agent_task.log_greedy_episode([1], [[2]], {"temperature": 0}, environ={
        agent_task.TURNS_DIR_ENV: str(tmp_path / "turns" / f"turns-{os.getpid()}.jsonl")})  # not a folder: no raise


def test_the_tools_side_command_tells_the_workers_where_to_log_turns(tmp_path):
    cmd = verl_compare.side_command("ours", tmp_path / "m", tmp_path / "run", 1, 1, 4, 0.5, python="python",
                                    task="tools")
    cfg = trainer_config(cmd[3:])
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars[agent_task.TURNS_DIR_ENV] == str(tmp_path / "run" / "turns")


def test_verls_agent_loop_worker_runs_the_tool_turns_through_this_package(tmp_path, plain_requests, monkeypatch):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto

    tok = build_chat_tokenizer()
    model_dir = build_chat_model_dir(tmp_path / "model")
    _, _, loops = agent_task.write_tools_task(tmp_path / "data", n_train=2, n_val=2)
    cfg = _config(tmp_path, model_dir, loops)
    srv = verl_server(256, max_model_len=768, model_path=str(model_dir))
    answers = iter(["12 + 30 = 42. Answer: 42<|im_end|>", "Still 42.<|im_end|>", "Answer: 42<|im_end|>"])
    prompt = [{"role": "user", "content": "What is 12 + 30?"}]
    batch = DataProto(non_tensor_batch={
        "raw_prompt": np.array([np.array(prompt, dtype=object)], dtype=object),
        "agent_name": np.array([agent_task.LOOP_NAME], dtype=object),
        "data_source": np.array(["t"], dtype=object),
    }, meta_info={"global_steps": 1, "validate": True})

    def reply(ids):  # the step moves on after each turn reached the engine, which reports the step it
        srv.global_steps += 1  # reached the engine at: the trajectory spans versions 3..5
        return tok.encode(next(answers), add_special_tokens=False)

    async def body():
        await srv.start()
        try:
            await srv.set_global_steps(3)
            srv._engine._engine.reply = reply
            worker = AgentLoopWorker(cfg, _verl_client(srv))
            return await worker.generate_sequences(batch), list(srv._engine._engine.requests)
        finally:
            await srv.shutdown()

    monkeypatch.setenv(agent_task.TURNS_DIR_ENV, str(tmp_path / "turns"))
    out, requests = asyncio.run(body())
    assert out.non_tensor_batch["__num_turns__"].tolist() == [1 + agent_task.TURNS + (agent_task.TURNS - 1)]
    # the weight versions the episode ran on, which verl's trainer reads as ints for every training sample
    # (np.array(..., dtype=int), verl/trainer/ppo/v1/trainer_base.py): None there failed step 1 on the GPUs
    nt = out.non_tensor_batch
    assert np.array(nt["min_global_steps"].tolist(), dtype=int).tolist() == [3]
    assert np.array(nt["max_global_steps"].tolist(), dtype=int).tolist() == [5]
    (logged,) = [json.loads(ln) for f in (tmp_path / "turns").glob("*.jsonl") for ln in f.read_text().splitlines()]
    assert len(logged["turns"]) == agent_task.TURNS
    assert tok.decode(logged["turns"][0]) == "12 + 30 = 42. Answer: 42<|im_end|>"
    assert tok.decode(logged["turns"][-1]) == "Answer: 42<|im_end|>"
    assert logged["prompt"] == requests[0]["input_ids"][0]  # the turns' token ids, after the prompt verl built
    ids, mask = out.batch["responses"][0].tolist(), out.batch["response_mask"][0].tolist()
    n = sum(out.batch["attention_mask"][0, -len(ids):].tolist())
    text_by_mask = []
    for i in range(n):
        if not text_by_mask or text_by_mask[-1][0] != mask[i]:
            text_by_mask.append([mask[i], []])
        text_by_mask[-1][1].append(ids[i])
    segs = [(m, tok.decode(t, skip_special_tokens=False)) for m, t in text_by_mask]
    assert [m for m, _ in segs] == [1, 0, 1, 0, 1]
    assert segs[0][1] == "12 + 30 = 42. Answer: 42<|im_end|>" and segs[4][1] == "Answer: 42<|im_end|>"
    assert segs[1][1] == agent_task.tool_turn(agent_task.text_stats("12 + 30 = 42. Answer: 42"))
    # every turn asked the server for the whole conversation so far
    sent = [r["input_ids"][0] for r in requests]
    assert len(sent) == agent_task.TURNS
    for a, b in zip(sent, sent[1:]):
        assert b[:len(a)] == a and len(b) > len(a)
    assert sent[-1][len(sent[0]):] == ids[:len(sent[-1]) - len(sent[0])]
    logprobs = out.batch["rollout_log_probs"][0][:n]
    assert all(lp == 0.0 for lp, m in zip(logprobs.tolist(), mask) if m == 0)
    assert all(r["sampling_params"]["temperature"] == 0 for r in requests)
