#!/usr/bin/env bash
# Compiled vs eager training on one GPU node: bash scripts/validate_compile.sh OUT [WORK]
# One parity run: EP = 1 and every degree up to the GPU count (2, 4, 8), each eager and
# compiled, all from one seed checkpoint, CONFIG (default the reduced Qwen3-30B-A3B) in bf16
# for STEPS steps (default 50): loss within 1% and grad norm within 5% of EP = 1 eager at
# every step -> OUT/compile.md, OUT/compile.png (with each setting's tokens/s/GPU).
# Checkpoints stay in WORK (default /tmp/validate_compile): the 30b-a3b-8l seed is 22 GB.
set -uo pipefail
out=${1:?usage: scripts/validate_compile.sh OUT [WORK]}
work=${2:-/tmp/validate_compile}
config=${CONFIG:-configs/qwen3_30b_a3b_8l.toml}
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ngpu=$("$py" -c "import torch; print(torch.cuda.device_count())")
eps=1
for ep in 2 4 8; do [ "$ep" -le "$ngpu" ] && eps="$eps,$ep"; done
mkdir -p "$out" "$work"
"$py" -m torchtitan_moe.tools.parity "$config" --vary "parallelism.expert_parallel_degree=$eps" \
    --vary compile.enable=false,true --steps "${STEPS:-50}" --nproc "$ngpu" --loss-rtol 0.01 --grad-rtol 0.05 \
    --out "$work" -- --metrics.log_freq 1 ${EXTRA:-} > "$work/parity.log" 2>&1
status=$?
echo "parity exit status: $status"
cp "$work/parity.md" "$out/compile.md" 2>/dev/null && cp "$work/parity.png" "$out/compile.png"
tail -n 14 "$work/parity.log"
exit $status
