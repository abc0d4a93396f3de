#!/usr/bin/env bash
# Every test that asserts a learning result, re-run under each CPU kernel path torch offers here
# (ATEN_CPU_CAPABILITY=default, avx2, and avx512 where the CPU has it), 1 and 2 CPU threads per
# worker, and 3 seeds; then the margins table (docs/learning-margins.md's format) from what each
# run recorded (tests/helpers.py:record_learning).
#
#   bash scripts/learning_margins.sh                       # the whole matrix (hours on 2 cores)
#   CAPS="avx2" THREADS="1" SEEDS="0" bash scripts/learning_margins.sh     # one variant
#   TESTS="tests/pref/test_pref_pipeline.py::test_reward_model_ranks_held_out_pairs" bash scripts/learning_margins.sh
#   VARIANTS="default:1:0 avx2:2:0" bash scripts/learning_margins.sh  # cap:threads:seed list instead of the grid
#   OUT=margins.jsonl bash scripts/learning_margins.sh     # where the rows go (appended; default below)
#
# A variant that fails its assertion still records its value: the table shows every variant's
# minimum, so a change that thins a margin shows before a test turns red on some other machine.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/learning-margins/margins.jsonl}
mkdir -p "$(dirname "$OUT")"

if [ -z "${CAPS:-}" ]; then
  CAPS="default avx2"
  grep -qw avx512f /proc/cpuinfo 2>/dev/null && CAPS="$CAPS avx512"
fi
THREADS=${THREADS:-"1 2"}
SEEDS=${SEEDS:-"0 1 2"}
TESTS=${TESTS:-"tests/rl/test_rl_runs.py::test_grpo_learns
tests/rl/test_rl_learning.py::test_algo_learns_with_its_defaults
tests/rl/test_rl_learning.py::test_dapo_learns_with_its_defaults_in_150_steps
tests/rl/test_rl_registry.py::test_toy_estimator_and_loss_learn
tests/rl/test_rl_lora.py::test_lora_grpo_learns
tests/rl/test_rl_eval.py::test_greedy_eval_reward_rises
tests/rl/test_rl_async.py::test_async_one_step_learns_and_overlaps
tests/rl/test_rl_env.py::test_keymap_chain_env_learns
tests/pref/test_pref_pipeline.py::test_sft_lowers_held_out_loss
tests/pref/test_pref_pipeline.py::test_reward_model_ranks_held_out_pairs
tests/pref/test_pref_pipeline.py::test_ppo_against_the_reward_model_raises_its_score_and_the_true_reward
tests/pref/test_pref_pipeline.py::test_dpo_preference_accuracy
tests/pref/test_pref_pipeline.py::test_preference_method_accuracy
tests/rl/test_rl_distill.py::test_student_closes_most_of_the_held_out_gap_to_the_teacher
tests/agent/test_agent_recipes.py::test_lookup_tool_recipe_learns
tests/agent/test_agent_recipes.py::test_code_recipe_learns_from_sandboxed_tests"}

if [ -z "${VARIANTS:-}" ]; then
  for cap in $CAPS; do for threads in $THREADS; do for seed in $SEEDS; do
    VARIANTS="${VARIANTS:-} $cap:$threads:$seed"
  done; done; done
fi

for v in $VARIANTS; do
  IFS=: read -r cap threads seed <<< "$v"
  echo "== $(date +%T) ATEN_CPU_CAPABILITY=$cap threads=$threads seed=$seed"
  # shellcheck disable=SC2086
  # OMP_WAIT_POLICY=PASSIVE: with 2 threads per worker several workers share 2 cores, and spinning
  # OpenMP threads slowed those runs 3-5x; the arithmetic (threads, partitioning) is the same
  ATEN_CPU_CAPABILITY=$cap RLHF_CPU_THREADS=$threads OMP_NUM_THREADS=$threads RLHF_TEST_SEED=$seed OMP_WAIT_POLICY=PASSIVE \
    RLHF_MARGINS_OUT=$OUT "$PY" -m pytest -q -n "${WORKERS:-2}" --dist loadgroup --no-loadscope-reorder \
    -p no:cacheprovider $TESTS | grep -E "passed|failed|error" | tail -1
done
"$PY" scripts/margins_table.py "$OUT"
