#!/usr/bin/env bash
# The full Qwen3-30B-A3B on one node of 4 H200s (issue 51), in ONE device call (nvidia-h200-x4, needs_h200):
#   bash scripts/full_model_gpu.sh OUT
# configs/qwen3_30b_a3b_4gpu.toml (seq 4096, learned router, full recompute, compiled, bf16 AdamW moments unless
# said), bench_train with --gpu-power (tokens per joule over the 4 GPUs), torchtitan 0.2.2's Qwen3-MoE beside
# ours on the same keys, few steps each:
#   shipped the config as shipped: EP = 1 (every expert under FSDP2 over the 4 ranks, the local dispatcher, no
#           all-to-all), local batch 16, expandable segments: ours
#   baseline torchtitan at its fastest fitting setting on the same keys: local batch TT_BATCH (default 12)
#   accum   ours as shipped x 3 micro-batches a step (786,432 tokens)
#   batches ours as shipped at local batches BATCHES (default 12,24,32; --vary, one run)
#   offload ours as shipped with the blocks' inputs in host memory ([activation_checkpoint] offload_inputs) at local
#           batches OFFLOAD_BATCHES (default 16,32,40; --vary, one run)
#   attention ours as shipped with the blocks' inputs offloaded at local batch ATTENTION_BATCH (default 32), their
#           attention's outputs kept for the recompute and not ([activation_checkpoint] offload_attention; --vary)
#   fixed   ours as shipped with the allocator's fixed-size segments ([training] no-expandable_segments), the
#           segments tools/plan.py models
#   memory  ours as shipped at local batch MEMORY_BATCH (default 16), its inputs kept and offloaded, 3 steps with
#           a memory snapshot of the last: what rank 0 holds at its peak (tools/memory_peak.py)
#   ep4lb8  EP = 4 (each rank holds 32 experts outside FSDP2, all_to_all), local batch 8, the recompute exchanging
#           again ([dispatch] recompute = "exchange": no received rows kept for it): torchtitan and ours
#   ep1lb8  EP = 1 at local batch 8: torchtitan and ours
#   ep2lb8  EP = 2 (experts split 2 ways, each half under FSDP2 over 2 ranks), local batch 8, exchanging again:
#           torchtitan and ours
#   ep4lb4  EP = 4, local batch 4, the recompute replaying its exchanges: torchtitan and ours
#   ep4lb2  EP = 4, local batch 2, fp32 AdamW moments, replaying: torchtitan and ours
# Each table gives tokens/s/GPU, tokens a step, TFLOP/s, MFU in torchtitan's count and in the causal count,
# tokens/J per GPU and peak memory. STAGES (default "shipped baseline accum") picks stages; STEPS/WARMUP (6/2; accum
# 3/1) the steps; PROFILE=1 adds the step-time breakdowns to shipped and ep4lb8 (4 more steps). BUDGET (default
# 560 s) bounds the whole script: a stage gets what is left, is stopped at the deadline, and its finished runs are
# still tabled (bench_train --report). Runs finished on a warm machine are kept in WORK (default
# /tmp/full_model_gpu) and not trained again (--resume), so a second call goes on where the first stopped.
# OUT: summary.md (the planner's breakdown, every table, failed runs' log tails), STAGE.json, logs.tar.gz (the
# training logs).
# CONFIG, NPROC, MODES (compiled) and EXTRA (overrides for every run) are for a smoke run of the script itself, e.g. on a CPU with
# tests/fakes/nvidia_smi on PATH: CONFIG=configs/debug.toml NPROC=2 MODES=eager EXTRA="--parallelism.expert_parallel_degree 2".
# Wheels carried in .whl (see the device notes) are installed first.
set -uo pipefail
out=${1:-${OUT:?usage: scripts/full_model_gpu.sh OUT}}
stages=${STAGES:-shipped baseline accum}
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
profiled=$steps
[ -n "${PROFILE:-}" ] && profiled=$((steps + 4))  # bench_train leaves the profiler's 1 + 3 steps out of its medians
ep1=(--parallelism.expert_parallel_degree 1 --dispatch.backend local)
has shipped && stage shipped "$profiled" "$warmup" --models local ${PROFILE:+--profile} -- "${ep1[@]}"
has baseline && stage baseline "$steps" "$warmup" --models torchtitan \
    -- "${ep1[@]}" --training.local_batch_size "${TT_BATCH:-12}"
has accum && stage accum "${ACCUM_STEPS:-3}" "${ACCUM_WARMUP:-1}" --models local --grad-accum 3 -- "${ep1[@]}"
has batches && stage batches "$steps" "$warmup" --models local --vary training.local_batch_size=${BATCHES:-12,24,32} \
    -- "${ep1[@]}"
has offload && stage offload "$steps" "$warmup" --models local \
    --vary training.local_batch_size=${OFFLOAD_BATCHES:-16,32,40} -- "${ep1[@]}" --activation_checkpoint.offload_inputs
has attention && stage attention "$steps" "$warmup" --models local --vary activation_checkpoint.offload_attention=false,true \
    -- "${ep1[@]}" --activation_checkpoint.offload_inputs --training.local_batch_size "${ATTENTION_BATCH:-32}"
has fixed && stage fixed "$steps" "$warmup" --models local -- "${ep1[@]}" --training.no-expandable_segments
if has memory; then
    stage memory 3 1 --models local --vary activation_checkpoint.offload_inputs=false,true \
        --vary training.local_batch_size=${MEMORY_BATCH:-16} -- "${ep1[@]}" --profiling.enable_memory_snapshot \
        --profiling.profile_freq 3
    for snapshot in "$work"/memory/*/memory_snapshot/iteration_3/rank0_memory_snapshot.pickle; do
        [ -f "$snapshot" ] || continue
        run=${snapshot#"$work"/memory/}
        { echo; echo "### memory peak: ${run%%/*}"; echo; "$py" -m torchtitan_moe.tools.memory_peak "$snapshot" 2>&1; } \
            | tee -a "$summary"
    done
fi
has ep4lb8 && stage ep4lb8 "$profiled" "$warmup" --models torchtitan,all_to_all ${PROFILE:+--profile} \
    -- --parallelism.expert_parallel_degree 4 --training.local_batch_size 8 --dispatch.recompute exchange
has ep1lb8 && stage ep1lb8 "$steps" "$warmup" --models torchtitan,local -- "${ep1[@]}" --training.local_batch_size 8
has ep2lb8 && stage ep2lb8 "$steps" "$warmup" --models torchtitan,all_to_all \
    -- --parallelism.expert_parallel_degree 2 --training.local_batch_size 8 --dispatch.recompute exchange
has ep4lb4 && stage ep4lb4 "$steps" "$warmup" --models torchtitan,all_to_all \
    -- --parallelism.expert_parallel_degree 4 --training.local_batch_size 4 --dispatch.recompute replay
has ep4lb2 && stage ep4lb2 "$steps" "$warmup" --models torchtitan,all_to_all \
    -- --parallelism.expert_parallel_degree 4 --training.local_batch_size 2 --optimizer.moments_dtype float32 \
    --dispatch.recompute replay

tar -czf "$out/logs.tar.gz" -C "$work" $(cd "$work" && ls -d *.log */*.log 2>/dev/null) 2>/dev/null
echo "== done in $SECONDS s; $summary"
