#!/usr/bin/env bash
# AdamW with bf16 moments on one GPU ([optimizer] moments_dtype):
#   bash scripts/bf16_moments_gpu.sh OUT [STAGES]     STAGES: any of tests,bench,parity (default: all)
# tests   the op against float64 and the optimizer against torch's AdamW, the kernel compiled
# bench   kernels/bench_adamw.py: one 30B-A3B layer's parameters, ours against torch's fused AdamW
# parity  30b-a3b-8l at EP = 1, STEPS (500) steps from one init (--seed init): fp32 moments, bf16
#         moments, and fp32 again (--deterministic's repeat: the run-to-run spread, bitwise if the
#         GPU's kernels are deterministic); losses, grad norms, tokens/s and peak memory per setting.
# train   bench_train of 30b-a3b-8l at EP = 1 (ours and torchtitan's, learned router, eager) at local batch
#         2 and 4, fp32 then bf16 moments (both models build their optimizer in components/optimizer.py)
# EXTRA="--training.local_batch_size 1" adds overrides to the parity runs; REPEAT=0 leaves out the repeat.
set -uo pipefail
out=${1:?usage: scripts/bf16_moments_gpu.sh OUT [tests,bench,parity,train]}
stages=${2:-tests,bench,parity,train}
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
mkdir -p "$out"
if [[ $stages == *tests* ]]; then
    "$py" -m pytest -q -p no:cacheprovider tests/ops/test_adamw.py 2>&1 | tail -3 | tee "$out/tests.txt"
fi
if [[ $stages == *bench* ]]; then
    "$py" kernels/bench_adamw.py --json "$out/bench_adamw.json" 2>&1 | tee "$out/bench_adamw.txt"
fi
if [[ $stages == *parity* ]]; then
    "$py" -m torchtitan_moe.tools.parity configs/qwen3_30b_a3b_8l.toml --vary optimizer.moments_dtype=float32,bfloat16 \
        --steps "${STEPS:-500}" --nproc 1 --seed init $([ "${REPEAT:-1}" = 1 ] && echo --deterministic) --out "$out/parity" \
        -- --parallelism.expert_parallel_degree 1 --dispatch.backend auto --metrics.log_freq 1 ${EXTRA:-} 2>&1 | tail -40
fi
if [[ $stages == *train* ]]; then
    for batch in ${BATCHES:-2 4}; do
        for moments in float32 bfloat16; do
            "$py" -m torchtitan_moe.tools.bench_train configs/qwen3_30b_a3b_8l.toml --models torchtitan,local \
                --routers learned --modes eager --steps 30 --out "$out/train-lb$batch-$moments" \
                -- --parallelism.expert_parallel_degree 1 --dispatch.backend auto \
                --training.local_batch_size "$batch" --optimizer.moments_dtype "$moments" 2>&1 | tail -12
        done
    done
fi
