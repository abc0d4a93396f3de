#!/usr/bin/env bash
# Hybrid + async rollouts on one H200 (issue 33, item 3): the GPU run of recipe
# grpo_qwen05_random_1xh200 (a random Qwen2.5-0.5B-shaped model, 32 prompts × 8 samples, 256 response
# tokens) twice, with algo.async_steps=0 (vLLM sleeps during the update) and algo.async_steps=1 (vLLM
# stays awake and samples step t+1 during step t's update), both with algo.tis_cap=2.0. For each: the
# plan (--plan, its training-phase figure), the run, and the GPU's memory in use every 0.5 s
# (nvidia-smi, every process on it); then bench.async_report compares step times and the plan's
# figure against the measured peak.
#
#   bash scripts/async_gpu.sh            # STEPS (default 10) sets train.steps; EXTRA_ARGS adds overrides
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
model=/tmp/rlhf-gpu/models/qwen2.5-0.5b-random
$PY -m bench.make_model qwen2.5-0.5b "$model" || exit 1
source scripts/lib/plan_and_run.sh
runs=/tmp/rlhf-gpu/runs
mkdir -p "$runs"
rc=0
for k in 0 1; do
  out=$runs/grpo-hybrid-async$k
  # shellcheck disable=SC2086
  args="recipe=grpo_qwen05_random_1xh200 train.steps=${STEPS:-10} algo.tis_cap=2.0 algo.async_steps=$k ${EXTRA_ARGS:-}"
  # shellcheck disable=SC2086
  plan_and_run "$out" $args
done
$PY -m bench.async_report "$runs/grpo-hybrid-async0" "$runs/grpo-hybrid-async1" || rc=1
exit $rc
