"""Real SGLang engine on one GPU: greedy output equals Hugging Face after each sync, sleep frees memory,
invalid transitions are refused and the engine keeps serving."""

import threading

import pytest
import torch

from sgl_rollout.bench import LLAMA_1B, LLAMA_TINY, gpu_engine_flags, make_llama_dir
from sgl_rollout.config import RolloutConfig
from sgl_rollout.memory import MemoryStateError, device_memory
from sgl_rollout.worker import RolloutWorker

from .greedy import PROMPTS, assert_greedy_equal, engine_greedy, new_weights

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A bf16 tiny Llama (sgl_kernel's rmsnorm has no float32) and a worker serving it."""
    path = str(tmp_path_factory.mktemp("tiny"))
    model = make_llama_dir(path, LLAMA_TINY, dtype=torch.bfloat16, with_weights=True, init_std=0.15)
    cfg = RolloutConfig(model_path=path, dtype="bfloat16", gpu_memory_utilization=0.15,
                        update_weights_bucket_megabytes=1,
                        engine_kwargs=dict(gpu_engine_flags(), cuda_graph_max_bs=8))
    worker = RolloutWorker(cfg)
    yield worker, model.cuda().eval()
    worker.shutdown()


def test_greedy_matches_hf_after_each_sync(tiny):
    worker, model = tiny
    with torch.no_grad():
        spread = model(torch.tensor([PROMPTS[0]], device="cuda")).logits[0, -1].float().std()
    print(f"\nHF last-position logit std: {float(spread):.2f}")
    assert_greedy_equal(model, PROMPTS, engine_greedy(worker, PROMPTS, NEW_TOKENS))
    before = [engine_greedy(worker, PROMPTS, NEW_TOKENS)]
    for seed in (1, 2):
        new_weights(model, seed)
        worker.sleep()
        stats = worker.update_weights(model.named_parameters())
        assert stats.n_buckets > 1  # several flattened buckets crossed over IPC
        got = engine_greedy(worker, PROMPTS, NEW_TOKENS)
        assert_greedy_equal(model, PROMPTS, got)
        # the new weights really arrived: the old and new models disagree on these prompts
        assert got != before[-1]
        before.append(got)


def test_logprobs_and_n_samples(tiny):
    worker, _ = tiny
    gens = worker.generate(PROMPTS[:2], {"temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True}, n=3)
    assert [len(g) for g in gens] == [3, 3]
    for g in gens[0] + gens[1]:
        assert len(g.output_ids) == 5 and len(g.logprobs) == 5
        assert all(lp <= 0.0 for lp in g.logprobs)


#: Largest |SGLang - HF| allowed on a prompt log-probability (natural log). Both run the bf16 model with
#: different kernels (logits differ by up to NEAR_TIE, the tiny model's logits spread about 2.5); a
#: position shifted by one or a wrong token misses by whole units.
PROMPT_LOGPROB_TOL = 0.3


def _hf_prompt_logprobs(model, prompt):
    """HF's ``log p(prompt[i] | prompt[:i])`` for i = 1 .. len - 1 (float32), and the log-softmax rows."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt], device="cuda")).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)[:-1]
    return rows.gather(-1, torch.tensor(prompt[1:], device="cuda")[:, None])[:, 0].tolist(), rows


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS[1:3]], ids=["one-request", "batch"])
def test_prompt_logprobs_match_hugging_face(tiny, prompts):
    """Prompt log-probabilities (verl's distillation teacher asks for them) through SGLang's single form (a
    batch of one, as the server sends each verl request) and its batch form: every position is HF's
    log-softmax of the prompt's own next token, and the top-3 are HF's most likely tokens."""
    worker, model = tiny
    gens = worker.engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": 1}, return_logprob=True,
                                  logprob_start_len=0, top_logprobs_num=3)
    for prompt, (gen,) in zip(prompts, gens):
        want, rows = _hf_prompt_logprobs(model, prompt)
        assert gen.prompt_token_ids == prompt
        assert gen.prompt_logprobs[0] is None and len(gen.prompt_logprobs) == len(prompt)
        err = max(abs(g - w) for g, w in zip(gen.prompt_logprobs[1:], want))
        print(f"\nprompt of {len(prompt)}: largest |SGLang - HF| prompt logprob {err:.3f}")
        assert err < PROMPT_LOGPROB_TOL
        assert gen.prompt_top_logprobs[0] is None and len(gen.prompt_top_logprobs) == len(prompt)
        for top, row in zip(gen.prompt_top_logprobs[1:], rows):
            assert len(top) == 3
            for lp, tok in top:  # each is what HF gives that token, and near HF's top 3
                assert abs(lp - float(row[tok])) < PROMPT_LOGPROB_TOL
                assert float(row[tok]) >= float(row.topk(3).values[-1]) - PROMPT_LOGPROB_TOL


def test_invalid_transitions_refused_engine_keeps_serving(tiny):
    worker, model = tiny
    expected = engine_greedy(worker, PROMPTS[:1], 4)
    worker.sleep()
    with pytest.raises(MemoryStateError):
        worker.sleep()  # double release: torch-memory-saver would exit(1)
    with pytest.raises(MemoryStateError):
        worker.engine.release(["kv_cache"])
    worker.update_weights(model.named_parameters())
    with pytest.raises(MemoryStateError):
        worker.engine.resume(["weights"])  # resume resident: KeyError in the scheduler
    with pytest.raises(MemoryStateError):
        worker.engine.resume(["kv_cache"])
    # release while a long request runs
    done = threading.Event()
    t = threading.Thread(target=lambda: (worker.generate([PROMPTS[0]], {"max_new_tokens": 900, "ignore_eos": True}), done.set()))
    t.start()
    try:
        for _ in range(500):
            if worker.engine.state.in_flight:
                break
            threading.Event().wait(0.002)
        assert worker.engine.state.in_flight == 1
        with pytest.raises(MemoryStateError, match="request"):
            worker.sleep()
    finally:
        t.join(120)
    assert done.is_set()
    assert engine_greedy(worker, PROMPTS[:1], 4) == expected


@pytest.fixture(scope="module")
def llama_1b(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama1b"))
    make_llama_dir(path, LLAMA_1B)
    cfg = RolloutConfig(model_path=path, load_format="dummy", gpu_memory_utilization=0.5, enforce_eager=True,
                        engine_kwargs=gpu_engine_flags())
    worker = RolloutWorker(cfg)
    yield worker
    worker.shutdown()


def test_sleep_frees_weights_and_kv_cache(llama_1b):
    worker = llama_1b
    info = worker.engine.server_info()
    tokens = info["max_total_num_tokens"]
    head_dim = LLAMA_1B["hidden_size"] // LLAMA_1B["num_attention_heads"]
    kv_bytes = tokens * LLAMA_1B["num_hidden_layers"] * 2 * LLAMA_1B["num_key_value_heads"] * head_dim * 2
    from sgl_rollout.bench import llama_named_tensors

    named = llama_named_tensors(LLAMA_1B, device="cpu")
    weight_bytes = sum(t.numel() * t.element_size() for _, t in named)
    awake, _ = device_memory()
    worker.sleep()
    asleep, _ = device_memory()
    print(f"\nsleep freed {(asleep - awake) / 2**30:.2f} GiB; weights {weight_bytes / 2**30:.2f} GiB "
          f"+ KV {kv_bytes / 2**30:.2f} GiB ({tokens} tokens)")
    assert asleep - awake >= weight_bytes + kv_bytes
    stats = worker.update_weights(named)  # CPU tensors: moved to the GPU one bucket at a time
    assert stats.bytes == weight_bytes
    woke, _ = device_memory()
    print(f"wake took back {(asleep - woke) / 2**30:.2f} GiB; phases {worker.last_phase_seconds}")
    assert asleep - woke >= 0.98 * (weight_bytes + kv_bytes)
    if worker.config.fast_sync:  # the default: the sync went through the fast path, whose buffer
        # (one bucket) was freed before the KV cache came back, as the next sleep releases the weights
        assert worker._fast is not None and "sync.call" in worker.last_phase_seconds
        assert "release_sync_buffers" in worker.last_phase_seconds and not worker._fast.holds_buffers
    # device_memory() gives free bytes: after the wake the GPU holds what it held before the sleep
    assert abs(awake - woke) < 0.05 * (weight_bytes + kv_bytes)
    out = worker.generate([[1, 2, 3]], {"max_new_tokens": 4, "ignore_eos": True})
    assert len(out[0][0].output_ids) == 4
