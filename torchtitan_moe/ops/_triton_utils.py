"""Helpers shared by the Triton kernels: rounding, compute dtype, autotune configs.

The kernels run compiled on a GPU and, in CI, under the Triton interpreter
(TRITON_INTERPRET=1, read when the kernel modules are imported, as @triton.jit does).
Three interpreter differences shape every kernel:

- it casts fp32 -> bf16 by truncation (and loses subnormals) where the GPU rounds to
  nearest even: every result is stored through `round_to`, which rounds the same way on both;
- its autotuner fails with several configs: `autotune_configs` gives it one;
- with numpy >= 2.4 it cannot loop to a runtime bound (`range(0, n, B)` with n a kernel
  argument): loop bounds are constexpr instead (widths and top_k are fixed in a model).

Kernels load, convert to the compute dtype (fp32; fp64 for fp64 tensors so that
gradcheck can check the kernels themselves), compute, and round once at the store.
No tl.dot, no atomics: every output element is written by exactly one program.
"""

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERPRET = tl.constexpr(INTERPRET)  # jit code may only read constexpr globals


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Convert fp32/fp64 `x` to `dtype`, rounding to nearest even."""
    if _INTERPRET and dtype == tl.bfloat16:
        # bf16 is the top half of fp32: add half an ulp (ties to even), drop the low half.
        # The result's bits are made here, not by the interpreter's cast (it loses subnormals).
        x = x.to(tl.float32)
        bits = x.to(tl.uint32, bitcast=True)
        top = tl.where(x != x, (bits >> 16) | 0x40, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)  # NaN stays NaN
        return top.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def round_stochastic_bf16(x, random_bits):
    """fp32 `x` to bf16, rounded up in magnitude with probability (dropped low bits) / 2^16, else down:
    unbiased, so small updates to a bf16 accumulator are kept on average rather than lost.
    `random_bits` uint32 of x's shape (only the low 16 bits are used). NaN and inf stay so."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + (random_bits & 0xFFFF)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded).to(tl.bfloat16)  # exact: the low 16 bits are zero


def compute_dtype(dtype: torch.dtype) -> tl.dtype:
    """Arithmetic dtype for `dtype` data: fp32, or fp64 for fp64 data (gradcheck)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def autotune_configs(configs: list[triton.Config], interpreter: triton.Config) -> list[triton.Config]:
    """`configs` on the GPU; `interpreter` alone under the interpreter."""
    return [interpreter] if INTERPRET else configs


_program_tables: dict = {}


def program_table(device: torch.device, sizes: tuple[int, ...], block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For kernels over a list of tensors in one launch, BLOCK elements a program: (the tensor [P] int32, the
    block within it [P] int32) of each program, for these sizes. A list's sizes stay the same from call to
    call (the optimizer's parameters, the experts' weights): made once on the device, then looked up."""
    key = (device, sizes, block)
    if key not in _program_tables:
        counts = torch.tensor([triton.cdiv(n, block) for n in sizes], dtype=torch.int64)
        tensors = torch.repeat_interleave(torch.arange(len(sizes)), counts)
        first = torch.cumsum(counts, 0) - counts  # each tensor's first program
        index = torch.arange(int(counts.sum())) - first[tensors]
        _program_tables[key] = (tensors.to(torch.int32).to(device), index.to(torch.int32).to(device))
    return _program_tables[key]


def device_table(rows: list[int], device: torch.device) -> torch.Tensor:
    """int64 rows (addresses, sizes, seeds) on the device without a host sync: from pinned memory on CUDA (a
    copy from pageable memory would wait for the stream)."""
    if device.type != "cuda":
        return torch.tensor(rows, dtype=torch.int64)
    return torch.tensor(rows, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)
