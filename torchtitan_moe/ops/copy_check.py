"""copies_differ: which low-precision copies are not their fp32 weight's cast, in one pass over them all.

    copies_differ(weights [*] fp32 each, copies [*] bf16 or fp16 each, of the weights' shapes)
        -> [n] bool: copy i holds other bits than weights[i].to(copies[i].dtype) somewhere
           (a NaN weight with a NaN copy counts as the same: a cast of NaN may carry another payload)

The training-health check of the experts' working copies (moe/experts.py: stale_working_copies), run
on every monitor step: the GEMMs read the copies, so a weight changed behind the update's back would
train on stale weights without a sign. In torch it is a cast, a comparison and a reduction per weight
(~12 bytes moved per weight: 7.5 ms a monitor step at 30B-A3B-8l, EP = 2, 2.4B expert weights a rank,
in a profile); the Triton kernel reads each weight and its copy once (6 bytes), all of them in
one launch (the program and device tables of ops/_triton_utils.py, as the one-launch AdamW), and writes
one flag per program. Not traced by autograd (a check); registered with torch.library so a compiled
region would see one node.
"""

from __future__ import annotations

import torch

from ._backend import use_triton

COPY_DTYPES = (torch.bfloat16, torch.float16)


def copies_differ_reference(weights: list[torch.Tensor], copies: list[torch.Tensor]) -> torch.Tensor:
    flags = []
    for w, c in zip(weights, copies):
        cast = w.to(c.dtype)
        bits = c.view(torch.int16) != cast.view(torch.int16)
        flags.append((bits & ~(cast.isnan() & c.isnan())).any())
    return torch.stack(flags) if flags else torch.zeros(0, dtype=torch.bool)


@torch.library.custom_op("torchtitan_moe::copies_differ", mutates_args=())
def _copies_differ_triton(weights: list[torch.Tensor], copies: list[torch.Tensor]) -> torch.Tensor:
    from .copy_check_triton import copies_differ_triton

    return copies_differ_triton(weights, copies)


@_copies_differ_triton.register_fake
def _(weights, copies):
    return weights[0].new_empty(len(weights), dtype=torch.bool) if weights else torch.empty(0, dtype=torch.bool)


def copies_differ(weights: list[torch.Tensor], copies: list[torch.Tensor], backend: str = "triton") -> torch.Tensor:
    """See the module docstring. weights and copies: plain tensors (a DTensor's local shard), contiguous,
    on one device; the copies of one dtype."""
    if len(weights) != len(copies):
        raise ValueError(f"copies_differ: {len(weights)} weights and {len(copies)} copies")
    if not weights:
        return torch.zeros(0, dtype=torch.bool)
    device, dtype = weights[0].device, copies[0].dtype
    if dtype not in COPY_DTYPES:
        raise ValueError(f"copies_differ: copies must be bfloat16 or float16, got {dtype}")
    for i, (w, c) in enumerate(zip(weights, copies)):
        if w.dtype != torch.float32 or c.dtype != dtype:
            raise ValueError(f"copies_differ: weight {i} must be float32 and its copy {dtype} like the first, "
                             f"got {w.dtype} and {c.dtype}")
        if w.shape != c.shape or w.device != device or c.device != device:
            raise ValueError(f"copies_differ: copy {i} must match its weight ({tuple(w.shape)} on {device}), got "
                             f"{tuple(c.shape)} on {c.device}")
        if not (w.is_contiguous() and c.is_contiguous()):
            raise ValueError(f"copies_differ: weight {i} and its copy must be contiguous")
    if not use_triton(backend, *weights, *copies):
        return copies_differ_reference(weights, copies)
    return _copies_differ_triton(weights, copies)
