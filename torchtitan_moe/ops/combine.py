"""gather_rows and combine: move token data into and out of the expert-major rows.

    gather_rows(x [T, D], index)               -> xs [N, D]   xs[r] = x[row_slot[r] // K]
    combine(y [N, D], index, probs [T, K]?)    -> out [T, D]  out[t] = sum_k w[t,k] * y[inv[t,k]]

The two are adjoint: gather's backward is an unweighted combine, and combine's
backward is a (weighted) gather. So there are exactly two kernels, both
gather-based (each output row is owned by one program, no atomics, so results
are deterministic), and each autograd op calls the other's kernel backwards.

Pad rows (row_slot == -1) and tail rows (r >= num_rows) are never read: their
contents may be garbage from torch._grouped_mm. Rows of xs / dy that hold no
slot are written as zeros. Slots with inv == -1 contribute nothing.
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import check_backend, check_triton_device, upcast

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _check_index(index, num_tokens: int | None, num_rows: int | None, device: torch.device) -> None:
    inv, row_slot = index.inv, index.row_slot
    if inv.dim() != 2 or inv.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index.inv must be a 2-D int32/int64 tensor, got {tuple(inv.shape)} {inv.dtype}")
    if row_slot.dim() != 1 or row_slot.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"index.row_slot must be a 1-D int32/int64 tensor, got {tuple(row_slot.shape)} {row_slot.dtype}"
        )
    if inv.shape[1] != index.top_k:
        raise ValueError(f"index.inv must have top_k={index.top_k} columns, got {inv.shape[1]}")
    if num_tokens is not None and inv.shape[0] != num_tokens:
        raise ValueError(f"index.inv has {inv.shape[0]} tokens, expected {num_tokens}")
    if num_rows is not None and row_slot.shape[0] != num_rows:
        raise ValueError(f"index.row_slot has {row_slot.shape[0]} rows, expected {num_rows}")
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


# --------------------------------------------------------------------------- references


def gather_rows_reference(x: torch.Tensor, index) -> torch.Tensor:
    """Plain torch; fp32 math so the autograd backward accumulates dx in fp32."""
    slot = index.row_slot.long()
    has_slot = (slot >= 0)[:, None]
    token = slot.clamp_min(0) // index.top_k
    return torch.where(has_slot, upcast(x)[token], 0.0).to(x.dtype)


def combine_reference(y: torch.Tensor, index, probs: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch; rows gathered by inv (never the pad/tail rows), summed in fp32."""
    inv = index.inv.long()
    has_row = (inv >= 0)[..., None]
    rows = torch.where(has_row, upcast(y)[inv.clamp_min(0)], 0.0)  # [T, K, D]
    if probs is not None:
        rows = rows * probs[..., None]
    return rows.sum(1).to(y.dtype)


# --------------------------------------------------------------------------- public ops


def gather_rows(x: torch.Tensor, index, *, backend: str = "triton") -> torch.Tensor:
    """xs [N, D] = token rows of x [T, D] in expert-major order; zeros for pad/tail rows."""
    check_backend(backend)
    _check_data("x", x)
    _check_index(index, x.shape[0], None, x.device)
    if backend == "torch":
        return gather_rows_reference(x, index)
    check_triton_device("x", x)
    raise NotImplementedError("gather_rows: the triton kernel lands in a following commit")


def combine(y: torch.Tensor, index, probs: torch.Tensor | None = None, *, backend: str = "triton") -> torch.Tensor:
    """out [T, D] = sum over k of (probs[t, k] or 1) * y[inv[t, k]], fp32 accumulation."""
    check_backend(backend)
    _check_data("y", y)
    _check_index(index, None, y.shape[0], y.device)
    if probs is not None:
        _check_probs(probs, index.inv)
    if backend == "torch":
        return combine_reference(y, index, probs)
    check_triton_device("y", y)
    raise NotImplementedError("combine: the triton kernel lands in a following commit")
