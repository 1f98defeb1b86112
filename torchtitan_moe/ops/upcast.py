"""upcast: a bf16 tensor's fp32 copy, with its strides, in one bandwidth-bound pass.

    x  [*]  bf16, dense (any order of its dimensions: a transposed view is fine)
    -> [*]  fp32, x's shape and strides, the exact values (widening loses nothing)

The experts' weight gradients come out of their bf16 GEMMs and reach the fp32 master weights
through this cast (moe/experts.py, once per weight and step). torch's `x.float()` runs it through
a dynamically casting elementwise kernel at about half the copy bandwidth: 7.6 ms of a 240 ms step
at EP = 2 on 2 H200s (2.4 billion expert weights a rank);
the Triton kernel reads and writes each element once in wide vector accesses.
"""

from __future__ import annotations

import torch

from ._backend import use_triton
from ._library import custom_op


def upcast_takes(x: torch.Tensor) -> bool:
    """x is dense: its elements fill one block of memory, in some order of its dimensions."""
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def upcast_reference(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


@custom_op("torchtitan_moe::upcast")
def _upcast_triton(x: torch.Tensor) -> torch.Tensor:
    from .upcast_triton import upcast_into

    out = torch.empty_like(x, dtype=torch.float32)  # x's strides: it is dense
    upcast_into(x, out)
    return out


@_upcast_triton.register_fake
def _(x):
    return torch.empty_like(x, dtype=torch.float32)


def upcast(x: torch.Tensor, backend: str = "triton") -> torch.Tensor:
    """x [*] bf16, dense -> fp32 [*] with x's strides; see the module docstring."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"upcast: x must be bfloat16, got {x.dtype}")
    if not upcast_takes(x):
        raise ValueError(f"upcast: x must be dense (a permutation of a contiguous tensor), got shape "
                         f"{tuple(x.shape)} and strides {x.stride()}")
    if not use_triton(backend, x):
        return upcast_reference(x)
    return _upcast_triton(x)
