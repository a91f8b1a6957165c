"""``python -m sgl_rollout.bench trl`` on the CPU: both sides train under TRL's real GRPOTrainer (side ``ours``
on an engine double), every step is recorded, and the comparison is summarized and printed."""

import argparse
import gc
import json

import torch

import pytest

pytest.importorskip("trl")

from test_trl import WorkerDouble  # noqa: E402

from sgl_rollout.bench import trl_compare  # noqa: E402
from sgl_rollout.bench.processes import GcClock  # noqa: E402
from sgl_rollout.bench.__main__ import build_parser  # noqa: E402
from sgl_rollout.bench.chat_tokenizer import build_chat_model_dir  # noqa: E402


def _args(**kw):
    args = build_parser().parse_args(["trl", "--steps", "2", "--batch", "2", "--num-generations", "2",
                                      "--max-completion-length", "4"])
    return argparse.Namespace(**{**vars(args), **kw})


def test_both_sides_train_and_every_step_is_recorded(tmp_path):
    model_dir = build_chat_model_dir(tmp_path / "model", with_weights=True)
    args = _args(out=str(tmp_path / "out"))
    workers = []

    def factory(path):
        workers.append(WorkerDouble(path))
        return workers[-1]

    ours = trl_compare.run_side("ours", args, model_dir, tmp_path / "out", worker_factory=factory)
    theirs = trl_compare.run_side("transformers", args, model_dir, tmp_path / "out")
    assert [r["step"] for r in ours] == [1, 2] and [r["step"] for r in theirs] == [1, 2]
    assert all(r["gen_s"] > 0 and r["step_s"] >= r["gen_s"] and r["sync_s"] is not None for r in ours)
    assert all(r["sync_s"] is None and r["wake_s"] is None and r["reward"] is not None for r in theirs)
    # ours' sync_s is the wake's phases that TRL's sync_weights does on vLLM (weights back, push, empty
    # cache) and the fast path's buffers freed: 4.5 ms a wake on the double; not the KV cache's resume;
    # wake_s times the whole call
    assert all(r["wake_phases"]["resume_kv_cache"] == 0.004 and r["wake_phases"]["sync"] == 0.002 for r in ours)
    assert all(r["sync_s"] == pytest.approx(0.0045) and r["wake_s"] > 0
               for r in ours)
    # ours splits its generation: the engine's generate call and its sleep, inside TRL's _generate
    assert all(r["engine_gen_s"] is not None and r["sleep_s"] is not None
               and r["wake_s"] + r["engine_gen_s"] + r["sleep_s"] <= r["gen_s"] for r in ours)
    assert all(r["engine_gen_s"] is None and r["sleep_s"] is None for r in theirs)
    # the garbage collection inside ours' wake is counted (maybe none on so short a run), none on theirs
    assert all(0.0 <= r["sync_gc_s"] <= r["wake_s"] for r in ours) and all(r["sync_gc_s"] is None for r in theirs)
    # then the greedy check: a sync of the last weights, greedy on the engine, back to sleep
    assert workers[0].events == ["sync", "generate", "sleep"] * 3
    greedy = json.loads((tmp_path / "out" / "ours.greedy.json").read_text())
    assert greedy == {"prompts": trl_compare.GREEDY_PROMPTS, "tokens": 4, "equal": trl_compare.GREEDY_PROMPTS,
                      "max_gap": 0.0}
    trainer_final = workers[0].synced[-1]
    assert all(torch.equal(trainer_final[n], p) for n, p in workers[0].params.items())
    saved = [json.loads(line) for line in (tmp_path / "out" / "ours.jsonl").read_text().splitlines()]
    assert saved == ours
    summary = trl_compare.summarize({"ours": ours, "transformers": theirs})
    assert summary["ours"]["gen_s"] == ours[1]["gen_s"] and summary["transformers"]["sync_s"] is None
    lines = trl_compare.table(summary)
    assert lines[0].startswith("| per step") and any(line.startswith("| gen_s |") and "x |" in line for line in lines)


