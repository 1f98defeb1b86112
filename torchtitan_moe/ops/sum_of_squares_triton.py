"""Triton kernel of sum_of_squares: every tensor of a list in one launch, one fp32 partial sum a program.

Each program owns BLOCK contiguous elements of one tensor, found through the program table (the tensor,
the block within it) and the tensor's row of the device table (address, size); it widens them to fp32,
squares and sums them, and stores the sum. torch then sums the partials (a fixed order: deterministic).
BLOCK is larger than the update's (ops/adamw_triton.py), since a program here reads 2-4 bytes an element
and writes nothing but its sum.
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import device_table, program_table

BLOCK, NUM_WARPS = 4096, 8
ROW = 2  # a tensor's row of the table: address, numel
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _squares_kernel(table_ptr, block_tensor_ptr, block_index_ptr, partial_ptr, DTYPE: tl.constexpr,
                    ROW: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = table_ptr + tl.load(block_tensor_ptr + pid).to(tl.int64) * ROW
    ptr = tl.load(row).to(tl.pointer_type(DTYPE))
    n = tl.load(row + 1)
    offs = tl.load(block_index_ptr + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, tl.sum(x * x, axis=0))


def sum_of_squares_triton(tensors: list[torch.Tensor], block: int = BLOCK, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """tensors: one dtype. block, num_warps: for benchmarks that sweep them; the op uses the defaults."""
    sizes = tuple(t.numel() for t in tensors)
    device = tensors[0].device
    if not sum(sizes):
        return torch.zeros((), dtype=torch.float32, device=device)
    block_tensor, block_index = program_table(device, sizes, block)
    rows = []
    for t, n in zip(tensors, sizes):
        rows += [t.data_ptr(), n]
    partial = torch.empty(block_tensor.numel(), dtype=torch.float32, device=device)
    _squares_kernel[(block_tensor.numel(),)](device_table(rows, device), block_tensor, block_index, partial,
                                             DTYPE=_TL[tensors[0].dtype], ROW=ROW, BLOCK=block, num_warps=num_warps)
    return partial.sum()
