#!/usr/bin/env bash
# Expert-parallel validation on one GPU node: bash scripts/validate_ep.sh OUT [WORK]
#   1. dispatch + combine microbenchmark at EP = 2, 4, 8       -> OUT/dispatch.md, OUT/dispatch.json
#   2. debug and reduced-depth 30B-A3B training, EP = 2, 4, 8   -> OUT/training.md
#   3. parity EP = 1 vs 8, reduced 30B-A3B, 200 steps in bf16 (seq 1024) -> OUT/parity.md, OUT/parity.png
# EP degrees run up to the node's GPU count (2, 4 on a 4-GPU node; parity EP = 1 vs 4 there).
#   logs and metrics of every run                               -> OUT/logs.tar.gz
# Checkpoints and dumps stay in WORK (default /tmp/validate_ep): the seed checkpoint is 22 GB.
# STAGES (default "dispatch training parity") picks stages, e.g. to split them over two calls.
set -uo pipefail
stages=${STAGES:-dispatch training parity}
out=${1:?usage: scripts/validate_ep.sh OUT [WORK]}
work=${2:-/tmp/validate_ep}
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
ngpu=$("$py" -c "import torch; print(torch.cuda.device_count())")
mkdir -p "$out" "$work"
eps=""
for ep in 2 4 8; do [ "$ep" -le "$ngpu" ] && eps="$eps $ep"; done

if [[ $stages == *dispatch* ]]; then
"$py" -m torch.distributed.run --standalone --nproc_per_node "$ngpu" kernels/bench_dispatch.py \
    --ep "$(echo $eps | tr ' ' ',')" --json "$out/dispatch.json" 2>&1 | tee "$work/dispatch.log" | grep -E '^\||^dispatch' > "$out/dispatch.md"
cat "$out/dispatch.md"
fi

if [[ $stages == *training* ]]; then
echo "| config | EP | steps | first loss | last loss | last grad norm | tokens/s/GPU | memory GiB |" > "$out/training.md"
echo "|---|---|---|---|---|---|---|---|" >> "$out/training.md"
for config in debug qwen3_30b_a3b_8l; do
    for ep in $eps; do
        run="$work/${config}_ep$ep"
        NPROC=$ngpu PYTHON=$py timeout 600 bash scripts/train.sh "configs/$config.toml" --job.dump_folder "$run" \
            --parallelism.expert_parallel_degree "$ep" --dispatch.backend all_to_all --training.steps 20 \
            --training.mixed_precision_param bfloat16 --metrics.log_freq 1 > "$run.log" 2>&1
        code=$?
        "$py" - "$run" "$config" "$ep" "$code" >> "$out/training.md" <<'PY'
import json, sys
run, config, ep, code = sys.argv[1:]
try:
    r = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
    last = r[-1]
    print(f"| {config} | {ep} | {last['step']} | {r[0]['loss']:.4f} | {last['loss']:.4f} | {last['grad_norm']:.4f} "
          f"| {last['throughput(tps)']:,.0f} | {last['memory/max_reserved(GiB)']:.1f} |")
except OSError:
    print(f"| {config} | {ep} | failed (exit {code}, see logs) | | | | | |")
PY
    done
done
cat "$out/training.md"
fi

if [[ $stages == *parity* ]]; then
"$py" -m torchtitan_moe.tools.parity configs/qwen3_30b_a3b_8l.toml --vary parallelism.expert_parallel_degree=1,$ngpu \
    --steps 200 --nproc "$ngpu" --loss-rtol 0.01 --grad-rtol 0.05 --out "$work/parity" \
    -- --training.seq_len 1024 --metrics.log_freq 1 > "$work/parity.log" 2>&1
echo "parity exit status: $?" >> "$work/parity.log"
cp "$work/parity/parity.md" "$work/parity/parity.png" "$out/" 2>/dev/null
tail -n 8 "$work/parity.log"
fi

tar -czf "$out/logs.tar.gz" -C "$work" --exclude='checkpoint' --exclude='*.distcp' .
