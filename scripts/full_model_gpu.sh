#!/usr/bin/env bash
# The full Qwen3-30B-A3B on one node of 4 H200s (issue 51), in ONE device call (nvidia-h200-x4, needs_h200):
#   bash scripts/full_model_gpu.sh OUT
# configs/qwen3_30b_a3b_4gpu.toml (EP = 4, seq 4096, learned router, full recompute, compiled), bench_train with
# --gpu-power (tokens per joule over the 4 GPUs), torchtitan 0.2.2's Qwen3-MoE beside ours, few steps each:
#   lb2     local batch 2, fp32 AdamW moments, the recompute replaying the exchanges: torchtitan and ours (all_to_all)
#   lb4     local batch 4, bf16 AdamW moments (lb 4 does not fit with fp32 moments: the planner's breakdown), the
#           recompute replaying: torchtitan and ours, the same optimizer for both (components/optimizer.py builds both)
#   lb8     the config as shipped: local batch 8, bf16 AdamW moments, the recompute exchanging again ([dispatch]
#           recompute = "exchange": no received rows kept for it, -22 GiB at lb 4): torchtitan and ours
#   ep1     the shipped setting at EP = 1, torchtitan and ours (the local dispatcher): every expert under FSDP2
#           over the 4 ranks, no all-to-all, the experts' weights all-gathered instead (the planner's pick)
#   ep1lb12 ours at EP = 1, local batch 12 (FSDP2's gathers and reductions are per step: fewer per token)
#   ep2     torchtitan and ours (all_to_all, exchanging again) at EP = 2: experts split 2 ways, each half
#           under FSDP2 over 2 ranks
#   accum   ours at local batch 2 x 16 micro-batches = 524,288 tokens a step, bf16 moments (accumulation keeps
#           the experts' gradients in fp32: +13.5 GiB, which fp32 moments leave no room for)
# Each table gives tokens/s/GPU, tokens a step, TFLOP/s, MFU in torchtitan's count and in the causal count,
# tokens/J per GPU and peak memory. STAGES (default "lb2 lb4 lb8 ep1 ep1lb12 ep2 accum") picks stages; STEPS/WARMUP (6/2; accum 3/1)
# the steps; PROFILE=1 adds the step-time breakdowns to lb8 and ep1 (4 more steps). BUDGET (default 560 s) bounds
# the whole script: a stage gets what is left, is stopped at the deadline, and its finished runs are
# still tabled (bench_train --report). Runs finished on a warm machine are kept in WORK (default
# /tmp/full_model_gpu) and not trained again (--resume), so a second call goes on where the first stopped.
# OUT: summary.md (the planner's breakdown, every table, failed runs' log tails), lb2.json, lb4.json,
# accum.json, logs.tar.gz (the training logs).
# CONFIG, NPROC, MODES (compiled) and EXTRA (overrides for every run) are for a smoke run of the script itself, e.g. on a CPU with
# tests/fakes/nvidia_smi on PATH: CONFIG=configs/debug.toml NPROC=2 MODES=eager EXTRA="--parallelism.expert_parallel_degree 2".
# Wheels carried in .whl (see the device notes) are installed first.
set -uo pipefail
out=${1:-${OUT:?usage: scripts/full_model_gpu.sh OUT}}
stages=${STAGES:-lb2 lb4 lb8 ep1 ep1lb12 ep2 accum}
work=${WORK:-/tmp/full_model_gpu}
steps=${STEPS:-6}
warmup=${WARMUP:-2}
deadline=$((SECONDS + ${BUDGET:-560}))
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
config=${CONFIG:-configs/qwen3_30b_a3b_4gpu.toml}
nproc=${NPROC:-4}
read -ra extra <<< "${EXTRA:-}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || { echo "installing .whl failed"; exit 1; }
fi
mkdir -p "$out" "$work"
out=$(cd "$out" && pwd)
summary=$out/summary.md
{
    echo "# Full model, 4 GPUs: $(git rev-parse --short HEAD 2>/dev/null)"
    "$py" -c "import torch, torchtitan; print(torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| torchtitan', torchtitan.__version__)" 2>&1 | tail -n 1
    echo
    "$py" -m torchtitan_moe.tools.plan "$config" --nodes 1 --gpus-per-node "$nproc" --breakdown "${extra[@]}" 2>&1
} > "$summary"

