"""TRL's real GRPOTrainer generating through sgl_rollout's TRL trainer (sgl_rollout.integrations.trl), on the
CPU with an engine double: the sync sends the trainer's weights before each step's generation, the engine
sleeps after it, the completions TRL scores are the engine's, and a bad call raises without killing the
trainer."""

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from fakes import hf_sample  # noqa: E402

from sgl_rollout.bench.chat_tokenizer import build_chat_model_dir  # noqa: E402
from sgl_rollout.engine import Generation  # noqa: E402
from sgl_rollout.errors import SyncValidationError  # noqa: E402
from sgl_rollout.integrations import trl as sgl_trl  # noqa: E402


class WorkerDouble:
    """RolloutWorker double: samples with its own Hugging Face copy of the model, refuses to generate while
    asleep, and at each sync checks the tensors against the trainer's parameters at that moment (when it
    knows the trainer), then copies them in (``refuse``: raises the manifest check's error instead, before anything is copied)."""

    def __init__(self, model_dir, refuse=False):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.params = dict(self.model.named_parameters())
        self.trainer, self.refuse, self.asleep = None, refuse, False
        self.events, self.synced, self.generated = [], [], []
        self.last_phase_seconds = {}  # the staged wake's phases, as RolloutWorker's
        self.gen = torch.Generator().manual_seed(0)

    def update_weights(self, named_tensors):
        named = list(named_tensors)
        if self.refuse:
            raise SyncValidationError(["model.layers.0.mlp.up_proj.weight: shape (8, 8) != (128, 64)"])
        if self.trainer is not None:  # the trainer's parameters at this moment, bit for bit
            live = dict(self.trainer.accelerator.unwrap_model(self.trainer.model).named_parameters())
            assert [n for n, _ in named] == list(live) and all(torch.equal(t, live[n]) for n, t in named)
        with torch.no_grad():
            for n, t in named:
                self.params[n].copy_(t)
        self.synced.append({n: t.clone() for n, t in named})
        self.asleep = False
        self.events.append("sync")
        self.last_phase_seconds = {"resume_weights": 0.001, "sync": 0.002, "release_sync_buffers": 0.0005,
                                   "empty_cache": 0.001, "resume_kv_cache": 0.004}

    def generate(self, input_ids, sampling_params, n=1, return_logprob=True):
        assert not self.asleep, "generate while asleep"
        assert n == 1 and sampling_params["max_new_tokens"] == 4
        out = []
        for prompt in input_ids:
            ids, lps, finish = hf_sample(self.model, prompt, sampling_params, self.gen)
            self.generated.append(ids)
            out.append([Generation(ids, lps, finish)])
        self.events.append("generate")
        return out

    def sleep(self):
        assert not self.asleep
        self.asleep = True
        self.events.append("sleep")
        return ["weights", "kv_cache"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model_dir(tmp_path_factory.mktemp("trl-model"), with_weights=True)


def _trainer(model_dir, out_dir, worker, scored=None, peft_config=None, **cfg):
    from trl import GRPOConfig

    def reward(completions, completion_ids, **kwargs):
        if scored is not None:
            scored.extend(list(c) for c in completion_ids)
        return [float(len(c)) for c in completions]

    args = GRPOConfig(**{**dict(output_dir=str(out_dir), per_device_train_batch_size=2, num_generations=2,
                                max_completion_length=4, max_steps=2, report_to="none", use_cpu=True, bf16=False,
                                gradient_checkpointing=False, logging_steps=1, save_strategy="no", beta=0.0,
                                learning_rate=1e-2), **cfg})  # cfg overrides (tests/test_trl_dp.py: batch 3)
    ds = datasets.Dataset.from_dict({"prompt": ["1+1=", "2+3=", "4+4=", "5+2=", "9+1=", "3+3="]})
    trainer = sgl_trl.SglGRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=ds,
                                     rollout=worker, peft_config=peft_config)
    worker.trainer = trainer
    return trainer


def test_grpo_trains_two_steps_on_the_engine_with_the_trainers_weights(model_dir, tmp_path):
    worker, scored = WorkerDouble(model_dir), []
    trainer = _trainer(model_dir, tmp_path, worker, scored)
    trainer.train()
    assert trainer.state.global_step == 2
    # each step: the staged wake with the trainer's weights (checked equal at the call), the step's
    # generation, then the engine sleeps for training
    assert worker.events == ["sync", "generate", "sleep", "sync", "generate", "sleep"]
    first, second = worker.synced
    assert any(not torch.equal(first[n], second[n]) for n in first)  # step 1 trained: step 2 sent new weights
    assert scored == worker.generated and len(scored) == 4  # TRL scored the engine's completions


