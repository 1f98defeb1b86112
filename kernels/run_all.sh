#!/usr/bin/env bash
# Every kernel benchmark and the GPU tests, JSON and tables in OUT: bash kernels/run_all.sh OUT
set -uo pipefail
out=${1:?usage: kernels/run_all.sh OUT}
cd "$(dirname "$0")/.."
mkdir -p "$out"
py=${PYTHON:-python3}
"$py" -m pytest -q -p no:cacheprovider tests/ops tests/test_moe_layer.py 2>&1 | tail -5 | tee "$out/gpu_tests.txt"
for bench in swiglu_prob combine permute cross_entropy gate moe_layer; do
    "$py" "kernels/bench_$bench.py" --json "$out/bench_$bench.json" 2>&1 | tee "$out/bench_$bench.txt"
done
