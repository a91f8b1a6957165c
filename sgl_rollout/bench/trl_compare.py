"""``python -m sgl_rollout.bench trl``: the same GRPO run under TRL's ``GRPOTrainer``, generating on SGLang
through :class:`sgl_rollout.integrations.trl.SglGRPOTrainer` (side ``ours``) and with TRL's own transformers
generation (side ``transformers``, what TRL users without vLLM get).

Both sides: the demo's model (SmolLM2-135M-Instruct unless ``--model``), the demo's word problems asked
through the chat template (:mod:`sgl_rollout.workloads`) and its reward, the same seed, batch and
completion length; each side in a process of its own, one after the other. Per training step the record
(``<out>/<side>.jsonl``) holds: ``step_s`` (the step, generation included), ``gen_s`` (TRL's ``_generate``:
templating, the engine's wake and sync on side ``ours``, generation, sleep), ``sync_s`` (the weight sync,
measured as TRL's ``VLLMGeneration.sync_weights`` is on side ``vllm``: the weights' memory back, the
weights pushed, the cache emptied; on side ``ours`` the phases ``resume_weights``, ``sync``,
``release_sync_buffers`` and ``empty_cache`` of :meth:`RolloutWorker.update_weights`), ``wake_s`` (side ``ours``: the whole staged wake
with its sync, the KV cache's and CUDA graphs' resume included, which vLLM does inside its generate),
``engine_gen_s`` and ``sleep_s`` (side ``ours``: the engine's generate call and its sleep, the rest of
``gen_s`` being TRL's own), ``sync_gc_s`` (seconds of Python garbage collection in the trainer's process
during side ``ours``' wake or side ``vllm``'s ``sync_weights``: :class:`~.processes.GcClock`), ``wake_phases`` (side
``ours``: the seconds of each phase of the step's last wake,
:attr:`RolloutWorker.last_phase_seconds`, the sync's parts ``sync.*`` included),
``peak_gb`` (torch's peak allocated device memory in the trainer's process during the step, GB = 1e9
bytes; the engine's own memory is in SGLang's processes and not in it) and ``reward`` (TRL's logged
mean). ``comparison.json`` and the printed table give medians over the steps after the first, and ours /
each other side. After its run side ``ours``
checks its engine bit for bit (:func:`greedy_check`, ``<out>/ours.greedy.json``, also in ``comparison.json``
and printed): greedy output after a sync equals Hugging Face's with the trainer's weights.

Side ``vllm`` (issue 48's side (b), ``--sides ours,vllm,transformers``) is TRL's own vLLM colocate mode
(``use_vllm=True, vllm_mode="colocate"``, vLLM's sleep mode on, ``--gpu-memory-utilization`` as vLLM's share):
its ``sync_s`` is TRL's ``VLLMGeneration.sync_weights`` (``empty_cache``, ``wake_up(tags=["weights"])``,
the per-parameter ``load_weights`` push, ``reset_prefix_cache``). It needs vLLM in the environment (TRL 1.16
takes vllm 0.22-0.31); it ran with vLLM 0.26.0 on one H200 in the seventh session of 2026-11-28
(``examples/trl/smollm2-135m-h200/``). vLLM and SGLang pin different kernels (flashinfer, tvm-ffi, ...), so they live
in sites of their own: ``--vllm-pythonpath`` gives side ``vllm``'s process its own ``PYTHONPATH`` (vLLM's site,
TRL's, and this package's root) while the other sides keep the caller's. The other two sides also run on the
CPU (``tests/test_bench_trl.py``, the ``ours`` side on an engine double). ``<out>/comparison.md`` holds the
printed table and the greedy check.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from .processes import GcClock

#: The sides a run can name, in the order they run (``--sides`` picks; the default leaves ``vllm`` out).
SIDES = ("ours", "vllm", "transformers")
DEFAULT_SIDES = ("ours", "transformers")
#: Per-step fields of a side's record, in the table's order; the table adds ``device_peak_gb`` (NVML's peak
#: over the side's run, every process on its GPUs, the engine's included, in GB above what was in use before).
FIELDS = ("step_s", "gen_s", "sync_s", "wake_s", "engine_gen_s", "sleep_s", "sync_gc_s", "peak_gb", "reward")
TABLE_FIELDS = FIELDS + ("device_peak_gb",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``trl`` subcommand's options."""
    p.add_argument("--model", help="Hugging Face model folder (default: the demo's SmolLM2-135M-Instruct)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--sides", default=",".join(DEFAULT_SIDES),
                   help=f"which sides to run, in order, of {','.join(SIDES)} (vllm needs vLLM installed)")
    p.add_argument("--batch", type=int, default=8, help="per-device train batch (completions per step)")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                   help="the engine's share of the GPU (SGLang's on side ours, vLLM's on side vllm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true",
                   help="side ours without CUDA graphs (SGLang's disable_cuda_graph); by default its engine "
                        "captures them, as vLLM's colocate mode does, and releases them while it sleeps")
    p.add_argument("--empty-cache", choices=("auto", "always"), default="auto",
                   help="side ours: the wake's empty-cache step (RolloutConfig.empty_cache): skipped where the "
                        "device has room (auto), or run at every wake (always)")
    p.add_argument("--vllm-pythonpath", default=None,
                   help="PYTHONPATH of side vllm's process (vLLM's own site first; it cannot share SGLang's); "
                        "default: the caller's")
    p.add_argument("--out", default="runs/trl-compare")


