"""grouped_mm: the experts' GEMM, y[r] = x[r] @ w[e] for the rows r of expert e's group.

    x        [N, D]     rows in expert-major order (rows >= offsets[-1] are never read)
    w        [E, D, F]  one matrix per expert (a transposed view of the weight is fine), x's dtype
    offsets  [E] int32  END row of each expert's group (ops.routing_index's offsets)
    -> y     [N, F]     rows >= offsets[-1] are left undefined

A custom op around `torch._grouped_mm`, with a fake implementation and registered
autograd, so torch.compile sees one opaque node of known shape. The aten op alone does not
compile for float32 (its meta function asks for bf16, though the CPU kernel takes fp32),
and its backward is two more grouped GEMMs, which this op's backward calls by name:

    dx = grouped_mm(dy, w^T)    dw[e] = x[group e]^T @ dy[group e]   (grouped_mm_weight)

dw is computed in w's memory layout (for a transposed view of an [E, F, D] weight, as
dy^T @ x, then viewed back), so accumulating it never transposes a whole weight.
"""

from __future__ import annotations

import torch

from ._library import custom_op


def _check_args(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_mm: x must be [N, D] and w [E, D, F], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_mm: w must have x's dtype, got x {x.dtype} and w {w.dtype}")
    if offsets.dim() != 1 or offsets.shape[0] != w.shape[0] or offsets.dtype != torch.int32:
        raise ValueError(f"grouped_mm: offsets must be int32 [E = {w.shape[0]}], got {tuple(offsets.shape)} {offsets.dtype}")
    if not x.device == w.device == offsets.device:
        raise ValueError(f"grouped_mm: x, w and offsets must share a device, got {x.device}, {w.device}, {offsets.device}")


@custom_op("torchtitan_moe::grouped_mm")
def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x.contiguous(), w, offs=offsets)


@_grouped_mm.register_fake
def _(x, w, offsets):
    return x.new_empty(x.shape[0], w.shape[2])


@custom_op("torchtitan_moe::grouped_mm_weight")
def _grouped_mm_weight(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [N, D], dy [N, F] -> dw [E, D, F]; an expert without rows gets zeros."""
    return torch._grouped_mm(x.t(), dy, offs=offsets)


@_grouped_mm_weight.register_fake
def _(x, dy, offsets):
    return x.new_empty(offsets.shape[0], x.shape[1], dy.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, dy):
    x, w, offsets = ctx.saved_tensors
    dy = dy.contiguous()  # grouped_mm needs 16-byte aligned strides; an autograd seed may be expanded
    dx = _grouped_mm(dy, w.transpose(-2, -1), offsets) if ctx.needs_input_grad[0] else None
    dw = None
    if ctx.needs_input_grad[1]:
        if w.stride(-2) == 1 and w.stride(-1) != 1:
            # w is the transposed view of a weight stored [E, F, D] (the experts' layout): compute
            # dw in that layout, so the gradient has the weight's strides. A [E, D, F] gradient
            # would cost a transposing elementwise pass over the whole weight when it is
            # accumulated (15% of the layer at dim 4096, expert dim 14336).
            dw = _grouped_mm_weight(dy, x, offsets).transpose(-2, -1)
        else:
            dw = _grouped_mm_weight(x, dy, offsets)
    return dx, dw, None


_grouped_mm.register_autograd(_backward, setup_context=_setup_context)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """y [N, F] = x [N, D] @ w[e] [D, F] per expert group; see the module docstring."""
    _check_args(x, w, offsets)
    return _grouped_mm(x, w, offsets)