def test_main_runs_each_side_in_its_own_process_and_reports_a_failed_one(tmp_path, monkeypatch, capsys):
    calls = []

    class Done:
        def __init__(self, rc):
            self.returncode = rc

    def fake_run(cmd, stdout=None, stderr=None, env=None):
        side = cmd[3]
        calls.append(side)
        assert env["PYTHONPATH"] == "/caller"  # sides other than vllm keep the caller's site
        if side == "ours":
            rows = [{"step": s, "step_s": 2.0, "gen_s": 1.0, "sync_s": 0.1, "peak_gb": None, "reward": 0.5}
                    for s in (1, 2)]
            (tmp_path / "ours.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            return Done(0)
        return Done(1)

    class Nvml:  # the device's memory over a side's run: GPU 1 rose by 3 GB, GPU 0 by 1 GB
        def start(self):
            return self

        def stop(self):
            return {"peak_used_bytes": {"0": 5e9, "1": 4e9}, "baseline_bytes": {"0": 4e9, "1": 1e9}}

    monkeypatch.setattr(trl_compare.subprocess, "run", fake_run)
    monkeypatch.setenv("PYTHONPATH", "/caller")
    monkeypatch.setattr("sgl_rollout.workloads.resolve_model", lambda model, gguf: tmp_path / "m")
    monkeypatch.setattr("sgl_rollout.bench.verl_compare.NvmlSampler", Nvml)
    assert trl_compare.main(_args(out=str(tmp_path))) == 1
    assert calls == ["ours", "transformers"]
    got = json.loads((tmp_path / "comparison.json").read_text())
    assert got["failed"] == ["transformers"] and got["summary"]["ours"]["sync_s"] == 0.1
    assert got["summary"]["ours"]["device_peak_gb"] == 3.0
    assert "side transformers failed" in capsys.readouterr().out
    report = (tmp_path / "comparison.md").read_text()  # the printed table, with the command that made it
    assert "- command: `python -m sgl_rollout.bench trl" in report and "| sync_s | 0.100 |" in report


def test_the_vllm_side_gets_its_own_pythonpath(monkeypatch):
    """vLLM and SGLang pin different kernels: side vllm runs on its own site (``--vllm-pythonpath``), the
    others on the caller's."""
    monkeypatch.setenv("PYTHONPATH", "/tmp/site:/repo")
    args = build_parser().parse_args(["trl", "--vllm-pythonpath", "/tmp/trl:/tmp/vsite:/repo"])
    assert trl_compare.side_env("vllm", args)["PYTHONPATH"] == "/tmp/trl:/tmp/vsite:/repo"
    assert trl_compare.side_env("ours", args)["PYTHONPATH"] == "/tmp/site:/repo"
    assert trl_compare.side_env("vllm", build_parser().parse_args(["trl"]))["PYTHONPATH"] == "/tmp/site:/repo"


def test_the_vllm_side_is_trls_colocate_mode_and_passes_trls_own_config_checks(tmp_path):
    """Side ``vllm`` (needs vLLM, never run here): the same run settings plus TRL's colocate mode with vLLM's
    sleep mode and the engine's memory share, through TRL's own ``GRPOConfig`` (its ``__post_init__`` checks)."""
    from trl import GRPOConfig

    args = _args(gpu_memory_utilization=0.25)
    ours = trl_compare.side_config("ours", args, False, tmp_path)
    vllm = trl_compare.side_config("vllm", args, False, tmp_path)
    assert {k: v for k, v in vllm.items() if k not in ("output_dir",)} == \
        {**{k: v for k, v in ours.items() if k != "output_dir"}, "use_vllm": True, "vllm_mode": "colocate",
         "vllm_enable_sleep_mode": True, "vllm_gpu_memory_utilization": 0.25}
    cfg = GRPOConfig(**vllm)
    assert cfg.use_vllm and cfg.vllm_mode == "colocate" and cfg.vllm_gpu_memory_utilization == 0.25
    assert build_parser().parse_args(["trl"]).sides == "ours,transformers"
    lines = trl_compare.table({"ours": {f: 1.0 for f in trl_compare.FIELDS},
                               "vllm": {f: 2.0 for f in trl_compare.FIELDS},
                               "transformers": {f: 4.0 for f in trl_compare.FIELDS}})
    assert lines[0] == "| per step (median after the first) | ours | vllm | transformers | ours / vllm | " \
                       "ours / transformers |"
    assert "| step_s | 1.000 | 2.000 | 4.000 | 0.50x | 0.25x |" in lines


def test_the_greedy_check_counts_a_wrong_weight(tmp_path):
    """An engine whose weights are not the trainer's fails the check: fewer prompts equal, a gap far above a
    near-tie."""
    model_dir = build_chat_model_dir(tmp_path / "model", with_weights=True)
    args = _args(out=str(tmp_path / "out"), steps=1)
    workers = []

    class Stale(WorkerDouble):
        def update_weights(self, named_tensors):  # takes the sync, keeps its own (other) weights
            super().update_weights([(n, t + 0.3 * torch.randn_like(t)) for n, t in named_tensors])

    def factory(path):
        workers.append(Stale(path))
        return workers[-1]

    trl_compare.run_side("ours", args, model_dir, tmp_path / "out", worker_factory=factory)
    greedy = json.loads((tmp_path / "out" / "ours.greedy.json").read_text())
    assert greedy["equal"] < greedy["prompts"] and greedy["max_gap"] > 0.5, greedy


def test_side_ours_engine_settings_follow_the_command_line(tmp_path):
    """``--empty-cache always`` reaches side ours' RolloutConfig (the wake then empties the cache every time,
    to compare with the default skip); ``--enforce-eager`` and the GPU share too."""
    args = build_parser().parse_args(["trl", "--empty-cache", "always", "--enforce-eager",
                                      "--gpu-memory-utilization", "0.25"])
    cfg = trl_compare.ours_rollout_config(args, str(tmp_path))
    assert cfg.empty_cache == "always" and cfg.enforce_eager and cfg.gpu_memory_utilization == 0.25
    assert trl_compare.ours_rollout_config(_args(), str(tmp_path)).empty_cache == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["trl", "--empty-cache", "never"])


def test_the_garbage_collection_inside_a_timed_sync_is_counted_and_none_outside():
    """``sync_gc_s`` holds the collections that ran inside the timed call only; the clock's callback is gone
    once it is uninstalled."""
    class Trainer:
        def sync_weights(self):
            gc.collect()

    trainer, into, before = Trainer(), {}, list(gc.callbacks)
    with GcClock() as clock:
        trl_compare._timed(trainer, "sync_weights", into, "sync_s", clock=clock)
        trainer.sync_weights()
        inside = clock.seconds
        gc.collect()  # outside the timed call
    assert 0.0 < into["sync_gc_s"] == pytest.approx(inside) and into["sync_gc_s"] <= into["sync_s"]
    assert clock.seconds > inside
    assert gc.callbacks == before
    total = clock.seconds
    gc.collect()
    assert clock.seconds == total  # not counted once uninstalled
