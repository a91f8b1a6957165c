"""sgl_rollout's TRL trainer (sgl_rollout.integrations.trl) data parallel: TRL's real GRPOTrainer in 2
processes on the CPU (gloo, ``use_cpu=True``; launched as ``accelerate launch`` / torchrun would, through
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), one engine double per rank (test_trl's
WorkerDouble), 2 steps. Checks: each rank's engine gets its own replica's weights, equal to that rank's
trainer after each step, and the two replicas agree (DDP); each rank generates only for its share of the
prompts, as TRL's RepeatSampler and accelerate's sharding deal them; each rank's engine settings name its
own GPU and ports; a refused sync on one rank fails both ranks with a clear error and no rank hangs (the
launch has a deadline).

Run as a script, this file is one rank (``_rank_main``).
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

HERE = Path(__file__).resolve().parent
WORLD = 2
#: Seconds both ranks get for the whole launch (both scenarios, about 20 s on 2 cores); a hang fails here.
DEADLINE_S = 120
#: Per rank and step: completions (3, with 2 per prompt: one prompt's group spans both ranks).
BATCH, NUM_GENERATIONS = 3, 2


# ----------------------------------------------------------------------------------------------- one rank
def _params(trainer):
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _ok_scenario(model_dir, out_dir, rank_worker):
    """2 steps; what this rank's trainer and engine saw."""
    from transformers import TrainerCallback
    from test_trl import _trainer

    worker, scored, prompts, after_step = rank_worker(model_dir), [], [], []
    trainer = _trainer(model_dir, out_dir / "ok", worker, scored, per_device_train_batch_size=BATCH,
                       num_generations=NUM_GENERATIONS)
    inner = trainer._generate

    def recorded(batch):
        prompts.append(list(batch))
        return inner(batch)

    trainer._generate = recorded

    class AfterStep(TrainerCallback):
        def on_step_end(self, *_a, **_k):
            after_step.append(_params(trainer))

    trainer.add_callback(AfterStep())
    trainer.train()
    trainer.sgl.wake(trainer.state.global_step, trainer._trainer_weights)  # the last step's weights, synced
    return {"synced": worker.synced, "after_step": after_step, "engine_now": {n: p.detach().clone() for n, p in
            worker.params.items()}, "trainer_now": _params(trainer), "prompts": prompts, "inputs": worker.inputs,
            "scored": scored, "generated": worker.generated, "dataset": list(trainer.train_dataset["prompt"]),
            "process_index": trainer.accelerator.process_index}


def _bad_scenario(model_dir, out_dir, rank_worker, rank):
    """Rank 1's engine refuses its first sync; the error each rank's ``train()`` raised."""
    from test_trl import _trainer

    worker = rank_worker(model_dir, refuse=rank == 1)
    trainer = _trainer(model_dir, out_dir / "bad", worker, per_device_train_batch_size=BATCH,
                       num_generations=NUM_GENERATIONS)
    try:
        trainer.train()
        return {"error": None, "events": worker.events}
    except Exception as err:  # noqa: BLE001 - the test reads which error each rank got
        return {"error": type(err).__name__, "message": str(err), "events": worker.events}


def _tp_scenario(model_dir, out_dir, rank_worker, rank, refuse=False):
    """``tensor_model_parallel_size=2`` over the 2 ranks: one engine (rank 0's double) serves both; rank 1's
    double is given too and must never be called. ``refuse``: the leader's engine refuses its first sync."""
    from types import SimpleNamespace

    from test_trl import _trainer

    worker = rank_worker(model_dir, refuse=refuse and rank == 0)
    worker.config = SimpleNamespace(tensor_model_parallel_size=2)
    scored = []
    trainer = _trainer(model_dir, out_dir / ("tp-bad" if refuse else "tp"), worker, scored,
                       per_device_train_batch_size=BATCH, num_generations=NUM_GENERATIONS)
    try:
        trainer.train()
        error = None
    except Exception as err:  # noqa: BLE001 - the test reads which error each rank got
        error = (type(err).__name__, str(err))
    return {"error": error, "events": worker.events, "inputs": worker.inputs, "scored": scored,
            "generated": worker.generated, "leader": trainer.sgl.engine_here}


