"""LoRA adapters on CPU: the base-resend rule, the config, adapter payloads and their checks, the engine's
adapter calls (with the engine double of fakes.py) and the adapter sync driven through a worker."""

import ast
import asyncio
import importlib.util
import pickle

import pytest
import torch
from pydantic import ValidationError

from fakes import FakeSGLangEngine
from sgl_rollout.config import RolloutConfig, lora_settings_from_peft, server_args_fields
from sgl_rollout.engine import RolloutEngine
from sgl_rollout.memory import MemoryStateError
from sgl_rollout.weight_sync import lora
from sgl_rollout.weight_sync.manifest import SyncValidationError, WeightManifest
from sgl_rollout.worker import RolloutWorker
from sgl_rollout.weight_sync.driver import fenced

peft = pytest.importorskip("peft")  # installed with verl (its Requires-Dist), pinned in requirements/cpu-test.txt

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ======================================================================= the rule
# The spec, row by row (not derived from the rule's code): the engine lacks its base weights when
# (a) the load format is a dummy one and no base sync reached it, or (b) sleep releases its weights
# (free_cache_engine and sleep level 2) and no CPU backup keeps them.
RULE_TABLE = [
    # free_cache_engine, sleep_level, base_sync_done, load_format, expected
    (True, 1, False, "dummy", True),
    (True, 1, False, "auto", False),
    (True, 1, False, "safetensors", False),
    (True, 1, True, "dummy", False),
    (True, 1, True, "auto", False),
    (True, 1, True, "safetensors", False),
    (True, 2, False, "dummy", True),
    (True, 2, False, "auto", True),
    (True, 2, False, "safetensors", True),
    (True, 2, True, "dummy", True),
    (True, 2, True, "auto", True),
    (True, 2, True, "safetensors", True),
    (False, 1, False, "dummy", True),
    (False, 1, False, "auto", False),
    (False, 1, False, "safetensors", False),
    (False, 1, True, "dummy", False),
    (False, 1, True, "auto", False),
    (False, 1, True, "safetensors", False),
    (False, 2, False, "dummy", True),
    (False, 2, False, "auto", False),
    (False, 2, False, "safetensors", False),
    (False, 2, True, "dummy", False),
    (False, 2, True, "auto", False),
    (False, 2, True, "safetensors", False),
]


@pytest.mark.parametrize("fce,level,done,fmt,expected", RULE_TABLE)
def test_base_resend_rule(fce, level, done, fmt, expected):
    assert lora.needs_base_sync(free_cache_engine=fce, sleep_level=level, base_sync_done=done,
                                load_format=fmt) is expected


def test_rule_table_covers_every_combination():
    assert len({row[:4] for row in RULE_TABLE}) == 2 * 2 * 2 * 3 == len(RULE_TABLE)


@pytest.mark.parametrize("done,fmt,expected", [(True, "auto", False), (True, "dummy", False),
                                               (False, "auto", False), (False, "dummy", True)])
def test_cpu_backup_keeps_the_base_through_a_level_2_release(done, fmt, expected):
    assert lora.needs_base_sync(free_cache_engine=True, sleep_level=2, base_sync_done=done, load_format=fmt,
                                weights_cpu_backup=True) is expected


@pytest.mark.parametrize("released,level,expected", [(True, 1, True), (False, 2, False), (True, 2, True),
                                                     (False, 1, False)])
def test_observed_release_replaces_the_prediction(released, level, expected):
    # an engine's own record (it restarted? someone released its weights?) wins over the settings
    assert lora.needs_base_sync(free_cache_engine=True, sleep_level=level, base_sync_done=True, load_format="auto",
                                weights_released=released) is expected
    assert lora.needs_base_sync(free_cache_engine=True, sleep_level=level, base_sync_done=True, load_format="auto",
                                weights_released=released, weights_cpu_backup=True) is False


def test_rule_edges():
    assert lora.is_dummy_load("dummy") and lora.is_dummy_load("DUMMY_dtensor") and not lora.is_dummy_load("auto")
    assert not lora.is_dummy_load(None)
    with pytest.raises(ValueError, match="sleep_level"):
        lora.needs_base_sync(free_cache_engine=True, sleep_level=3, base_sync_done=True, load_format="auto")


