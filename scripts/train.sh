#!/usr/bin/env bash
# Launch training on this node: bash scripts/train.sh CONFIG [--section.key value ...]
# One process per GPU; on a machine without GPUs, NPROC CPU processes over gloo (default 2).
# Only rank LOG_RANK (default 0) prints.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:?usage: scripts/train.sh CONFIG [--section.key value ...]}
shift
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
nproc=${NPROC:-$("$py" -c "import torch; print(torch.cuda.device_count() or 2)")}
[ -t 1 ] || export NO_COLOR=1  # colour codes only on a terminal
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # torchrun's default, set here so it prints no banner about it
# The config check first (the config, the data, the checkpoint to resume, the run folder): a refusal is its
# one line and exit status 2, with no launcher report.
"$py" -m torchtitan_moe.tools.check_config "$config" --nproc "$nproc" "$@" > /dev/null || exit $?
# torchrun, whose training processes die with it and whose failures are one line (train/launch.py).
exec "$py" -m torchtitan_moe.train.launch --standalone --nproc_per_node "$nproc" \
    --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3 \
    -m torchtitan_moe.train --job.config_file "$config" "$@"
