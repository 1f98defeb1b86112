"""gather_rows and combine: move token rows into and out of the expert-major layout.

    gather_rows(x [T, D], index)              -> xs  [N, D]  xs[r] = x[row_slot[r] // K]
    combine(y [N, D], index, probs [T, K]?)   -> out [T, D]  out[t] = sum_k w[t, k] * y[inv[t, k]]

w = probs, or 1 without probs (the weighted form is for dispatchers that apply the router
probability after the experts). The two ops are adjoint: gather_rows' backward is an
unweighted combine and combine's backward a (weighted) gather, so the Triton backend has
two gather-based kernels: each output row is owned by one program, no atomics, the same
bits on every run. Sums over k accumulate in fp32 in k order.

`index` is a RoutingIndex, or anything with its fields inv [T, K], row_slot [N] (int32 or
int64), num_rows (a device scalar) and top_k. Pad rows (row_slot = -1) and tail rows
(r >= num_rows, garbage from torch._grouped_mm) are never read: only rows named by inv are.
Pad rows of xs and of combine's input gradient are written as zeros (they sit inside the
grouped GEMMs' groups); tail rows are left undefined with the Triton kernels (nothing reads
them, and with worst-case buffers they are most of the buffer), zeros with the torch
reference. Slots with inv = -1 add nothing.
"""

from __future__ import annotations

import torch

from ._backend import use_triton
from ._library import custom_op

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def _check_index(index, device: torch.device, num_tokens: int | None = None, num_rows: int | None = None) -> None:
    inv, row_slot = index.inv, index.row_slot
    if inv.dim() != 2 or inv.dtype not in INDEX_DTYPES:
        raise ValueError(f"index.inv must be a 2-D int32/int64 tensor, got {tuple(inv.shape)} {inv.dtype}")
    if row_slot.dim() != 1 or row_slot.dtype not in INDEX_DTYPES:
        raise ValueError(f"index.row_slot must be a 1-D int32/int64 tensor, got {tuple(row_slot.shape)} {row_slot.dtype}")
    if inv.shape[1] != index.top_k:
        raise ValueError(f"index.inv must have top_k = {index.top_k} columns, got {inv.shape[1]}")
    if num_tokens is not None and inv.shape[0] != num_tokens:
        raise ValueError(f"index.inv has {inv.shape[0]} tokens, the data has {num_tokens}")
    if num_rows is not None and row_slot.shape[0] != num_rows:
        raise ValueError(f"index.row_slot has {row_slot.shape[0]} rows, the data has {num_rows}")
    for name, t in (("index.inv", inv), ("index.row_slot", row_slot)):
        if t.device != device:
            raise ValueError(f"{name} must be on {device}, got {t.device}")


def _check_data(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be a 2-D float tensor, got {tuple(t.shape)} {t.dtype}")


def _check_probs(probs: torch.Tensor, inv: torch.Tensor) -> None:
    if probs.shape != inv.shape or probs.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"probs must be float32 (or float64) of shape {tuple(inv.shape)}, got {tuple(probs.shape)} {probs.dtype}"
        )
    if probs.device != inv.device:
        raise ValueError(f"probs must be on {inv.device}, got {probs.device}")


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """fp32 for arithmetic; fp64 stays fp64 (gradcheck)."""
    return t.to(_compute_dtype(t.dtype))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# --------------------------------------------------------------------------- references


def gather_rows_reference(x: torch.Tensor, index) -> torch.Tensor:
    """Plain torch, in fp32 (autograd's backward then sums dx in fp32). Each slot puts its token's
    row at its row (slots without one at a dummy row), so the backward is a gather: a gather by
    row_slot would send every pad and tail row's gradient to token 0, and autograd's indexing
    backward serializes repeated indices (seconds a step at EP = 2 with worst-case buffers)."""
    inv = index.inv.reshape(-1).long()  # [T K]
    rows = index.row_slot.shape[0]
    xf = _upcast(x)
    per_slot = xf.unsqueeze(1).expand(-1, index.top_k, -1).reshape(-1, x.shape[1])  # [T K, D]
    target = torch.where(inv >= 0, inv, rows)
    return xf.new_zeros(rows + 1, x.shape[1]).index_put((target,), per_slot)[:rows].to(x.dtype)


