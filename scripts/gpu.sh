#!/usr/bin/env bash
# The GPU suite and benchmarks, on the device machine (docs/gpu.md says how to get there).
#
#   bash scripts/gpu.sh                 # every job
#   bash scripts/gpu.sh tests-hybrid bench-sync-ipc     # some jobs
#   BUDGET_S=540 bash scripts/gpu.sh    # stop starting jobs that would end after 540 s
#
# Needs the bundle installed (.gpu/tools/install.sh puts vLLM, DeepSpeed, Ray, ... in /tmp/site).
# Jobs run independently: each under its own timeout, each failure recorded and the next job run.
# With two GPUs, lane 0 (GPU 0) and lane 1 (GPU 1) run side by side, then the jobs that need both.
# With one GPU every job runs on GPU 0, in priority order. Every job starts its own Ray cluster
# (RAY_ADDRESS=local); what a job leaves running is ended by its tag when it returns.
#
# gen-levers, gen-levers-15b (BENCHMARKS.md §10): the generation phase's levers, one table per call (~9 min each).
# engines, engines-15b (BENCHMARKS.md §10): the GRPO recipe at engines_per_device=1 then 2, one call each (~8 min).
# engines-flat (BENCHMARKS.md §10): the same at 512 response tokens, three runs: one engine and two with the
#   logprobs nested as before (bench.vllm_nested), then two with the flat logprobs (the default since).
# engines-512: issue 33's generation line itself, in a shorter call than engines-flat: one engine with the log-probs
#   nested (the code when the issue was filed) against the defaults (two engines, flat log-probs), 512 tokens.
# engines-length: one engine against two at 256 then 512 response tokens on one machine (their gain fell from
#   1.41x to 1.04x between two sessions' calls: the length, or the machine?).
# mfu-probe (BENCHMARKS.md §12): the actor update's MFU at 0.5B, variant by variant, in < 390 s (its own budget).
# mfu-loop, mfu-loop-compiled (BENCHMARKS.md §12): §4's GRPO loop, our side alone, with the defaults the probe
#   decided (ZeRO-1 at one rank, the token budget the plan picks), then with model.compile_layers=true;
#   perf/mfu and perf/fwd_bwd_mfu per step in the table (MFU_LOOP_ARGS="--preset qwen2.5-1.5b" for 1.5B).
# bench-e2e-trl (BENCHMARKS.md §4) needs TRL in the bundle: EXTRA="trl==1.16.0" bash ../shared/gpu/build-bundle.sh.
#
# Results ($OUT, else /tmp/rlhf-gpu/out): log (this script's output), lane0.log, lane1.log,
# both.log (the jobs' output), results.jsonl (every figure measured, one JSON per line),
# bench.json (the benchmark tables), summary.txt (jobs, exit codes, seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-/tmp/rlhf-gpu/out}
WORK=/tmp/rlhf-gpu
mkdir -p "$OUT" "$WORK/results"
START=$(date +%s)
BUDGET_S=${BUDGET_S:-560}
# a device call ends at 600 s and returns only what is under $OUT by then: leave room to copy it
if (( BUDGET_S > ${CALL_LIMIT_S:-600} - 30 )); then
  echo "gpu.sh: BUDGET_S=$BUDGET_S is past the call's ${CALL_LIMIT_S:-600} s less 30; using $(( ${CALL_LIMIT_S:-600} - 30 ))"
  BUDGET_S=$(( ${CALL_LIMIT_S:-600} - 30 ))
fi
DEADLINE=$(( START + BUDGET_S ))

export PYTHONPATH=/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH
export TORCH_CUDA_ARCH_LIST=9.0            # DeepSpeed's op builder cannot parse the image's "9.0a"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RAY_ADDRESS=local RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
export RLHF_GPU_OUT=$WORK/results
# vLLM in the framework's runs: capture CUDA graphs for batch sizes up to 256 only (faster start)
export RLHF_VLLM_ARGS=${RLHF_VLLM_ARGS:-'{"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256]}}'}
PY=python3

NGPU=${GPU_SH_NGPU:-$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)}
echo "gpu.sh: $NGPU GPU(s), budget $(( DEADLINE - START )) s, $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/  /'

PYTEST="$PY -m pytest -c scripts/pytest-gpu.ini --rootdir=. -m gpu -v -rA --durations=0 -p no:randomly"