def test_a_refused_sync_raises_in_the_trainer_and_nothing_is_generated(model_dir, tmp_path):
    worker = WorkerDouble(model_dir, refuse=True)
    trainer = _trainer(model_dir, tmp_path, worker)
    with pytest.raises(SyncValidationError, match="up_proj"):
        trainer.train()
    assert worker.events == []  # never generated on weights it does not hold, and nothing to put to sleep


def test_unserved_settings_and_versions_are_refused_in_one_line(model_dir, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="use_vllm=True"):
        _trainer(model_dir, tmp_path, WorkerDouble(model_dir), use_vllm=True)
    from trl import GRPOConfig

    with pytest.raises(ValueError, match="needs rollout="):
        sgl_trl.SglGRPOTrainer(model=model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                               args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False))
    for bad in ("1.15.2", "1.17.0", "not-a-version"):
        with pytest.raises(sgl_trl.UnsupportedTRLVersion) as err:
            sgl_trl.check_trl_version(bad)
        assert "\n" not in str(err.value) and "trl>=1.16,<1.17" in str(err.value)
    assert sgl_trl.check_trl_version("1.16.0") == "1.16.0"
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda dist: "1.17.1" if dist == "trl" else real(dist))
    monkeypatch.delattr(sgl_trl, "SglGRPOTrainer", raising=False)  # made again at the next import
    with pytest.raises(sgl_trl.UnsupportedTRLVersion, match="trl 1.17.1 is outside"):
        sgl_trl.SglGRPOTrainer  # noqa: B018 - the import a script makes
    from types import SimpleNamespace

    def built(ds=False, fsdp=False, procs=1, tools=None, generation_kwargs=None):
        return SimpleNamespace(is_deepspeed_enabled=ds, is_fsdp_enabled=fsdp, tools=tools,
                               accelerator=SimpleNamespace(num_processes=procs), max_completion_length=8,
                               temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                               eos_token_ids=[2], args=SimpleNamespace(generation_kwargs=generation_kwargs,
                                                                       vllm_structured_outputs_regex=None))

    from sgl_rollout.config import RolloutConfig

    assert sgl_trl._refusal_after_init(built()) is None
    assert "FSDP" in sgl_trl._refusal_after_init(built(fsdp=True))
    assert sgl_trl._refusal_after_init(built(procs=2), RolloutConfig(model_path=model_dir)) is None  # data parallel
    tp2 = RolloutConfig(model_path=model_dir, tensor_model_parallel_size=2)
    assert sgl_trl._refusal_after_init(built(procs=2), tp2) is None  # one TP engine for the 2 ranks
    assert sgl_trl._refusal_after_init(built(procs=4), tp2) is None  # two of them
    odd = sgl_trl._refusal_after_init(built(procs=3), tp2)
    assert "multiple" in odd and "\n" not in odd
    assert "tool loop" in sgl_trl._refusal_after_init(built(procs=2, tools=[len]), tp2)
    assert sgl_trl._refusal_after_init(built(procs=1), RolloutConfig(model_path=model_dir, tensor_model_parallel_size=2)) is None
    pinned = RolloutConfig(model_path=model_dir, engine_kwargs={"base_gpu_id": 1})
    assert "['base_gpu_id']" in sgl_trl._refusal_after_init(built(procs=2), pinned)
    assert sgl_trl._refusal_after_init(built(procs=1), pinned) is None
    # generation_kwargs SGLang cannot take are refused at start-up, in one line naming the key
    beams = sgl_trl._refusal_after_init(built(generation_kwargs={"num_beams": 4}))
    assert "['num_beams']" in beams and "\n" not in beams
    seeded = built(generation_kwargs={"seed": 3})
    assert "enable_deterministic_inference" in sgl_trl._refusal_after_init(seeded, RolloutConfig(model_path=model_dir))
    assert sgl_trl._refusal_after_init(seeded, RolloutConfig(
        model_path=model_dir, engine_kwargs={"enable_deterministic_inference": True})) is None
    # a grammar needs the engine's tokenizer and a grammar backend (SGLang's GrammarManager would refuse each request)
    regex = built(generation_kwargs={"structured_outputs": {"regex": "[0-9]+"}})
    for kwargs in ({"skip_tokenizer_init": True}, {"grammar_backend": "none"}):
        why = sgl_trl._refusal_after_init(regex, RolloutConfig(model_path=model_dir, engine_kwargs=kwargs))
        assert "regex grammar" in why and "\n" not in why
    assert sgl_trl._refusal_after_init(regex, RolloutConfig(model_path=model_dir, engine_kwargs={
        "skip_tokenizer_init": False, "grammar_backend": "xgrammar"})) is None
    assert sgl_trl._refusal_after_init(built(), RolloutConfig(model_path=model_dir, engine_kwargs={
        "skip_tokenizer_init": True})) is None  # no grammar, no need


