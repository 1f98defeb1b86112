"""The Triton kernel of upcast: x's storage read and written as one flat block (x and its fp32 copy
share strides, so element i of one is element i of the other). A bf16 value is the top half of its
fp32 value: the kernel moves the 16 bits up (exact for every value, NaN payloads and subnormals
included, on the GPU and under the interpreter, whose float conversion flushes bf16 subnormals)."""

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _upcast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bits = tl.load(x_ptr + offs, mask=mask).to(tl.int32)  # int16 -> int32: the sign bits are shifted out
    tl.store(out_ptr + offs, bits << 16, mask=mask)


def upcast_into(x: torch.Tensor, out: torch.Tensor) -> None:
    assert x.stride() == out.stride() and x.dtype == torch.bfloat16 and out.dtype == torch.float32
    n = x.numel()
    if n:
        _upcast_kernel[(triton.cdiv(n, BLOCK),)](x.view(torch.int16), out.view(torch.int32), n, BLOCK=BLOCK,
                                                 num_warps=8)