# ======================================================================= config
def test_lora_config_maps_to_server_args():
    off = RolloutConfig(model_path="/m").to_server_args()
    assert not {"enable_lora", "max_lora_rank", "lora_target_modules", "max_loras_per_batch"} & set(off)
    kw = RolloutConfig(model_path="/m", lora_rank=16, max_loras=2).to_server_args()
    assert kw["enable_lora"] is True and kw["max_lora_rank"] == 16 and kw["max_loras_per_batch"] == 2
    assert kw["lora_target_modules"] == TARGETS  # PEFT's all-linear: the linear projections, no lm_head
    assert set(kw) <= server_args_fields()
    assert RolloutConfig(model_path="/m", lora_rank=8, lora_target_modules="all").to_server_args()[
        "lora_target_modules"] == ["all"]
    cfg = RolloutConfig(model_path="/m", lora_rank=8, lora_target_modules=["self_attn.q_proj", "v_proj", "q_proj"])
    assert cfg.lora_target_modules == ["q_proj", "v_proj"] and cfg.to_server_args()["lora_target_modules"] == ["q_proj", "v_proj"]


@pytest.mark.parametrize("kwargs,needles", [
    (dict(lora_rank=-1), ["lora_rank", "greater than or equal to 0"]),
    (dict(lora_rank=8, lora_alpha=0), ["lora_alpha", "greater than 0"]),
    (dict(lora_rank=8, max_loras=0), ["max_loras", "greater than or equal to 1"]),
    (dict(lora_rank=8, lora_target_modules=["q_proj", "wqkv"]), ["lora_target_modules", "wqkv"]),
    (dict(lora_rank=8, lora_target_modules="q_proj"), ["lora_target_modules", "'all-linear'"]),
    (dict(lora_rank=8, lora_target_modules=[]), ["lora_target_modules", "empty"]),
    (dict(lora_rank=8, engine_kwargs={"dp_size": 2}), ["lora_rank=8", "dp_size"]),
    (dict(lora_rank=8, engine_kwargs={"max_loaded_loras": 1}), ["lora_rank=8", "max_loaded_loras=1"]),
    (dict(lora_rank=8, engine_kwargs={"speculative_algorithm": "EAGLE"}), ["speculative_algorithm"]),
    (dict(engine_kwargs={"enable_lora": True}), ["enable_lora -> lora_rank"]),
    (dict(engine_kwargs={"max_loras_per_batch": 4}), ["max_loras_per_batch -> max_loras"]),
])
def test_bad_lora_settings_name_the_key(kwargs, needles):
    with pytest.raises(ValidationError) as e:
        RolloutConfig(model_path="/m", **kwargs)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_lora_settings_from_peft_config_object_and_dict():
    c = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "q_proj"])
    s = lora_settings_from_peft(c)
    assert s == {"lora_rank": 4, "lora_alpha": 8.0, "lora_target_modules": ["q_proj", "v_proj"]}
    assert lora_settings_from_peft(c.to_dict()) == s  # verl passes peft_config.to_dict(): enums, a set
    cfg = RolloutConfig(model_path="/m", **s)
    assert cfg.to_server_args()["max_lora_rank"] == 4
    assert lora_settings_from_peft({"r": 2, "target_modules": "all-linear"})["lora_target_modules"] == "all-linear"
    with pytest.raises(ValueError, match="peft_type"):
        lora_settings_from_peft({"r": 2, "peft_type": "IA3"})


