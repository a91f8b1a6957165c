"""The ``sgl_rollout`` checkpoint engine's transport on two GPUs (:mod:`sgl_rollout.weight_sync.p2p`): a
trainer rank on GPU 1 packs the rollout engine's copy plan and sends it over NCCL straight into the fast
path's buffer of the engine's TP rank on GPU 0 (verl's standalone layout: rollout on GPUs of its own).

Bit-exact: after the point-to-point sync of weights B the engine's parameters (hashed inside the
scheduler, op ``digest``) equal those SGLang's own ``load_weights`` gives for B; greedy output equals
Hugging Face's for B; a refused tensor ends the sync on both sides with the engine alive and the next
sync succeeds. Prints the transfer's seconds and bytes.

Needs 2 GPUs (``nvidia-h100-x2`` / ``nvidia-h200-x2``); not yet run on them.
"""

import copy
import threading
import time

import pytest
import torch

from sgl_rollout.weight_sync.manifest import SyncValidationError
from sgl_rollout.weight_sync.p2p import PeerGroup, PlanReceipt, TrainerRefused, receive_plan_buckets, send_plan_buckets
from sgl_rollout.weight_sync.driver import fenced

from .greedy import assert_greedy_equal
from .test_fast_path_gpu import PROMPTS, _digest, _greedy, _model, _params, _worker

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a trainer GPU and a rollout GPU: needs 2 GPUs")


def _groups():
    from torch.distributed.elastic.utils.distributed import get_free_port

    port, out = get_free_port(), [None, None]

    def make(rank, device):
        torch.cuda.set_device(device)
        out[rank] = PeerGroup("127.0.0.1", port, rank, 2, torch.device("cuda", device), timeout_s=120)

    threads = [threading.Thread(target=make, args=(0, 1)), threading.Thread(target=make, args=(1, 0))]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert all(out)
    return out  # rank 0: the trainer (GPU 1); rank 1: the rollout TP rank (GPU 0)


def _sync(worker, groups, named, renamer=None):
    """Trainer thread on GPU 1 sends, this thread (the engine's GPU 0) receives inside the sync fence;
    ``renamer`` as :func:`send_plan_buckets` takes it (verl's backend: the trainer's names to the checkpoint's)."""
    got = {}

    def trainer():
        torch.cuda.set_device(1)
        try:
            got["trainer"] = send_plan_buckets(groups[0], [(1, 0)], named, renamer=renamer)
        except BaseException as exc:  # noqa: BLE001
            got["trainer"] = exc

    t = threading.Thread(target=trainer)
    t.start()
    try:
        with fenced(worker.engine):
            got["rollout"] = receive_plan_buckets(worker._fast, PlanReceipt(groups[1], source=0, index=0))
    except BaseException as exc:  # noqa: BLE001
        got["rollout"] = exc
    t.join(300)
    assert not t.is_alive(), "the trainer side hangs"
    return got["trainer"], got["rollout"]


def test_point_to_point_sync_is_bit_exact_and_refusals_leave_the_engine_serving(tmp_path):
    a, b = _model("qwen2", False, 0), _model("qwen2", False, 1)
    a.save_pretrained(str(tmp_path), safe_serialization=True)
    torch.cuda.set_device(0)
    worker = _worker(str(tmp_path))
    try:
        worker.update_weights(_params(a.cuda(0)))  # the fast path's plan, asked once
        assert worker._fast is not None and worker._fast.covered, worker._fast and worker._fast.reason
        groups = _groups()
        b1 = copy.deepcopy(b).to("cuda:1").eval()  # the trainer's copy on its own GPU (Module.to moves in place)
        b = b.to("cuda:0").eval()
        sent, received = _sync(worker, groups, iter(_params(b1)))
        assert not isinstance(sent, BaseException) and not isinstance(received, BaseException), (sent, received)
        p2p = _digest(worker)
        worker.update_weights(_params(b), partial=True)  # SGLang's own load_weights
        assert _digest(worker) == p2p
        worker.update_weights(_params(a.cuda(0)), partial=True)
        assert _digest(worker) != p2p
        # again through the same group; then generate on B
        t_sent, t_received = _sync(worker, groups, iter(_params(b1)))
        assert _digest(worker) == p2p
        assert_greedy_equal(b, PROMPTS, _greedy(worker))
        # for reference, the same weights on the colocated fast path from GPU 1's tensors (the gather copies
        # across GPUs into the buffer on GPU 0): the same bits, in this process
        t0 = time.perf_counter()
        worker.update_weights(_params(b1))
        t_local = time.perf_counter() - t0
        assert _digest(worker) == p2p
        print(f"\nP2P | qwen2 TP=1 | trainer GPU 1 -> engine GPU 0 | {t_sent.bytes} bytes in {t_sent.n_buckets} "
              f"buckets | trainer {t_sent.seconds * 1e3:.1f} ms, rollout {t_received.seconds * 1e3:.1f} ms | "
              f"fast path from GPU 1's tensors {t_local * 1e3:.1f} ms | bit-exact vs load_weights, greedy == HF")

        bad = _params(b1)
        bad[-1] = (bad[-1][0], torch.zeros(3, 3, device="cuda:1", dtype=torch.bfloat16))
        sent, received = _sync(worker, groups, iter(bad))
        assert isinstance(sent, SyncValidationError) and isinstance(received, TrainerRefused), (sent, received)
        sent, received = _sync(worker, groups, iter(_params(b1)))  # the engine lives; a good sync succeeds
        assert not isinstance(received, BaseException), received
        assert _digest(worker) == p2p
    finally:
        worker.shutdown()
