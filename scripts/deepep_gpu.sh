#!/usr/bin/env bash
# DeepEP on one node of 2 GPUs (H200s):  bash scripts/deepep_gpu.sh OUT
#   build   DeepEP from third_party/DeepEP into WORK/deep_ep (scripts/install_deepep.sh)     -> logs/build.log
#           (always done first when WORK has no build yet, whatever STAGES says; OUT/build.log if it fails)
#   test    DeepEP's GPU tests (2 GPUs, real deep_ep) and the dispatcher-choice tests          -> logs/tests.log
#   tune    tune_dispatch at 30b-a3b-8l shapes, local batch BATCHES (8192, 16384 tokens/rank)   -> OUT/tune.md, dispatch.json
#   bench   kernels/bench_dispatch.py at EP = 2 with DeepEP default and tuned rows             -> OUT/bench.md, bench.json
#   train   30b-a3b-8l, EP = 2, 20 steps, all_to_all vs deepep (tuned), local batch BATCHES    -> OUT/training.md
#   parity  200 steps bf16 at seq 1024, all_to_all vs deepep, each twice (monitors every 10 or 7 steps, which changes no
#           number: all_to_all's second run is the run-to-run control), loss 1% / grad norm 5% (--seed init) -> OUT/parity.md, parity.png
# STAGES (default "build test tune bench train"; parity only when named) splits the work over calls:
# each stage fits in a few minutes. The build and the tuned file (WORK/dispatch.json, or TUNED=FILE)
# stay in WORK (default /tmp/deepep_gpu) for later calls on the same machine. Logs (logs/...): OUT/logs.tar.gz.
# OUT gets at most 8 files (what a lent machine sends back).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${1:-${OUT:?usage: scripts/deepep_gpu.sh OUT}}
work=${WORK:-/tmp/deepep_gpu}
stages=${STAGES:-build test tune bench train}
batches=${BATCHES:-2 4}
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
config=configs/qwen3_30b_a3b_8l.toml
mkdir -p "$out" "$work/logs"
out=$(cd "$out" && pwd)
target=$work/deep_ep
tuned=${TUNED:-$work/dispatch.json}
tuned_flag() { [ -f "$tuned" ] && echo "--dispatch.tuned_file $tuned"; }  # else the shipped table
export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
torchrun2() { "$py" -m torch.distributed.run --standalone --nproc_per_node 2 "$@"; }
has() { [[ " $stages " == *" $1 "* ]]; }

if has build || ! PYTHONPATH=$target "$py" -c "import deep_ep" 2>/dev/null; then
    echo "== build"
    rm -rf "$target"
    DEEPEP_TARGET=$target PYTHON=$py bash scripts/install_deepep.sh third_party/DeepEP > "$work/logs/build.log" 2>&1
    code=$?
    tail -n 3 "$work/logs/build.log"
    [ $code -eq 0 ] || { cp "$work/logs/build.log" "$out/"; echo "build failed (exit $code), see build.log"; exit 1; }
fi

if has test; then
    echo "== test"
    "$py" -m pytest -q -p no:cacheprovider tests/test_deepep.py tests/test_dispatch_choice.py "tests/test_dispatchers.py::test_dispatcher_matches_the_local_dispatcher" -k "not test_dispatcher_matches or deepep" > "$work/logs/tests.log" 2>&1
    echo "tests exit status: $?" >> "$work/logs/tests.log"
    tail -n 4 "$work/logs/tests.log"
fi

if has tune; then
    : > "$out/tune.md"
    for b in $batches; do
        echo "== tune, local batch $b"
        torchrun2 -m torchtitan_moe.tools.tune_dispatch "$config" --training.local_batch_size "$b" --out "$tuned" \
            --json "$work/logs/tune_b$b.json" > "$work/logs/tune_b$b.log" 2>&1
        echo "exit status: $?" >> "$work/logs/tune_b$b.log"
        grep -E '^\||^dispatch tuning|^\(a\)|^faster|^tune_dispatch|exit status' "$work/logs/tune_b$b.log" > "$work/tune_b$b.md"
        tee -a "$out/tune.md" < "$work/tune_b$b.md"
    done
    cp "$tuned" "$out/dispatch.json" 2>/dev/null
