#!/usr/bin/env bash
# Create ./.venv and install torchtitan-moe with its test extras.
# A torch that is already installed (a GPU image's) is reused through --system-site-packages;
# otherwise torch is pinned to 2.13.0, which a CPU-only machine takes as a local CPU wheel
# instead of the several GB of CUDA packages a newer torch would pull.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv --system-site-packages .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
python -c "import torch, torchtitan, torchtitan_moe; print(f'ready: torch {torch.__version__}, torchtitan {torchtitan.__version__}, cuda {torch.cuda.is_available()}')"
