"""A Qwen3-MoE through the fast path into real SGLang engines (issue 47, goal 4): bit-exact against SGLang's
own ``load_weights`` at TP=1, TP=2 and with expert parallelism (TP=2, ``ep_size=2``); greedy output then
equals Hugging Face's with the synced weights; and the ``sgl_rollout`` checkpoint engine's transport on two
GPUs, the same bits. First run on 2×H200 (SGLang 0.5.12, 2026-11-28): every engine died on its first request
(head_dim 32, which SGLang's Qwen3-MoE cannot serve: ``fused_kv_rope_problem``); the model has head_dim 64 since.

Model: :data:`~sgl_rollout.bench.models.QWEN3_MOE_TINY` (8 experts, 2 active, 4 layers), its checkpoint
written by transformers (weights A, one tensor per expert and projection). The trainer's tensors are the
Hugging Face model's under their checkpoint names
(:func:`~sgl_rollout.bench.models.qwen3_moe_checkpoint_tensors`: transformers 5 holds the experts fused).

Bit-exact: the engine loads A through SGLang's own ``load_weights`` (op ``load``) and hashes its parameters
inside the scheduler (op ``digest``); the fast path syncs B (every weight redrawn); the hashes must then
equal those after SGLang's ``load_weights`` of A and then of B, and differ from A's, so every parameter the
loader writes was written by the fast path. B's routing is a function of the token id with wide margins
(:func:`~sgl_rollout.bench.models.route_by_token`): with random routers, bf16 near-ties between the second
and third expert make SGLang and Hugging Face pick different experts, whole expert outputs apart.

Expert parallelism: SGLang 0.5.12 serves Qwen3-MoE with ``ep_size > 1`` and no all-to-all backend
(``moe_a2a_backend="none"``, the default) on the kernels TP already uses: ``get_moe_impl_class`` gives
the plain ``FusedMoE`` (``sglang/srt/layers/moe/ep_moe/layer.py``), each rank holds ``num_experts / ep_size``
experts (``FusedMoE.__init__``), ``StandardDispatcher.dispatch`` maps the other ranks' expert ids to -1
(``sglang/srt/layers/moe/token_dispatcher/standard.py``) and ``Qwen3MoeSparseMoeBlock.forward_normal``
all-reduces over the EP group (``sglang/srt/models/qwen3_moe.py``); ``initialize_model_parallel`` splits the
TP ranks into ``tp_size / ep_size`` MoE-TP ranks per EP rank (``sglang/srt/distributed/parallel_state.py``) and
``ServerArgs`` asks nothing more of ``ep_size`` with this backend (only the ``triton_kernel`` runner refuses
it). DeepEP, Mooncake or NIXL all-to-all would need kernels of their own.

Engine flags besides the dense fast-path test's: ``moe_runner_backend="triton"`` (what ``auto`` resolves to on
H100/H200 for bf16; on SM100 0.5.12 would pick ``flashinfer_trtllm``, whose block layout is another test), and
at TP=2 ``enforce_disable_flashinfer_allreduce_fusion`` (0.5.12 turns FlashInfer's all-reduce fusion on for
Qwen3-MoE at TP > 1 on SM90, ``ServerArgs._handle_model_specific_adjustments``; the dense tests run without it).
"""

import copy
import glob
import re

import pytest
import torch

from sgl_rollout.bench import gpu_engine_flags
from sgl_rollout.bench.models import QWEN3_MOE_TINY, make_qwen3_moe_dir, qwen3_moe_checkpoint_tensors, redraw, \
    route_by_token
from sgl_rollout.config import RolloutConfig
from sgl_rollout.worker import RolloutWorker

from .greedy import assert_greedy_equal
from .test_fast_path_gpu import PROMPTS, _digest, _greedy

_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP=2 needs 2 GPUs (run on nvidia-h200-x2)")


def _worker(path, tp=1, ep=1):
    kw = dict(gpu_engine_flags(), moe_runner_backend="triton")
    if tp > 1:
        kw["enforce_disable_flashinfer_allreduce_fusion"] = True
    if ep > 1:
        kw["ep_size"] = ep
    cfg = RolloutConfig(model_path=path, dtype="bfloat16", gpu_memory_utilization=0.15, tensor_model_parallel_size=tp,
                        update_weights_bucket_megabytes=1, enforce_eager=True, fast_sync=True, engine_kwargs=kw)
    return RolloutWorker(cfg)


def _models(path):
    """(A, B): A as saved in ``path`` (the engine's checkpoint), B every weight redrawn, routed by token."""
    a = make_qwen3_moe_dir(path, QWEN3_MOE_TINY, seed=0, init_std=0.15)
    saved = {}
    from safetensors.torch import load_file

    for f in glob.glob(f"{path}/*.safetensors"):
        saved.update(load_file(f))
    named = qwen3_moe_checkpoint_tensors(a)  # this transformers' in-memory layout, split as it saves it
    assert {n for n, _ in named} == set(saved) and all(torch.equal(saved[n], t) for n, t in named)
    b = copy.deepcopy(a)
    redraw(b, seed=1, init_std=0.15)
    route_by_token(b)
    return a.cuda().eval(), b.cuda().eval()


def _experts(chunks):
    return sorted({int(m[1]) for c in chunks for m in [_EXPERT.match(c[0])] if m})


