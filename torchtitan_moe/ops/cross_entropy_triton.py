"""Triton kernel of linear_cross_entropy: each row's loss, and its gradient written over the row.

One program owns one logits row and walks it twice in BLOCK steps: first the running max and
the sum of exponentials (fp32, rescaled as the max grows), which give logsumexp; then
softmax - one-hot, stored over the logits it was computed from (each element read, then
written, by the same program: no atomics, no second [N, V] buffer). A row's offset is int64:
N V passes 2^31 at 16k tokens of Qwen3's vocabulary.

The backward's scaling by the loss's incoming gradient: a flat pass, the fp32 scalar read on the device,
each product rounded once (torch's bf16 tensor times a 0-dim fp32 CUDA tensor rounds the scalar to bf16
first, in its casting kernel: 1.18 ms for Qwen3's [151936, 2048] output layer on an H200).
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import INTERPRET, round_to

# The interpreter runs small vocabularies in several blocks, so the tests cross block edges.
MAX_BLOCK = 256 if INTERPRET else 8192


@triton.jit
def _cross_entropy_rows_kernel(logits_ptr, labels_ptr, loss_ptr, ignore_index, V: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = logits_ptr + row * V
    label = tl.load(labels_ptr + row)
    m = float("-inf")
    s = 0.0
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    log_s = tl.log(s)  # logsumexp = m + log_s; kept apart, so x - m cancels before log_s is added
    counted = label != ignore_index
    in_range = (label >= 0) & (label < V)
    x_label = tl.load(x_row + label, mask=counted & in_range, other=float("nan")).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(counted, (m - x_label) + log_s, 0.0))
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        g = tl.exp((x - m) - log_s) - tl.where(cols == label, 1.0, 0.0)
        g = tl.where(counted, g, 0.0)
        tl.store(x_row + cols, round_to(g, logits_ptr.dtype.element_ty), mask=cols < V)


def cross_entropy_rows_(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """logits [N, V] (contiguous; overwritten with softmax - one-hot, 0 for ignored rows),
    labels [N] int64 -> loss per row [N] fp32 (0 for ignored rows)."""
    N, V = logits.shape
    loss = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N:
        block = min(MAX_BLOCK, triton.next_power_of_2(V))
        _cross_entropy_rows_kernel[(N,)](logits, labels, loss, ignore_index, V=V, BLOCK=block,
                                         num_warps=16 if block >= 4096 else 4)
    return loss


SCALE_BLOCK = 4096


@triton.jit
def _scale_kernel(x_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, round_to(x * tl.load(scale_ptr), out_ptr.dtype.element_ty), mask=mask)


def scaled(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [*], scale [] fp32 on x's device -> x * scale in fp32, rounded once to x's dtype (contiguous)."""
    x = x.contiguous()  # the kernel walks the storage flat (the op's GEMM outputs already are)
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        _scale_kernel[(triton.cdiv(n, SCALE_BLOCK),)](x, scale, out, n, BLOCK=SCALE_BLOCK, num_warps=8)
    return out
