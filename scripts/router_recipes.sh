#!/usr/bin/env bash
# Router recipes side by side: the same model, seed, data and steps under each balancing recipe.
#   bash scripts/router_recipes.sh OUT
#       Qwen3-30B-A3B at 8 layers, one GPU per recipe (two recipes at once where 2 GPUs are
#       visible), 200 steps of 2 micro-batches of 2 x 512 tokens, bf16 autocast; ~95 GB per GPU (H200)
#   CONFIG=configs/debug.toml BALANCE_COEFF=1e-2 bash scripts/router_recipes.sh OUT
#       the debug model, 2 micro-batches of 4 x 128 tokens; on a CPU one process per recipe (NPROC=1:
#       torch's CPU DTensor init gives every FSDP shard the same random rows, so 2 processes would
#       train pairs of identical experts)
# Every step has MICRO_BATCHES (2) micro-batches, so the micro_batch and global_batch losses differ
# even in one process: the global one counts f over the step's micro-batches so far.
# -> OUT/router_recipes.md (the table, also printed), OUT/<recipe>.log, OUT/<recipe>/metrics.jsonl
#
# Recipes: bias (aux-loss-free expert bias alone), none (no balancing at all),
# sequence / micro_batch / global_batch balance loss (BALANCE_COEFF, bias off; global_batch is the
# shipped configs' recipe), global_batch+z
# (plus a 1e-3 z-loss), groups (bias + DeepSeek-V3 group-limited routing, ROUTER_GROUPS="n_groups topk_groups").
# Environment: CONFIG, STEPS (200), SEQ (512 for the 30B config, else the config's), BATCH (local
# batch: 2 for the 30B config, else 4), MICRO_BATCHES (2), BALANCE_COEFF (1e-3), ROUTER_GROUPS
# (8 4; 4 1 for the debug model's top-2: a group limit binds only when topk_groups < top_k),
# RECIPES (all), PYTHON (python3), NPROC (processes per recipe on a CPU: 1), TIMEOUT (seconds per
# recipe: 900), EXTRA (more --section.key value overrides for every recipe).
set -uo pipefail
out=${1:?usage: scripts/router_recipes.sh OUT}
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
config=${CONFIG:-configs/qwen3_30b_a3b_8l.toml}
steps=${STEPS:-200}
coeff=${BALANCE_COEFF:-1e-3}
case "$config" in
    *30b*) seq=${SEQ:-512}; batch=${BATCH:-2}; groups=${ROUTER_GROUPS:-8 4} ;;
    *) seq=${SEQ:-}; batch=${BATCH:-4}; groups=${ROUTER_GROUPS:-4 1} ;;
esac
read -r n_groups topk_groups <<< "$groups"
recipes=(${RECIPES:-bias none sequence micro_batch global_batch global_batch+z groups})
mkdir -p "$out"

declare -A overrides=(
    [bias]="--router.bias_update_rate 1e-3 --router.balance_loss none --router.balance_loss_coeff 0"
    [none]="--router.bias_update_rate 0 --router.balance_loss none --router.balance_loss_coeff 0"
    [sequence]="--router.bias_update_rate 0 --router.balance_loss sequence --router.balance_loss_coeff $coeff"
    [micro_batch]="--router.bias_update_rate 0 --router.balance_loss micro_batch --router.balance_loss_coeff $coeff"
    [global_batch]="--router.bias_update_rate 0 --router.balance_loss global_batch --router.balance_loss_coeff $coeff"
    [global_batch+z]="--router.bias_update_rate 0 --router.balance_loss global_batch --router.balance_loss_coeff $coeff --router.z_loss_coeff 1e-3"
    [groups]="--router.bias_update_rate 1e-3 --router.balance_loss none --router.balance_loss_coeff 0 --router.n_groups $n_groups --router.topk_groups $topk_groups"
)

