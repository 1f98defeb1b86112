"""The Triton kernel of gate_logits' splits: an fp32 tensor's three bf16 parts, laid out as the GEMMs read them.

    split_blocks(t [R, C] fp32, pattern, [pattern2]) -> out [R, 3C] bf16 (one per pattern)
        out[:, k C:(k+1) C] = part[pattern[k]],  part[0] + part[1] + part[2] = t  (gate.split_bf16's parts)

One pass over t, however many blocks and outputs: the weight's [w1; w2; w3] for the forward (R = 1, C = E D),
[w1; w2; w1] for dx, and the gradient's [g1 | g1 | g2] and [g1 | g2 | g3] together. In torch ops the same
splits take seven elementwise launches and a concatenation each (~85 us on an H200 for a 1 MiB weight or an
8 MiB gradient, most of it launches); here one launch moves the bytes. Each part is rounded to nearest even
through `round_to`, as the interpreter needs, so the parts equal split_bf16's bit for bit.
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import round_to

BLOCK = 1024


@triton.jit
def _pick(p0, p1, p2, k: tl.constexpr):
    if k == 0:
        return p0
    elif k == 1:
        return p1
    else:
        return p2


@triton.jit
def _store_blocks(out_ptr, base, C, mask, p0, p1, p2, K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr):
    tl.store(out_ptr + base, _pick(p0, p1, p2, K0), mask=mask)
    tl.store(out_ptr + base + C, _pick(p0, p1, p2, K1), mask=mask)
    tl.store(out_ptr + base + 2 * C, _pick(p0, p1, p2, K2), mask=mask)


@triton.jit
def _split_kernel(t_ptr, out_ptr, out2_ptr, n, C,
                  A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr,
                  B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    t = tl.load(t_ptr + offs, mask=mask)
    p0 = round_to(t, tl.bfloat16)
    rest = t - p0.to(tl.float32)
    p1 = round_to(rest, tl.bfloat16)
    p2 = round_to(rest - p1.to(tl.float32), tl.bfloat16)
    row = offs // C
    base = offs + 2 * row * C  # row r's element c of block 0 sits at r 3C + c
    _store_blocks(out_ptr, base, C, mask, p0, p1, p2, A0, A1, A2)
    if out2_ptr is not None:
        _store_blocks(out2_ptr, base, C, mask, p0, p1, p2, B0, B1, B2)


def split_blocks(t: torch.Tensor, pattern: tuple[int, int, int],
                 pattern2: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, ...]:
    assert t.dim() == 2 and t.dtype == torch.float32 and t.is_contiguous()
    rows, cols = t.shape
    outs = [t.new_empty(rows, 3 * cols, dtype=torch.bfloat16) for _ in range(1 if pattern2 is None else 2)]
    n = t.numel()
    if n:
        _split_kernel[(triton.cdiv(n, BLOCK),)](t, outs[0], outs[1] if pattern2 else None, n, cols,
                                                *pattern, *(pattern2 or (0, 0, 0)), BLOCK=BLOCK, num_warps=4)
    return tuple(outs)
