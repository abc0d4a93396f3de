#!/usr/bin/env bash
# On the GPU machine (one device call): install the bundle part carried, then the peers' wheels
# (--no-deps, into their own site dir), then run bench.e2e_peers with the arguments given.
# The harness travels in .peers-carry/ (a copy of bench/ from the peers branch) and is laid over
# the device's copy of the tree; the peers' wheels travel in .peers-whl/.
#   bash .peers-carry/bench/peers/device.sh TAG [bench.e2e_peers args...]
set -uo pipefail
tag=$1; shift
# the harness's --budget-s counts from here (the install below is part of the call), and each side's
# log reaches $OUT as <tag>_<side>.log.gz when the side ends, before any outer timeout
export E2E_CALL_STARTED=${E2E_CALL_STARTED:-$(date +%s)} E2E_TAG=$tag
bash .gpu/tools/install.sh || exit $?
source .gpu/tools/env.sh
cp -r .peers-carry/bench/. bench/
if [ ! -f /tmp/peers/site/.ok ]; then
  mkdir -p /tmp/peers/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peers/site .peers-whl/*.whl || exit 4
  rm -rf /tmp/peers/site/tests /tmp/peers/site/scripts   # the wheels' own test/script packages: not the project's
  touch /tmp/peers/site/.ok
fi
# the bundle installs with --no-compile: without this, each process of a fresh machine's first run
# compiles the same modules' bytecode (vLLM, Ray, DeepSpeed, the peers) while it starts
if [ ! -f /tmp/site/.bytecode ]; then
  t0=$(date +%s); python3 -m compileall -q -j 16 /tmp/site /tmp/peers/site > /dev/null 2>&1
  echo "bytecode compiled in $(( $(date +%s) - t0 )) s"; touch /tmp/site/.bytecode
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RAY_ADDRESS=local RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
export RLHF_VLLM_ARGS=${RLHF_VLLM_ARGS:-'{"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256]}}'}
export OUT=${OUT:-/tmp/peers/out}; mkdir -p "$OUT"
{
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm --format=csv,noheader
PYTHONPATH=bench/peers/shim:$PYTHONPATH python3 - <<'PY'
# the flash_attn stand-in on the GPU path against its own float32 reference (fresh random data)
import torch
from flash_attn import flash_attn_varlen_func
from flash_attn import _varlen_reference
lens = [300, 17, 511, 64]; cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
T = sum(lens); q = torch.randn(T, 14, 64, device="cuda", dtype=torch.bfloat16)
k = torch.randn(T, 2, 64, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
o = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True).float()
r = _varlen_reference(q.float(), k.float(), v.float(), cu.cpu(), cu.cpu(), None, -1, 0)
print("flash_attn stand-in, varlen causal GQA bf16 vs fp32 reference: rel err %.2e" % ((o - r).norm() / r.norm()).item())
PY
python3 -m bench.e2e_peers "$@" 2>&1
} 2>&1 | tee "$OUT/${tag}_log"
rc=$?
w=/tmp/rlhf-gpu/e2e_trl
for f in verl openrlhf ours trl; do  # the harness keeps each side's log when the side ends; any it missed
  [ -f "$w/$f.log" ] && { [ -f "$OUT/${tag}_$f.log.gz" ] || gzip -c "$w/$f.log" > "$OUT/${tag}_$f.log.gz"; rm -f "$w/$f.log"; }
done
ls -la "$OUT"
exit $rc
