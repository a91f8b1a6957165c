"""The trainer side of the demo: batches, log-probs, AdamW with fp32 master weights, CPU offload.

The policy is a Hugging Face causal LM held in bf16 (the copy that is forwarded and sent to the
engine). AdamW updates fp32 master copies of its parameters and writes them back rounded to bf16:
a plain bf16 AdamW step of lr ~1e-5 on weights of size ~0.05 is below half a bf16 step (2**-9
relative) and would mostly round away.

Offload: parameters, master weights and optimizer state move between the GPU and pinned CPU
buffers by swapping each tensor's ``.data``, so the optimizer's references stay valid and each
round trip reuses the same pinned buffers. The reference policy (no grads) lives on CPU and visits
the GPU only to score a batch; its CPU buffers are never written back.

LoRA (``lora_rank > 0``): the policy is wrapped with ``peft`` (``LoraConfig`` + ``get_peft_model``, the
adapter in the model's dtype, as SGLang computes it) and only the adapter is trained: the optimizer holds
the adapter's parameters alone and the base stays frozen, bit for bit (it is never merged). The
reference policy of the KL term is the base itself, scored under ``disable_adapter()`` instead of a
second copy. The frozen base moves between the GPU and pinned memory read-only (its GPU copy is
dropped at offload, never copied back). What the engine gets: :meth:`Trainer.adapter_state_dict`
(PEFT's saved names, ``base_model.model.<module>.lora_A.weight``) and, when the engine lacks its base,
:meth:`Trainer.base_named_parameters` (Hugging Face names, no LoRA tensors).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from .grpo import ppo_clip_kl_loss, token_logprobs


# --------------------------------------------------------------------------------------------- batch
@dataclass
class Batch:
    """Prompt + completion sequences, right-padded, for scoring the completions.

    Attributes:
        input_ids: int64 [B, L]: each row is ``prompt + completion[:-1]`` then ``pad_id``; the
            last completion token is never an input (nothing after it is scored).
        positions: int64 [B, C]: for completion token j of row b, the input position whose output
            predicts it (``len(prompt_b) - 1 + j``); 0 on padding.
        targets: int64 [B, C]: the completion tokens, 0 on padding.
        mask: bool [B, C]: True on completion tokens.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: Sequence[int]) -> "Batch":
        """Rows ``idx``, trimmed to their own longest input and completion."""
        i = torch.as_tensor(list(idx), dtype=torch.long)
        mask = self.mask[i]
        c = max(int(mask.sum(1).max()), 1)
        pos = self.positions[i, :c]
        length = int((pos.max() + 1).clamp(min=1))
        return Batch(self.input_ids[i, :length], pos, self.targets[i, :c], mask[:, :c])

    def to(self, device) -> "Batch":
        """The same batch with every tensor on ``device``."""
        return Batch(*(t.to(device, non_blocking=True) for t in (self.input_ids, self.positions, self.targets, self.mask)))


