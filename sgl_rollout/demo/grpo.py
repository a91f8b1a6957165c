"""GRPO maths: group-normalised advantages, token log-probs from logits, PPO-clip loss with KL.

Shapes use B for sequences, C for completion positions, V for the vocabulary, G for groups (prompts)
and n for samples per group. Log-probabilities are natural logs (nats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4, scale: bool = True) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std.

    Args:
        rewards: float tensor [G, n], the rewards of n samples of each of G prompts.
        eps: added to the std, so a group whose rewards are all equal gets advantages 0, not NaN.
        scale: divide by the std (GRPO); False keeps only the mean subtraction (Dr. GRPO).

    Returns:
        float32 tensor [G, n]. The std is the population std (``correction=0``) of the group.

    Raises:
        ValueError: ``rewards`` is not 2-D.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards.shape)}")
    r = rewards.float()
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (r.std(dim=1, keepdim=True, correction=0) + eps)
    return adv


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_rows: int = 1024) -> torch.Tensor:
    """Log-probability of each target token under ``softmax(logits / temperature)``.

    The temperature is applied in place, so no second full-size logits tensor is made:

    * float32 logits: ``logits.div_(temperature)`` on the whole tensor (``logits`` is modified);
    * bf16/fp16 logits: each chunk of ``chunk_rows`` positions is upcast to float32 and divided in
      place there (``logits`` is left as it is), so the extra memory is one float32 chunk. Dividing
      bf16 logits in bf16 would round them again (by up to 1/16 for logits of 16 to 32).

    The log-normaliser is taken in float32 per chunk. This is the arithmetic of SGLang's sampler,
    which upcasts the bf16 logits to float32, divides them by the temperature and returns the
    logprobs of that scaled distribution (``LogitsProcessor`` and ``Sampler.forward``, SGLang 0.5.10,
    unless the engine runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB``). Gradients flow through
    ``logits``.

    Args:
        logits: [..., V] float tensor. float32 logits must not be a leaf that requires grad (an
            activation, such as a model's output, is fine).
        targets: [...] int64 token ids, the shape of ``logits`` without its last dimension.
        temperature: > 0.
        chunk_rows: positions per float32 chunk, >= 1.

    Returns:
        float32 tensor shaped like ``targets``.

    Raises:
        ValueError: ``temperature`` <= 0, or ``targets`` does not match ``logits``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (greedy samples have no trainable log-prob), got {temperature}")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match logits {tuple(logits.shape)}")
    scale_whole = logits.dtype == torch.float32
    if scale_whole and temperature != 1.0:
        logits.div_(temperature)
    flat = logits.reshape(-1, logits.shape[-1])
    tgt = targets.reshape(-1, 1)
    parts = []
    for s in range(0, flat.shape[0], max(1, chunk_rows)):
        rows = flat[s : s + chunk_rows]
        if not scale_whole:
            rows = rows.float()
            if temperature != 1.0:
                rows.div_(temperature)
        picked = rows.gather(-1, tgt[s : s + chunk_rows]).squeeze(-1)
        parts.append(picked - torch.logsumexp(rows, dim=-1))
    if not parts:
        return torch.zeros(targets.shape, dtype=torch.float32, device=logits.device)
    return torch.cat(parts).reshape(targets.shape)


@dataclass
class LossStats:
    """Diagnostics of one :func:`ppo_clip_kl_loss` call (plain floats, means over valid tokens).

    Attributes:
        pg_loss: the clipped policy-gradient term.
        kl: the k3 KL estimate against the reference policy (0 when there is none).
        clip_frac: fraction of tokens where the clipped term was the one taken.
        ratio_mean: mean probability ratio new/old.
        tokens: number of valid tokens.
    """

    pg_loss: float
    kl: float
    clip_frac: float
    ratio_mean: float
    tokens: int


def ppo_clip_kl_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: Optional[torch.Tensor] = None,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    normalizer: Optional[float] = None,
):
    """PPO-clip policy loss with a KL penalty against a reference policy, token-averaged.

    Per valid token t of sequence b, with ratio ``r = exp(logp - old_logp)`` and advantage ``A_b``:

    * policy term ``-min(r * A_b, clip(r, 1 - clip_eps, 1 + clip_eps) * A_b)``;
    * KL term (Schulman's k3 estimator, >= 0) ``exp(ref - logp) - (ref - logp) - 1``.

    loss = sum over valid tokens of (policy + kl_coef * KL), divided by ``normalizer``
    (default: the number of valid tokens). Pass the whole batch's token count as ``normalizer``
    when the batch is split into micro-batches whose gradients are accumulated.

    Args:
        logp: [B, C] float, log-probs of the sampled tokens under the policy being trained (with grad).
        old_logp: [B, C] float, log-probs under the policy that sampled them (no grad).
        advantages: [B] float (one per sequence) or [B, C].
        mask: [B, C] bool or 0/1, True on completion tokens, False on padding.
        ref_logp: [B, C] float, log-probs under the reference policy; None skips the KL term.
        clip_eps: PPO clip range, >= 0.
        kl_coef: weight of the KL term, >= 0.
        normalizer: divisor of the summed loss, > 0.

    Returns:
        (loss, LossStats): a 0-dim float32 tensor and its diagnostics.

    Raises:
        ValueError: mismatched shapes, or a negative ``clip_eps``/``kl_coef``.
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask {tuple(mask.shape)} must match")
    if clip_eps < 0 or kl_coef < 0:
        raise ValueError(f"clip_eps and kl_coef must be >= 0, got {clip_eps}, {kl_coef}")
    m = mask.to(torch.float32)
    adv = advantages.float()
    if adv.dim() == 1:
        adv = adv[:, None]
    logp = logp.float()
    log_ratio = logp - old_logp.float().detach()
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    pg = -torch.minimum(unclipped, clipped)
    per_token = pg
    kl = torch.zeros_like(pg)
    if ref_logp is not None:
        d = ref_logp.float().detach() - logp
        kl = torch.exp(d) - d - 1.0
        if kl_coef:
            per_token = pg + kl_coef * kl
    n_tok = float(m.sum())
    denom = float(normalizer) if normalizer is not None else max(n_tok, 1.0)
    if denom <= 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    loss = (per_token * m).sum() / denom
    with torch.no_grad():
        div = max(n_tok, 1.0)
        stats = LossStats(
            pg_loss=float((pg * m).sum() / div),
            kl=float((kl * m).sum() / div),
            clip_frac=float(((clipped < unclipped).float() * m).sum() / div),
            ratio_mean=float((ratio * m).sum() / div),
            tokens=int(n_tok),
        )
    return loss, stats