def test_sampling_params_follow_trls_generation_settings():
    from types import SimpleNamespace

    t = SimpleNamespace(max_completion_length=16, temperature=0.7, top_p=0.9, top_k=None, min_p=None,
                        repetition_penalty=1.1, eos_token_ids=[2, 7])
    assert sgl_trl.sampling_params_of(t) == {"max_new_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": -1,
                                             "min_p": 0.0, "repetition_penalty": 1.1, "stop_token_ids": [2, 7]}
    t.top_k = 20
    assert sgl_trl.sampling_params_of(t)["top_k"] == 20
    # TRL's vLLM mode lays generation_kwargs over those (vLLM's names or SGLang's); the regex flag wins
    t.args = SimpleNamespace(generation_kwargs={"max_tokens": 4, "temperature": 0.2, "stop": ["\n\n"], "seed": 5,
                                                "stop_token_ids": [7, 9], "presence_penalty": 0.5, "n": 1,
                                                "structured_outputs": {"json": {"type": "object"}}},
                             vllm_structured_outputs_regex=None)
    p = sgl_trl.sampling_params_of(t)
    assert p == {"max_new_tokens": 4, "temperature": 0.2, "top_p": 0.9, "top_k": 20, "min_p": 0.0,
                 "repetition_penalty": 1.1, "stop": ["\n\n"], "sampling_seed": 5, "presence_penalty": 0.5,
                 "json_schema": '{"type": "object"}', "stop_token_ids": [2, 7, 9]}
    t.args.vllm_structured_outputs_regex = "(yes|no)"
    p = sgl_trl.sampling_params_of(t)
    assert p["regex"] == "(yes|no)" and "json_schema" not in p
    t.args = SimpleNamespace(generation_kwargs='{"min_tokens": 2}', vllm_structured_outputs_regex=None)  # TRL's CLI
    assert sgl_trl.sampling_params_of(t)["min_new_tokens"] == 2


def test_the_real_trainer_sends_its_generation_kwargs_and_refuses_one_sglang_lacks(model_dir, tmp_path):
    """TRL's GRPOConfig.generation_kwargs, in vLLM's names as a vLLM-colocate script sets them, reach the engine
    as SGLang's; a transformers-only key stops the trainer's construction, before an engine starts."""
    class Recording(WorkerDouble):
        def generate(self, input_ids, sampling_params, n=1, return_logprob=True):
            self.params = dict(sampling_params)
            return super().generate(input_ids, sampling_params, n=n, return_logprob=return_logprob)

    worker = Recording(model_dir)
    trainer = _trainer(model_dir, tmp_path, worker, max_steps=1, generation_kwargs={
        "stop": ["\n"], "presence_penalty": 0.3, "min_tokens": 1, "structured_outputs": {"regex": "[0-9]+"}})
    trainer.train()
    assert {k: worker.params[k] for k in ("stop", "presence_penalty", "min_new_tokens", "regex", "max_new_tokens")} == {
        "stop": ["\n"], "presence_penalty": 0.3, "min_new_tokens": 1, "regex": "[0-9]+", "max_new_tokens": 4}
    with pytest.raises(ValueError, match=r"generation_kwargs \['num_beams'\]"):
        _trainer(model_dir, tmp_path, WorkerDouble(model_dir), generation_kwargs={"num_beams": 2})


