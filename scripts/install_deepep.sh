#!/usr/bin/env bash
# Build DeepEP (v1 intranode API) and install it into the active Python environment:
#   bash scripts/install_deepep.sh [SRC]
# SRC: a DeepEP source tree at the pinned commit (DEEPEP_COMMIT in torchtitan_moe/dispatch/deepep_backend.py);
#      without it the pinned commit is cloned (needs network).
# DEEPEP_TARGET=DIR  install into DIR (pip --target) instead; then put DIR on PYTHONPATH.
# For Hopper (TORCH_CUDA_ARCH_LIST=9.0 unless set). NVSHMEM comes from the pip package
# nvidia-nvshmem-cu13 (or -cu12; NVSHMEM_DIR overrides); CUDA 13 needs its CCCL headers on CPATH.
# No build isolation: it compiles against the installed torch, without network. About a minute.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python}
commit=$(sed -n 's/^DEEPEP_COMMIT = "\([0-9a-f]*\)".*/\1/p' "$repo/torchtitan_moe/dispatch/deepep_backend.py")
src=${1:-}

if [ -z "$src" ]; then
    src=$(mktemp -d)/DeepEP
    echo "install_deepep: cloning DeepEP $commit into $src"
    git clone --quiet https://github.com/deepseek-ai/DeepEP "$src"
    git -C "$src" checkout --quiet "$commit"
fi
src=$(cd "$src" && pwd)
if [ ! -f "$src/setup.py" ] || [ ! -f "$src/deep_ep/buffer.py" ]; then
    echo "install_deepep: $src is not a DeepEP v1 source tree (no setup.py or deep_ep/buffer.py); use commit $commit" >&2
    exit 2
fi

# NVSHMEM: the pip wheel's folder (include/ and lib/). DeepEP's setup.py links -l:libnvshmem_host.so
# when NVSHMEM_DIR is set, and the wheel ships only libnvshmem_host.so.N: add the unversioned link.
if [ -z "${NVSHMEM_DIR:-}" ]; then
    NVSHMEM_DIR=$("$py" - <<'PY'
import glob, importlib.util, os
try:
    spec = importlib.util.find_spec("nvidia.nvshmem")
except ImportError:
    spec = None
roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
for root in roots + [os.path.dirname(os.path.dirname(p)) for r in roots for p in glob.glob(f"{r}/**/libnvshmem_host.so*", recursive=True)]:
    if glob.glob(f"{root}/lib/libnvshmem_host.so*") and os.path.isdir(f"{root}/include"):
        print(root)
        break
PY
)
fi
if [ -z "$NVSHMEM_DIR" ]; then
    echo "install_deepep: no NVSHMEM found: pip install nvidia-nvshmem-cu13 (or -cu12), or set NVSHMEM_DIR" >&2
    exit 2
fi
host_lib=$(cd "$NVSHMEM_DIR/lib" && ls libnvshmem_host.so* | sort | head -n 1)
if [ ! -e "$NVSHMEM_DIR/lib/libnvshmem_host.so" ]; then
    ln -s "$host_lib" "$NVSHMEM_DIR/lib/libnvshmem_host.so"
fi
export NVSHMEM_DIR

cuda_home=${CUDA_HOME:-/usr/local/cuda}
if [ -d "$cuda_home/include/cccl" ]; then  # CUDA 13 moved cuda/std and friends here
    export CPATH="$cuda_home/include/cccl${CPATH:+:$CPATH}"
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

echo "install_deepep: building $src (arch $TORCH_CUDA_ARCH_LIST, NVSHMEM $NVSHMEM_DIR)"
target=()
if [ -n "${DEEPEP_TARGET:-}" ]; then
    mkdir -p "$DEEPEP_TARGET"
    target=(--target "$DEEPEP_TARGET" --upgrade)
fi
"$py" -m pip install --no-build-isolation --no-deps ${target[@]+"${target[@]}"} "$src"

check_path=${DEEPEP_TARGET:+$DEEPEP_TARGET:}${PYTHONPATH:-}
PYTHONPATH=$check_path "$py" -c "import deep_ep; print(f'install_deepep: ok, deep_ep at {deep_ep.__file__}, Buffer.get_dispatch_layout: {hasattr(deep_ep.Buffer, \"get_dispatch_layout\")}')"