def _bit_exact_then_greedy(tmp_path, tp, ep=1):
    a, b = _models(str(tmp_path))
    worker = _worker(str(tmp_path), tp, ep)
    try:
        worker.update_weights(qwen3_moe_checkpoint_tensors(a), partial=True)  # SGLang's load_weights: A
        start = _digest(worker)
        worker.update_weights(qwen3_moe_checkpoint_tensors(b))  # the fast path: B
        assert worker._fast is not None and worker._fast.covered, worker._fast and worker._fast.reason
        fast = _digest(worker)
        assert len(fast) == tp and all(len(d) > 10 for d in fast)
        assert_greedy_equal(b, PROMPTS, _greedy(worker))
        worker.update_weights(qwen3_moe_checkpoint_tensors(a), partial=True)
        assert _digest(worker) == start
        worker.update_weights(qwen3_moe_checkpoint_tensors(b), partial=True)  # SGLang's load_weights: B
        slow = _digest(worker)
        assert fast != start
        assert slow == fast, [f"rank {r}: {n}" for r in range(tp) for n in fast[r] if fast[r][n] != slow[r][n]]
        # the trainer's own parameters (transformers 5: fused experts, which the worker splits into per-expert
        # views, SyncPath.renamed) in fp32 (cast into the bf16 buffer in the gather), written over A: the same bits
        worker.update_weights(qwen3_moe_checkpoint_tensors(a), partial=True)
        worker.update_weights([(n, p.detach().float()) for n, p in b.named_parameters()])
        assert _digest(worker) == fast
        per_rank = [_experts(ch) for ch in worker._fast.plan.chunks]
        n_experts = QWEN3_MOE_TINY["num_experts"]
        if ep == 1:
            assert per_rank == [list(range(n_experts))] * tp, per_rank
        else:  # each EP rank's plan holds its own experts only
            local = n_experts // ep
            assert per_rank == [list(range(r * local, (r + 1) * local)) for r in range(ep)], per_rank
        unchanged = sum(fast[r][n] == start[r][n] for r in range(tp) for n in fast[r])
        print(f"\nFASTPATH-MOE | qwen3-moe tp={tp} ep={ep} | bit-exact vs SGLang load_weights "
              f"({unchanged} of {sum(map(len, fast))} parameters unchanged from A) | experts per rank {per_rank} | "
              f"{sum(len(x) for x in worker._fast.plan.layouts[0])} pieces in {len(worker._fast.plan.layouts[0])} "
              "buckets | greedy == HF")
    finally:
        worker.shutdown()


def test_moe_fast_path_bit_exact_tp1(tmp_path):
    _bit_exact_then_greedy(tmp_path, 1)


@two_gpus
def test_moe_fast_path_bit_exact_tp2(tmp_path):
    _bit_exact_then_greedy(tmp_path, 2)


@two_gpus
def test_moe_fast_path_bit_exact_ep2(tmp_path):
    _bit_exact_then_greedy(tmp_path, 2, ep=2)


@two_gpus
def test_moe_checkpoint_engine_sync_bit_exact(tmp_path):
    """The ``sgl_rollout`` checkpoint engine's transport with the MoE (issue 47, goal 4): a trainer on GPU 1
    sends B into the engine's buffer on GPU 0, first under the checkpoint's per-expert names, then as the
    trainer's own fused (transformers 5) parameters renamed per expert on the way (verl's backend passes the
    same renamer, ``verl_checkpoint_engine._renamer``); both equal SGLang's ``load_weights`` of B bit for bit."""
    from sgl_rollout.checkpoint_names import checkpoint_mappings

    from .test_p2p_gpu import _groups, _sync

    torch.cuda.set_device(0)
    a, b = _models(str(tmp_path))
    worker = _worker(str(tmp_path))
    try:
        worker.update_weights(qwen3_moe_checkpoint_tensors(a))  # the fast path's plan, asked once
        assert worker._fast is not None and worker._fast.covered, worker._fast and worker._fast.reason
        start = _digest(worker)
        groups = _groups()
        b1 = copy.deepcopy(b).to("cuda:1").eval()
        sent, received = _sync(worker, groups, iter(qwen3_moe_checkpoint_tensors(b1)))
        assert not isinstance(sent, BaseException) and not isinstance(received, BaseException), (sent, received)
        p2p = _digest(worker)
        worker.update_weights(qwen3_moe_checkpoint_tensors(b), partial=True)  # SGLang's own load_weights: B
        assert _digest(worker) == p2p and p2p != start
        worker.update_weights(qwen3_moe_checkpoint_tensors(a), partial=True)
        renamer = checkpoint_mappings(str(tmp_path))[1]
        assert renamer is not None
        fused = [(n, p.detach()) for n, p in b1.named_parameters()]
        sent, received = _sync(worker, groups, iter(fused), renamer=lambda plan: renamer)
        assert not isinstance(sent, BaseException) and not isinstance(received, BaseException), (sent, received)
        assert _digest(worker) == p2p
        assert_greedy_equal(b, PROMPTS, _greedy(worker))
        print(f"\nP2P-MOE | qwen3-moe TP=1 | trainer GPU 1 -> engine GPU 0 | {sent.bytes} bytes in {sent.n_buckets} "
              f"buckets, {sent.n_tensors} tensors read | bit-exact vs load_weights (per-expert and fused names), greedy == HF")
    finally:
        worker.shutdown()
