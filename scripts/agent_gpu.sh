#!/usr/bin/env bash
# Agentic RL on one H200 (issue 37), in one device call: a Qwen2.5-0.5B-shaped random model with
# the tiny chat tokenizer, vLLM rollouts through the agent loop, hybrid placement.
#
#   1. sft      recipe=agent_sft_qwen05_1xh200: SFT on tool-call demonstrations (and answers
#               from memory when no tool is offered)
#   2. lookup   recipe=agent_lookup_qwen05_1xh200: GRPO with the lookup tool, held-out sampled
#               reward before the first step vs after the last (margin stated before running: +0.10)
#   3. notools  the same GRPO, a few steps, on the same prompts offering no tool
#               (builtin:agent-recall: one turn, answered from memory; same reward, same model,
#               same batch): the step time without the tool turn
#   4. slow     the same GRPO, a few steps, with the lookup tool replaced by bench.agent_tools:lookup
#               (the same answers; 1 call in RLHF_SLOW_TOOL_EVERY=64 first waits RLHF_SLOW_TOOL_S=2 s)
#   then bench.agent_report: held-out rewards, s/step of each (median of steps 2..6), the agent
#   metrics, $OUT/agent_summary.json.
#
#   source .gpu/tools/env.sh && bash scripts/agent_gpu.sh         # on the device; results in $OUT
#   AGENT_GPU_CPU=1 bash scripts/agent_gpu.sh                     # the same logic on CPU, tiny and short
#
# BUDGET_S (default 540): a stage that would start with less than its estimate left is skipped
# (said so in the log and the summary), each runs under `timeout` of what is left; the timings
# are printed as it goes. Exit status: non-zero if a stage failed or the margin was missed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
CPU=${AGENT_GPU_CPU:-0}
OUT=${OUT:-/tmp/rlhf-gpu/agent-out}
export RLHF_AGENT_GPU_DIR=${RLHF_AGENT_GPU_DIR:-/tmp/rlhf-gpu/agent}
BUDGET_S=${BUDGET_S:-540}
START=$(date +%s)
mkdir -p "$OUT"
rm -rf "$RLHF_AGENT_GPU_DIR"

export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export RLHF_SLOW_TOOL_EVERY=${RLHF_SLOW_TOOL_EVERY:-64} RLHF_SLOW_TOOL_S=${RLHF_SLOW_TOOL_S:-2}
common=(tracking=none tracking.console=plain)
if [ "$CPU" = 1 ]; then
  # the tiny chat model's shapes and learning rates on CPU (recipes/agent_*_tiny.yaml), a few steps of a
  # few prompts: checks the stages, the tools (the SFT model calls them) and the report, not the margin
  shape=(hardware=cpu model.n_layers=2 model.hidden=128 model.intermediate=256 model.n_heads=4 model.dtype=float32)
  sft=("${shape[@]}" algo.lr=3e-3 train.micro_batch_size=16)
  rl=("${shape[@]}" train.prompts_per_step=8 algo.group_size=4 train.micro_batch_size=32 algo.lr=3e-4)
  lookup=(train.steps=3 eval.every=3 eval.max_prompts=8 eval.n_samples=2)
  short=(train.steps=3)
  export RLHF_SLOW_TOOL_EVERY=4 RLHF_SLOW_TOOL_S=1
  est=(120 60 40 40)
else
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 RAY_ADDRESS=local
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
  # vLLM: CUDA graphs for batch sizes up to 256 only (a faster start; as scripts/gpu.sh)
  export RLHF_VLLM_ARGS=${RLHF_VLLM_ARGS:-'{"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256]}}'}
  sft=() rl=() lookup=()
  short=(train.steps=6)
  est=(110 160 80 90)   # seconds: each start ~50-110 s (vLLM's first compile is the longest), then the steps
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/  /'
fi

