#!/usr/bin/env bash
# Compiled vs eager training on one GPU node: bash scripts/validate_compile.sh OUT [WORK]
# For each EP degree (1, then every degree up to the GPU count from 2): the parity harness
# trains CONFIG (default the reduced Qwen3-30B-A3B) eager and compiled from one seed
# checkpoint for STEPS steps (default 50) in bf16, loss within 1% and grad norm within 5%
# at every step -> OUT/compile_ep<N>.md, .png (with tokens/s/GPU of both).
# Checkpoints stay in WORK (default /tmp/validate_compile): the 30b-a3b-8l seed is 22 GB.
set -uo pipefail
out=${1:?usage: scripts/validate_compile.sh OUT [WORK]}
work=${2:-/tmp/validate_compile}
config=${CONFIG:-configs/qwen3_30b_a3b_8l.toml}
steps=${STEPS:-50}
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ngpu=$("$py" -c "import torch; print(torch.cuda.device_count())")
mkdir -p "$out" "$work"
status=0
for ep in 1 2 4 8; do
    [ "$ep" -le "$ngpu" ] || continue
    "$py" -m torchtitan_moe.parity "$config" --vary compile.enable=false,true --steps "$steps" --nproc "$ngpu" \
        --loss-rtol 0.01 --grad-rtol 0.05 --out "$work/ep$ep" -- --parallelism.expert_parallel_degree "$ep" \
        --metrics.log_freq 1 ${EXTRA:-} > "$work/ep$ep.log" 2>&1
    code=$?
    echo "EP = $ep: parity exit status $code"
    [ "$code" -eq 0 ] || status=1
    cp "$work/ep$ep/parity.md" "$out/compile_ep$ep.md" 2>/dev/null && cp "$work/ep$ep/parity.png" "$out/compile_ep$ep.png"
    tail -n 12 "$work/ep$ep.log"
done
exit $status