@pytest.mark.parametrize("kwargs, said", [
    ({"num_beams": 2, "suppress_tokens": [3]}, "['num_beams', 'suppress_tokens']"),
    ({"n": 4}, "n=1"),
    ({"logprobs": 5}, "logprobs=None"),
    ({"max_tokens": 4, "max_new_tokens": 8}, "['max_new_tokens'] twice"),
    ({"structured_outputs": {"regex": "a", "json": "{}"}}, "one grammar"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "['choice']"),
    ({"regex": "a", "ebnf": "root ::= 'a'"}, "['ebnf', 'regex']"),
])
def test_generation_kwargs_sglang_cannot_take_are_refused_naming_the_key(kwargs, said):
    from sgl_rollout.integrations.trl_sampling import translate_generation_kwargs

    with pytest.raises(ValueError) as e:
        translate_generation_kwargs(kwargs)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_every_sglang_name_the_translation_sends_is_a_checked_touch_point():
    """The names :mod:`trl_sampling` translates to are all in ``sglang_api.SAMPLING_PARAMS``, which
    test_sglang_versions checks against each supported release's ``SamplingParams``."""
    from sgl_rollout.engine.sglang_api import SAMPLING_PARAMS
    from sgl_rollout.integrations import trl_sampling

    sent = set(trl_sampling.VLLM_TO_SGLANG.values()) | set(trl_sampling.STRUCTURED_TO_SGLANG.values())
    assert sent <= set(SAMPLING_PARAMS), sorted(sent - set(SAMPLING_PARAMS))


def test_the_extra_names_the_range_the_trainer_accepts():
    import tomllib
    from pathlib import Path

    extra = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["trl"]
    assert extra[0] == f"trl{sgl_trl.TRL_REQUIREMENT}" and extra[1:] == ["jmespath"]  # TRL's tool calls, transformers < 5.13


def test_images_reach_the_engine_with_their_prompts(model_dir, tmp_path):
    """TRL hands ``_generate_single_turn`` one entry per prompt: None or that prompt's images (a vision-language
    model's). They reach the engine as ``image_data``, each with its own prompt; a batch without images sends
    none (a text-only engine call)."""
    from PIL import Image

    class ImageWorker(WorkerDouble):
        def generate(self, input_ids, sampling_params, n=1, return_logprob=True, image_data=None):
            self.images = image_data
            return super().generate(input_ids, sampling_params, n=n, return_logprob=return_logprob)

    worker = ImageWorker(model_dir)
    trainer = _trainer(model_dir, tmp_path, worker)
    red, blue = Image.new("RGB", (28, 28), (220, 30, 30)), Image.new("RGB", (28, 28), (30, 30, 220))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12]]
    ids, logprobs = trainer._generate_single_turn(prompts, [[red, blue], None, [blue]], None, 1)
    assert worker.images == [[red, blue], None, [blue]]
    assert len(ids) == 3 and [len(x) for x in ids] == [len(x) for x in logprobs]
    trainer._generate_single_turn(prompts, [None, None, None], None, 1)
    assert worker.images is None


def test_the_readmes_example_script_trains_on_the_engine(model_dir, tmp_path):
    """``examples/trl/train_grpo.py`` (the README's TRL script) as a user runs it, with the engine double for
    SGLang: 2 steps, each a sync of the trainer's weights, the step's generation and the engine's sleep."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "trl" / "train_grpo.py"
    spec = importlib.util.spec_from_file_location("train_grpo", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    worker = WorkerDouble(model_dir)
    trainer = script.main(["--model", model_dir, "--steps", "2", "--batch", "4", "--num-generations", "2",
                           "--max-completion-length", "4", "--out", str(tmp_path)], rollout=worker)
    assert trainer.state.global_step == 2
    assert worker.events == ["sync", "generate", "sleep"] * 2 and len(worker.generated) == 8
    assert any("rewards/problem_reward/mean" in h for h in trainer.state.log_history)


def test_shutdown_stops_a_running_engine_and_never_starts_one(model_dir):
    from sgl_rollout.config import RolloutConfig

    unused = sgl_trl._SglGeneration(RolloutConfig(model_path=model_dir))
    unused.shutdown()  # the engine was never started: nothing is started to be shut down
    assert isinstance(unused._rollout, RolloutConfig)

    class Stoppable(WorkerDouble):
        stopped = 0

        def shutdown(self):
            self.stopped += 1

    worker = Stoppable(model_dir)
    sgl_trl._SglGeneration(worker).shutdown()
    assert worker.stopped == 1
    sgl_trl._SglGeneration(WorkerDouble(model_dir)).shutdown()  # a double without shutdown: nothing to call
