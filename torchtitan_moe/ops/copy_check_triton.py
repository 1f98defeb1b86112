"""Triton kernel of copies_differ: every (weight, copy) pair of a list in one launch.

Each program owns BLOCK contiguous elements of one pair, found through the program table (the pair,
the block within it) and the pair's row of the device table (weight and copy addresses, size); it
rounds the weights to the copy's dtype as a cast does (to nearest even), compares bits, and stores
one flag. The flags of a pair's programs are then reduced on the device (no host sync here).
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import device_table, program_table, round_to

BLOCK, NUM_WARPS = 1024, 4
ROW = 3  # a pair's row of the table: weight address, copy address, numel
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _differ_kernel(table_ptr, block_pair_ptr, block_index_ptr, flags_ptr, COPY: tl.constexpr, ROW: tl.constexpr,
                   BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = table_ptr + tl.load(block_pair_ptr + pid).to(tl.int64) * ROW
    weight_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
    copy_ptr = tl.load(row + 1).to(tl.pointer_type(COPY))
    n = tl.load(row + 2)
    offs = tl.load(block_index_ptr + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    copy = tl.load(copy_ptr + offs, mask=mask, other=0.0)
    wide = copy.to(tl.float32)  # NaN tests in fp32 (the interpreter compares bf16 by its bits)
    same = (round_to(weight, COPY).to(tl.int16, bitcast=True) == copy.to(tl.int16, bitcast=True)) | (
        (weight != weight) & (wide != wide))
    tl.store(flags_ptr + pid, tl.max((~same & mask).to(tl.int32), axis=0))


def copies_differ_triton(weights: list[torch.Tensor], copies: list[torch.Tensor]) -> torch.Tensor:
    sizes = tuple(w.numel() for w in weights)
    device = weights[0].device
    differ = torch.zeros(len(weights), dtype=torch.int32, device=device)
    if not sum(sizes):
        return differ.bool()
    block_pair, block_index = program_table(device, sizes, BLOCK)
    rows = []
    for w, c, n in zip(weights, copies, sizes):
        rows += [w.data_ptr(), c.data_ptr(), n]
    flags = torch.empty(block_pair.numel(), dtype=torch.int32, device=device)
    _differ_kernel[(block_pair.numel(),)](device_table(rows, device), block_pair, block_index, flags,
                                          COPY=_TL[copies[0].dtype], ROW=ROW, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return differ.scatter_reduce_(0, block_pair.long(), flags, "amax").bool()