def pack(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int = 0) -> Batch:
    """Build a :class:`Batch` (on CPU) from token-id lists.

    Args:
        prompts: B prompts (each non-empty).
        completions: B completions (each non-empty), the tokens to score.
        pad_id: id written into the padding of ``input_ids`` (never attended: padding is on the
            right and attention is causal).

    Raises:
        ValueError: different counts, or an empty prompt or completion.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if any(len(p) == 0 for p in prompts) or any(len(c) == 0 for c in completions):
        raise ValueError("prompts and completions must be non-empty")
    b = len(prompts)
    length = max(len(p) + len(c) - 1 for p, c in zip(prompts, completions))
    c_max = max(len(c) for c in completions)
    ids = torch.full((b, length), pad_id, dtype=torch.long)
    pos = torch.zeros((b, c_max), dtype=torch.long)
    tgt = torch.zeros((b, c_max), dtype=torch.long)
    mask = torch.zeros((b, c_max), dtype=torch.bool)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        seq = list(p) + list(c)[:-1]
        ids[r, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        n = len(c)
        pos[r, :n] = torch.arange(len(p) - 1, len(p) - 1 + n)
        tgt[r, :n] = torch.tensor(list(c), dtype=torch.long)
        mask[r, :n] = True
    return Batch(ids, pos, tgt, mask)


def completion_logprobs(model, batch: Batch, temperature: float) -> torch.Tensor:
    """Log-probs [B, C] (float32, 0 on padding) of the completion tokens of ``batch`` under ``model``.

    Runs the decoder once over ``input_ids`` (no attention mask: padding is on the right and the
    attention causal), gathers the hidden states of the scored positions only, and applies the
    output head to those ([B, C, V] logits, not [B, L, V]). The logits are upcast to float32 once
    and divided by the temperature in place (``logits.div_(T)`` in
    :func:`sgl_rollout.demo.grpo.token_logprobs`), so no second logits tensor is made. Gradients
    flow when enabled by the caller.

    Args:
        model: a Hugging Face causal LM (``get_decoder()`` and ``get_output_embeddings()``), on the
            device of ``batch``. A ``final_logit_softcapping`` in its config is applied.
        batch: the sequences (same device as the model).
        temperature: the sampling temperature, > 0.
    """
    hidden = model.get_decoder()(input_ids=batch.input_ids, use_cache=False).last_hidden_state
    h = hidden.gather(1, batch.positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    del hidden
    # bf16 head output -> float32 (the bf16 tensor is then dropped: neither op's backward keeps it),
    # then token_logprobs divides this float32 tensor by the temperature in place: SGLang's order
    logits = model.get_output_embeddings()(h).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    lp = token_logprobs(logits, batch.targets, temperature)
    return lp * batch.mask


def batched_logprobs(model, batch: Batch, temperature: float, micro_batch: int, device) -> torch.Tensor:
    """:func:`completion_logprobs` without grad over micro-batches of ``micro_batch`` rows; [B, C] on CPU."""
    out = torch.zeros(batch.mask.shape, dtype=torch.float32)
    with torch.no_grad():
        for s in range(0, len(batch), micro_batch):
            idx = list(range(s, min(s + micro_batch, len(batch))))
            sub = batch.select(idx)
            out[s : s + len(idx), : sub.mask.shape[1]] = completion_logprobs(model, sub.to(device), temperature).cpu()
    return out


# ---------------------------------------------------------------------------------------- optimizer
class MasterAdamW:
    """AdamW on fp32 master copies of (bf16) model parameters; the model keeps its dtype.

    ``step()`` copies each parameter's gradient into its master's, runs ``torch.optim.AdamW`` on the
    masters, and writes the masters back into the parameters (rounded to their dtype).

    Args:
        params: the model's trainable parameters (any float dtype, one device).
        lr, betas, weight_decay: AdamW's.
        max_grad_norm: clip the global gradient norm (of the masters) to this; None: no clipping.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, betas=(0.9, 0.999),
                 weight_decay: float = 0.0, max_grad_norm: Optional[float] = 1.0):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=lr, betas=betas, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm

    def step(self) -> float:
        """One update; returns the global gradient norm (before clipping) as a float."""
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.detach().float()
        grads = [m for m in self.masters if m.grad is not None]
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in grads]))
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
        self.zero_grad()
        return float(norm)

    def zero_grad(self) -> None:
        """Drop the gradients of the parameters and of the masters."""
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """The masters and the AdamW moments (for offloading); the step counters stay on the CPU,
        where AdamW keeps them."""
        yield from self.masters
        for st in self.opt.state.values():
            for key, v in st.items():
                if torch.is_tensor(v) and key != "step":
                    yield v


