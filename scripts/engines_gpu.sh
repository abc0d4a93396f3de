#!/usr/bin/env bash
# One vLLM engine per GPU against two (placement.rollout.engines_per_device, BENCHMARKS.md §10): the
# GPU run of recipe grpo_qwen05_random_1xh200 (hybrid on one H200, 32 prompts × 8 samples, 256
# response tokens) twice, engines_per_device=1 then 2, on a random model of PRESET's shape
# (qwen2.5-0.5b, or qwen2.5-1.5b: model.path's config.json gives the plan its shape). For each: the
# plan (--plan), the run, the GPU's memory in use every 0.5 s; then bench.engines_report compares
# time/generate (median over steps 2..) and the engine-vs-trainer mismatch (mismatch/logp_abs_mean)
# of each run with the first's.
#
#   bash scripts/engines_gpu.sh [PRESET]     # STEPS (default 6) sets train.steps; EXTRA_ARGS adds overrides;
#                                            # RUNS_DIR (default /tmp/rlhf-gpu/runs) holds the run dirs
#   VARIANTS="1n 2n 2" bash scripts/engines_gpu.sh   # runs in this order; N engines per GPU, "n": the
#                                                    # logprobs nested as before flat_logprobs (bench.vllm_nested)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
preset=${1:-qwen2.5-0.5b}
model=/tmp/rlhf-gpu/models/$preset-random
$PY -m bench.make_model "$preset" "$model" || exit 1
source scripts/lib/plan_and_run.sh
runs=${RUNS_DIR:-/tmp/rlhf-gpu/runs}
mkdir -p "$runs"
rc=0
dirs=()
for v in ${VARIANTS:-1 2}; do
  n=${v%n}
  out=$runs/engines-$preset-e$v
  args="recipe=grpo_qwen05_random_1xh200 model.path=$model train.steps=${STEPS:-6} placement.rollout.engines_per_device=$n ${EXTRA_ARGS:-}"
  [ "$v" != "$n" ] && args="$args rollout.engine=vllm_nested rollout.plugins=[bench.vllm_nested]"
  # shellcheck disable=SC2086
  plan_and_run "$out" $args
  dirs+=("$out")
done
$PY -m bench.engines_report "${dirs[@]}" || rc=1
exit $rc