def _rank_config(model_dir, accelerator):
    """This rank's engine settings from one RolloutConfig that all ranks share."""
    from sgl_rollout.config import RolloutConfig
    from sgl_rollout.integrations.trl import rank_rollout_config

    shared = RolloutConfig(model_path=model_dir, engine_kwargs={"random_seed": 7})
    args = rank_rollout_config(shared, accelerator).to_server_args()
    return {k: args.get(k) for k in ("base_gpu_id", "gpu_id_step", "nccl_port", "port", "random_seed")}


def _rank_main(model_dir, out_dir):
    from _sglang_cpu import ensure_sglang_importable

    ensure_sglang_importable()
    from test_trl import WorkerDouble

    class RankWorker(WorkerDouble):
        """WorkerDouble that also keeps the prompt ids of each generate call."""

        def __init__(self, path, refuse=False):
            super().__init__(path, refuse)
            self.inputs = []

        def generate(self, input_ids, sampling_params, n=1, return_logprob=True):
            self.inputs.append([list(p) for p in input_ids])
            return super().generate(input_ids, sampling_params, n, return_logprob)

    rank, out_dir = int(os.environ["RANK"]), Path(out_dir)
    result = {"ok": _ok_scenario(model_dir, out_dir / f"rank{rank}", RankWorker)}
    from accelerate import PartialState

    result["config"] = _rank_config(model_dir, PartialState())
    result["bad"] = _bad_scenario(model_dir, out_dir / f"rank{rank}", RankWorker, rank)
    result["tp"] = _tp_scenario(model_dir, out_dir / f"rank{rank}", RankWorker, rank)
    result["tp_bad"] = _tp_scenario(model_dir, out_dir / f"rank{rank}", RankWorker, rank, refuse=True)
    torch.save(result, out_dir / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown, as tests/conftest.py ends pytest (native extensions crashed there)


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2])


# ----------------------------------------------------------------------------------------------- the test
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(model_dir, out_dir):
    """Both ranks, as ``accelerate launch --num_processes 2`` would start them; their results, rank order.
    A rank still running after DEADLINE_S is killed and the test fails with both logs."""
    port, procs = _free_port(), []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                   LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
        log = open(out_dir / f"rank{rank}.log", "w", encoding="utf-8")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, str(Path(__file__)), str(model_dir), str(out_dir)],
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline, hung = time.monotonic() + DEADLINE_S, []
    for rank, (proc, log) in enumerate(procs):
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung.append(rank)
            proc.kill()
            proc.wait()
        log.close()
    logs = "\n".join(f"--- rank {r}\n{(out_dir / f'rank{r}.log').read_text()[-3000:]}" for r in range(WORLD))
    assert not hung, f"rank(s) {hung} still running after {DEADLINE_S} s\n{logs}"
    assert [p.returncode for p, _ in procs] == [0] * WORLD, logs
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from sgl_rollout.bench.chat_tokenizer import build_chat_model_dir

    root = tmp_path_factory.mktemp("trl-dp")
    model_dir = build_chat_model_dir(root / "model", with_weights=True)
    return model_dir, _launch(model_dir, root)


def _equal(a, b):
    return list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_each_rank_syncs_its_own_replica_after_each_step_and_the_replicas_agree(ranks):
    _, results = ranks
    ok = [r["ok"] for r in results]
    assert [o["process_index"] for o in ok] == [0, 1]
    for o in ok:
        first, second, last = o["synced"]  # before step 1's and step 2's generation, and after training
        assert _equal(second, o["after_step"][0])  # the weights this rank's trainer had after step 1
        assert _equal(last, o["after_step"][1]) and _equal(o["engine_now"], o["after_step"][1])
        assert _equal(o["trainer_now"], o["after_step"][1])
        assert not _equal(first, second)  # step 1 trained
    assert _equal(ok[0]["synced"][0], ok[1]["synced"][0])  # both start from the same weights
    for step in range(2):  # DDP: the replicas are equal after every optimizer step, bit for bit
        assert _equal(ok[0]["after_step"][step], ok[1]["after_step"][step])