def test_our_target_module_list_is_sglangs():
    from sgl_rollout.config import SGLANG_LORA_TARGET_MODULES

    spec = importlib.util.find_spec("sglang.srt.utils.common")
    tree = ast.parse(open(spec.origin, encoding="utf-8").read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "SUPPORTED_LORA_TARGET_MODULES":
            assert tuple(ast.literal_eval(node.value)) == SGLANG_LORA_TARGET_MODULES
            return
    pytest.fail("SUPPORTED_LORA_TARGET_MODULES not found in SGLang")


# ======================================================================= adapters
def tiny_llama(seed=0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64)
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def model():
    """(base named tensors, manifest, PEFT model, its LoraConfig, the adapter's state dict)."""
    from peft.utils.save_and_load import get_peft_model_state_dict

    m = tiny_llama()
    base = [(n, p.detach().clone()) for n, p in m.named_parameters()]
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)
    pm = peft.get_peft_model(m, cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # PEFT starts B at zero; a trained adapter is not
    sd = {k: v.detach().clone() for k, v in get_peft_model_state_dict(pm).items()}
    return base, WeightManifest.from_named_tensors(base), pm, cfg, sd


def read_like_sglang(data):
    """The payload as SGLang's TpModelWorker reads it: its SafeUnpickler and FlattenedTensorBucket."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    d = MultiprocessingSerializer.deserialize(data)
    return dict(FlattenedTensorBucket(flattened_tensor=d["flattened_tensor"], metadata=d["metadata"]).reconstruct_tensors())


def test_payload_round_trips_through_sglangs_reader(model):
    _, manifest, _, cfg, sd = model
    engine_cfg = RolloutConfig(model_path="/m", lora_rank=8)
    p = lora.build_adapter_payload(sd, cfg, manifest=manifest, engine_config=engine_cfg)
    got = read_like_sglang(p.data)
    assert list(got) == list(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    assert set(p.build_parts) == {"check", "flatten", "serialize"}
    assert abs(sum(p.build_parts.values()) - p.build_seconds) < 1e-6
    assert p.n_tensors == len(sd) == 2 * 2 * 7 and p.tensor_bytes == sum(t.numel() * 4 for t in sd.values())
    assert p.config["peft_type"] == "LORA" and p.config["r"] == 4 and p.config["lora_alpha"] == 8
    assert p.config["target_modules"] == sorted(TARGETS)  # a set in PEFT's to_dict, a list for SGLang
    pickle.dumps(p.config)
    # named_parameters() names (with the adapter's name) and unprefixed names become PEFT's saved names
    pm = model[2]
    named = [(n, t.detach()) for n, t in pm.named_parameters() if "lora_" in n]
    assert named[0][0].endswith("lora_A.default.weight")
    p2 = lora.build_adapter_payload(named, cfg, manifest=manifest)
    assert list(read_like_sglang(p2.data)) == list(sd)
    bare = [(k[len(lora.PEFT_PREFIX):], v) for k, v in sd.items()]
    assert list(read_like_sglang(lora.build_adapter_payload(bare, cfg.to_dict()).data)) == list(sd)
    bf16 = lora.build_adapter_payload(sd, cfg, dtype=torch.bfloat16)
    assert {t.dtype for t in read_like_sglang(bf16.data).values()} == {torch.bfloat16}


def test_every_bad_adapter_problem_is_listed_at_once(model):
    _, manifest, _, cfg, sd = model
    bad = dict(sd)
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    o_b = "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"
    bad[q_a] = torch.zeros(4, 31)  # in-dim of q_proj is 32
    bad[o_b] = torch.zeros(33, 4)  # out-dim of o_proj is 32
    bad["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"] = torch.zeros(5, 48)  # rank 5, r is 4
    del bad["base_model.model.model.layers.1.mlp.gate_proj.lora_B.weight"]
    bad["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"] = torch.zeros(16, 4, dtype=torch.int32)
    bad["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 64)
    bad["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 32)
    bad["base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 32)
    with pytest.raises(SyncValidationError) as e:
        lora.build_adapter_payload(bad, cfg, manifest=manifest)
    msg = str(e.value)
    for needle in ("q_proj.lora_A: shape (4, 31), expected (4, 32)", "o_proj.lora_B: shape (33, 4), expected (32, 4)",
                   "has rank 5, the config's r is 4", "layers.1.mlp.gate_proj: lora_B is missing",
                   "dtype torch.int32 is not floating point", "lora_embedding_A: not a LoRA weight name",
                   "adapters on 'lm_head' are not served", "the base model has no weight model.layers.9.self_attn.q_proj.weight"):
        assert needle in msg, (needle, msg)


def test_sglang_stacking_rules_and_unservable_configs(model):
    _, manifest, _, cfg, sd = model
    no_q = {k: v for k, v in sd.items() if "layers.0.self_attn.q_proj" not in k}
    no_gate = {k: v for k, v in sd.items() if "layers.1.mlp.gate_proj" not in k}
    with pytest.raises(SyncValidationError, match=r"layers.0.self_attn: \['k_proj', 'v_proj'\] without q_proj"):
        lora.validate_adapter(no_q.items(), lora.adapter_config_dict(cfg), manifest)
    with pytest.raises(SyncValidationError, match="up_proj without gate_proj"):
        lora.validate_adapter(no_gate.items(), lora.adapter_config_dict(cfg), manifest)
    no_v = {k: v for k, v in sd.items() if "layers.0.self_attn.v_proj" not in k}
    with pytest.raises(SyncValidationError, match="q_proj without v_proj"):
        lora.validate_adapter(no_v.items(), lora.adapter_config_dict(cfg), manifest)
    for key, value, needle in [("use_rslora", True, "sqrt"), ("use_dora", True, "DoRA"),
                               ("rank_pattern", {"q_proj": 8}, "one rank"), ("bias", "all", "biases"),
                               ("modules_to_save", ["lm_head"], "fully trained"), ("peft_type", "IA3", "only LORA")]:
        with pytest.raises(SyncValidationError, match=needle):
            lora.build_adapter_payload(sd, {**cfg.to_dict(), key: value}, manifest=manifest)
    small = RolloutConfig(model_path="/m", lora_rank=2, lora_target_modules=["q_proj", "v_proj"])
    with pytest.raises(SyncValidationError) as e:
        lora.build_adapter_payload(sd, cfg, manifest=manifest, engine_config=small)
    assert "exceeds the engine's lora_rank=2" in str(e.value) and "gate_up_proj" in str(e.value)
    with pytest.raises(SyncValidationError, match="without LoRA"):
        lora.build_adapter_payload(sd, cfg, engine_config=RolloutConfig(model_path="/m"))
    with pytest.raises(SyncValidationError, match="empty adapter"):
        lora.build_adapter_payload({}, cfg)


# ======================================================================= engine with the double
def lora_engine(model, **cfg):
    base, manifest, _, _, _ = model
    config = RolloutConfig(model_path="/fake", **{"lora_rank": 8, "load_format": "auto", **cfg})
    engine = RolloutEngine(config, engine_factory=FakeSGLangEngine, watch_interval_s=0.05)
    fake = engine._engine
    fake.lora_base_shapes = {n[: -len(".weight")]: tuple(t.shape) for n, t in base if t.dim() == 2}
    return engine, fake


def calls(fake, kind):
    return [c for c in fake.calls if c[0] == kind]


def test_engine_loads_replaces_and_serves_an_adapter(model):
    _, manifest, _, cfg, sd = model
    engine, fake = lora_engine(model)
    try:
        payload = lora.build_adapter_payload(sd, cfg, manifest=manifest, engine_config=engine.config)
        with fenced(engine):
            first = engine.load_lora_adapter_from_tensors("policy", payload)
        assert first.version == 1 and list(fake.lora) == [first.sglang_name]
        assert all(torch.equal(fake.lora[first.sglang_name]["tensors"][k], sd[k]) for k in sd)
        engine.generate([[1, 2]], {"max_new_tokens": 2}, lora_path="policy")
        assert fake.last_lora_path == [first.sglang_name]
        engine.generate([[1, 2]], {"max_new_tokens": 2})
        assert fake.last_lora_path is None  # the base alone
        with fenced(engine):  # a new version: loaded next to the old one, then the old one goes
            second = engine.load_lora_adapter_from_tensors("policy", payload)
        assert second.version == 2 and list(fake.lora) == [second.sglang_name]
        assert [c[0] for c in fake.calls[-2:]] == ["load_lora", "unload_lora"]
        assert fake.calls[-1] == ("unload_lora", first.sglang_name)
        engine.generate([[1]], {"max_new_tokens": 1}, lora_path="policy", n=2)
        assert fake.last_lora_path == [second.sglang_name] * 2
        # a payload built from named tensors (rank and targets checked against the engine's settings)
        with fenced(engine):
            third = engine.load_lora_adapter_from_tensors(
                "other", lora.build_adapter_payload(list(sd.items()), cfg, engine_config=engine.config))
        assert third.version == 1 and set(engine.lora_adapters) == {"policy", "other"}
        with fenced(engine):
            engine.unload_lora_adapter("other")
        assert set(engine.lora_adapters) == {"policy"} and len(fake.lora) == 1
        with pytest.raises(ValueError, match="no LoRA adapter 'other'"):
            engine.generate([[1]], {"max_new_tokens": 1}, lora_path="other")
        assert not fake.dead and engine.state.in_flight == 0
    finally:
        engine.shutdown()


def test_adapter_refused_asleep_in_flight_or_malformed_never_reaches_the_engine(model):
    import threading

    _, manifest, _, cfg, sd = model
    engine, fake = lora_engine(model)
    try:
        payload = lora.build_adapter_payload(sd, cfg, manifest=manifest)
        with pytest.raises(MemoryStateError, match="begin_sync"):
            engine.load_lora_adapter_from_tensors("policy", payload)
        engine.release(["weights", "kv_cache"])
        with pytest.raises(MemoryStateError, match="weights are released"):
            engine.begin_sync()
        engine.resume(["weights"])
        with fenced(engine):  # the staged wake: the KV cache is still released, that is fine
            engine.load_lora_adapter_from_tensors("policy", payload)
        engine.resume(["kv_cache"])
        loads = len(calls(fake, "load_lora"))
        fake.block = threading.Event()
        t = threading.Thread(target=engine.generate, args=([[1]], {"max_new_tokens": 1}), kwargs={"lora_path": "policy"})
        t.start()
        assert fake.entered.wait(5)
        with pytest.raises(MemoryStateError, match="request"):
            engine.begin_sync()  # a request runs: no adapter swap under it
        fake.block.set()
        t.join(5)
        bad = dict(sd)
        bad["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 31)
        with fenced(engine):
            with pytest.raises(SyncValidationError, match="q_proj.lora_A"):  # manifest: the base's shapes
                engine.load_lora_adapter_from_tensors("policy", lora.build_adapter_payload(bad, cfg, manifest=manifest))
            with pytest.raises(SyncValidationError, match="rank 8"):  # no manifest: rank still checked
                engine.load_lora_adapter_from_tensors("policy", lora.build_adapter_payload(
                    {**sd, list(sd)[0]: torch.zeros(8, 32)}, cfg, engine_config=engine.config))
            with pytest.raises(TypeError, match="AdapterPayload"):  # named tensors are the builder's job
                engine.load_lora_adapter_from_tensors("policy", list(sd.items()), cfg)
            with pytest.raises(SyncValidationError, match="exceeds the engine's lora_rank=8"):
                engine.load_lora_adapter_from_tensors("policy", payload.data, {**payload.config, "r": 16})
            with pytest.raises(ValueError, match="adapter name"):
                engine.load_lora_adapter_from_tensors("a@b", payload)
            with pytest.raises(ValueError, match="config_dict is required"):
                engine.load_lora_adapter_from_tensors("policy", payload.data)
        assert len(calls(fake, "load_lora")) == loads and not fake.dead
        # SGLang's own refusal: the previous version keeps serving
        before = engine.lora_adapters["policy"]
        fake.fail_next_lora = True
        with fenced(engine):
            with pytest.raises(RuntimeError, match="injected"):
                engine.load_lora_adapter_from_tensors("policy", payload)
        assert engine.lora_adapters["policy"] == before
        engine.generate([[1]], {"max_new_tokens": 1}, lora_path="policy")
        assert fake.last_lora_path == [before.sglang_name] and not fake.dead
    finally:
        engine.shutdown()

    plain = RolloutEngine(RolloutConfig(model_path="/fake"), engine_factory=FakeSGLangEngine, watch_interval_s=0.05)
    try:
        with fenced(plain):
            with pytest.raises(ValueError, match="without LoRA"):
                plain.load_lora_adapter_from_tensors("policy", payload)
        assert not calls(plain._engine, "load_lora")
    finally:
        plain.shutdown()


def test_cancelled_adapter_load_is_committed_on_sglangs_answer(model):
    _, manifest, _, cfg, sd = model
    engine, fake = lora_engine(model)
    payload = lora.build_adapter_payload(sd, cfg, manifest=manifest)

    async def scenario():
        await engine.async_begin_sync()
        fake.answer_delay_s = 0.3
        try:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(engine.async_load_lora_adapter_from_tensors("policy", payload), 0.05)
        finally:
            engine.end_sync(False)
        # the load is still in SGLang: the fence holds until it answers, then the adapter is there
        with pytest.raises(MemoryStateError):
            await engine.async_generate([[1]], {"max_new_tokens": 1})
        await engine.async_settle()
        fake.answer_delay_s = 0.0
        return await engine.async_generate([[1]], {"max_new_tokens": 1}, lora_path="policy")

    try:
        asyncio.run(scenario())
        assert engine.lora_adapters["policy"].version == 1 and fake.last_lora_path == [engine.lora_adapters["policy"].sglang_name]
        assert engine.state.busy is None and not fake.dead
    finally:
        engine.shutdown()


def test_engine_records_what_the_rule_needs_and_restart_forgets_adapters(model):
    base, manifest, _, cfg, sd = model
    engine, fake = lora_engine(model, load_format="dummy", sleep_level=2)
    worker = RolloutWorker(engine.config, engine=engine)
    worker.manifest = manifest
    try:
        assert (engine.weights_synced, engine.weights_released_since_sync) == (False, False)
        assert lora.engine_needs_base_sync(engine)  # dummy weights
        worker.update_weights(base)
        assert engine.weights_synced and not lora.engine_needs_base_sync(engine)
        worker.sleep()
        assert engine.weights_released_since_sync and lora.engine_needs_base_sync(engine)
        worker.update_weights(base)
        assert not engine.weights_released_since_sync and not lora.engine_needs_base_sync(engine)
        with fenced(engine):
            engine.load_lora_adapter_from_tensors("policy", lora.build_adapter_payload(sd, cfg))
        gen = engine.generation
        worker.restart()
        assert engine.generation == gen + 1 and engine.lora_adapters == {}
        assert not engine.weights_synced and lora.engine_needs_base_sync(engine)  # dummy again
    finally:
        worker.shutdown()


# ======================================================================= adapter sync through a worker
def worker_for(model, **cfg):
    engine, fake = lora_engine(model, **cfg)
    worker = RolloutWorker(engine.config, engine=engine)
    worker.manifest = model[1]
    return worker, fake


def sent(fake):
    """(base buckets, adapter loads) the double received."""
    return len(calls(fake, "update_weights")), len(calls(fake, "load_lora"))


@pytest.mark.parametrize("fce,level,fmt,backup,base_steps", [
    (True, 1, "dummy", False, [True, False, False]),   # verl's adapter mode: the base once
    (False, 1, "dummy", False, [True, False, False]),  # never released: once, for the dummy load
    (False, 2, "dummy", False, [True, False, False]),  # level 2 without free_cache_engine releases nothing
    (True, 2, "dummy", False, [True, True, True]),     # weights released every sleep: every step
    (True, 2, "dummy", True, [True, False, False]),    # ... unless the CPU backup keeps them
    (True, 2, "auto", False, [False, True, True]),     # a real load: only after each release
    (True, 1, "auto", False, [False, False, False]),   # a real load, kept: never
])
def test_update_adapter_sends_the_base_only_when_the_engine_lacks_it(model, fce, level, fmt, backup, base_steps):
    base, _, _, cfg, sd = model
    worker, fake = worker_for(model, free_cache_engine=fce, sleep_level=level, load_format=fmt,
                              enable_weights_cpu_backup=backup)
    base_calls = []
    offloads = []
    try:
        for step, expect_base in enumerate(base_steps):
            if step:
                worker.sleep()
            before = sent(fake)
            stats = lora.update_adapter(worker, sd, cfg, base_weights=lambda: (base_calls.append(step), base)[1],
                                        offload_trainer=lambda: offloads.append((step, *engine_state(worker))))
            after = sent(fake)
            assert stats.base_sent is expect_base, step
            assert after[0] - before[0] == (1 if expect_base else 0) and after[1] - before[1] == 1
            assert stats.base_bytes == (sum(t.numel() * 4 for _, t in base) if expect_base else 0)
            assert stats.adapter_tensors == len(sd) and stats.version == step + 1
            assert not worker.engine.state.released  # awake again
            assert worker.generate([[1]], {"max_new_tokens": 1}) and not fake.dead
        assert base_calls == [i for i, b in enumerate(base_steps) if b]  # the base is only gathered when sent
        # the trainer offloads once the adapter is in and (asleep) before the KV cache returns
        assert len(offloads) == len(base_steps)
        assert all(adapters and ("kv_cache" in released or not fce or not step) for step, adapters, released in offloads)
    finally:
        worker.shutdown()


def engine_state(worker):
    return dict(worker.engine.lora_adapters), set(worker.engine.state.released)


def test_update_adapter_without_base_when_needed_sends_nothing(model):
    _, _, _, cfg, sd = model
    worker, fake = worker_for(model, load_format="dummy", sleep_level=1)
    try:
        worker.sleep()
        n = len(fake.calls)
        with pytest.raises(lora.BaseWeightsMissing, match="pass base_weights"):
            lora.update_adapter(worker, sd, cfg)
        assert len(fake.calls) == n and set(worker.engine.state.released) == {"kv_cache", "cuda_graph"}
        bad = {**sd, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 31)}
        with pytest.raises(SyncValidationError):
            lora.update_adapter(worker, bad, cfg, base_weights=model[0])
        assert len(fake.calls) == n and not fake.dead
    finally:
        worker.shutdown()


def test_adapter_sync_on_a_resident_engine_counts_base_once(model):
    base, manifest, _, cfg, sd = model
    engine, fake = lora_engine(model, load_format="dummy", free_cache_engine=False)
    sync = lora.AdapterSync(engine, manifest=manifest)
    try:
        first = sync.sync(sd, cfg, base_weights=base)
        again = [sync.sync(sd, cfg, base_weights=base) for _ in range(3)]
        assert first.base_sent and first.base_tensors == len(base)
        assert [s.base_sent for s in again] == [False] * 3 and [s.version for s in again] == [2, 3, 4]
        assert sum(s.base_bytes for s in sync.history) == sum(t.numel() * 4 for _, t in base)
        assert len(calls(fake, "update_weights")) == 1 and len(calls(fake, "load_lora")) == 4
        # a bad base is refused whole before the adapter or any bucket is sent
        engine2, fake2 = lora_engine(model, load_format="dummy")
        try:
            with pytest.raises(SyncValidationError, match="model.norm.weight"):
                lora.AdapterSync(engine2, manifest=manifest).sync(sd, cfg, base_weights=base[:-2])
            assert not calls(fake2, "update_weights") and not calls(fake2, "load_lora")
        finally:
            engine2.shutdown()
    finally:
        engine.shutdown()


def test_tensors_outside_the_declared_or_served_modules_are_refused(model):
    _, manifest, _, cfg, sd = model
    qv = {k: v for k, v in sd.items() if "q_proj" in k or "v_proj" in k}
    with pytest.raises(SyncValidationError, match="'o_proj' is not in the config's target_modules"):
        lora.validate_adapter({**qv, **{k: v for k, v in sd.items() if "o_proj" in k}}.items(),
                              lora.adapter_config_dict({**cfg.to_dict(), "target_modules": ["q_proj", "v_proj"]}))
    engine_cfg = RolloutConfig(model_path="/m", lora_rank=8, lora_target_modules=["q_proj", "v_proj"])
    p = lora.build_adapter_payload(qv, {**cfg.to_dict(), "target_modules": ["q_proj", "v_proj"]}, manifest=manifest,
                                   engine_config=engine_cfg)
    assert p.modules == ["q_proj", "v_proj"] and p.config["target_modules"] == ["q_proj", "v_proj"]
    # a config saying all-linear with only q/v tensors is fine for the engine: SGLang gets the modules sent
    p = lora.build_adapter_payload(qv, {**cfg.to_dict(), "target_modules": "all-linear"}, engine_config=engine_cfg)
    assert p.config["target_modules"] == ["q_proj", "v_proj"]