# name | lane (0, 1 or both) | timeout s | command      (in priority order within a lane)
JOBS=$(cat <<'T'
tests-kernels|0|240|$PYTEST tests/gpu/test_packed_kernels.py
tests-optimizer|0|150|$PYTEST tests/gpu/test_optimizer_step.py
update-speed|0|300|$PY -m bench.update_speed
mfu-probe|0|405|$PY -m bench.mfu_probe ${MFU_PROBE_ARGS:-}
mfu-loop|0|420|$PY -m bench.e2e_trl --sides ours --side-reserve-s 0 --warmup 2 --steps 4 --ours-tokens 0 ${MFU_LOOP_ARGS:-}
mfu-loop-compiled|0|480|$PY -m bench.e2e_trl --sides ours --side-reserve-s 0 --warmup 2 --steps 4 --ours-tokens 0 --ours-extra model.compile_layers=true ${MFU_LOOP_ARGS:-}
grpo|0|360|bash scripts/grpo_gpu.sh hybrid
bench-mfu|0|300|$PY -m bench.train_mfu --preset qwen2.5-1.5b --samples 64
tests-hybrid|0|300|$PYTEST tests/gpu/test_vllm_hybrid.py
grpo-async|0|540|bash scripts/async_gpu.sh
bench-e2e-trl|0|560|$PY -m bench.e2e_trl ${E2E_ARGS:-}
matrix|0|580|$PY -m bench.matrix
learn|0|580|bash scripts/learn_gpu.sh
bench-sync-ipc|1|300|$PY -m bench.sync --mode ipc --presets qwen2.5-0.5b,qwen2.5-1.5b --buckets 128,512,1024
bench-rollout-05b|1|330|$PY -m bench.rollout --preset qwen2.5-0.5b --prompts 512 --prompt-len 128 --gen-len 512
bench-rollout-15b|1|300|$PY -m bench.rollout --preset qwen2.5-1.5b --prompts 512 --prompt-len 128 --gen-len 512 --variants framework
mismatch|1|480|$PY -m bench.mismatch
gen-levers|1|560|$PY -m bench.gen_levers --preset qwen2.5-0.5b ${GEN_LEVERS_ARGS:-}
gen-levers-15b|1|560|$PY -m bench.gen_levers --preset qwen2.5-1.5b ${GEN_LEVERS_ARGS:-}
engines|1|570|bash scripts/engines_gpu.sh qwen2.5-0.5b
engines-15b|1|570|bash scripts/engines_gpu.sh qwen2.5-1.5b
engines-flat|1|570|VARIANTS="1n 2n 2" EXTRA_ARGS="rollout.max_response_tokens=512" bash scripts/engines_gpu.sh qwen2.5-0.5b
engines-512|1|420|VARIANTS="1n 2" STEPS=5 EXTRA_ARGS="rollout.max_response_tokens=512" bash scripts/engines_gpu.sh qwen2.5-0.5b
engines-length|1|570|STEPS=5 bash scripts/engines_gpu.sh qwen2.5-0.5b; a=$?; STEPS=5 EXTRA_ARGS="rollout.max_response_tokens=512" bash scripts/engines_gpu.sh qwen2.5-0.5b && exit $a
tests-nccl|both|240|$PYTEST tests/gpu/test_vllm_nccl.py
grpo-disagg|both|330|bash scripts/grpo_gpu.sh disaggregated
grpo-hybrid2|both|330|bash scripts/grpo_gpu.sh hybrid2
bench-sync-nccl|both|240|$PY -m bench.sync --mode nccl --presets qwen2.5-1.5b --buckets 256,1024
T
)
[ -n "${GPU_SH_JOBS:-}" ] && JOBS=$(cat "$GPU_SH_JOBS")   # a dry run's stand-in table

WANT=" $* "
want() { [ "$WANT" = "  " ] || [[ "$WANT" == *" $1 "* ]]; }

kill_tag() {  # end every process this job started (they all carry its tag in their environment)
  local tag=$1 p
  for p in /proc/[0-9]*; do
    if grep -qz "^RLHF_JOB_TAG=$tag\$" "$p/environ" 2>/dev/null; then kill -9 "${p#/proc/}" 2>/dev/null; fi
  done
}