def problems_dataset(n: int, seed: int):
    """``n`` of the demo's word problems as a TRL conversational dataset: ``prompt`` (system and user
    messages) and ``answer`` (int), the column the reward reads."""
    import datasets

    from ..workloads import chat_messages, make_problems

    probs = make_problems(seed, n)
    return datasets.Dataset.from_dict({"prompt": [chat_messages(p) for p in probs],
                                       "answer": [int(p.answer) for p in probs]})


def problem_reward(completions, answer, **kwargs) -> List[float]:
    """The demo's reward (:func:`sgl_rollout.workloads.reward`) of each completion (conversational: the
    assistant message's text) against its problem's ``answer``."""
    from ..workloads import reward

    texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
    return [reward(t, int(a)) for t, a in zip(texts, answer)]


#: The phases of :meth:`RolloutWorker.update_weights` (:attr:`Switch.last_phase_seconds`) that make up what
#: TRL's ``VLLMGeneration.sync_weights`` does on vLLM: the weights' memory back, the push, the cache emptied;
#: and the freeing of the fast path's buffers, which vLLM's push has no need of.
SYNC_PHASES = ("resume_weights", "sync", "release_sync_buffers", "empty_cache")


def _timed(trainer, name: str, into: Dict[str, Any], key: str,
           after: Optional[Callable[[Dict[str, Any]], None]] = None, clock: Optional[GcClock] = None) -> None:
    """Wrap ``trainer.<name>`` so that each call adds its seconds to ``into[key]`` (and, with ``clock``, the
    seconds of garbage collection inside it to ``into["sync_gc_s"]``), then calls ``after(into)`` (when
    given) once the call returned or raised."""
    inner = getattr(trainer, name)

    def timed(*args, **kwargs):
        t0, gc0 = time.perf_counter(), clock.seconds if clock is not None else 0.0
        try:
            return inner(*args, **kwargs)
        finally:
            into[key] = into.get(key, 0.0) + time.perf_counter() - t0
            if clock is not None:
                into["sync_gc_s"] = into.get("sync_gc_s", 0.0) + clock.seconds - gc0
            if after is not None:
                after(into)

    setattr(trainer, name, timed)


