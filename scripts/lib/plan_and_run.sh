# Sourced by scripts/async_gpu.sh and scripts/engines_gpu.sh: plan_and_run OUT ARGS... prints the
# plan of `rlhf.cli ARGS` (also into OUT.plan.txt), then runs it into OUT with nvidia-smi's memory.used
# sampled every 0.5 s into OUT.smi (every process on the GPU: what bench.async_report compares the
# plan with). Sets rc=1 when the plan or the run fails. The run's checkpoints and final export are
# removed after it (a 1.5B pair's 2 × 27 GB would fill the device's 64 GB disk; the metrics stay).
plan_and_run() {
  local out=$1; shift
  rm -rf "$out" "$out.plan.txt" "$out.smi"
  $PY -m rlhf.cli "$@" --plan > "$out.plan.txt" 2>&1 || rc=1
  cat "$out.plan.txt"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$out.smi" 2>/dev/null &
  local smi=$!
  $PY -m rlhf.cli "$@" tracking.console=plain output_dir="$out" || rc=1
  kill "$smi" 2>/dev/null
  wait "$smi" 2>/dev/null
  rm -rf "$out/checkpoints" "$out/final"
}
