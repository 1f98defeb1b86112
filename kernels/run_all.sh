#!/usr/bin/env bash
# On a CUDA machine: the op tests (GPU-only ones included), then the three kernel
# benchmarks. Tables go to the terminal and OUTDIR/*.txt, results to OUTDIR/*.json,
# test results to OUTDIR/tests_ops.xml (JUnit). Exits non-zero if anything failed.
#
#   kernels/run_all.sh OUTDIR        (PYTHON=... to pick the interpreter)
set -uo pipefail
OUT=${1:?usage: kernels/run_all.sh OUTDIR}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."  # the repository root: `python -m kernels.<bench>` imports from here

failed=0
"$PYTHON" -m pytest -q tests/ops -rs --durations=10 --junitxml="$OUT/tests_ops.xml" 2>&1 | tee "$OUT/tests_ops.txt" || failed=1
for op in swiglu_prob combine permute; do
    "$PYTHON" -m "kernels.bench_$op" --json "$OUT/bench_$op.json" 2>&1 | tee "$OUT/bench_$op.txt" || failed=1
done
exit $failed