def combine_reference(y: torch.Tensor, index, probs: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, summed in fp32 in k order. Each row is put at its slot (pad and tail rows at a
    dummy slot), so the backward is a gather (see gather_rows_reference), and a slot without a
    row adds an exact 0 whatever the rows hold (a NaN tail included)."""
    T, K = index.inv.shape
    slot = index.row_slot.long()
    target = torch.where(slot >= 0, slot, T * K)
    yf = _upcast(y)
    per_slot = yf.new_zeros(T * K + 1, y.shape[1]).index_put((target,), yf)[: T * K].view(T, K, y.shape[1])
    out = torch.zeros(T, y.shape[1], dtype=yf.dtype, device=y.device)
    for k in range(K):
        out = out + (per_slot[:, k] if probs is None else per_slot[:, k] * probs[:, k, None])
    return out.to(y.dtype)


# --------------------------------------------------------------------------- ops


# ---------------------------------------------------------------------------- Triton ops
# Opaque nodes for torch.compile: custom ops with fake implementations and autograd. The
# kernels' module is imported inside, on first use: backend="torch" needs no Triton.
# gather_rows' backward is the unweighted combine; combine's is a weighted gather that
# also reduces dprobs (combine_backward).


@custom_op("torchtitan_moe::gather_rows")
def _gather_rows_triton(x: torch.Tensor, row_slot: torch.Tensor, inv: torch.Tensor, num_rows: torch.Tensor) -> torch.Tensor:
    from .combine_triton import gather

    return gather(x, inv, row_slot, num_rows)[0]


@_gather_rows_triton.register_fake
def _(x, row_slot, inv, num_rows):
    return x.new_empty(row_slot.shape[0], x.shape[1])


def _gather_rows_setup(ctx, inputs, output) -> None:
    _, row_slot, inv, num_rows = inputs
    ctx.save_for_backward(row_slot, inv, num_rows)


def _gather_rows_backward(ctx, dxs):
    row_slot, inv, num_rows = ctx.saved_tensors
    return _combine_triton(dxs, inv, row_slot, num_rows, None), None, None, None


_gather_rows_triton.register_autograd(_gather_rows_backward, setup_context=_gather_rows_setup)


@custom_op("torchtitan_moe::combine")
def _combine_triton(
    y: torch.Tensor, inv: torch.Tensor, row_slot: torch.Tensor, num_rows: torch.Tensor, probs: torch.Tensor | None
) -> torch.Tensor:
    from .combine_triton import combine_rows

    return combine_rows(y, inv, None if probs is None else probs.contiguous())


@_combine_triton.register_fake
def _(y, inv, row_slot, num_rows, probs):
    return y.new_empty(inv.shape[0], y.shape[1])


@custom_op("torchtitan_moe::combine_backward")
def _combine_backward(
    dout: torch.Tensor, inv: torch.Tensor, row_slot: torch.Tensor, num_rows: torch.Tensor,
    probs: torch.Tensor | None, y: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> dy [N, D] (rows past num_rows undefined), dprobs [T, K] (empty [0] unless both probs and y are given)."""
    from .combine_triton import gather

    dy, dots = gather(dout, inv, row_slot, num_rows, weights=None if probs is None else probs.contiguous(), dot_src=y)
    return dy, dout.new_empty(0, dtype=torch.float32) if dots is None else dots.view(inv.shape)


@_combine_backward.register_fake
def _(dout, inv, row_slot, num_rows, probs, y):
    dy = dout.new_empty(row_slot.shape[0], dout.shape[1])
    if probs is None or y is None:
        return dy, dout.new_empty(0, dtype=torch.float32)
    return dy, torch.empty_like(probs)


def _combine_setup(ctx, inputs, output) -> None:
    y, inv, row_slot, num_rows, probs = inputs
    need_dprobs = probs is not None and ctx.needs_input_grad[4]
    ctx.save_for_backward(y if need_dprobs else None, inv, row_slot, num_rows, probs)


def _combine_backward_fn(ctx, dout):
    y, inv, row_slot, num_rows, probs = ctx.saved_tensors
    dy, dprobs = _combine_backward(dout, inv, row_slot, num_rows, probs, y)
    return dy, None, None, None, dprobs if y is not None else None


_combine_triton.register_autograd(_combine_backward_fn, setup_context=_combine_setup)


def gather_rows(x: torch.Tensor, index, *, backend: str = "triton") -> torch.Tensor:
    """xs [N, D]: the token rows of x [T, D] in expert-major order; zeros for pad rows, rows past
    index.num_rows undefined (zeros with the torch reference)."""
    _check_data("x", x)
    _check_index(index, x.device, num_tokens=x.shape[0])
    if not use_triton(backend, x):
        return gather_rows_reference(x, index)
    return _gather_rows_triton(x, index.row_slot, index.inv, index.num_rows)


def combine(y: torch.Tensor, index, probs: torch.Tensor | None = None, *, backend: str = "triton") -> torch.Tensor:
    """out [T, D] in y.dtype: sum over k of (probs[t, k] or 1) * y[inv[t, k]], fp32 accumulation."""
    _check_data("y", y)
    _check_index(index, y.device, num_rows=y.shape[0])
    if probs is not None:
        _check_probs(probs, index.inv)
    if not use_triton(backend, y):
        return combine_reference(y, index, probs)
    return _combine_triton(y, index.inv, index.row_slot, index.num_rows, probs)


def combine_tokens(y: torch.Tensor, index, start: int, end: int, *, backend: str = "triton") -> torch.Tensor:
    """combine(y, index)[start:end] without the other tokens' work where the kernel allows (the Triton
    kernel reads only these tokens' inv rows; the reference combines all tokens and slices). No weights."""
    if not use_triton(backend, y):
        return combine(y, index, backend=backend)[start:end]
    return combine(y, index._replace(inv=index.inv[start:end]), backend=backend)
