import pytest
from pydantic import ValidationError

from sgl_rollout.config import FAST_SYNC_LOADER, MANAGED_SERVER_ARGS, RolloutConfig, server_args_fields


def test_defaults_and_server_args():
    cfg = RolloutConfig(model_path="/m", tensor_model_parallel_size=2, gpu_memory_utilization=0.8, max_num_seqs=64,
                        enforce_eager=True, engine_kwargs={"attention_backend": "triton"})
    kw = cfg.to_server_args()
    assert kw["tp_size"] == 2
    assert kw["mem_fraction_static"] == 0.8
    assert kw["max_running_requests"] == 64
    assert kw["enable_memory_saver"] is True
    assert kw["disable_piecewise_cuda_graph"] is True
    assert kw["disable_cuda_graph"] is True
    assert kw["attention_backend"] == "triton"
    piecewise = RolloutConfig(model_path="/m", piecewise_cuda_graph=True).to_server_args()
    assert piecewise["disable_piecewise_cuda_graph"] is False
    # eager is SGLang's disable_cuda_graph (decode graphs), as verl's built-in maps it; piecewise ones follow
    # piecewise_cuda_graph alone (off by default here)
    eager = RolloutConfig(model_path="/m", piecewise_cuda_graph=True, enforce_eager=True).to_server_args()
    assert eager["disable_cuda_graph"] is True and eager["disable_piecewise_cuda_graph"] is False
    eager = RolloutConfig(model_path="/m", enforce_eager=True).to_server_args()
    assert eager["disable_cuda_graph"] is True and eager["disable_piecewise_cuda_graph"] is True
    assert cfg.bucket_bytes == 2048 << 20
    assert cfg.name == "sglang" and cfg.sleep_level == 2 and cfg.free_cache_engine


def test_every_server_arg_we_emit_exists_in_installed_sglang():
    fields = server_args_fields()
    assert "enable_memory_saver" in fields and "tp_size" in fields
    emitted = RolloutConfig(model_path="/m", max_num_seqs=1).to_server_args()
    assert set(emitted) <= fields
    assert set(MANAGED_SERVER_ARGS) <= fields


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("gpu_memory_utilization", 1.5, "less than or equal to 1"),
        ("gpu_memory_utilization", 0.0, "greater than 0"),
        ("tensor_model_parallel_size", 0, "greater than or equal to 1"),
        ("sleep_level", 3, "1 or 2"),
        ("update_weights_bucket_megabytes", 0, "greater than or equal to 1"),
        ("max_num_seqs", 0, "greater than or equal to 1"),
        ("name", "vllm", "'sglang'"),
        ("dtype", "int3", "dtype must be one of"),
    ],
)
def test_bad_values_name_key_and_range(key, value, needle):
    with pytest.raises(ValidationError) as e:
        RolloutConfig(model_path="/m", **{key: value})
    msg = str(e.value)
    assert key in msg and needle in msg


def test_unknown_top_level_key_rejected():
    with pytest.raises(ValidationError, match="gpu_mem_util"):
        RolloutConfig(model_path="/m", gpu_mem_util=0.5)


def test_unknown_engine_kwarg_lists_valid_keys():
    with pytest.raises(ValidationError) as e:
        RolloutConfig(model_path="/m", engine_kwargs={"attention_backnd": "triton"})
    msg = str(e.value)
    assert "attention_backnd" in msg and "attention_backend" in msg and "valid SGLang ServerArgs keys" in msg


def test_engine_kwarg_owned_by_config_is_rejected():
    with pytest.raises(ValidationError, match="tp_size -> tensor_model_parallel_size"):
        RolloutConfig(model_path="/m", engine_kwargs={"tp_size": 2})


def test_assignment_is_validated():
    cfg = RolloutConfig(model_path="/m")
    with pytest.raises(ValidationError):
        cfg.gpu_memory_utilization = 2.0


def test_fast_sync_registers_the_loader_once_and_keeps_the_users():
    assert RolloutConfig(model_path="/m").to_server_args()["custom_weight_loader"] == [FAST_SYNC_LOADER]  # the default
    assert "custom_weight_loader" not in RolloutConfig(model_path="/m", fast_sync=False).to_server_args()
    kw = RolloutConfig(model_path="/m", fast_sync=True,
                       engine_kwargs={"custom_weight_loader": ["my.loader", FAST_SYNC_LOADER]}).to_server_args()
    assert kw["custom_weight_loader"] == ["my.loader", FAST_SYNC_LOADER]
    kw = RolloutConfig(model_path="/m", fast_sync=True).to_server_args()
    assert kw["custom_weight_loader"] == [FAST_SYNC_LOADER]
    import importlib

    assert callable(getattr(importlib.import_module(FAST_SYNC_LOADER.rsplit(".", 1)[0]), FAST_SYNC_LOADER.rsplit(".", 1)[1]))


def test_the_gpu_suites_fast_sync_switch_changes_only_the_default():
    """``SGLROLLOUT_GPU_FAST_SYNC=0 pytest -m gpu`` runs the worker's GPU suite on the flattened buckets,
    ``=1`` on the fast path (the default) (tests/gpu/conftest.py)."""
    from gpu.conftest import fast_sync_default

    with fast_sync_default(False):
        off = RolloutConfig(model_path="/m")
        assert not off.fast_sync and "custom_weight_loader" not in off.to_server_args()
        assert RolloutConfig(model_path="/m", fast_sync=True).fast_sync is True  # a config that sets it keeps it
    with fast_sync_default(True):
        assert RolloutConfig(model_path="/m").fast_sync is True
        assert RolloutConfig(model_path="/m", fast_sync=False).fast_sync is False
    assert RolloutConfig(model_path="/m").fast_sync is True  # the default is back
