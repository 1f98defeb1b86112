"""Triton kernels of gather_rows and combine, and their autograd functions.

    _gather_kernel   out [N, D]: out[r] = w[s] * src[s // K] for s = row_slot[r] >= 0, else 0;
                     optionally dots[s] = <src[s // K], dot_src[r]> on the way (dprobs)
    _combine_kernel  out [T, D]: out[t] = sum_k w[t, k] * src[inv[t, k]] over inv >= 0

                 forward                          backward
    gather_rows  _gather_kernel (w = 1)           _combine_kernel (w = 1)
    combine      _combine_kernel (w = probs?)     _gather_kernel (w = probs?, dots = dprobs)

One program owns BLOCK_R whole output rows and walks D in BLOCK_D steps, so a row's dot
product (dprobs) is reduced inside one program, in a fixed order, without atomics.
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import autotune_configs, compute_dtype, round_to

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


# The key leaves out the row counts: they change from step to step under expert
# parallelism, and a retune per step would cost more than it wins.
@triton.autotune(configs=_CONFIGS, key=["D", "K", "HAS_WEIGHTS", "HAS_DOTS"])
@triton.jit
def _gather_kernel(
    src_ptr, row_slot_ptr, weights_ptr, dot_src_ptr, out_ptr, dots_ptr, N, D: tl.constexpr, K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr, HAS_DOTS: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_bounds = rows < N
    slot = tl.load(row_slot_ptr + rows, mask=in_bounds, other=-1).to(tl.int64)
    has_slot = slot >= 0  # pad and tail rows: nothing read, zeros written
    src_row = src_ptr + (slot // K)[:, None] * D
    out_row = out_ptr + rows.to(tl.int64)[:, None] * D
    if HAS_WEIGHTS:
        w = tl.load(weights_ptr + slot, mask=has_slot, other=0.0).to(COMPUTE)[:, None]
    dot = tl.zeros([BLOCK_R], dtype=COMPUTE)
    for d0 in range(0, D, BLOCK_D):
        cols = (d0 + tl.arange(0, BLOCK_D))[None, :]
        read = has_slot[:, None] & (cols < D)
        v = tl.load(src_row + cols, mask=read, other=0.0).to(COMPUTE)
        if HAS_DOTS:
            other = tl.load(dot_src_ptr + rows.to(tl.int64)[:, None] * D + cols, mask=read, other=0.0)
            dot += tl.sum(v * other.to(COMPUTE), axis=1)
        if HAS_WEIGHTS:
            v = v * w
        tl.store(out_row + cols, round_to(v, out_ptr.dtype.element_ty), mask=in_bounds[:, None] & (cols < D))
    if HAS_DOTS:
        tl.store(dots_ptr + slot, dot.to(dots_ptr.dtype.element_ty), mask=has_slot)


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


def gather(src, row_slot, top_k, weights=None, dot_src=None):
    """src [T, D] -> (out [N, D], dots [T*K] or None); see _gather_kernel."""
    src, row_slot = src.contiguous(), row_slot.contiguous()
    N, D = row_slot.shape[0], src.shape[1]
    out = torch.empty(N, D, dtype=src.dtype, device=src.device)
    dots = None
    if dot_src is not None:
        dot_src = dot_src.contiguous()
        dots = torch.zeros(src.shape[0] * top_k, dtype=weights.dtype, device=src.device)  # slots without a row: 0
    _gather_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_R"]),)](
        src, row_slot, weights, dot_src, out, dots, N, D, top_k,
        HAS_WEIGHTS=weights is not None, HAS_DOTS=dot_src is not None, COMPUTE=compute_dtype(src.dtype),
    )
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


class GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, row_slot, inv):
        ctx.save_for_backward(inv)
        return gather(x, row_slot, inv.shape[1])[0]

    @staticmethod
    def backward(ctx, dxs):
        (inv,) = ctx.saved_tensors
        return combine_rows(dxs, inv), None, None


class Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, probs, inv, row_slot):
        probs = None if probs is None else probs.contiguous()
        need_dprobs = probs is not None and ctx.needs_input_grad[1]
        ctx.save_for_backward(y if need_dprobs else None, probs, row_slot)
        ctx.top_k = inv.shape[1]
        return combine_rows(y, inv, probs)

    @staticmethod
    def backward(ctx, dout):
        y, probs, row_slot = ctx.saved_tensors
        dy, dots = gather(dout, row_slot, ctx.top_k, weights=probs, dot_src=y)
        return dy, None if dots is None else dots.view_as(probs), None, None