class Offloader:
    """Moves tensors between one CUDA device and pinned CPU buffers, keeping the tensor objects.

    Args:
        tensors: ``() -> iterable of tensors`` to move (called at each move, so state created since
            is included).
        device: the CUDA device.
        read_only: the tensors never change on the GPU, so ``to_cpu`` points them back at their
            pinned buffers without copying.
    """

    def __init__(self, tensors: Callable[[], Iterable[torch.Tensor]], device, read_only: bool = False):
        self._tensors = tensors
        self.device = torch.device(device)
        self.read_only = read_only
        self._pinned: Dict[int, torch.Tensor] = {}

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        buf = self._pinned.get(id(t))
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
            self._pinned[id(t)] = buf
            if self.read_only and t.device.type == "cpu":
                buf.copy_(t.data)
        return buf

    def to_gpu(self) -> None:
        """Copy every tensor that is on the CPU to the device (asynchronous from pinned memory).
        Nothing to do when the device is the CPU."""
        if self.device.type != "cuda":
            return
        for t in self._tensors():
            if t.device.type == "cpu":
                src = self._buffer(t) if self.read_only else t.data
                t.data = src.to(self.device, non_blocking=True)
        torch.cuda.synchronize(self.device)

    def to_cpu(self) -> None:
        """Move every tensor on the device into its pinned CPU buffer; the GPU memory is then free."""
        moved = []
        for t in self._tensors():
            if t.device.type != "cuda":
                continue
            buf = self._buffer(t)
            if not self.read_only:
                buf.copy_(t.data, non_blocking=True)
            moved.append((t, buf))
        if moved:
            torch.cuda.synchronize(self.device)
        for t, buf in moved:
            t.data = buf

    def pinned_bytes(self) -> int:
        """Bytes of pinned CPU memory held."""
        return sum(b.numel() * b.element_size() for b in self._pinned.values())


# ------------------------------------------------------------------------------------------ trainer
@dataclass
class TrainStats:
    """One GRPO update (several optimizer steps): means over mini-batches."""

    loss: float
    pg_loss: float
    kl: float
    clip_frac: float
    log_ratio_abs: float
    grad_norm: float
    optimizer_steps: int