def side_config(side: str, args: argparse.Namespace, cuda: bool, out_dir: Path) -> dict:
    """``GRPOConfig``'s arguments for ``side``: the same batch, group, completion length, steps and seed on
    every side; side ``vllm`` adds TRL's colocate mode with vLLM's sleep mode and its memory share."""
    cfg = dict(output_dir=str(out_dir / f"{side}-trainer"), per_device_train_batch_size=args.batch,
               num_generations=args.num_generations, max_completion_length=args.max_completion_length,
               max_steps=args.steps, report_to="none", logging_steps=1, save_strategy="no", seed=args.seed,
               use_cpu=not cuda, bf16=cuda, gradient_checkpointing=False, beta=0.0)
    if side == "vllm":
        cfg.update(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True,
                   vllm_gpu_memory_utilization=args.gpu_memory_utilization)
    return cfg


def ours_rollout_config(args: argparse.Namespace, model_dir: str):
    """Side ``ours``' :class:`~sgl_rollout.config.RolloutConfig`: the engine's share of the GPU, CUDA graphs
    unless ``--enforce-eager``, the wake's ``--empty-cache`` step, and the engine flags ``bench verl`` and the
    GPU tests pass (triton attention, pytorch sampling: what this project's GPU host runs, shared/gpu-overlay)."""
    from ..config import RolloutConfig
    from ..workloads import gpu_engine_flags

    return RolloutConfig(model_path=model_dir, gpu_memory_utilization=args.gpu_memory_utilization,
                         enforce_eager=bool(args.enforce_eager), empty_cache=getattr(args, "empty_cache", "auto"),
                         engine_kwargs=gpu_engine_flags())


def run_side(side: str, args: argparse.Namespace, model_dir: str, out_dir: Path,
             worker_factory: Optional[Callable[[str], object]] = None) -> List[dict]:
    """Train ``args.steps`` steps on ``side`` in this process; returns (and writes ``<out>/<side>.jsonl``)
    one record per step (the module docstring's fields).

    Args:
        worker_factory: side ``ours``: ``(model_dir) -> worker`` instead of a
            :class:`~sgl_rollout.worker.RolloutWorker` on this process's GPU (tests: an engine double).

    Raises:
        ValueError: an unknown side.
    """
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if side not in SIDES:
        raise ValueError(f"unknown side {side!r}; one of {SIDES}")
    cuda = torch.cuda.is_available()
    cfg = GRPOConfig(**side_config(side, args, cuda, out_dir))
    data = problems_dataset(max(64, args.steps * args.batch), args.seed)
    common = dict(model=model_dir, reward_funcs=problem_reward, args=cfg, train_dataset=data)
    if side == "ours":
        from ..integrations.trl import SglGRPOTrainer

        worker = worker_factory(model_dir) if worker_factory else None
        trainer = SglGRPOTrainer(rollout=worker or ours_rollout_config(args, model_dir), **common)
    else:
        trainer = GRPOTrainer(**common)
    now: Dict[str, Any] = {}
    rows: List[dict] = []
    clock = GcClock()
    _timed(trainer, "_generate", now, "gen_s")
    if side == "ours":
        worker = trainer.sgl.worker

        def sync_part(into: Dict[str, Any]) -> None:
            phases = worker.last_phase_seconds
            into["sync_s"] = into.get("sync_s", 0.0) + sum(phases.get(k, 0.0) for k in SYNC_PHASES)
            into["wake_phases"] = {k: round(v, 6) for k, v in phases.items()}  # the step's last wake, by phase

        _timed(worker, "update_weights", now, "wake_s", after=sync_part, clock=clock)
        _timed(worker, "generate", now, "engine_gen_s")
        _timed(worker, "sleep", now, "sleep_s")
    elif side == "vllm":
        _timed(trainer.vllm_generation, "sync_weights", now, "sync_s", clock=clock)

    class Record(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            now.clear()
            now["t0"] = time.perf_counter()
            if cuda:
                torch.cuda.reset_peak_memory_stats()

        def on_log(self, _args, state, _control, logs=None, **_k):
            if logs and "reward" in logs and rows and rows[-1]["step"] == state.global_step:
                rows[-1]["reward"] = float(logs["reward"])

        def on_step_end(self, _args, state, *_a, **_k):
            rows.append({"step": state.global_step, "step_s": time.perf_counter() - now.get("t0", 0.0),
                         "gen_s": now.get("gen_s", 0.0), "sync_s": now.get("sync_s"), "wake_s": now.get("wake_s"),
                         "engine_gen_s": now.get("engine_gen_s"), "sleep_s": now.get("sleep_s"),
                         "sync_gc_s": now.get("sync_gc_s"),
                         "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None, "reward": None,
                         "wake_phases": now.get("wake_phases")})

    trainer.add_callback(Record())
    with clock:
        trainer.train()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{side}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if side == "ours":
        check = greedy_check(trainer, data["prompt"][:GREEDY_PROMPTS], min(GREEDY_TOKENS, args.max_completion_length))
        (out_dir / f"{side}.greedy.json").write_text(json.dumps(check) + "\n")
    return rows


#: Prompts and new tokens (at most the run's completion length) of :func:`greedy_check`.
GREEDY_PROMPTS, GREEDY_TOKENS = 8, 16


def _hf_greedy(model, prompt: List[int], n: int) -> Tuple[List[int], List[float]]:
    """``model``'s greedy continuation of ``prompt`` (``n`` ids, EOS not special) and, per step, the float32
    logits of all tokens (to measure how far another continuation's tokens are from the argmax)."""
    import torch

    ids, rows = torch.tensor([prompt], device=model.device), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids).logits[0, -1].float()
            rows.append(logits)
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist(), rows


