"""Greedy output of an engine against Hugging Face's, tolerant of bf16 near-ties only.

Both sides run bf16 with different kernels (SGLang's triton attention and sgl_kernel rmsnorm vs HF's
torch, whose lm_head output is itself rounded to bf16), so two candidates whose logits differ by less
than bf16 rounding may swap. Every engine token must be HF's argmax for the same prefix, or within
NEAR_TIE of it (the tiny test model's logits have a standard deviation of about 2.5, where bf16 steps
are 1/64 to 1/32); wrong or garbled weights miss by whole units.
"""

import torch

NEAR_TIE = 0.15


PROMPTS = [[1, 17, 42, 99, 7], [1, 500, 3, 3, 3, 8], [1, 1000, 256], [1, 64, 65, 66, 67, 68, 69]]


def engine_greedy(worker, prompts, n):
    """Greedy continuation of each prompt by a ``RolloutWorker``'s engine: n new token ids each (EOS ignored)."""
    gens = worker.generate(prompts, {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True})
    return [g[0].output_ids for g in gens]


def new_weights(model, seed):
    """A trainer step's stand-in: every weight of the tiny test Llama redrawn in place from ``seed``
    (matrices N(0, 0.15), norms U(0.5, 1.5)), far enough from the last ones to change greedy output."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.uniform_(0.5, 1.5)


def hf_greedy(model, prompts, n):
    """Greedy continuation of each prompt (list of ids) by ``model`` on CUDA; n new tokens each."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            for _ in range(n):
                nxt = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            outs.append(ids[0, len(p):].tolist())
    return outs


def greedy_gaps(model, prompts, got):
    """Per prompt: (max gap between HF's top logit and the engine token's logit, number of swaps)."""
    res = []
    with torch.no_grad():
        for p, g in zip(prompts, got):
            ids = torch.tensor([p + g], device="cuda")
            logits = model(ids).logits[0, len(p) - 1 : -1].float()
            gap = logits.max(-1).values - logits.gather(-1, torch.tensor(g, device="cuda")[:, None])[:, 0]
            res.append((float(gap.max()), int((gap > 0).sum())))
    return res


def assert_greedy_equal(model, prompts, got, tol: float = NEAR_TIE):
    """Engine output ``got`` equals HF greedy output, up to near-ties of ``tol`` (logit units)."""
    if got == hf_greedy(model, prompts, len(got[0])):
        return
    for g, (gap, swaps) in zip(got, greedy_gaps(model, prompts, got)):
        assert gap < tol, f"{g}: a token misses HF argmax by {gap:.3f}"
        print(f"near-tie swaps vs HF: {swaps} of {len(g)} tokens")
