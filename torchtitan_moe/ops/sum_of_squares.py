"""sum_of_squares: the sum of the squares of every element of a list of tensors, in one pass.

    sum_of_squares(tensors [*] each, float, on one device) -> [] fp32 (fp64 where a tensor is)

What gradient clipping and the training-health monitor need of the gradients (components/optimizer.py:
total_grad_norm, checks/monitors.py: local_grad_norm): the experts' bf16 gradients are 2.4B elements a
rank at 30B-A3B-8l, EP = 2. The reference is torch's foreach norm per dtype, accumulated in fp32 from the
tensors as they are, which runs ~115 launches of 320 blocks over them (2.0 ms a step on an H200 in a
profile, 4.8 GB: about half the copy bandwidth); the Triton kernel reads every element once, one launch
per dtype (the program and device tables of ops/_triton_utils.py, as the one-launch AdamW), writes one fp32
partial sum per program, and torch sums those (deterministic: no atomics). The two differ in rounding only
(the order of the sums; the reference squares a norm).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ._backend import use_triton

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups = defaultdict(list)
    for t in tensors:
        groups[t.dtype].append(t)
    return groups


def sum_of_squares_reference(tensors: list[torch.Tensor]) -> torch.Tensor:
    squares = [torch.stack(torch._foreach_norm(group, 2.0, dtype=torch.promote_types(dtype, torch.float32)))
               .square().sum() for dtype, group in _by_dtype(tensors).items()]
    wide = torch.float64 if any(s.dtype == torch.float64 for s in squares) else torch.float32
    return torch.stack([s.to(wide) for s in squares]).sum()


@torch.library.custom_op("torchtitan_moe::sum_of_squares", mutates_args=())
def _sum_of_squares_triton(tensors: list[torch.Tensor]) -> torch.Tensor:
    from .sum_of_squares_triton import sum_of_squares_triton

    return sum_of_squares_triton(tensors)


@_sum_of_squares_triton.register_fake
def _(tensors):
    return tensors[0].new_empty((), dtype=torch.float32)


def sum_of_squares(tensors: list[torch.Tensor], backend: str = "triton") -> torch.Tensor:
    """See the module docstring. Plain tensors (a DTensor's local shard), contiguous, on one device, at
    least one; the Triton path takes fp32, bf16 or fp16, one launch per dtype."""
    if not tensors:
        raise ValueError("sum_of_squares: no tensors")
    device = tensors[0].device
    for i, t in enumerate(tensors):
        if not t.is_floating_point() or t.device != device:
            raise ValueError(f"sum_of_squares: tensor {i} must be a float tensor on {device}, got {t.dtype} on {t.device}")
    if not use_triton(backend, *tensors):
        return sum_of_squares_reference(tensors)
    for i, t in enumerate(tensors):
        if t.dtype not in TRITON_DTYPES or not t.is_contiguous():
            raise ValueError(f"sum_of_squares: tensor {i} must be contiguous fp32, bf16 or fp16 for backend='triton', "
                             f"got {t.dtype}{'' if t.is_contiguous() else ', not contiguous'}; use backend='torch'")
    sums = [_sum_of_squares_triton(group) for group in _by_dtype(tensors).values()]
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum()