def greedy_check(trainer, messages, n_tokens: int) -> dict:
    """Bit-level sanity of side ``ours`` after its run (issue 48): a sync of the trainer's last weights, then
    the engine's greedy continuation of each of ``messages`` (chat prompts, the run's own) against Hugging
    Face's greedy with those weights in the engine's dtype (bf16 on a GPU; the model's own on the CPU), token
    for token. Where they differ, ``max_gap`` is the largest distance (float32 logit units) between Hugging
    Face's top logit and the logit of the engine's token at the first differing position: bf16 near-ties
    are a few tenths at most, a wrong weight is far more. Returns ``{"prompts", "tokens", "equal",
    "max_gap"}`` (gap 0.0 when all are equal); the engine is put back to sleep."""
    import copy

    import torch

    tok = trainer.processing_class
    prompts = []
    for m in messages:
        prompts.append(list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]))
    model = trainer.accelerator.unwrap_model(trainer.model)
    if model.device.type == "cuda":
        model = copy.deepcopy(model).to(torch.bfloat16)  # the engine's dtype
    trainer.sgl.awake = False  # a sync of the trainer's last weights whatever the engine holds
    trainer.sgl.wake(trainer.state.global_step, trainer._trainer_weights)
    gens = trainer.sgl.worker.generate(prompts, {"temperature": 0.0, "max_new_tokens": n_tokens, "ignore_eos": True},
                                       n=1)
    trainer.sgl.sleep(raise_errors=True)
    equal, gap = 0, 0.0
    for prompt, gen in zip(prompts, gens):
        got = list(gen[0].output_ids)
        ref, logits = _hf_greedy(model, prompt, n_tokens)
        if got == ref:
            equal += 1
            continue
        at = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
        gap = max(gap, float(logits[at].max() - logits[at][got[at]]))
    return {"prompts": len(prompts), "tokens": n_tokens, "equal": equal, "max_gap": gap}


def summarize(rows_by_side: Dict[str, List[dict]]) -> Dict[str, Dict[str, Optional[float]]]:
    """Median of each field over the steps after the first, per side (None where never recorded)."""
    out = {}
    for side, rows in rows_by_side.items():
        later = rows[1:] or rows
        out[side] = {f: (statistics.median(v) if (v := [r[f] for r in later if r.get(f) is not None]) else None)
                     for f in FIELDS}
    return out


