"""CPU tests of the demo's LoRA mode (``--lora RANK``, ``--lora-base kept|resent``).

The loop runs against the real :class:`~sgl_rollout.worker.RolloutWorker` and
:class:`~sgl_rollout.engine.RolloutEngine` (sleep levels, the staged wake, ``update_adapter`` and its
base-resend rule, the adapter payload read back with SGLang's own reader) over an engine double that
samples with its own Hugging Face copy of the model. The double serves an adapter the way SGLang does
(base weights plus ``alpha / r * B @ A`` on the target modules, computed here through PEFT), copies base
weights it is sent into its copy, and scrambles its copy when its ``weights`` tag is released (what a
level-2 release without a CPU backup leaves behind). The sync check (``check_sync``) therefore passes
only when the adapter it serves and the base under it are the trainer's.
"""

import copy
import json
import pickle

import pytest
import torch

from fakes import FakeSGLangEngine, FakeTokenizerManager, hf_sample
from sgl_rollout.config import ALL_LINEAR_MODULES
from sgl_rollout.demo import task
from sgl_rollout.weight_sync import lora
from sgl_rollout.weight_sync.manifest import SyncValidator, WeightManifest

peft = pytest.importorskip("peft")


#: The runs' dtype on both sides and their sync tolerance (nats): in float32 the trainer and the double agree
#: to ~1e-5 on any x86 CPU, where bf16 matmuls round differently on AMX-BF16 (0.0227 there, 0.01 allowed).
DTYPE, SYNC_TOL = "float32", 1e-3


def disk_weights(model_dir):
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, DTYPE)).named_parameters())


# ------------------------------------------------------------------------------------ engine double
class _ScramblingTokenizerManager(FakeTokenizerManager):
    async def release_memory_occupation(self, obj, request):
        await super().release_memory_occupation(obj, request)
        if "weights" in obj.tags:
            self.engine.scramble()


class HFLoraEngine(FakeSGLangEngine):
    """``sglang.Engine`` double that generates with a Hugging Face copy of ``model_path`` (in the server
    arguments' ``dtype``, full recompute per token; logprobs of the temperature-scaled distribution, as
    SGLang's), with a loaded adapter applied when a request names it."""

    def __init__(self, **server_args):
        from transformers import AutoModelForCausalLM

        super().__init__(**server_args)
        self.tokenizer_manager = _ScramblingTokenizerManager(self)
        dtype = getattr(torch, server_args.get("dtype", "bfloat16"))
        self.model = AutoModelForCausalLM.from_pretrained(server_args["model_path"], dtype=dtype).eval()
        self.params = dict(self.model.named_parameters())
        self.lora_base_shapes = {n[: -len(".weight")]: tuple(p.shape) for n, p in self.params.items() if p.dim() == 2}
        self.on_update = self._copy_base
        self.gen = torch.Generator().manual_seed(0)
        self._adapted = {}  # sglang adapter name -> PEFT model over a copy of the current base
        self.generate_lora_paths = []
        self.base_received = {}  # name -> last tensor received
        self.scrambles = 0

    def scramble(self):
        """What a level-2 release leaves in the weights: not the weights."""
        g = torch.Generator().manual_seed(1000 + self.scrambles)
        self.scrambles += 1
        with torch.no_grad():
            for p in self.params.values():
                p.copy_(torch.randn(p.shape, generator=g))
        self._adapted.clear()

    def _copy_base(self, payloads):
        d = pickle.loads(payloads[0])  # TP rank 0's flattened bucket
        flat = d["flattened_tensor"]
        with torch.no_grad():
            for m in d["metadata"]:
                t = flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)
                self.params[m.name].copy_(t)
                self.base_received[m.name] = t.clone()
        self._adapted.clear()

    def _model_for(self, name):
        if name not in self._adapted:
            entry = self.lora[name]
            cfg = entry["config"]
            pm = peft.get_peft_model(
                copy.deepcopy(self.model),
                peft.LoraConfig(r=cfg["r"], lora_alpha=cfg["lora_alpha"], target_modules=cfg["target_modules"],
                                lora_dropout=0.0),
                autocast_adapter_dtype=False).eval()
            res = peft.set_peft_model_state_dict(pm, entry["tensors"])
            assert not res.unexpected_keys, res.unexpected_keys
            from peft.utils.save_and_load import get_peft_model_state_dict

            assert set(get_peft_model_state_dict(pm)) == set(entry["tensors"])  # every adapter weight arrived
            self._adapted[name] = pm
        return self._adapted[name]

    async def async_generate(self, input_ids, sampling_params, return_logprob, rid=None, lora_path=None):
        await self._alive()
        self.calls.append(("generate", len(input_ids)))
        self.last_lora_path = lora_path
        self.generate_lora_paths.append(lora_path)
        if self.released:
            await self._die("generate on released memory")
        model = self.model
        if lora_path is not None:
            names = set(lora_path)
            assert len(names) == 1 and None not in names
            name = names.pop()
            if name not in self.lora:
                raise ValueError(f"The following requested LoRA adapters are not loaded: {name}")
            model = self._model_for(name)
        outs = []
        for prompt in input_ids:
            out, lps, finish = hf_sample(model, prompt, sampling_params, self.gen)
            outs.append({"output_ids": out,
                         "meta_info": {"output_token_logprobs": [(lp, t, None) for lp, t in zip(lps, out)],
                                       "finish_reason": {"type": finish}}})
        return outs


