"""swiglu_prob: the experts' gate, h = silu(a) * b * p, fused with the router probability.

    ab       [N, 2I]  output of the first grouped matmul; a = ab[:, :I], b = ab[:, I:]
    probs    [N]      fp32 router probability of each row's (token, k) slot
    num_rows []       0-dim int tensor: rows >= num_rows are tail garbage of torch._grouped_mm
    -> h     [N, I]   in ab.dtype, computed in fp32; rows >= num_rows undefined (zeros with the
                      torch reference): nothing reads them, the next grouped GEMM stops at its last offset

Backward: dab [N, 2I] (rows >= num_rows undefined, as h's) and dprobs [N] fp32 =
sum_i dh * silu(a) * b, the gradient that reaches the router (0 for rows >= num_rows). Rows >=
num_rows are never read, neither ab nor dh: masked or selected, never multiplied by 0 (NaN * 0 = NaN).
"""

from __future__ import annotations

import torch

from ._backend import use_triton
from ._library import custom_op

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _check_args(ab: torch.Tensor, probs: torch.Tensor, num_rows: torch.Tensor | None) -> None:
    if ab.dim() != 2 or ab.shape[1] % 2 or ab.dtype not in FLOAT_DTYPES:
        raise ValueError(f"ab must be a float tensor [N, 2I], got {tuple(ab.shape)} {ab.dtype}")
    if probs.shape != ab.shape[:1] or probs.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"probs must be float32 (or float64) of shape [{ab.shape[0]}], got {tuple(probs.shape)} {probs.dtype}"
        )
    if probs.device != ab.device:
        raise ValueError(f"probs must be on {ab.device}, got {probs.device}")
    if num_rows is not None:
        if not isinstance(num_rows, torch.Tensor) or num_rows.dim() != 0 or num_rows.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"num_rows must be a 0-dim int32/int64 tensor or None, got {num_rows!r}")
        if num_rows.device != ab.device:
            raise ValueError(f"num_rows must be on {ab.device}, got {num_rows.device}")


def swiglu_prob_reference(ab: torch.Tensor, probs: torch.Tensor, num_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch in fp32 (fp64 for fp64). Tail rows are selected away with torch.where on
    the inputs and the output, so neither their values nor their gradients reach anything."""
    N, I = ab.shape[0], ab.shape[1] // 2
    valid = torch.ones(N, dtype=torch.bool, device=ab.device)
    if num_rows is not None:
        valid = torch.arange(N, device=ab.device) < num_rows
    ab32 = torch.where(valid[:, None], ab.to(torch.promote_types(ab.dtype, torch.float32)), 0.0)
    a, b = ab32[:, :I], ab32[:, I:]
    h = torch.nn.functional.silu(a) * b * torch.where(valid, probs, 0.0)[:, None]
    return torch.where(valid[:, None], h, 0.0).to(ab.dtype)


# ---------------------------------------------------------------------------- Triton op
# One opaque node for torch.compile: a custom op with a fake implementation and autograd.
# The kernels' module is imported inside, on first use: backend="torch" needs no Triton.


@custom_op("torchtitan_moe::swiglu_prob")
def _swiglu_prob_triton(ab: torch.Tensor, probs: torch.Tensor, num_rows: torch.Tensor | None) -> torch.Tensor:
    from .swiglu_prob_triton import swiglu_prob_fwd

    return swiglu_prob_fwd(ab, probs, num_rows)


@_swiglu_prob_triton.register_fake
def _(ab, probs, num_rows):
    return ab.new_empty(ab.shape[0], ab.shape[1] // 2)


@custom_op("torchtitan_moe::swiglu_prob_backward")
def _swiglu_prob_backward(
    dh: torch.Tensor, ab: torch.Tensor, probs: torch.Tensor, num_rows: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    from .swiglu_prob_triton import swiglu_prob_bwd

    return swiglu_prob_bwd(dh, ab, probs, num_rows)


@_swiglu_prob_backward.register_fake
def _(dh, ab, probs, num_rows):
    return torch.empty_like(ab), torch.empty_like(probs)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)  # ab, probs, num_rows: silu is recomputed, h is not kept


def _backward(ctx, dh):
    ab, probs, num_rows = ctx.saved_tensors
    dab, dprobs = _swiglu_prob_backward(dh, ab, probs, num_rows)
    return dab, dprobs, None


_swiglu_prob_triton.register_autograd(_backward, setup_context=_setup_context)


def swiglu_prob(
    ab: torch.Tensor, probs: torch.Tensor, num_rows: torch.Tensor | None = None, *, backend: str = "triton"
) -> torch.Tensor:
    """h [N, I] = silu(a) * b * probs[:, None] for rows < num_rows (all rows if None); rows after it
    undefined with the Triton kernel (zeros with the torch reference)."""
    _check_args(ab, probs, num_rows)
    if not use_triton(backend, ab):
        return swiglu_prob_reference(ab, probs, num_rows)
    return _swiglu_prob_triton(ab, probs, num_rows)
