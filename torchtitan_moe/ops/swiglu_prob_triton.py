"""Triton kernels of swiglu_prob, forward and backward, and their launchers.

One program owns BLOCK_R whole rows and walks the I columns in BLOCK_I steps, reading
a and b from the two contiguous halves of each ab row. Owning whole rows lets the
backward reduce dprobs inside the program, in a fixed order, without atomics. silu is
recomputed from ab in the backward instead of saving h. Rows >= num_rows are never read
(masked loads) nor written in h and dab: they are the tail of a worst-case-sized buffer, which
the grouped GEMMs never read either (they stop at their last offset); dprobs is 0 there.
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import autotune_configs, compute_dtype, round_to

_CONFIGS = autotune_configs(
    [
        triton.Config({"BLOCK_R": r, "BLOCK_I": i}, num_warps=w)
        for r, i, w in [
            (1, 1024, 4), (2, 1024, 8), (2, 512, 4), (4, 512, 8), (4, 256, 4), (8, 256, 8), (16, 128, 8),
        ]
    ],
    triton.Config({"BLOCK_R": 4, "BLOCK_I": 16}),
)


@triton.jit
def _row_block(num_rows_ptr, N, BLOCK_R: tl.constexpr):
    """This program's rows, which of them hold data (r < num_rows), and which exist (r < N)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    end = N if num_rows_ptr is None else tl.load(num_rows_ptr)
    return rows, rows < end, rows < N


# The key leaves out N: it changes from step to step under expert parallelism.
@triton.autotune(configs=_CONFIGS, key=["I"])
@triton.jit
def _swiglu_prob_fwd_kernel(
    ab_ptr, probs_ptr, num_rows_ptr, h_ptr, N, I: tl.constexpr,
    COMPUTE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
):
    rows, valid, _ = _row_block(num_rows_ptr, N, BLOCK_R)
    p = tl.load(probs_ptr + rows, mask=valid, other=0.0).to(COMPUTE)[:, None]
    ab_row = ab_ptr + rows.to(tl.int64)[:, None] * (2 * I)
    h_row = h_ptr + rows.to(tl.int64)[:, None] * I
    for i0 in range(0, I, BLOCK_I):
        cols = (i0 + tl.arange(0, BLOCK_I))[None, :]
        read = valid[:, None] & (cols < I)
        a = tl.load(ab_row + cols, mask=read, other=0.0).to(COMPUTE)
        b = tl.load(ab_row + I + cols, mask=read, other=0.0).to(COMPUTE)
        h = a * tl.sigmoid(a) * b * p
        tl.store(h_row + cols, round_to(h, h_ptr.dtype.element_ty), mask=read)


@triton.autotune(configs=_CONFIGS, key=["I"])
@triton.jit
def _swiglu_prob_bwd_kernel(
    dh_ptr, ab_ptr, probs_ptr, num_rows_ptr, dab_ptr, dprobs_ptr, N, I: tl.constexpr,
    COMPUTE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
):
    rows, valid, in_bounds = _row_block(num_rows_ptr, N, BLOCK_R)
    p = tl.load(probs_ptr + rows, mask=valid, other=0.0).to(COMPUTE)[:, None]
    ab_row = ab_ptr + rows.to(tl.int64)[:, None] * (2 * I)
    dab_row = dab_ptr + rows.to(tl.int64)[:, None] * (2 * I)
    dh_row = dh_ptr + rows.to(tl.int64)[:, None] * I
    dp = tl.zeros([BLOCK_R], dtype=COMPUTE)
    for i0 in range(0, I, BLOCK_I):
        cols = (i0 + tl.arange(0, BLOCK_I))[None, :]
        read = valid[:, None] & (cols < I)
        a = tl.load(ab_row + cols, mask=read, other=0.0).to(COMPUTE)
        b = tl.load(ab_row + I + cols, mask=read, other=0.0).to(COMPUTE)
        dh = tl.load(dh_row + cols, mask=read, other=0.0).to(COMPUTE)
        sig = tl.sigmoid(a)
        silu = a * sig
        dp += tl.sum(dh * silu * b, axis=1)
        dsilu = sig * (1.0 + a * (1.0 - sig))
        tl.store(dab_row + cols, round_to(dh * p * b * dsilu, dab_ptr.dtype.element_ty), mask=read)
        tl.store(dab_row + I + cols, round_to(dh * p * silu, dab_ptr.dtype.element_ty), mask=read)
    tl.store(dprobs_ptr + rows, dp.to(dprobs_ptr.dtype.element_ty), mask=in_bounds)


def _grid(N):
    return lambda meta: (triton.cdiv(N, meta["BLOCK_R"]),)


def swiglu_prob_fwd(ab, probs, num_rows):
    """ab [N, 2I], probs [N], num_rows [] or None -> h [N, I] (rows >= num_rows not written)."""
    ab, probs = ab.contiguous(), probs.contiguous()
    N, I = ab.shape[0], ab.shape[1] // 2
    h = torch.empty(N, I, dtype=ab.dtype, device=ab.device)
    _swiglu_prob_fwd_kernel[_grid(N)](ab, probs, num_rows, h, N, I, COMPUTE=compute_dtype(ab.dtype))
    return h


def swiglu_prob_bwd(dh, ab, probs, num_rows):
    """-> dab [N, 2I] (rows >= num_rows not written), dprobs [N] (0 there)."""
    ab, probs = ab.contiguous(), probs.contiguous()
    N, I = ab.shape[0], ab.shape[1] // 2
    dab = torch.empty(N, 2 * I, dtype=ab.dtype, device=ab.device)
    dprobs = torch.empty(N, dtype=probs.dtype, device=probs.device)
    _swiglu_prob_bwd_kernel[_grid(N)](
        dh.contiguous(), ab, probs, num_rows, dab, dprobs, N, I, COMPUTE=compute_dtype(ab.dtype)
    )
    return dab, dprobs
