"""swiglu_prob: the expert MLP's gate, h = silu(a) * b * p, fused with the routing prob.

    ab    [N, 2I]  output of the first grouped matmul; a = ab[:, :I], b = ab[:, I:]
    probs [N]      fp32 routing probability of each row's (token, k) slot
    num_rows []    rows >= num_rows are tail garbage from torch._grouped_mm
    -> h  [N, I]   in ab.dtype; zeros for tail rows

Backward: dab [N, 2I] and dprobs [N] = sum_i dh * silu(a) * b. One program owns
whole rows, so dprobs is reduced without atomics. silu is recomputed from ab
instead of saving h. Tail rows are never read (masked loads, not multiply by
zero: NaN * 0 = NaN) and are written as zeros.
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import check_backend, check_triton_device, upcast

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
        if num_rows.dim() != 0 or num_rows.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"num_rows must be a 0-dim int tensor, got {tuple(num_rows.shape)} {num_rows.dtype}")
        if num_rows.device != ab.device:
            raise ValueError(f"num_rows must be on {ab.device}, got {num_rows.device}")


def swiglu_prob_reference(ab: torch.Tensor, probs: torch.Tensor, num_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch in fp32; tail rows are masked with torch.where on input and output."""
    N, I = ab.shape[0], ab.shape[1] // 2
    valid = torch.ones(N, dtype=torch.bool, device=ab.device)
    if num_rows is not None:
        valid = torch.arange(N, device=ab.device) < num_rows
    ab32 = torch.where(valid[:, None], upcast(ab), 0.0)
    a, b = ab32[:, :I], ab32[:, I:]
    h = torch.nn.functional.silu(a) * b * torch.where(valid, probs, 0.0)[:, None]
    return torch.where(valid[:, None], h, 0.0).to(ab.dtype)


def swiglu_prob(
    ab: torch.Tensor, probs: torch.Tensor, num_rows: torch.Tensor | None = None, *, backend: str = "triton"
) -> torch.Tensor:
    """h [N, I] = silu(a) * b * probs[:, None] for rows < num_rows, zeros after."""
    check_backend(backend)
    _check_args(ab, probs, num_rows)
    if backend == "torch":
        return swiglu_prob_reference(ab, probs, num_rows)
    check_triton_device("ab", ab)
    raise NotImplementedError("swiglu_prob: the triton kernel lands in a following commit")
