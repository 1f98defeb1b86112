"""Shared helpers for the op files: backend choice, device checks, rounding.

Kernels run either on a CUDA GPU or, in CI, under the Triton interpreter
(TRITON_INTERPRET=1, CPU tensors). The interpreter differs from the GPU in ways
that matter for bit-level tests, so every kernel funnels its final cast through
`round_to` and asks `autotune_configs` for its config list.
"""

import os

import torch
import triton
import triton.language as tl

# Read once at import, like @triton.jit does when it decides to interpret.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERPRET = tl.constexpr(INTERPRET)  # jit code may only read constexpr globals

BACKENDS = ("triton", "torch")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def check_triton_device(name: str, t: torch.Tensor) -> None:
    """backend="triton" needs CUDA tensors, or any tensors under the interpreter."""
    if INTERPRET:
        return
    if not torch.cuda.is_available():
        raise RuntimeError(
            "backend='triton' needs a CUDA GPU or TRITON_INTERPRET=1; use backend='torch'"
        )
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor for backend='triton', got device {t.device}")


def autotune_configs(configs: list) -> list:
    """All configs on GPU; the first one under the interpreter (it cannot autotune)."""
    return configs[:1] if INTERPRET else configs


def compute_dtype(dtype: torch.dtype):
    """fp32 arithmetic for 16/32-bit data; fp64 data (gradcheck) keeps fp64."""
    return tl.float64 if dtype == torch.float64 else tl.float32


TL_DTYPE = {
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Cast fp32/fp64 `x` to `dtype` with round-to-nearest-even.

    The GPU cast already rounds to nearest even. The interpreter truncates
    fp32 -> bf16, so there we round the fp32 bits by hand: add 0x7FFF plus the
    lowest kept bit, then drop the low 16 bits (exact after that).
    """
    if _INTERPRET and dtype == tl.bfloat16:
        x = x.to(tl.float32)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        rounded = bits.to(tl.float32, bitcast=True)
        return tl.where(x != x, x, rounded).to(dtype)  # keep NaN a NaN
    return x.to(dtype)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """The references' arithmetic dtype: fp32, or fp64 for fp64 data (gradcheck)."""
    return t if t.dtype == torch.float64 else t.float()
