"""Triton kernels of gather_rows and combine, and their launchers.

    _gather_kernel   out [N, D]: out[inv[t, k]] = w[t, k] * src[t], pushed from each token row;
                     optionally dots[t, k] = <src[t], dot_src[inv[t, k]]> on the way (dprobs)
                     (+ _zero_pad_rows_kernel: zeros in the pad rows; rows past num_rows left alone)
    _combine_kernel  out [T, D]: out[t] = sum_k w[t, k] * src[inv[t, k]] over inv >= 0

                 forward                          backward
    gather_rows  _gather_kernel (w = 1)           _combine_kernel (w = 1)
    combine      _combine_kernel (w = probs?)     _gather_kernel (w = probs?, dots = dprobs)

One program owns BLOCK_R whole tokens and walks D in BLOCK_D steps: every output row has
one writer, and a slot's dot product (dprobs) is reduced inside one program, in a fixed
order, without atomics.
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import INTERPRET, autotune_configs, compute_dtype, round_to

_CONFIGS = autotune_configs(
    [
        triton.Config({"BLOCK_R": r, "BLOCK_D": d}, num_warps=w)
        for r, d, w in [
            (1, 1024, 4), (1, 2048, 8), (2, 1024, 4), (2, 2048, 8), (4, 512, 4),
            (4, 1024, 8), (8, 256, 4), (8, 512, 8), (16, 256, 8),
        ]
    ],
    triton.Config({"BLOCK_R": 8, "BLOCK_D": 32}),
)


# The keys leave out the row counts: they change from step to step under expert
# parallelism, and a retune per step would cost more than it wins.
@triton.autotune(configs=_CONFIGS, key=["D", "K", "HAS_WEIGHTS", "HAS_DOTS"])
@triton.jit
def _gather_kernel(
    src_ptr, inv_ptr, weights_ptr, dot_src_ptr, out_ptr, dots_ptr, T, D: tl.constexpr, K: tl.constexpr,
    KP: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_DOTS: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Pushed from the tokens: each token row is read once and stored to its K rows. Pulling
    # per output row instead reads every token K times, far apart in time (expert-major
    # order), so from DRAM: 2 N D bytes instead of T D + N D.
    tokens = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    in_bounds = tokens < T
    ks = tl.arange(0, KP)
    dots = tl.zeros([BLOCK_R, KP], dtype=COMPUTE)
    for d0 in range(0, D, BLOCK_D):
        cols = (d0 + tl.arange(0, BLOCK_D))[None, :]
        v = tl.load(src_ptr + tokens[:, None] * D + cols, mask=in_bounds[:, None] & (cols < D), other=0.0)
        v = v.to(COMPUTE)
        for k in range(K):  # each row has one writer: no atomics
            row = tl.load(inv_ptr + tokens * K + k, mask=in_bounds, other=-1).to(tl.int64)
            has_row = (row >= 0)[:, None] & (cols < D)
            out = v
            if HAS_WEIGHTS:
                out = v * tl.load(weights_ptr + tokens * K + k, mask=in_bounds, other=0.0).to(COMPUTE)[:, None]
            tl.store(out_ptr + row[:, None] * D + cols, round_to(out, out_ptr.dtype.element_ty), mask=has_row)
            if HAS_DOTS:
                other = tl.load(dot_src_ptr + row[:, None] * D + cols, mask=has_row, other=0.0).to(COMPUTE)
                dots += tl.where(ks[None, :] == k, tl.sum(v * other, axis=1)[:, None], 0.0)
    if HAS_DOTS:
        dot_mask = in_bounds[:, None] & (ks[None, :] < K)
        tl.store(dots_ptr + tokens[:, None] * K + ks[None, :], dots.to(dots_ptr.dtype.element_ty), mask=dot_mask)


@triton.jit
def _zero_pad_rows_kernel(row_slot_ptr, num_rows_ptr, out_ptr, N, D: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """Pad rows (no slot, below num_rows: inside a grouped GEMM's groups) are zeros: the pushes above
    never touch them. Rows past num_rows are read by nothing (grouped_mm takes device offsets), and
    with worst-case buffers they are most of the buffer: left as they are."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    limit = tl.load(num_rows_ptr)
    slot = tl.load(row_slot_ptr + rows, mask=rows < N, other=0)
    unowned = ((slot < 0) & (rows < limit))[:, None]
    for d0 in range(0, D, BLOCK_D):
        cols = (d0 + tl.arange(0, BLOCK_D))[None, :]
        zeros = tl.zeros([BLOCK_R, BLOCK_D], dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * D + cols, zeros, mask=unowned & (cols < D))


@triton.autotune(configs=_CONFIGS, key=["D", "K", "HAS_WEIGHTS"])
@triton.jit
def _combine_kernel(
    src_ptr, inv_ptr, weights_ptr, out_ptr, T, D: tl.constexpr, K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tokens = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    in_bounds = tokens < T
    out_row = out_ptr + tokens[:, None] * D
    for d0 in range(0, D, BLOCK_D):
        cols = (d0 + tl.arange(0, BLOCK_D))[None, :]
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=COMPUTE)
        for k in range(K):  # in k order: the same sum on every run
            row = tl.load(inv_ptr + tokens * K + k, mask=in_bounds, other=-1).to(tl.int64)
            has_row = row >= 0
            v = tl.load(src_ptr + row[:, None] * D + cols, mask=has_row[:, None] & (cols < D), other=0.0)
            v = v.to(COMPUTE)
            if HAS_WEIGHTS:
                v = v * tl.load(weights_ptr + tokens * K + k, mask=has_row, other=0.0).to(COMPUTE)[:, None]
            acc += v
        tl.store(out_row + cols, round_to(acc, out_ptr.dtype.element_ty), mask=in_bounds[:, None] & (cols < D))


def gather(src, inv, row_slot, num_rows, weights=None, dot_src=None):
    """src [T, D] -> (out [N, D], dots [T*K] or None); see _gather_kernel. num_rows: a device scalar,
    the rows the groups take; pad rows below it are zeros, rows past it undefined."""
    src, inv, row_slot = src.contiguous(), inv.contiguous(), row_slot.contiguous()
    (T, K), N, D = inv.shape, row_slot.shape[0], src.shape[1]
    out = torch.empty(N, D, dtype=src.dtype, device=src.device)
    dots = None
    if dot_src is not None:
        dot_src = dot_src.contiguous()
        dots = torch.empty(T * K, dtype=weights.dtype, device=src.device)  # slots without a row get 0
    if T > 0:
        _gather_kernel[lambda meta: (triton.cdiv(T, meta["BLOCK_R"]),)](
            src, inv, weights, dot_src, out, dots, T, D, K, triton.next_power_of_2(K),
            HAS_WEIGHTS=weights is not None, HAS_DOTS=dot_src is not None, COMPUTE=compute_dtype(src.dtype),
        )
    if N > 0:
        block_r = 8 if INTERPRET else 16
        block_d = 32 if INTERPRET else 1024
        _zero_pad_rows_kernel[(triton.cdiv(N, block_r),)](row_slot, num_rows, out, N, D, BLOCK_R=block_r,
                                                          BLOCK_D=block_d)
    return out, dots


def combine_rows(src, inv, weights=None):
    """src [N, D] -> out [T, D]; see _combine_kernel."""
    src, inv = src.contiguous(), inv.contiguous()
    (T, K), D = inv.shape, src.shape[1]
    out = torch.empty(T, D, dtype=src.dtype, device=src.device)
    _combine_kernel[lambda meta: (triton.cdiv(T, meta["BLOCK_R"]),)](
        src, inv, weights, out, T, D, K, HAS_WEIGHTS=weights is not None, COMPUTE=compute_dtype(src.dtype)
    )
    return out
