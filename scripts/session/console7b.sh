#!/usr/bin/env bash
# 3-step 7B LoRA run, console line count (docs/gpu.md "The console of a GPU run"). Arg: verbose|plain
set -uo pipefail
source .gpu/tools/env.sh
c=${1:-plain}
M=/tmp/rlhf-gpu/models/qwen2.5-7b-random
mkdir -p /tmp/rlhf-gpu/models
t0=$(date +%s)
test -f $M/config.json || python -m bench.make_model qwen2.5-7b $M > $OUT/make_model.log 2>&1
echo "model ready after $(( $(date +%s) - t0 )) s"
rm -rf /tmp/rlhf-gpu/quiet-*
t1=$(date +%s)
python -m rlhf.cli model=qwen2.5-7b model.path=$M hardware=1xh200 placement=hybrid algo=grpo \
  model.lora.rank=16 model.lora.alpha=32 train.steps=3 train.prompts_per_step=8 algo.group_size=4 \
  rollout.max_response_tokens=256 checkpoint.every=2 tracking=none \
  'reward.functions=[{fn: bench.rewards:letters}]' tracking.console=$c \
  output_dir=/tmp/rlhf-gpu/quiet-$c > $OUT/console-$c.log 2>&1
rc=$?
echo "$c: exit $rc · $(wc -l < $OUT/console-$c.log) console lines · $(( $(date +%s) - t1 )) s"
wc -l /tmp/rlhf-gpu/quiet-$c/logs/*.log 2>/dev/null
mkdir -p $OUT/logs-$c; cp /tmp/rlhf-gpu/quiet-$c/logs/*.log $OUT/logs-$c/ 2>/dev/null
find /tmp/rlhf-gpu/quiet-$c -name 'report*' -o -name '*.png' -o -name '*.html' | head
for f in $(find /tmp/rlhf-gpu/quiet-$c \( -name '*.png' -o -name '*.html' \) ); do cp $f $OUT/; done
du -sh /tmp/rlhf-gpu/quiet-$c; df -h /tmp | tail -1
