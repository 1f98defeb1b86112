#!/usr/bin/env bash
# Create ./.venv and install torchtitan-moe with its test extras.
# A torch that is already installed (a GPU image's) is reused through --system-site-packages.
# Otherwise torch==2.13.0 is installed from pip's configured indexes: where pip finds a CPU
# wheel (a local wheelhouse, or TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu) that is
# ~200 MB; from the public index alone it is the CUDA build, which also pulls several GB of
# nvidia-* wheels (cuDNN, cuBLAS, NCCL, ...) and runs on the CPU all the same.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv --system-site-packages .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
python -m pip install -q -e ".[test]"
python -c "import torch, torchtitan, torchtitan_moe; print(f'ready: torch {torch.__version__}, torchtitan {torchtitan.__version__}, cuda {torch.cuda.is_available()}')"