def table(summary: Dict[str, Dict[str, Optional[float]]]) -> List[str]:
    """The printed comparison: one row per field, a column per side, then ours / each other side run
    (``ours / vllm`` when side ``vllm`` ran, ``ours / transformers``)."""
    sides = [s for s in SIDES if s in summary]
    others = [s for s in sides if s != "ours"]
    lines = ["| per step (median after the first) | " + " | ".join(sides + [f"ours / {o}" for o in others]) + " |",
             "| --- | " + " | ".join("---:" for _ in sides + others) + " |"]
    for f in [f for f in TABLE_FIELDS if any(f in summary[s] for s in sides)]:
        cells = ["n/a" if (v := summary[s].get(f)) is None else f"{v:.3f}" for s in sides]
        ours = summary.get("ours", {}).get(f)
        for o in others:
            theirs = summary[o].get(f)
            cells.append(f"{ours / theirs:.2f}x" if ours is not None and theirs else "n/a")
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    return lines


def child(side: str, args_json: str, model_dir: str, out_dir: str) -> None:
    """Entry of a side's process (:func:`main` starts it)."""
    run_side(side, argparse.Namespace(**json.loads(args_json)), model_dir, Path(out_dir))


def side_env(side: str, args: argparse.Namespace) -> Dict[str, str]:
    """The environment of ``side``'s process: the caller's, with ``PYTHONPATH`` replaced by
    ``--vllm-pythonpath`` on side ``vllm`` when given."""
    env = dict(os.environ)
    if side == "vllm" and args.vllm_pythonpath:
        env["PYTHONPATH"] = args.vllm_pythonpath
    return env


def main(args: argparse.Namespace) -> int:
    """Run each side in a process of its own, then print and write ``comparison.json``; exit 1 when a side
    failed (its log is ``<out>/<side>.log``)."""
    from ..workloads import resolve_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = str(resolve_model(args.model, None))
    from .verl_compare import NvmlSampler, argv_tail

    rows, failed, nvml = {}, [], {}
    for side in [s for s in args.sides.split(",") if s]:
        code = ("import sys; from sgl_rollout.bench.trl_compare import child; "
                "child(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4])")
        sampler = NvmlSampler().start()  # the device's memory, the engine's processes included
        with open(out / f"{side}.log", "w", encoding="utf-8") as log:
            rc = subprocess.run([sys.executable, "-c", code, side, json.dumps(vars(args)), model_dir, str(out)],
                                stdout=log, stderr=subprocess.STDOUT, env=side_env(side, args)).returncode
        nvml[side] = sampler.stop()
        path = out / f"{side}.jsonl"
        if rc != 0 or not path.is_file():
            failed.append(side)
            continue
        rows[side] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    summary = summarize(rows)
    for side in summary:  # NVML's peak over the side's whole run, above what was in use before it
        used, base = nvml[side]["peak_used_bytes"], nvml[side]["baseline_bytes"]
        summary[side]["device_peak_gb"] = max((used[g] - base.get(g, 0)) / 1e9 for g in used) if used else None
    greedy_file = out / "ours.greedy.json"
    greedy = json.loads(greedy_file.read_text()) if "ours" in rows and greedy_file.is_file() else None
    (out / "comparison.json").write_text(json.dumps({"args": vars(args), "model": model_dir, "summary": summary,
                                                     "greedy": greedy, "failed": failed}, indent=1) + "\n")
    lines = table(summary) if summary else ["no side finished"]
    if greedy:
        lines += ["", f"greedy after the last sync (ours): {greedy['equal']} of {greedy['prompts']} prompts equal to "
                      f"Hugging Face's with the trainer's weights, {greedy['tokens']} tokens each (largest gap where "
                      f"not: {greedy['max_gap']:.3f} logit units)"]
    print("\n".join(lines))
    command = " ".join(["python -m sgl_rollout.bench trl", *(shlex.quote(a) for a in argv_tail(sys.argv, "trl"))])
    (out / "comparison.md").write_text(f"# bench trl\n\n- command: `{command}`\n- model: `{model_dir}`\n\n"
                                       + "\n".join(lines) + "\n")
    for side in failed:
        print(f"bench trl: side {side} failed (log {out / (side + '.log')})")
    return 1 if failed else 0