ngpu=$("$py" -c "import torch; print(torch.cuda.device_count())") || exit 1
common=(--training.steps "$steps" --metrics.log_freq 1 --metrics.disable_color_printing ${EXTRA:-})
if [ "$ngpu" -ge 1 ]; then
    # One GPU per recipe: no expert parallelism, the local dispatcher.
    nproc=1
    queues=$(( ngpu >= 2 ? 2 : 1 ))
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then devices=(${CUDA_VISIBLE_DEVICES//,/ }); else devices=(0 1); fi
    common+=(--parallelism.expert_parallel_degree 1 --dispatch.backend local)
    "$py" - "$config" <<'PY' || exit 1
import sys, torch
gib = torch.cuda.get_device_properties(0).total_memory / 2**30
if "30b" in sys.argv[1] and gib < 100:
    sys.exit(f"router_recipes.sh: {sys.argv[1]} on one GPU needs ~95 GB (fp32 weights, grads, AdamW); "
             f"this GPU has {gib:.0f} GiB: use an H200")
PY
else
    nproc=${NPROC:-1}
    queues=1
    devices=("")
fi
micro=${MICRO_BATCHES:-2}
[ -n "$seq" ] && common+=(--training.seq_len "$seq")
common+=(--training.local_batch_size "$batch" --training.global_batch_size $(( batch * micro * nproc )))
echo "router recipes: $config, $steps steps of $micro micro-batches of $batch x ${seq:-(config)} tokens" \
     "per process, coeff $coeff, groups $n_groups/$topk_groups, $queues queue(s) of $nproc process(es)"

run_queue() {  # run_queue DEVICE RECIPE...: the recipes one after another on one device
    local device=$1; shift
    for name in "$@"; do
        local start=$SECONDS
        rm -rf "$out/$name"
        # shellcheck disable=SC2086  # the overrides are words
        CUDA_VISIBLE_DEVICES=$device NPROC=$nproc PYTHON=$py timeout "${TIMEOUT:-900}" \
            bash scripts/train.sh "$config" --job.dump_folder "$out/$name" "${common[@]}" ${overrides[$name]} \
            > "$out/$name.log" 2>&1
        echo "$? $(( SECONDS - start ))" > "$out/$name.status"
        echo "  $name: exit $(cut -d' ' -f1 "$out/$name.status"), $(( SECONDS - start )) s"
    done
}

for name in "${recipes[@]}"; do
    [ -n "${overrides[$name]+x}" ] || { echo "unknown recipe $name: expected one of ${!overrides[*]}"; exit 1; }
done
if [ "$queues" -eq 2 ]; then
    run_queue "${devices[0]}" $(for i in "${!recipes[@]}"; do (( i % 2 == 0 )) && echo "${recipes[$i]}"; done) &
    run_queue "${devices[1]}" $(for i in "${!recipes[@]}"; do (( i % 2 == 1 )) && echo "${recipes[$i]}"; done) &
    wait
else
    run_queue "${devices[0]}" "${recipes[@]}"
fi

"$py" - "$out" "$steps" "${recipes[@]}" > "$out/router_recipes.md" <<'PY'
import json, statistics, sys
import torch

out, steps, recipes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print("| recipe | loss at last step | loss, mean of last 10 | load CV worst layer, last step | "
      "load CV worst layer, mean of last 20 | load CV mean of layers, last 20 | busiest/mean, last 20 | "
      "dead experts, last step | balance loss | z-loss | tokens/s | wall s |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for name in recipes:
    code, wall = open(f"{out}/{name}.status").read().split()
    try:
        rows = [json.loads(line) for line in open(f"{out}/{name}/metrics.jsonl")]
    except OSError:
        rows = []
    if code != "0" or not rows or rows[-1]["step"] != steps:
        print(f"| {name} | failed (exit {code}, {len(rows)} steps logged; see {name}.log) | | | | | | | | | | {wall} |")
        continue
    last, tail20 = rows[-1], rows[-20:]
    loads = [torch.tensor(r["moe/tokens_per_expert"], dtype=torch.float64) for r in tail20]
    layer_cv = [float((l.std(dim=1, unbiased=False) / l.mean(dim=1)).mean()) for l in loads]
    fmt = lambda key: f"{last[key]:.4f}" if key in last else "-"
    tps = statistics.median(r["throughput(tps)"] for r in rows[10:]) if len(rows) > 10 else last["throughput(tps)"]
    print(f"| {name} | {last['loss']:.4f} | {statistics.mean(r['loss'] for r in rows[-10:]):.4f} "
          f"| {last['moe/load_cv']:.3f} | {statistics.mean(r['moe/load_cv'] for r in tail20):.3f} "
          f"| {statistics.mean(layer_cv):.3f} | {statistics.mean(r['moe/load_max_over_mean'] for r in tail20):.2f} "
          f"| {last['moe/dead_experts']} | {fmt('moe/balance_loss')} | {fmt('moe/z_loss')} | {tps:,.0f} | {wall} |")
PY
cat "$out/router_recipes.md"
