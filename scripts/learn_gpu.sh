#!/usr/bin/env bash
# Learning from scratch on one H200 with the GPU path (issue: learning everywhere):
#   1. SFT of a Qwen2.5-0.5B-shaped random model on the built-in task's demonstrations;
#   2. GRPO and 3. PPO from the SFT model, vLLM rollouts, hybrid placement, held-out greedy
#      evaluation before the first step (the SFT model: eval_before/...) and every 10 steps;
# then bench.learn_report compares the held-out rewards (margin stated before the run: 0.10).
#   bash scripts/learn_gpu.sh            # RLHF_LEARN_DIR (default /tmp/rlhf-gpu/learn) holds the runs
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export RLHF_LEARN_DIR=${RLHF_LEARN_DIR:-/tmp/rlhf-gpu/learn}
rm -rf "$RLHF_LEARN_DIR"
common="tracking.console=plain"
$PY -m rlhf.cli recipe=learn_sft_1xh200 $common || exit 1
$PY -m rlhf.cli recipe=learn_grpo_1xh200 $common; g=$?
$PY -m rlhf.cli recipe=learn_ppo_1xh200 $common; p=$?
$PY -m bench.learn_report "$RLHF_LEARN_DIR" --margin 0.10 | tee "${OUT:-$RLHF_LEARN_DIR}/learn_report.txt"
r=${PIPESTATUS[0]}  # the report's verdict (margin missed: non-zero), not tee's
for run in sft grpo ppo; do
  [ -f "$RLHF_LEARN_DIR/$run/metrics.jsonl" ] && cp "$RLHF_LEARN_DIR/$run/metrics.jsonl" "${OUT:-$RLHF_LEARN_DIR}/learn_${run}_metrics.jsonl"
done
exit $(( g || p || r ))
