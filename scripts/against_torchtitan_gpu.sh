#!/usr/bin/env bash
# Ours against torchtitan 0.2.2's Qwen3-MoE from identical weights on one GPU:
#   bash scripts/against_torchtitan_gpu.sh OUT [CONFIG] [STEPS] [-- overrides]
# ONLY="ours as torchtitan;ours" (';'-separated setting names) trains a subset besides torchtitan,
# so the 7 runs of 30b-a3b-8l can be split over calls; OUT gets parity.md, parity.png, the logs.
# DETERMINISTIC=1: torch's deterministic algorithms in every run, torchtitan trained twice (bitwise).
set -uo pipefail
out=${1:?usage: scripts/against_torchtitan_gpu.sh OUT [CONFIG] [STEPS] [-- overrides]}
config=${2:-configs/qwen3_30b_a3b_8l.toml}
steps=${3:-200}
shift $(( $# < 3 ? $# : 3 )); [ "${1:-}" = "--" ] && shift
cd "$(dirname "$0")/.."
only=()
IFS=';' read -ra names <<< "${ONLY:-}"
for n in "${names[@]}"; do only+=(--only "$n"); done
mkdir -p "$out"
${PYTHON:-python3} -m torchtitan_moe.tools.parity "$config" --against torchtitan --steps "$steps" --nproc 1 "${only[@]}" \
    ${DETERMINISTIC:+--deterministic} \
    --out "$out" -- --parallelism.expert_parallel_degree 1 --dispatch.backend auto "$@"
