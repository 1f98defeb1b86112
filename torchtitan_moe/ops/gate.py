"""gate_logits: the router's fp32 logits from bf16 tokens, on the bf16 tensor cores.

    gate_logits(x [T, D] bf16, w [E, D] fp32) -> logits [T, E] fp32      = x.float() @ w.T
    backward: dx [T, D] bf16 (x's dtype) = g @ w, dw [E, D] fp32 = g.T @ x.float(), g = dlogits fp32

The router computes its gate in fp32 (its own FSDP2 group keeps fp32 weights): on the CUDA cores, ~0.67 ms
a layer forward + backward at 16,384 tokens (E = 128) on an H200. A product of two bf16 numbers is exact
in fp32, and an fp32 number is the sum of three bf16 numbers (high, middle and low 8 bits of its 24-bit
significand; `split_bf16`), so fp32 products come out of bf16 GEMMs with fp32 accumulation:

    forward   x @ [w1; w2; w3].T   one GEMM, N = 3E, then the three [T, E] blocks summed
              (every product exact: the fp32 GEMM's result up to summation order)
    dx        [g1 | g1 | g2] @ [w1; w2; w1]   one GEMM, K = 3E; the terms left out (g1 w3, g2 w2, g3 w1, ...)
              are below 2^-17 of the largest: ~1e-6 of max|dx| against fp32's ~5e-7
    dw        [g1; g2; g3] @ x   one GEMM, M = 3E, then the three blocks summed (x exact: every product exact)

The parts are made by one Triton kernel each (ops/gate_triton.py: the gradient's two layouts in one pass),
and dx comes out of its GEMM in bf16 (no fp32 [T, D] product in memory). On an H200 at T = 16,384
(kernels/bench_gate.py): forward 97 us against the compiled fp32
GEMM's 235, backward 377 us against 457 (the torch ops' splits had taken 83-86 us each, the dx product 62 us
in fp32 and 53 more to cast it); in the training step's profile the backward's kernels take ~115 us a layer.
The torch reference is the fp32 GEMM itself. On CPU (TRITON_INTERPRET=1, how CI runs the fast path) a bf16
GEMM with fp32 output is emulated by an fp32 GEMM of the bf16 values: the same exact products and fp32 sums.
"""

from __future__ import annotations

import torch

from ._backend import use_triton
from ._library import custom_op


def gate_logits_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() @ w.float().t()


def split_bf16(t: torch.Tensor, terms: int) -> list[torch.Tensor]:
    """fp32 t -> `terms` bf16 tensors whose fp32 sum is t to ~2^-(8 terms) of |t| (three: exact for normal
    numbers whose low parts stay normal). Each is the bf16 rounding of what the ones before left."""
    parts, rest = [], t.float()
    for _ in range(terms):
        part = rest.to(torch.bfloat16)
        parts.append(part)
        rest = rest - part.float()
    return parts


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """bf16 a [M, K] @ bf16 b [K, N] -> [M, N] in out_dtype (fp32 or bf16): fp32 accumulation (tensor cores
    on CUDA), one rounding at the end (a bf16 result is written as such: no fp32 [M, N] in memory)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32) if out_dtype == torch.float32 else torch.mm(a, b)
    return (a.float() @ b.float()).to(out_dtype)


def _blocks_sum(t: torch.Tensor, blocks: int, dim: int) -> torch.Tensor:
    """[.., blocks * n, ..] -> the sum of its `blocks` equal parts along `dim`, in order."""
    parts = t.chunk(blocks, dim=dim)
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out


def _weight_blocks(w: torch.Tensor, pattern: tuple[int, int, int]) -> torch.Tensor:
    """w [E, D] fp32 -> its bf16 parts stacked as `pattern` picks them: [3 E, D]."""
    from .gate_triton import split_blocks

    return split_blocks(w.reshape(1, -1), pattern)[0].view(3 * w.shape[0], w.shape[1])


@custom_op("torchtitan_moe::gate_logits")
def _gate_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _blocks_sum(_mm(x, _weight_blocks(w, (0, 1, 2)).t()), 3, dim=1)


@_gate_logits.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)


def _setup(ctx, inputs, output) -> None:
    x, w = inputs
    ctx.save_for_backward(x, w)


@custom_op("torchtitan_moe::gate_logits_backward")
def _gate_logits_backward(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .gate_triton import split_blocks

    g_dx, g_dw = split_blocks(grad.contiguous(), (0, 0, 1), (0, 1, 2))  # [g1 | g1 | g2], [g1 | g2 | g3]
    dx = _mm(g_dx, _weight_blocks(w, (0, 1, 0)), out_dtype=x.dtype)  # @ [w1; w2; w1]
    dw = _blocks_sum(_mm(g_dw.t(), x), 3, dim=0)
    return dx, dw


@_gate_logits_backward.register_fake
def _(grad, x, w):
    return torch.empty_like(x), torch.empty_like(w)


def _backward(ctx, grad: torch.Tensor):
    x, w = ctx.saved_tensors
    return _gate_logits_backward(grad, x, w)


_gate_logits.register_autograd(_backward, setup_context=_setup)


def gate_logits(x: torch.Tensor, w: torch.Tensor, *, backend: str = "triton") -> torch.Tensor:
    """x [T, D] bf16, w [E, D] fp32 -> fp32 logits [T, E]; see the module docstring."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gate_logits: x [T, D] and w [E, D], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != torch.bfloat16 or w.dtype != torch.float32:
        raise ValueError(f"gate_logits: x must be bfloat16 and w float32, got {x.dtype} and {w.dtype}")
    if not use_triton(backend, x, w):
        return gate_logits_reference(x, w)
    return _gate_logits(x, w)