elapsed() { echo $(( $(date +%s) - START )); }
kill_tag() {  # what a stage left running (a run ended by timeout: its Ray cluster, vLLM's engine core)
  local p
  for p in /proc/[0-9]*; do
    if grep -qz "^AGENT_GPU_TAG=$1\$" "$p/environ" 2>/dev/null; then kill -9 "${p#/proc/}" 2>/dev/null; fi
  done
}
declare -A RC
run_stage() {  # name estimate_s overrides...: runs rlhf.cli unless the budget is too short
  local name=$1 need=$2; shift 2
  local left=$(( BUDGET_S - $(elapsed) ))
  if (( left < need )); then
    echo "agent_gpu: [$(elapsed) s] SKIP $name: $left s left of $BUDGET_S, it needs ~$need s"
    RC[$name]=skipped; return
  fi
  echo "agent_gpu: [$(elapsed) s] $name: $*"
  local t0 tag="agent$RANDOM$RANDOM"; t0=$(date +%s)
  AGENT_GPU_TAG=$tag timeout --signal=TERM --kill-after=15 "$left" $PY -m rlhf.cli "$@" "${common[@]}" \
    >"$OUT/agent_$name.log" 2>&1
  RC[$name]=$?
  kill_tag "$tag"
  grep -E "^(step [0-9]+/[0-9]+ ·|eval|sft:|cluster up|saved|done in)|[Ee]rror|Traceback" "$OUT/agent_$name.log" | tail -n 36 \
    | sed "s/^/  [$name] /"
  if [ -f "$RLHF_AGENT_GPU_DIR/$name/metrics.jsonl" ]; then
    cp "$RLHF_AGENT_GPU_DIR/$name/metrics.jsonl" "$OUT/agent_${name}_metrics.jsonl"
    $PY -m bench.agent_report "$RLHF_AGENT_GPU_DIR/$name" --brief | sed "s/^/agent_gpu: /"
  fi
  echo "agent_gpu: [$(elapsed) s] $name: exit ${RC[$name]} after $(( $(date +%s) - t0 )) s"
}

echo "agent_gpu: budget $BUDGET_S s, runs under $RLHF_AGENT_GPU_DIR, results in $OUT, cpu=$CPU, $(date -u +%FT%TZ)"
run_stage sft "${est[0]}" recipe=agent_sft_qwen05_1xh200 "${sft[@]}"
if [ "${RC[sft]}" = 0 ]; then
  run_stage lookup "${est[1]}" recipe=agent_lookup_qwen05_1xh200 "${rl[@]}" "${lookup[@]}"
  run_stage notools "${est[2]}" recipe=agent_lookup_qwen05_1xh200 "${rl[@]}" "${short[@]}" \
    'data.train_files=[builtin:agent-recall/train]' 'data.eval_files=[]' eval.every=0 eval.before_training=false \
    output_dir="$RLHF_AGENT_GPU_DIR/notools"
  run_stage slow "${est[3]}" recipe=agent_lookup_qwen05_1xh200 "${rl[@]}" "${short[@]}" \
    'agent.tools=["bench.agent_tools:lookup"]' 'data.eval_files=[]' eval.every=0 eval.before_training=false \
    output_dir="$RLHF_AGENT_GPU_DIR/slow"
else
  for s in lookup notools slow; do RC[$s]=skipped; done
fi

stages=$(for s in sft lookup notools slow; do printf '%s=%s ' "$s" "${RC[$s]}"; done)
$PY -m bench.agent_report "$RLHF_AGENT_GPU_DIR" --margin 0.10 --stages "$stages" --budget "$BUDGET_S" \
  --elapsed "$(elapsed)" --json "$OUT/agent_summary.json" | tee "$OUT/agent_report.txt"
r=${PIPESTATUS[0]}
echo "agent_gpu: [$(elapsed) s] done: $stages report=$r"
bad=0
for s in sft lookup notools slow; do [ "${RC[$s]}" = 0 ] || bad=1; done
exit $(( bad || r ))
