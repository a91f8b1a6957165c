"""verl's hydra-composed trainer config (verl/trainer/config/ppo_trainer.yaml) through this package's
mapping: the default, each variant verl's own SGLang server honours, and every refusal names its key.
No Ray here; the Ray-driven checks are in test_verl_rollout.py."""

import json
import os
import shutil
import types

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402

from sgl_rollout.integrations.verl_config import (  # noqa: E402
    UnsupportedVerlFeature,
    resolve_local_model,
    rollout_config_from_verl,
)
from sgl_rollout.integrations.verl_rollout import SglRollout  # noqa: E402
from sgl_rollout.integrations.verl_server import SglRolloutReplica, format_address, server_name  # noqa: E402


def make_tiny_model(folder: str, hidden: int = 32, intermediate: int = 64, vocab: int = 64) -> str:
    """A Llama-shaped Hugging Face folder (config, fast tokenizer, safetensors weights) made offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(folder, exist_ok=True)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i + 3 for i in range(vocab - 3)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="</s>").save_pretrained(folder)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      architectures=["LlamaForCausalLM"], tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


def compose(*overrides, model_path="/models/x"):
    """verl's ppo_trainer config composed with hydra's compose API, as ``python -m verl.trainer.main_ppo`` does."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=[
            "actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.model.path={model_path}", *overrides])


def mapped(*overrides, **kwargs):
    """(verl's RolloutConfig dataclass, our RolloutConfig) for a composed config."""
    from verl.utils.config import omega_conf_to_dataclass

    root = compose(*overrides)
    verl_cfg = omega_conf_to_dataclass(root.actor_rollout_ref.rollout)
    return verl_cfg, rollout_config_from_verl(verl_cfg, "/models/x", model_config=root.actor_rollout_ref.model, **kwargs)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "tiny-llama"))


def test_default_ppo_trainer_config_maps():
    verl_cfg, cfg = mapped()
    assert cfg.tensor_model_parallel_size == verl_cfg.tensor_model_parallel_size == 2
    assert cfg.gpu_memory_utilization == 0.5 and cfg.load_format == "dummy" and cfg.max_num_seqs == 256
    assert cfg.free_cache_engine and cfg.sleep_level == 2 and not cfg.enable_weights_cpu_backup
    assert cfg.update_weights_bucket_megabytes == 2048
    assert cfg.engine_kwargs == {"skip_tokenizer_init": True}
    args = cfg.to_server_args()
    assert args["tp_size"] == 2 and "dp_size" not in args and "quantization" not in args
    # the DictConfig itself (what verl's replica and worker hold before converting) maps the same way
    root = compose()
    assert rollout_config_from_verl(root.actor_rollout_ref.rollout, "/models/x") == cfg


def test_mem_fraction_static_in_engine_kwargs_overrides_gpu_memory_utilization():
    _, cfg = mapped("actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
                    "+actor_rollout_ref.rollout.engine_kwargs.sglang.mem_fraction_static=0.8",
                    "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton")
    assert cfg.gpu_memory_utilization == 0.8  # verl's semantics: engine_kwargs win
    assert "mem_fraction_static" not in cfg.engine_kwargs and cfg.engine_kwargs["attention_backend"] == "triton"
    assert cfg.to_server_args()["mem_fraction_static"] == 0.8


def test_quantization_fp8_reaches_sglang(tiny_model):
    from transformers import AutoConfig

    _, cfg = mapped("actor_rollout_ref.rollout.quantization=fp8")
    assert cfg.to_server_args()["quantization"] == "fp8"
    # with the model's config (the engine actor has it) the block-wise FP8 config goes along, as in verl
    _, cfg = mapped("actor_rollout_ref.rollout.quantization=fp8",
                    '+actor_rollout_ref.rollout.engine_kwargs.sglang.json_model_override_args=\'{"rope_theta": 5.0}\'',
                    hf_config=AutoConfig.from_pretrained(tiny_model))
    overrides = json.loads(cfg.engine_kwargs["json_model_override_args"])
    assert overrides["rope_theta"] == 5.0  # the user's own overrides are kept
    assert overrides["quantization_config"]["quant_method"] == "fp8"
    assert overrides["quantization_config"]["weight_block_size"] == [128, 128]
    with pytest.raises(UnsupportedVerlFeature, match=r"actor_rollout_ref\.rollout\.quantization='int8'"):
        mapped("actor_rollout_ref.rollout.quantization=int8")


def test_layered_summon_maps_and_keeps_sleep_level_2():
    verl_cfg, cfg = mapped()
    assert verl_cfg.layered_summon is False and cfg.layered_summon is False
    verl_cfg, cfg = mapped("actor_rollout_ref.rollout.layered_summon=true")
    assert verl_cfg.layered_summon is True and cfg.layered_summon is True
    # verl's vLLM rollout drops to sleep level 1 with layered_summon; the staged wake needs no such thing
    assert cfg.sleep_level == 2 and cfg.free_cache_engine
    root = compose("actor_rollout_ref.rollout.layered_summon=true")
    assert rollout_config_from_verl(root.actor_rollout_ref.rollout, "/models/x").layered_summon is True
    assert rollout_config_from_verl({"layered_summon": True}, "/models/x").layered_summon is True
    assert "layered_summon" not in cfg.to_server_args()  # ours, not SGLang's