def test_each_rank_generates_only_its_share_of_the_prompts(ranks):
    from transformers import AutoTokenizer
    from trl.trainer.utils import RepeatSampler

    model_dir, results = ranks
    ok = [r["ok"] for r in results]
    dataset = ok[0]["dataset"]
    # TRL's sampler (GRPOTrainer._get_train_sampler, default seed 42): each prompt NUM_GENERATIONS times in a
    # row, BATCH * WORLD per generation; accelerate gives rank r the r-th BATCH of each generation batch
    order = [dataset[i] for i in RepeatSampler(dataset, mini_repeat_count=NUM_GENERATIONS,
                                               batch_size=BATCH * WORLD // NUM_GENERATIONS, seed=42)]
    tok = AutoTokenizer.from_pretrained(model_dir)
    for rank, o in enumerate(ok):
        share = [order[(2 * s + rank) * BATCH:(2 * s + rank + 1) * BATCH] for s in range(2)]
        assert o["prompts"] == share
        assert o["inputs"] == [tok(text=p)["input_ids"] for p in share]  # the engine got exactly those
        assert o["scored"] == o["generated"] and len(o["generated"]) == 2 * BATCH  # TRL scored them
    assert set(ok[0]["prompts"][0]) & set(ok[1]["prompts"][0])  # a group spanning both ranks (TRL gathers rewards)


def test_each_ranks_engine_is_pinned_to_its_gpu_with_ports_of_its_own(ranks):
    _, results = ranks
    cfg = [r["config"] for r in results]
    assert [c["base_gpu_id"] for c in cfg] == [0, 1] and all(c["gpu_id_step"] == 1 for c in cfg)
    assert [c["random_seed"] for c in cfg] == [7, 8]  # a shared seed, offset by rank as TRL seeds vLLM
    ports = [{c["nccl_port"], c["port"]} for c in cfg]
    assert all(len(p) == 2 for p in ports) and not ports[0] & ports[1]


def test_a_refused_sync_on_one_rank_fails_both_ranks_clearly_without_a_hang(ranks):
    _, results = ranks
    first, second = (r["bad"] for r in results)
    assert second["error"] == "SyncValidationError" and "up_proj" in second["message"]
    assert second["events"] == []  # rank 1 never generated on weights it does not hold
    assert first["error"] == "RankFailedError" and "\n" not in first["message"]
    assert "rank 1 of 2" in first["message"] and "up_proj" in first["message"]
    assert first["events"] == ["sync", "generate", "sleep"]  # rank 0's engine was put back to sleep


def test_a_tp_engine_shared_by_both_ranks_generates_for_both(ranks):
    """``tensor_model_parallel_size=2`` over 2 processes (TRL's ``vllm_tensor_parallel_size=2``): rank 0 leads,
    its engine syncs from its replica and generates both ranks' prompts in one call per generation, rank 0's
    first; each rank scores its own share; rank 1's engine is never touched."""
    _, results = ranks
    lead, member = (r["tp"] for r in results)
    assert lead["error"] is None and member["error"] is None
    assert lead["leader"] and not member["leader"]
    assert member["events"] == [] and member["inputs"] == []
    assert lead["events"] == ["sync", "generate", "sleep"] * 2
    assert [len(call) for call in lead["inputs"]] == [2 * BATCH] * 2
    for step in range(2):  # each rank got back the completions of its own prompts
        mine = lead["generated"][step * 2 * BATCH:(step + 1) * 2 * BATCH]
        assert lead["scored"][step * BATCH:(step + 1) * BATCH] == mine[:BATCH]
        assert member["scored"][step * BATCH:(step + 1) * BATCH] == mine[BATCH:]


def test_a_failing_tp_leader_stops_its_member_clearly_without_a_hang(ranks):
    _, results = ranks
    lead, member = (r["tp_bad"] for r in results)
    assert lead["error"][0] == "SyncValidationError" and "up_proj" in lead["error"][1]
    assert member["error"][0] == "RankFailedError" and "leader" in member["error"][1]
    assert "up_proj" in member["error"][1] and "\n" not in member["error"][1]
    assert lead["events"] == [] and member["events"] == []