fi

if has bench; then
    echo "== bench"
    torchrun2 kernels/bench_dispatch.py --ep 2 --tuned-file "$tuned" --json "$out/bench.json" > "$work/logs/bench.log" 2>&1
    echo "exit status: $?" >> "$work/logs/bench.log"
    grep -E '^\||^dispatch|^the same|exit status' "$work/logs/bench.log" > "$out/bench.md"
    cat "$out/bench.md"
fi

if has train; then
    echo "== train"
    [ -f "$tuned" ] || echo "no tuned file at $tuned: deepep takes the shipped table's settings, else DeepEP's defaults"
    echo "| local batch | dispatcher | steps | first loss | last loss | tokens/s/GPU (median, steps 6+) | memory GiB | vs all_to_all | dispatcher log |" > "$out/training.md"
    echo "|---|---|---|---|---|---|---|---|---|" >> "$out/training.md"
    for b in $batches; do
        for backend in all_to_all deepep; do
            run="$work/train_${backend}_b$b"
            rm -rf "$run"
            NPROC=2 PYTHON=$py timeout 900 bash scripts/train.sh "$config" --job.dump_folder "$run" \
                --parallelism.expert_parallel_degree 2 --dispatch.backend "$backend" $(tuned_flag) \
                --training.local_batch_size "$b" --training.steps 20 --metrics.log_freq 1 > "$run.log" 2>&1
            code=$?
            "$py" - "$run" "$b" "$backend" "$code" "$work/train_all_to_all_b$b" >> "$out/training.md" <<'PY'
import json, re, statistics, sys
run, batch, backend, code, baseline = sys.argv[1:]

def tps(folder):
    records = [json.loads(line) for line in open(f"{folder}/metrics.jsonl")]
    return records, statistics.median(r["throughput(tps)"] for r in records if r["step"] >= 6)

try:
    records, mine = tps(run)
    ratio = f"{mine / tps(baseline)[1]:.2f}x" if backend != "all_to_all" else "1.00x"
    line = next((m.group(1) for m in map(re.compile(r"\[dispatch\] (.*)").search, open(f"{run}.log")) if m), "")
    last = records[-1]
    print(f"| {batch} | {backend} | {last['step']} | {records[0]['loss']:.4f} | {last['loss']:.4f} | {mine:,.0f} "
          f"| {last['memory/max_reserved(GiB)']:.1f} | {ratio} | {line} |")
except (OSError, StopIteration, KeyError, ValueError) as e:
    print(f"| {batch} | {backend} | failed (exit {code}: {type(e).__name__}), see {run}.log | | | | | | |")
PY
        done
    done
    cat "$out/training.md"
fi

if has parity; then
    echo "== parity"
    "$py" -m torchtitan_moe.tools.parity "$config" --vary dispatch.backend=all_to_all,deepep \
        --vary checks.monitor_freq=10,7 --steps 200 --nproc 2 --seed init \
        --loss-rtol 0.01 --grad-rtol 0.05 --out "$work/parity" -- --parallelism.expert_parallel_degree 2 \
        --training.seq_len 1024 $(tuned_flag) --metrics.log_freq 1 > "$work/logs/parity.log" 2>&1
    echo "parity exit status: $?" >> "$work/logs/parity.log"
    cp "$work/parity/parity.md" "$work/parity/parity.png" "$out/" 2>/dev/null
    tail -n 8 "$work/logs/parity.log"
fi

tar -czf "$out/logs.tar.gz" -C "$work" --exclude='checkpoint' --exclude='*.distcp' --exclude='deep_ep' \
    --exclude='parity/seed' logs $(cd "$work" && ls -d train_* parity/*.log 2>/dev/null)