#: Modules a LoRA adapter targets unless told otherwise: every linear projection of a decoder layer
#: (PEFT's ``"all-linear"`` for Llama-style models; the output layer is not among them).
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Trainer:
    """Policy (trained), reference policy (CPU, no grads), optimizer and offloading; both in ``dtype``.

    Args:
        model_dir: Hugging Face model folder.
        device: CUDA device of training.
        lr, weight_decay, max_grad_norm: optimizer settings.
        temperature: sampling temperature of the rollouts (> 0), applied to the logits.
        clip_eps, kl_coef: PPO clip range and KL weight.
        micro_batch: rows per forward/backward.
        mini_batches: optimizer steps per GRPO update (the rollout batch is split in this many).
        seed: shuffling seed.
        lora_rank: 0: full fine-tuning. > 0: train a LoRA adapter of this rank only (see the module docstring).
        lora_alpha: the adapter's ``lora_alpha``; None: ``2 * lora_rank``.
        lora_targets: module names the adapter wraps; None: :data:`DEFAULT_LORA_TARGETS`.
        dtype: the models' dtype, ``torch.bfloat16`` (the demo's) or ``torch.float32`` (the CPU tests':
            bf16 matmuls round differently on CPUs with AMX-BF16, so two bf16 forward passes of the same
            weights differ there by more than a missed sync's tolerance can allow).

    After construction everything is on the CPU; call :meth:`load` before training.

    Raises:
        ImportError: ``lora_rank > 0`` and ``peft`` is not installed.
        ValueError: ``peft`` finds none of ``lora_targets`` in the model.
    """

    def __init__(self, model_dir: str, device, lr: float, temperature: float, clip_eps: float = 0.2,
                 kl_coef: float = 0.02, micro_batch: int = 32, mini_batches: int = 2,
                 weight_decay: float = 0.0, max_grad_norm: Optional[float] = 1.0, seed: int = 0,
                 lora_rank: int = 0, lora_alpha: Optional[float] = None,
                 lora_targets: Optional[Sequence[str]] = None, dtype: torch.dtype = torch.bfloat16):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        if lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0, got {lora_rank}")
        self.device = torch.device(device)
        self.lora = lora_rank > 0
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # one "Loading weights" bar per copy would break the demo's log
        try:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
            self.ref = None
            if kl_coef > 0 and not self.lora:  # LoRA: the reference is the base, under disable_adapter()
                self.ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
                self.ref.requires_grad_(False)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        self.peft_config = None
        if self.lora:
            self.peft_config = lora_config(lora_rank, lora_alpha, lora_targets)
            from peft import get_peft_model

            # the adapter in the model's dtype (bf16), as SGLang computes LoRA; the optimizer keeps fp32 masters
            self.model = get_peft_model(self.model, self.peft_config, autocast_adapter_dtype=False).eval()
        self.optim = MasterAdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay,
                                 max_grad_norm=max_grad_norm)
        self.temperature = temperature
        self.clip_eps = clip_eps
        self.kl_coef = kl_coef
        self.micro_batch = micro_batch
        self.mini_batches = mini_batches
        self._rng = random.Random(seed)
        self._policy_off = Offloader(self._policy_tensors, self.device)
        self._ref_off = Offloader(self._ref_tensors, self.device, read_only=True) if self.ref is not None else None
        # LoRA: the frozen base never changes on the GPU, so its offload drops the GPU copy without copying
        self._base_off = Offloader(self._frozen_tensors, self.device, read_only=True) if self.lora else None
        self.on_gpu = False

    def _policy_tensors(self):
        for p in self.model.parameters():
            if not self.lora or p.requires_grad:
                yield p
        yield from self.model.buffers()
        yield from self.optim.state_tensors()

    def _frozen_tensors(self):
        for p in self.model.parameters():
            if not p.requires_grad:
                yield p

    def _ref_tensors(self):
        yield from self.ref.parameters()
        yield from self.ref.buffers()

    def named_parameters(self):
        """(name, tensor) of the policy in Hugging Face naming (tied weights listed once). Full
        fine-tuning only: a LoRA policy is :meth:`base_named_parameters` plus :meth:`adapter_state_dict`."""
        if self.lora:
            raise RuntimeError("a LoRA policy has no single set of Hugging Face weights: sync "
                               "adapter_state_dict() (and base_named_parameters() when the engine lacks its base)")
        return self.model.named_parameters()

    def trainable_parameters(self) -> int:
        """Number of trained parameter elements (the adapter's with LoRA)."""
        return sum(p.numel() for p in self.optim.params)

    def adapter_state_dict(self) -> Dict[str, torch.Tensor]:
        """The LoRA adapter as PEFT saves it (``get_peft_model_state_dict``): names
        ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``, the tensors themselves (no copies;
        on the GPU while the trainer is loaded).

        Raises:
            RuntimeError: not a LoRA trainer.
        """
        if not self.lora:
            raise RuntimeError("adapter_state_dict() of a trainer without LoRA (lora_rank=0)")
        from peft.utils.save_and_load import get_peft_model_state_dict

        return get_peft_model_state_dict(self.model)

    def base_named_parameters(self) -> List[Tuple[str, torch.Tensor]]:
        """The frozen base weights of a LoRA policy in Hugging Face naming, as the checkpoint has them:
        no ``base_model.model.`` prefix, no LoRA tensors, PEFT's ``.base_layer`` level removed (tied weights
        listed once). Not merged: the adapter is not in them.

        Raises:
            RuntimeError: not a LoRA trainer.
        """
        if not self.lora:
            raise RuntimeError("base_named_parameters() of a trainer without LoRA (lora_rank=0): use named_parameters()")
        out = []
        for name, p in self.model.get_base_model().named_parameters():
            if ".lora_" in name:
                continue
            out.append((name.replace(".base_layer.", "."), p.detach()))
        return out

    def load(self) -> None:
        """Policy, masters and optimizer state to the GPU."""
        self._policy_off.to_gpu()
        if self._base_off is not None:
            self._base_off.to_gpu()
        self.on_gpu = True

    def offload(self) -> None:
        """Policy, masters and optimizer state to pinned CPU memory (gradients are dropped)."""
        self.optim.zero_grad()
        self._policy_off.to_cpu()
        if self._base_off is not None:
            self._base_off.to_cpu()
        self.on_gpu = False

    def logprobs(self, batch: Batch) -> torch.Tensor:
        """Policy log-probs [B, C] (CPU, float32) of ``batch``'s completions, no grad."""
        return batched_logprobs(self.model, batch, self.temperature, self.micro_batch, self.device)

    def ref_logprobs(self, batch: Batch) -> Optional[torch.Tensor]:
        """Reference log-probs [B, C] (CPU, float32); the reference visits the GPU for this only (LoRA:
        the base, i.e. the policy under ``disable_adapter()``). None when there is no KL term."""
        if self.kl_coef <= 0:
            return None
        if self.lora:
            with self.model.disable_adapter():
                return batched_logprobs(self.model, batch, self.temperature, self.micro_batch, self.device)
        self._ref_off.to_gpu()
        try:
            return batched_logprobs(self.ref, batch, self.temperature, self.micro_batch, self.device)
        finally:
            self._ref_off.to_cpu()

    def train(self, batch: Batch, advantages: torch.Tensor, old_logp: torch.Tensor,
              ref_logp: Optional[torch.Tensor]) -> TrainStats:
        """GRPO update on one rollout batch: ``mini_batches`` AdamW steps over shuffled rows.

        Args:
            batch: [B] sequences (CPU).
            advantages: float [B], one per sequence.
            old_logp: [B, C] log-probs of the sampling policy (CPU).
            ref_logp: [B, C] reference log-probs (CPU) or None.

        Returns:
            TrainStats averaged over the optimizer steps.
        """
        rows = list(range(len(batch)))
        self._rng.shuffle(rows)
        k = max(1, min(self.mini_batches, len(rows)))
        size = math.ceil(len(rows) / k)
        agg = dict(loss=0.0, pg_loss=0.0, kl=0.0, clip_frac=0.0, log_ratio_abs=0.0, grad_norm=0.0)
        steps = 0
        for s in range(0, len(rows), size):
            mini = rows[s : s + size]
            n_tok = float(batch.mask[mini].sum())
            for ms in range(0, len(mini), self.micro_batch):
                idx = mini[ms : ms + self.micro_batch]
                sub = batch.select(idx)
                c = sub.mask.shape[1]
                dev = sub.to(self.device)
                logp = completion_logprobs(self.model, dev, self.temperature)
                old = old_logp[idx, :c].to(self.device)
                ref = ref_logp[idx, :c].to(self.device) if ref_logp is not None else None
                loss, st = ppo_clip_kl_loss(logp, old, advantages[idx].to(self.device), dev.mask, ref,
                                            clip_eps=self.clip_eps, kl_coef=self.kl_coef, normalizer=max(n_tok, 1.0))
                loss.backward()
                w = st.tokens / max(n_tok, 1.0)
                agg["loss"] += float(loss.detach())
                agg["pg_loss"] += st.pg_loss * w
                agg["kl"] += st.kl * w
                agg["clip_frac"] += st.clip_frac * w
                with torch.no_grad():
                    agg["log_ratio_abs"] += float(((logp.detach() - old).abs() * dev.mask).sum()) / max(n_tok, 1.0)
            agg["grad_norm"] += self.optim.step()
            steps += 1
        return TrainStats(**{k2: v / steps for k2, v in agg.items()}, optimizer_steps=steps)


def lora_config(rank: int, alpha: Optional[float] = None, targets: Optional[Sequence[str]] = None):
    """The demo's ``peft.LoraConfig``: rank ``rank``, ``lora_alpha`` ``alpha`` (None: ``2 * rank``), the
    modules ``targets`` (None: :data:`DEFAULT_LORA_TARGETS`), no dropout (the engine has none), no biases.

    Raises:
        ImportError: ``peft`` is not installed.
        ValueError: ``rank`` < 1 or ``alpha`` <= 0.
    """
    from peft import LoraConfig

    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    alpha = 2 * rank if alpha is None else alpha
    if alpha <= 0:
        raise ValueError(f"lora_alpha must be > 0, got {alpha}")
    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets or DEFAULT_LORA_TARGETS),
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
