#!/usr/bin/env bash
# The kernel benchmarks and the op tests on a CUDA GPU; results under OUT_DIR.
#
#   bash kernels/run_all.sh OUT_DIR          (PYTHON=... to pick the interpreter)
#
# OUT_DIR/bench_<op>.json and .txt per benchmark, OUT_DIR/tests.xml (JUnit) and tests.txt.
# The tests are all of tests/ops: on a GPU machine every test runs the compiled kernels,
# and the `gpu`-marked ones (determinism, real sizes) run instead of being skipped.
# Runs every step even when one fails; exits non-zero if any did.
set -uo pipefail
out=${1:?usage: bash kernels/run_all.sh OUT_DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python}
mkdir -p "$out"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"

"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "run_all.sh needs a CUDA GPU")' || exit 1

failed=()
for op in swiglu_prob combine permute; do
    echo "== kernels/bench_$op.py"
    "$py" "kernels/bench_$op.py" --json "$out/bench_$op.json" 2>&1 | tee "$out/bench_$op.txt" || failed+=("bench_$op")
done
echo "== pytest tests/ops"
"$py" -m pytest -q -rs tests/ops --junitxml "$out/tests.xml" 2>&1 | tee "$out/tests.txt" || failed+=("tests")

if ((${#failed[@]})); then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all done: $out"