def test_data_parallel_size(monkeypatch):
    with pytest.raises(UnsupportedVerlFeature,
                       match=r"actor_rollout_ref\.rollout\.data_parallel_size=2.*enable_dp_attention=True"):
        mapped("actor_rollout_ref.rollout.data_parallel_size=2")
    _, cfg = mapped("actor_rollout_ref.rollout.data_parallel_size=2",
                    "+actor_rollout_ref.rollout.engine_kwargs.sglang.enable_dp_attention=true")
    args = cfg.to_server_args()
    # verl's SGLang server: tp_size = tensor_model_parallel_size * data_parallel_size, dp_size = data_parallel_size
    assert (args["tp_size"], args["dp_size"], args["enable_dp_attention"]) == (4, 2, True)


def test_local_path_is_resolved_as_verl_does(tiny_model):
    root = compose("actor_rollout_ref.model.use_shm=true", model_path=tiny_model)
    local, hf_config = resolve_local_model(root.actor_rollout_ref.model)
    try:
        assert local.startswith("/dev/shm/verl-cache/") and local != tiny_model
        assert os.path.isfile(os.path.join(local, "config.json"))
        assert hf_config.max_position_embeddings == 256
    finally:
        shutil.rmtree(os.path.dirname(local), ignore_errors=True)
    # an HFModelConfig made on another node: its local_path is absent here, so the path is fetched again
    local, _ = resolve_local_model(types.SimpleNamespace(path=tiny_model, local_path="/elsewhere/x", use_shm=False))
    assert local == tiny_model


def test_refusals_name_the_verl_key():
    with pytest.raises(UnsupportedVerlFeature) as err:
        mapped("actor_rollout_ref.rollout.prometheus.enable=true",
               "actor_rollout_ref.rollout.checkpoint_engine.backend=delta_sharded",
               "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
               "actor_rollout_ref.model.lora_rank=8")
    msg = str(err.value)
    for key in ("actor_rollout_ref.rollout.prometheus.enable=True", "actor_rollout_ref.rollout.checkpoint_engine.backend",
                "actor_rollout_ref.rollout.enable_rollout_routing_replay", "actor_rollout_ref.model.lora.merge=True",
                "VERL_USE_EXTERNAL_PLUGINS=none"):
        assert key in msg, key
    _, cfg = mapped("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora.merge=true")  # merged: fine
    with pytest.raises(UnsupportedVerlFeature, match=r"engine_kwargs\.sglang\.tp_size=4.*tensor_model_parallel_size"):
        mapped("+actor_rollout_ref.rollout.engine_kwargs.sglang.tp_size=4")
    with pytest.raises(UnsupportedVerlFeature, match="enable_memory_saver"):
        mapped("+actor_rollout_ref.rollout.engine_kwargs.sglang.enable_memory_saver=false")
    # piecewise CUDA graphs: on through verl, as in verl's built-in server; the SGLang key turns them off
    _, cfg = mapped()
    assert cfg.piecewise_cuda_graph is True and cfg.to_server_args()["disable_piecewise_cuda_graph"] is False
    _, cfg = mapped("+actor_rollout_ref.rollout.engine_kwargs.sglang.disable_piecewise_cuda_graph=true")
    assert cfg.piecewise_cuda_graph is False and "disable_piecewise_cuda_graph" not in cfg.engine_kwargs
    assert cfg.to_server_args()["disable_piecewise_cuda_graph"] is True
    # eager: SGLang's disable_cuda_graph only, as verl's built-in server maps it (the same command gives both
    # rollouts the same graphs: piecewise ones stay on)
    _, cfg = mapped("actor_rollout_ref.rollout.enforce_eager=true")
    args = cfg.to_server_args()
    assert args["disable_cuda_graph"] is True and args["disable_piecewise_cuda_graph"] is False
    with pytest.raises(UnsupportedVerlFeature, match="disable_piecewise_cuda_graph: not a boolean"):
        mapped("+actor_rollout_ref.rollout.engine_kwargs.sglang.disable_piecewise_cuda_graph=maybe")
    # the fast path (the default) registers the loader inside SGLang; verl's config can turn it off
    for extra in ((), ("+actor_rollout_ref.rollout.engine_kwargs.sgl_rollout.fast_sync=true",)):
        _, cfg = mapped(*extra)
        assert cfg.fast_sync is True
        assert cfg.to_server_args()["custom_weight_loader"] == ["sgl_rollout.weight_sync.receiver.load_weights"]
    _, cfg = mapped("+actor_rollout_ref.rollout.engine_kwargs.sgl_rollout.fast_sync=false")
    assert cfg.fast_sync is False and not cfg.to_server_args().get("custom_weight_loader")
    with pytest.raises(UnsupportedVerlFeature, match=r"engine_kwargs\.sgl_rollout\.fast_sync='maybe': not a boolean"):
        mapped("+actor_rollout_ref.rollout.engine_kwargs.sgl_rollout.fast_sync=maybe")
    # the garbage collector's freeze after the first generate: on by default, verl's config can turn it off
    _, cfg = mapped()
    assert cfg.freeze_gc is True
    _, cfg = mapped("+actor_rollout_ref.rollout.engine_kwargs.sgl_rollout.freeze_gc=false")
    assert cfg.freeze_gc is False and "freeze_gc" not in cfg.to_server_args()  # ours, not a ServerArgs field
    with pytest.raises(UnsupportedVerlFeature, match=r"engine_kwargs\.sgl_rollout\.freeze_gc='later': not a boolean"):
        mapped("+actor_rollout_ref.rollout.engine_kwargs.sgl_rollout.freeze_gc=later")
    # an unknown key of ours is refused with the keys there are, not silently ignored
    with pytest.raises(UnsupportedVerlFeature, match=r"engine_kwargs\.sgl_rollout\.fast_synk.*one of fast_sync"):
        mapped("+actor_rollout_ref.rollout.engine_kwargs.sgl_rollout.fast_synk=true")