# stage NAME STEPS WARMUP [bench_train arguments] -- [overrides]: bench_train under what is left of BUDGET
stage() {
    local name=$1 n=$2 w=$3
    shift 3
    local left=$((deadline - SECONDS))
    if [ "$left" -lt 90 ]; then
        echo "== $name: skipped, ${left} s left of BUDGET" | tee -a "$summary"
        return
    fi
    echo "== $name ($left s left)"
    local args=("$config" --routers learned --modes "${MODES:-compiled}" --nproc "$nproc" --gpu-power --log-freq 1 --steps "$n"
                --warmup "$w" --out "$work/$name")
    local resume=()
    [ -d "$work/$name" ] && resume=(--resume)  # a call before this one on the same machine trained some
    timeout --kill-after=20 "$left" "$py" -m torchtitan_moe.tools.bench_train "${args[@]}" "${resume[@]}" "$@" \
        "${extra[@]}" > "$work/$name.log" 2>&1
    local code=$?
    if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then  # stopped at the deadline: table what finished
        echo "(stopped at the deadline, exit $code: the runs that finished)" >> "$work/$name.log"
        "$py" -m torchtitan_moe.tools.bench_train "${args[@]}" --report "$@" "${extra[@]}" >> "$work/$name.log" 2>&1
    fi
    {
        echo; echo "## $name (exit $code)"; echo
        if [ -f "$work/$name/bench_train.md" ]; then cat "$work/$name/bench_train.md"; else tail -n 30 "$work/$name.log"; fi
        for log in "$work/$name"/*.log; do  # a failed run's tail
            [ -f "$log" ] && grep -q "failed.*$(basename "$log")" "$work/$name/bench_train.md" 2>/dev/null \
                && { echo; echo "### $(basename "$log")"; echo '```'; tail -n 15 "$log"; echo '```'; }
        done
    } >> "$summary"
    cp "$work/$name/bench_train.json" "$out/$name.json" 2>/dev/null
    tail -n 25 "$work/$name.log"
}

has() { [[ " $stages " == *" $1 "* ]]; }
lb8_steps=$steps
[ -n "${PROFILE:-}" ] && lb8_steps=$((steps + 4))  # bench_train leaves the profiler's 1 + 3 steps out of its medians
has lb2 && stage lb2 "$steps" "$warmup" --models torchtitan,all_to_all \
    -- --training.local_batch_size 2 --optimizer.moments_dtype float32 --dispatch.recompute replay
has lb4 && stage lb4 "$steps" "$warmup" --models torchtitan,all_to_all \
    -- --training.local_batch_size 4 --optimizer.moments_dtype bfloat16 --dispatch.recompute replay
has lb8 && stage lb8 "$lb8_steps" "$warmup" --models torchtitan,all_to_all ${PROFILE:+--profile} \
    -- --training.local_batch_size 8 --optimizer.moments_dtype bfloat16 --dispatch.recompute exchange
has ep1 && stage ep1 "$lb8_steps" "$warmup" --models torchtitan,local ${PROFILE:+--profile} \
    -- --training.local_batch_size 8 --optimizer.moments_dtype bfloat16 --parallelism.expert_parallel_degree 1 \
    --dispatch.backend local --dispatch.recompute replay
has ep1lb12 && stage ep1lb12 "$steps" "$warmup" --models local \
    -- --training.local_batch_size 12 --optimizer.moments_dtype bfloat16 --parallelism.expert_parallel_degree 1 \
    --dispatch.backend local --dispatch.recompute replay
has ep2 && stage ep2 "$steps" "$warmup" --models torchtitan,all_to_all \
    -- --training.local_batch_size 8 --optimizer.moments_dtype bfloat16 --parallelism.expert_parallel_degree 2 \
    --dispatch.recompute exchange
has accum && stage accum "${ACCUM_STEPS:-3}" "${ACCUM_WARMUP:-1}" --models all_to_all --grad-accum 16 \
    -- --training.local_batch_size 2 --optimizer.moments_dtype bfloat16 --dispatch.recompute replay

tar -czf "$out/logs.tar.gz" -C "$work" $(cd "$work" && ls -d *.log */*.log 2>/dev/null) 2>/dev/null
echo "== done in $SECONDS s; $summary"
