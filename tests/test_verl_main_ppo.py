"""verl's real trainer entry point, ``python -m verl.trainer.main_ppo``, on CPU: it imports (TransferQueue
included), it resolves ``rollout.name=sglang`` to this package, and it parses the exact command line of
``examples/verl/run_grpo.sh`` (run with DRY_RUN=1, which stops after hydra composed the config)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import inspect, sys
import transfer_queue, verl.trainer.main_ppo as m
from verl.trainer.ppo.v1 import AgentLoopManagerTQ, get_trainer_cls
from verl.workers.rollout.base import get_rollout_class
from verl.workers.rollout.replica import get_rollout_replica_class, RolloutReplica
from verl.workers.rollout.base import BaseRollout
print("TQ", "init" in dir(transfer_queue) and "KVBatchMeta" in dir(transfer_queue))
print("RUNNER", "import transfer_queue as tq" in inspect.getsource(m.TaskRunnerV1.run))
print("TRAINER", get_trainer_cls("sync").__name__)
cls, rep = get_rollout_class("sglang", "async"), get_rollout_replica_class("sglang")
print("ROLLOUT", cls.__module__ + "." + cls.__name__, issubclass(cls, BaseRollout))
print("REPLICA", rep.__module__ + "." + rep.__name__, issubclass(rep, RolloutReplica))
"""


def _env(**extra):
    env = dict(os.environ)
    env.pop("VERL_USE_EXTERNAL_PLUGINS", None)
    env.update(extra)
    return env


def test_main_ppo_imports_and_resolves_sglang_to_this_package():
    out = subprocess.run([sys.executable, "-c", PROBE], env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "TQ True" in lines and "RUNNER True" in lines
    assert "TRAINER PPOTrainerSync" in lines  # trainer.v1.trainer_mode=sync, the default
    assert "ROLLOUT sgl_rollout.integrations.verl_rollout.SglRollout True" in lines
    assert "REPLICA sgl_rollout.integrations.verl_server.SglRolloutReplica True" in lines


def _pins(path: Path) -> dict:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s#;]+)", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def test_cpu_pins_match_the_gpu_overlay_and_the_venv():
    """TransferQueue and the other packages verl's trainer imports: the CPU test environment pins the
    versions the GPU overlay ships, and this environment has them installed."""
    from importlib.metadata import version

    ours = _pins(ROOT / "requirements" / "cpu-test.txt")
    assert ours.get("transferqueue") == "0.1.11"
    for name, pin in ours.items():
        assert version(name) == pin, f"{name}: installed {version(name)}, requirements/cpu-test.txt pins {pin}"
    overlay = next((p for p in (ROOT / "shared", ROOT.parent / "shared")
                    if (p / "gpu-overlay" / "requirements-verl.txt").is_file()), None)
    if overlay is not None:  # the GPU overlay's pins, where this checkout has them
        theirs = _pins(overlay / "gpu-overlay" / "requirements-verl.txt")
        assert "transferqueue" in theirs
        for name in ours.keys() & theirs.keys():
            assert ours[name] == theirs[name], f"{name}: cpu-test.txt {ours[name]}, gpu overlay {theirs[name]}"


def test_run_script_command_line_parses_in_main_ppo(tmp_path):
    """The script's whole command (prepare, overrides, extra hydra arguments) up to verl's hydra: the
    config main_ppo would run with, printed by hydra's --cfg job."""
    from sgl_rollout.bench import LLAMA_TINY, make_llama_dir
    from sgl_rollout.demo.model import save_byte_level_tokenizer

    model = tmp_path / "model"
    make_llama_dir(str(model), LLAMA_TINY)
    save_byte_level_tokenizer(model, LLAMA_TINY["vocab_size"])
    run = tmp_path / "run"
    out = subprocess.run(
        ["bash", str(ROOT / "examples" / "verl" / "run_grpo.sh"), "trainer.test_freq=4"],
        env=_env(PYTHON=sys.executable, MODEL=str(model), OUT=str(run), DRY_RUN="1", NGPUS="2", TP="2",
                 STEPS="7"),
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = yaml.safe_load(out.stdout)
    r = cfg["actor_rollout_ref"]["rollout"]
    assert (r["name"], r["tensor_model_parallel_size"], r["n_gpus_per_node"]) == ("sglang", 2, 2)
    assert r["engine_kwargs"]["sglang"] == {"attention_backend": "triton", "sampling_backend": "pytorch",
                                            "grammar_backend": "none"}
    assert cfg["actor_rollout_ref"]["model"]["path"] == str(model.resolve())
    assert cfg["actor_rollout_ref"]["model"]["override_config"] == {"attn_implementation": "sdpa"}
    assert cfg["trainer"]["total_training_steps"] == 7 and cfg["trainer"]["test_freq"] == 4  # extra arg wins
    assert cfg["reward"]["custom_reward_function"] == {"path": "pkg://sgl_rollout.demo.verl_task",
                                                      "name": "compute_score"}
    assert cfg["data"]["train_files"] == str(run / "data" / "train.parquet")
    assert (run / "data" / "train.parquet").is_file() and (run / "data" / "val.parquet").is_file()
    cmd = (run / "command.sh").read_text()
    assert "-m verl.trainer.main_ppo" in cmd and "trainer.test_freq=4" in cmd
    assert "NGPUS=2 TP=2 STEPS=7" in out.stderr
