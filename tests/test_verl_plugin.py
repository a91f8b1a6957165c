"""verl loads the plugin through its entry point and resolves ("sglang", "async") to this package."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("verl")

PROBE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(levelname)s %(name)s %(message)s")
{pre}
import verl
from verl.workers.rollout.base import _ROLLOUT_REGISTRY, get_rollout_class
print("PATH", _ROLLOUT_REGISTRY[("sglang", "async")])
{post}
"""


def _run(pre="", post="", **env):
    e = dict(os.environ)
    e.pop("VERL_USE_EXTERNAL_PLUGINS", None)
    e.update(env)
    code = PROBE.format(pre=pre, post=post)
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert eps.get("sgl_rollout") == "sgl_rollout.integrations.verl:register"


def test_import_verl_loads_plugin_and_registries_return_our_classes():
    out = _run(post=(
        "from verl.workers.rollout.replica import RolloutReplicaRegistry;"
        "cls = get_rollout_class('sglang', 'async'); rep = RolloutReplicaRegistry.get('sglang');"
        "from verl.workers.rollout.base import BaseRollout; from verl.workers.rollout.replica import RolloutReplica;"
        "print('ROLLOUT', cls.__module__ + '.' + cls.__name__, issubclass(cls, BaseRollout));"
        "print('REPLICA', rep.__module__ + '.' + rep.__name__, issubclass(rep, RolloutReplica))"))
    assert "PATH sgl_rollout.integrations.verl_rollout.SglRollout" in out
    assert "ROLLOUT sgl_rollout.integrations.verl_rollout.SglRollout True" in out
    assert "REPLICA sgl_rollout.integrations.verl_server.SglRolloutReplica True" in out
    assert "LOG INFO sgl_rollout rollout.name=sglang is answered by sgl-rollout" in out


def test_verl_use_external_plugins_none_gives_verls_own():
    out = _run(post="from verl.workers.rollout.replica import RolloutReplicaRegistry;"
               "print('REPLICA_LOADER', RolloutReplicaRegistry._registry['sglang'].__module__)",
               VERL_USE_EXTERNAL_PLUGINS="none")
    assert "PATH verl.workers.rollout.sglang_rollout.sglang_rollout.ServerAdapter" in out
    assert "REPLICA_LOADER verl.workers.rollout.replica" in out
    assert "sgl-rollout" not in out


def test_broken_plugin_import_is_reported_at_warning():
    # Make the registry module unimportable while verl loads its plugins: the plugin must say so loudly.
    pre = "import sys; sys.modules['verl.workers.rollout.replica'] = None"
    out = _run(pre=pre)
    assert "LOG WARNING sgl_rollout sgl-rollout could not register with verl" in out
    assert "verl.workers.rollout.replica" in out  # the cause is in the message
    assert "PATH verl.workers.rollout.sglang_rollout.sglang_rollout.ServerAdapter" in out


def test_verl_config_maps_to_rollout_config():
    from verl.workers.config import RolloutConfig as VerlRolloutConfig

    from sgl_rollout.integrations.verl_config import rollout_config_from_verl

    vc = VerlRolloutConfig(name="sglang", tensor_model_parallel_size=2, gpu_memory_utilization=0.7,
                           free_cache_engine=True, enforce_eager=True, max_num_seqs=64, load_format="dummy",
                           engine_kwargs={"sglang": {"attention_backend": "triton"}})
    cfg = rollout_config_from_verl(vc, "/models/x")
    assert (cfg.model_path, cfg.tensor_model_parallel_size, cfg.gpu_memory_utilization) == ("/models/x", 2, 0.7)
    assert cfg.enforce_eager and cfg.max_num_seqs == 64 and cfg.load_format == "dummy"
    assert cfg.engine_kwargs["attention_backend"] == "triton"
    assert cfg.update_weights_bucket_megabytes == vc.checkpoint_engine.update_weights_bucket_megabytes


def test_doctor_reports_every_check():
    import torch

    out = subprocess.run([sys.executable, "-m", "sgl_rollout", "doctor"], capture_output=True, text=True, timeout=600)
    # without a GPU (CI) doctor says what is missing and exits 1 (tests/test_doctor.py)
    assert out.returncode == (0 if torch.cuda.is_available() else 1), out.stderr
    for label in ("sglang", "torch-memory-saver", "verl", "memory-saver hook", "TP imbalance check", "GPUs",
                  'verl resolves "sglang" to'):
        assert any(line.startswith(label) for line in out.stdout.splitlines()), label
    assert "SGLang check enabled in engine: False" in out.stdout
    assert "sgl_rollout.integrations.verl_rollout.SglRollout (this package" in out.stdout


def test_trl_conflict_is_what_verl_hits_with_the_installed_trl():
    """TRL 1.16 (this package's ``trl`` extra) lacks the class verl 0.9.1's FSDP model build imports
    whenever trl is importable: the check says so, and both of its premises are checked for real here."""
    pytest.importorskip("trl")
    import importlib.util

    from sgl_rollout.integrations.verl import VERL_TRL_CLASS, trl_conflict

    spec = importlib.util.find_spec("verl.models.transformers.monkey_patch")
    source = open(spec.origin, encoding="utf-8").read()
    assert f"from trl import {VERL_TRL_CLASS}" in source and "is_trl_available()" in source
    import trl

    assert not hasattr(trl, VERL_TRL_CLASS) and importlib.util.find_spec("trl.experimental.ppo") is None
    why = trl_conflict()
    assert why is not None and VERL_TRL_CLASS in why and trl.__version__ in why


def test_trl_conflict_is_none_for_a_trl_that_has_the_class(monkeypatch, tmp_path):
    import importlib.metadata

    from sgl_rollout.integrations import verl as plugin

    (tmp_path / "trl").mkdir()
    (tmp_path / "trl" / "__init__.py").write_text("from .models import AutoModelForCausalLMWithValueHead\n")

    class Dist:
        version, files = "0.11.0", ["trl/__init__.py"]

        def locate_file(self, path):
            return tmp_path / path

    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Dist())
    assert plugin.trl_conflict() is None
    (tmp_path / "trl" / "__init__.py").write_text("__version__ = '1.16.0'\n")
    assert "0.11.0" in plugin.trl_conflict()