# -------------------------------------------------------------------------------------- the runs
class _Run:
    """One demo run over the double: its config, rows, summary and timeline, the engine double, the
    engine's rollout config and the trainer."""


def run_demo(tiny_dir, tmp_path, monkeypatch, steps=2, **over):
    from sgl_rollout import workloads
    from sgl_rollout.demo import loop, trainer as trainer_mod
    from sgl_rollout.engine import RolloutEngine
    from sgl_rollout.worker import RolloutWorker

    # a random model never answers right: reward something it does vary in, so the policy moves
    monkeypatch.setattr(task, "reward", lambda text, answer, finished=True, format_weight=0.1: float(len(text) % 2))
    # shorter prompts (bytes are tokens here): a faster test; the task's prompts are made in sgl_rollout.workloads
    monkeypatch.setattr(workloads, "SYSTEM_PROMPT", "Add.")
    r = _Run()
    r.fakes, r.trainers = [], []

    class RecordingTrainer(trainer_mod.Trainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            r.trainers.append(self)

    monkeypatch.setattr(trainer_mod, "Trainer", RecordingTrainer)

    def factory(rcfg, timeline):
        engine = RolloutEngine(rcfg, engine_factory=HFLoraEngine, watch_interval_s=0.05)
        r.fakes.append(engine._engine)
        r.rcfg = rcfg
        return RolloutWorker(rcfg, engine=engine, timeline=timeline)

    r.out = tmp_path / "run"
    kw = dict(model=tiny_dir, out=str(r.out), steps=steps, prompts=2, samples=3, max_new_tokens=5, temperature=0.8,
              lr=3e-2, kl_coef=0.05, mini_batches=2, micro_batch=3, eval_every=2, eval_prompts=2, digits=(1,),
              check_sync=True, sync_tol=SYNC_TOL, progress=False, lora_rank=4, dtype=DTYPE)
    kw.update(over)
    r.cfg = loop.DemoConfig(**kw)
    r.summary = loop.run(r.cfg, worker_factory=factory, device="cpu")
    r.rows = [json.loads(ln) for ln in (r.out / "metrics.jsonl").read_text().splitlines()]
    r.fake, r.trainer = r.fakes[0], r.trainers[0]
    r.timeline = json.loads((r.out / "memory_timeline.json").read_text())
    return r


def calls(fake, kind):
    return [c for c in fake.calls if c[0] == kind]


NEW_ROW_KEYS = {"adapter_sync_ms", "adapter_bytes", "base_sent", "base_sync_ms", "sync_ms", "switch_ms", "step_s"}


def check_common(r, steps):
    trained = [x for x in r.rows if not x["final"]]
    assert [x["step"] for x in r.rows] == list(range(steps + 1)) and r.rows[-1]["final"] and len(trained) == steps
    assert r.rcfg.lora_enabled and r.rcfg.lora_rank == 4 and r.rcfg.lora_alpha == 8.0  # alpha defaults to 2 * rank
    assert sorted(r.rcfg.server_lora_target_modules()) == sorted(ALL_LINEAR_MODULES)
    # the adapter is loaded at the start and after every step; every generate (eval too) names it
    loads = calls(r.fake, "load_lora")
    assert len(loads) == steps + 1
    assert r.fake.generate_lora_paths and all(p is not None for p in r.fake.generate_lora_paths)
    assert len(r.fake.lora) == 1 and set(r.fake.last_lora_path) == set(r.fake.lora)  # the newest version
    # the engine serves the trainer's adapter (PEFT's names, bit for bit); the trainer learned one
    served = r.fake.lora[next(iter(r.fake.lora))]["tensors"]
    mine = r.trainer.adapter_state_dict()
    assert set(served) == set(mine) and all(torch.equal(served[k], mine[k]) for k in mine)
    assert max(float(v.abs().max()) for k, v in mine.items() if "lora_B" in k) > 0  # PEFT starts B at 0
    # only the adapter was trained: the trainer's base is the checkpoint's, bit for bit
    disk = disk_weights(r.cfg.model)
    base = dict(r.trainer.base_named_parameters())
    assert set(base) == set(disk)
    assert all(torch.equal(base[n], disk[n].detach()) for n in disk)
    assert r.trainer.trainable_parameters() == sum(t.numel() for t in mine.values())
    # per-step metrics
    for x in trained:
        assert NEW_ROW_KEYS <= set(x), NEW_ROW_KEYS - set(x)
        assert x["adapter_bytes"] == sum(t.numel() * t.element_size() for t in mine.values())
        assert x["adapter_sync_ms"] > 0 and x["switch_ms"] >= x["sync_ms"] >= x["adapter_sync_ms"]
        assert x["grad_norm"] > 0
    for x in r.rows:
        assert x["logprob_abs_diff"] < r.cfg.sync_tol, x  # check_sync: the engine served the trainer's policy
    assert r.rows[1]["log_ratio_abs"] > 0 or r.rows[0]["log_ratio_abs"] > 0
    s = r.summary
    assert s["lora_rank"] == 4 and s["lora_alpha"] == 8.0 and s["adapter_sync_ms_median"] > 0
    assert s["adapter_bytes"] == trained[0]["adapter_bytes"] and s["trainable_params"] == r.trainer.trainable_parameters()
    assert s["first_adapter"]["base_sent"] is False and s["lora_targets"] == sorted(ALL_LINEAR_MODULES)
    assert json.loads((r.out / "summary.json").read_text())["base_sent_steps"] == s["base_sent_steps"]
    assert json.loads((r.out / "config.json").read_text())["lora_rank"] == 4
    # the memory-step plot finds a training step (it ends with the adapter's load)
    assert (r.out / "memory_step.png").stat().st_size > 1000
    return trained


def test_lora_kept_syncs_only_the_adapter_and_never_releases_weights(tiny_dir, tmp_path, monkeypatch, capsys):
    from sgl_rollout.demo.loop import closing_note

    steps = 2
    r = run_demo(tiny_dir, tmp_path, monkeypatch, steps=steps, lora_base="kept")
    trained = check_common(r, steps)
    assert r.rcfg.sleep_level == 1
    releases = calls(r.fake, "release")
    # one sleep per step, and one after the final rollout (the trainer scores it for the sync check)
    assert len(releases) == steps + 1 and all("weights" not in c[1] for c in releases)
    assert r.fake.scrambles == 0
    assert not calls(r.fake, "update_weights")  # the base never travels, not even at the start
    assert all(x["base_sent"] is False and x["base_sync_ms"] is None and x["base_bytes"] == 0 for x in trained)
    assert all(x["sync_bytes"] == x["adapter_bytes"] for x in trained)
    step1 = [x["phase"] for x in r.timeline if x["step"] == 1]
    assert step1 == ["generate", "sleep", "load_trainer", "score", "train",
                     "adapter", "offload_trainer", "empty_cache", "resume_kv_cache"]
    s = r.summary
    assert (s["lora_base"], s["sleep_level"], s["base_sent"], s["base_sent_steps"]) == ("kept", 1, False, 0)
    assert s["base_sync_ms_median"] is None
    note = closing_note(s)
    assert "LoRA rank 4 (alpha 8)" in note and "base kept in the engine (sleep level 1), sent at 0 of 2 steps" in note
    printed = capsys.readouterr().out
    lines = [ln for ln in printed.splitlines() if ln.startswith("step ")]
    assert len(lines) == steps + 1 and all(" | adapter " in ln and " | base " not in ln for ln in lines[:-1])


def test_lora_resent_sends_the_base_with_the_adapter_every_step(tiny_dir, tmp_path, monkeypatch, capsys):
    from sgl_rollout.demo.loop import closing_note

    steps = 2
    r = run_demo(tiny_dir, tmp_path, monkeypatch, steps=steps, lora_base="resent")
    trained = check_common(r, steps)
    assert r.rcfg.sleep_level == 2
    releases = calls(r.fake, "release")
    assert len(releases) == steps + 1 and all("weights" in c[1] for c in releases)
    assert r.fake.scrambles == steps + 1  # the double's weights were garbage after every sleep ...
    # ... and the base the trainer sent brought them back: the checkpoint's, never merged with the adapter
    disk = disk_weights(r.cfg.model)
    assert set(r.fake.base_received) == set(disk)
    assert all(torch.equal(r.fake.base_received[n], disk[n].detach()) for n in disk)
    assert len(calls(r.fake, "update_weights")) >= steps
    assert all(x["base_sent"] is True and x["base_sync_ms"] > 0 for x in trained)
    assert all(x["base_bytes"] == sum(t.numel() * t.element_size() for t in disk.values()) for x in trained)
    assert all(x["sync_bytes"] == x["adapter_bytes"] + x["base_bytes"] for x in trained)
    assert all(x["switch_ms"] >= x["base_sync_ms"] for x in trained)
    s = r.summary
    assert (s["lora_base"], s["sleep_level"], s["base_sent"], s["base_sent_steps"]) == ("resent", 2, True, steps)
    assert s["base_sync_ms_median"] > 0
    assert "base resent with the adapter (sleep level 2) at 2 of 2 steps" in closing_note(s)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert all(" | adapter " in ln and " | base " in ln for ln in lines[:-1])


def test_sync_check_fails_when_the_base_does_not_come_back(tiny_dir, tmp_path, monkeypatch):
    # the check can fail: with the rule forced to "the engine has its base" after a level-2 release, the
    # engine serves the adapter over garbage, and the sync check says so
    from sgl_rollout.demo.loop import SyncCheckError

    monkeypatch.setattr(lora, "engine_needs_base_sync", lambda engine: False)
    with pytest.raises(SyncCheckError, match="step 1: engine vs trainer logprob"):
        run_demo(tiny_dir, tmp_path, monkeypatch, steps=1, lora_base="resent")


# ------------------------------------------------------------------------------------- the trainer
def test_trainer_trains_only_the_adapter_and_scores_the_reference_without_it(tiny_dir):
    from transformers import AutoModelForCausalLM

    from sgl_rollout.demo.trainer import Trainer, batched_logprobs, pack

    tr = Trainer(tiny_dir, "cpu", lr=3e-2, temperature=0.7, kl_coef=0.05, micro_batch=4, mini_batches=1,
                 lora_rank=2, lora_alpha=3.0, lora_targets=("q_proj", "v_proj"))
    assert tr.ref is None  # the reference is the base under disable_adapter(), not a second copy
    manifest = WeightManifest.from_pretrained(tiny_dir)
    sd = tr.adapter_state_dict()
    assert all(k.startswith("base_model.model.model.layers.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
               for k in sd)
    assert {lora.parse_adapter_name(k)[1].split(".")[-1] for k in sd} == {"q_proj", "v_proj"}
    cfg = lora.adapter_config_dict(tr.peft_config)
    assert cfg["r"] == 2 and cfg["lora_alpha"] == 3.0 and cfg["lora_dropout"] == 0.0
    assert [n for n, _ in lora.validate_adapter(sd.items(), cfg, manifest)] == list(sd)  # the names the sync takes
    base = tr.base_named_parameters()
    SyncValidator(manifest).validate_all(base)  # a complete sync of the checkpoint's names and shapes
    assert not any("lora" in n or "base_layer" in n or n.startswith("base_model") for n, _ in base)
    assert tr.trainable_parameters() == sum(t.numel() for t in sd.values())
    with pytest.raises(RuntimeError, match="LoRA"):
        tr.named_parameters()

    plain = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()
    batch = pack([[1, 5, 6, 7], [1, 9], [1, 4, 4]], [[10, 11, 12], [13, 14], [15]])
    tr.load()
    want = batched_logprobs(plain, batch, 0.7, 4, "cpu")
    assert torch.equal(tr.ref_logprobs(batch), want)
    assert torch.equal(tr.logprobs(batch), want)  # B starts at zero: the adapter changes nothing yet
    before = {n: t.clone() for n, t in base}
    for _ in range(2):
        old = tr.logprobs(batch)
        tr.train(batch, torch.tensor([1.0, -1.0, 0.5]), old, tr.ref_logprobs(batch))
    tr.offload()
    assert all(torch.equal(t, before[n]) for n, t in tr.base_named_parameters())  # the base is frozen
    assert any(float(v.abs().max()) > 0 for k, v in tr.adapter_state_dict().items() if "lora_B" in k)
    tr.load()
    assert not torch.equal(tr.logprobs(batch), want)  # the adapter moved the policy ...
    assert torch.equal(tr.ref_logprobs(batch), want)  # ... and the reference is still the base


# ------------------------------------------------------------------------------------------- flags
@pytest.mark.parametrize("argv, needle", [
    (["--lora", "-1"], "--lora must be >= 0"),
    (["--lora", "4", "--fast-sync"], "--fast-sync has nothing to speed up with --lora-base kept"),
    (["--lora", "4", "--lora-base", "kept", "--fast-sync"], "--fast-sync has nothing to speed up"),
    (["--lora-base", "resent"], "need --lora RANK > 0"),
    (["--lora-alpha", "8"], "need --lora RANK > 0"),
    (["--lora", "0", "--lora-targets", "q_proj,v_proj"], "need --lora RANK > 0"),
    (["--lora", "4", "--lora-alpha", "0"], "--lora-alpha must be > 0"),
    (["--lora", "4", "--lora-base", "merged"], "invalid choice: 'merged'"),
    (["--lora", "4", "--lora-targets", "q_proj,lm_head"], "expected module names from q_proj"),
    (["--lora", "four"], "invalid int value"),
])
def test_bad_lora_flags_exit_2(argv, needle, capsys):
    from sgl_rollout.demo import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err, err
    assert "Traceback" not in err


def test_lora_flags_reach_the_config():
    from sgl_rollout.demo.cli import build_parser, config_from_args

    def cfg(*argv):
        p = build_parser()
        a = p.parse_args(list(argv))
        from sgl_rollout.demo.cli import _check_args

        _check_args(p, a)
        return config_from_args(a)

    off = cfg()
    assert (off.lora_rank, off.lora, off.sleep_level) == (0, False, 2)
    kept = cfg("--lora", "8")
    assert (kept.lora_rank, kept.lora_alpha, kept.lora_base, kept.lora_targets, kept.sleep_level) == (8, None, "kept", None, 1)
    res = cfg("--lora", "4", "--lora-base", "resent", "--lora-alpha", "16", "--lora-targets", "q_proj,v_proj,q_proj",
              "--fast-sync")
    assert (res.lora_base, res.lora_alpha, res.lora_targets, res.fast_sync, res.sleep_level) == \
        ("resent", 16.0, ("q_proj", "v_proj"), True, 2)


def test_missing_peft_exits_2_with_one_line(monkeypatch, capsys, tmp_path):
    import importlib.util

    from sgl_rollout.demo import cli, main

    real = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else (real(name) or object()))
    rc = main(["--lora", "4", "--steps", "1", "--out", str(tmp_path / "run")])
    cap = capsys.readouterr()
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert rc == 2 and lines == ["sgl-rollout demo: needs peft for --lora (pip install peft): module 'peft' is not installed"]
    assert cap.out == "" and not (tmp_path / "run").exists()
    # without --lora, peft is not asked for
    assert "peft" not in (cli.missing_requirement(lora=False) or "")


def test_adapter_the_engine_cannot_serve_is_refused_before_the_engine_starts(tiny_dir, tmp_path):
    from sgl_rollout.demo.loop import DemoConfig, run
    from sgl_rollout.demo.model import ModelSetupError

    started = []
    cfg = DemoConfig(model=tiny_dir, out=str(tmp_path / "run"), steps=1, lora_rank=2, lora_targets=("k_proj",),
                     progress=False)
    with pytest.raises(ModelSetupError, match="without q_proj"):  # SGLang stacks q/k/v on q_proj
        run(cfg, worker_factory=lambda *a: started.append(a), device="cpu")
    assert not started
