#!/usr/bin/env bash
# GRPO end-to-end on the device through the framework's own entry point (rlhf.cli -> rlhf.run ->
# rlhf.loops.rl), with recipe grpo_qwen05_random_1xh200 (a random Qwen2.5-0.5B-shaped model, a
# Python reward function), then a per-step table of phase times, weight sync, memory and the
# rollout-vs-trainer logprob mismatch from the run's metrics.jsonl.
#
#   bash scripts/grpo_gpu.sh hybrid          # 1 GPU, hybrid placement (the acceptance run)
#   bash scripts/grpo_gpu.sh disaggregated   # 2 GPUs: actor on GPU 0, vLLM on GPU 1, NCCL sync
#   bash scripts/grpo_gpu.sh hybrid2         # 2 GPUs, hybrid: actor DP 2, a vLLM engine per GPU
# STEPS (default 8) sets train.steps; EXTRA_ARGS adds overrides.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-hybrid}
PY=${PY:-python3}
model=/tmp/rlhf-gpu/models/qwen2.5-0.5b-random
$PY -m bench.make_model qwen2.5-0.5b "$model" || exit 1
case $mode in
  hybrid) args="" ;;
  disaggregated) args="hardware=2xh200 placement=disaggregated algo.kl.coef=0" ;;
  hybrid2) args="hardware=2xh200 algo.kl.coef=0" ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
out=/tmp/rlhf-gpu/runs/grpo-$mode
rm -rf "$out"
# shellcheck disable=SC2086
$PY -m rlhf.cli recipe=grpo_qwen05_random_1xh200 $args train.steps=${STEPS:-8} tracking.console=plain \
  output_dir="$out" ${EXTRA_ARGS:-}
rc=$?
$PY -m bench.grpo_report "$out/metrics.jsonl" "$mode" || true
exit $rc