def test_rollout_mode_decides_what_sleep_releases():
    _, standalone = mapped(rollout_mode="standalone")
    _, colocated = mapped(rollout_mode="colocated")
    assert standalone.sleep_level == 1  # weight syncs land in resident weights (verl: KV cache only)
    assert colocated.enable_weights_cpu_backup  # no sync ever comes: a wake-up must restore the weights


def test_server_names_are_unique_per_role_and_suffix():
    names = {server_name(0), server_name(1), server_name(0, role="reward"), server_name(0, role="teacher"),
             server_name(0, role="teacher", name_suffix="gsm8k"), server_name(0, node_rank=1)}
    assert len(names) == 6
    assert server_name(0) == "sgl_rollout_server_0_0"
    assert format_address("10.0.0.1", 5) == "10.0.0.1:5" and format_address("fe80::1", 5) == "[fe80::1]:5"


def test_reward_and_teacher_replicas_and_rl_insight_are_refused(monkeypatch):
    from verl.workers.config import RolloutConfig as VerlRolloutConfig

    cfg = VerlRolloutConfig(name="sglang", tensor_model_parallel_size=1)
    model = types.SimpleNamespace(path="/models/x")
    SglRolloutReplica(0, cfg, model, gpus_per_node=1)  # the policy's rollout replica is fine
    with pytest.raises(UnsupportedVerlFeature, match=r"reward\.reward_model\.rollout\.name"):
        SglRolloutReplica(0, cfg, model, gpus_per_node=1, is_reward_model=True)
    with pytest.raises(UnsupportedVerlFeature, match=r"distillation\.teacher_models\.<teacher>\.inference\.name"):
        SglRolloutReplica(0, cfg, model, gpus_per_node=1, is_teacher_model=True, name_suffix="gsm8k")
    monkeypatch.setenv("VERL_RL_INSIGHT_ENABLE", "1")
    with pytest.raises(UnsupportedVerlFeature, match="VERL_RL_INSIGHT_ENABLE"):
        SglRolloutReplica(0, cfg, model, gpus_per_node=1)


def test_adapter_quantizes_fp8_before_the_sync(tiny_model, tmp_path, monkeypatch):
    """verl's SGLang adapter sends block-wise FP8 weights plus ``*_scale_inv`` for quantization=fp8."""
    import asyncio

    import torch.distributed as dist
    from verl.workers.config import RolloutConfig as VerlRolloutConfig

    monkeypatch.setenv("RANK", "0")
    cfg = VerlRolloutConfig(name="sglang", tensor_model_parallel_size=1, quantization="fp8")
    adapter = SglRollout(cfg, {"_target_": "verl.workers.config.HFModelConfig", "path": tiny_model})
    assert adapter.is_leader_rank and adapter.replica_rank == 0 and adapter._sync_manifest() is None

    async def collect(items):
        return [(n, t) async for n, t in adapter._named_tensors(iter(items))]

    w = torch.randn(128, 128)
    items = [("model.layers.0.mlp.up_proj.base_layer.weight", w), ("model.norm.weight", torch.ones(128))]
    # verl's quantizer needs torch.distributed; without it, it would silently send bf16: refused instead
    with pytest.raises(RuntimeError, match="FP8 quantization of model.layers.0.mlp.up_proj.weight failed"):
        asyncio.run(collect(items))
    from verl.utils.kernel import fp8_kernel

    monkeypatch.setattr(fp8_kernel, "_DISABLE_TRITON_FP8", True)  # Triton is installed but has no GPU here
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        out = dict(asyncio.run(collect(items)))
    finally:
        dist.destroy_process_group()
    assert out["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert out["model.layers.0.mlp.up_proj.weight_scale_inv"].shape == (1, 1)
    assert out["model.norm.weight"].dtype == torch.float32


def test_expert_parallel_size_reaches_sglang_as_ep_size():
    _, cfg = mapped("actor_rollout_ref.rollout.expert_parallel_size=2",
                    "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    args = cfg.to_server_args()
    assert (args["ep_size"], args["tp_size"]) == (2, 2)  # as verl's SGLang server passes them