run_job() {  # name timeout gpus command
  local name=$1 t=$2 gpus=$3 cmd=$4
  if [ -f "$WORK/done/$name" ] && [ -z "${FORCE:-}" ]; then
    echo "=== JOB $name already passed on this machine (FORCE=1 reruns it)"; return
  fi
  local left=$(( DEADLINE - $(date +%s) ))
  if (( left < 45 )); then
    echo "=== JOB $name SKIPPED: ${left}s left"; echo "$name skipped (no time)" >> "$WORK/summary.txt"; return
  fi
  (( t > left )) && t=$left
  local tag="rj$RANDOM$RANDOM" t0=$(date +%s)
  echo "=== JOB $name start $(date +%T) timeout ${t}s GPUs $gpus"
  CUDA_VISIBLE_DEVICES=$gpus RLHF_JOB_TAG=$tag RAY_TMPDIR=/tmp/$tag PYTEST="$PYTEST" PY=$PY JOB_TIMEOUT_S=$t \
    timeout -k 10 "$t" bash -c "$cmd"
  local rc=$?
  kill_tag "$tag"; rm -rf "/tmp/$tag"
  local dt=$(( $(date +%s) - t0 ))
  echo "=== JOB $name rc=$rc ${dt}s $( ((rc == 124)) && echo TIMEOUT)"
  echo "$name rc=$rc ${dt}s" >> "$WORK/summary.txt"
  if [ "$rc" = 0 ]; then mkdir -p "$WORK/done"; touch "$WORK/done/$name"; fi
}

run_lane() {  # lane gpus
  local lane=$1 gpus=$2 name ln t cmd
  while IFS='|' read -r name ln t cmd; do
    [ -z "$name" ] && continue
    want "$name" || continue
    if [ "$NGPU" -ge 2 ]; then [ "$ln" = "$lane" ] || continue
    else [ "$ln" = both ] && continue; fi
    cmd=${cmd//\$PYTEST/$PYTEST}; cmd=${cmd//\$PY/$PY}
    run_job "$name" "$t" "$gpus" "$cmd"
  done <<< "$JOBS"
}

: > "$WORK/summary.txt"   # this call's jobs (results.jsonl keeps every call's figures)
if [ "$NGPU" -ge 2 ]; then
  run_lane 0 0 > "$OUT/lane0.log" 2>&1 &
  p0=$!
  run_lane 1 1 > "$OUT/lane1.log" 2>&1 &
  p1=$!
  wait $p0 $p1
  run_lane both 0,1 > "$OUT/both.log" 2>&1
elif [ "$NGPU" -eq 1 ]; then
  run_lane 0 0 > "$OUT/lane0.log" 2>&1
  echo "one GPU: the jobs that need two (tests-nccl, grpo-disagg, grpo-hybrid2, bench-sync-nccl) not run" | tee -a "$WORK/summary.txt"
else
  echo "no GPU visible: nothing run" | tee -a "$WORK/summary.txt"
fi

# collect: results, benchmark tables, the tail of each job's table
cp "$WORK/results/results.jsonl" "$OUT/results.jsonl" 2>/dev/null
$PY - "$WORK/results" "$OUT/bench.json" <<'PYEOF'
import json, sys, pathlib
d = pathlib.Path(sys.argv[1]); out = {}
for f in sorted(d.glob("bench_*.json")):
    out[f.stem] = json.loads(f.read_text())
pathlib.Path(sys.argv[2]).write_text(json.dumps(out, indent=1, default=str))
PYEOF
{ echo "jobs:"; cat "$WORK/summary.txt"; } > "$OUT/summary.txt"
echo; cat "$OUT/summary.txt"
echo; echo "tables:"
for f in "$OUT"/lane0.log "$OUT"/lane1.log "$OUT"/both.log; do
  [ -f "$f" ] && grep -E -A12 "^(rollout,|weight sync,|actor update,|log-prob mismatch,)" "$f" | grep -v "^--$"
done
grep -h -A26 "^e2e GRPO step" "$OUT"/lane0.log 2>/dev/null
grep -h -A26 "^generation levers," "$OUT"/lane0.log "$OUT"/lane1.log 2>/dev/null
grep -h "^RESULT" "$OUT"/*.log 2>/dev/null | grep -E '"name": "(greedy_|ipc_sync|nccl_sync|sleep_level|logprob_mismatch|grpo)' \
  | cut -c1-400
echo "gpu.sh done in $(( $(date +%s) - START )) s"
