"""Zero-token padding policy for torch._grouped_mm.

torch 2.11's grouped_mm gives exact-zero weight gradients to experts with no tokens on
Hopper, but not on Blackwell (compute capability 10.x, pytorch#172439). Padding every
expert's group to a multiple of `align` rows (at least `align`, so none is empty) avoids
that at the cost of a few zero rows. The padding is an index map shared by all
dispatchers (`ops.routing_index`), so it is decided once, here.
"""

from __future__ import annotations

from typing import Literal

import torch

PaddingPolicy = Literal["none", "auto", "always"]
ALIGNMENTS = (8, 16, 32)  # rows an expert's group is padded to a multiple of


def needs_padding(device: torch.device) -> bool:
    """True where grouped_mm mishandles empty groups: CUDA compute capability 10.x and newer."""
    if device.type != "cuda":
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 10


def resolve_alignment(policy: PaddingPolicy, align: int, device: torch.device) -> int:
    """The `align` argument of ops.routing_index: 1 (no padding) or `align` rows (both checked with the
    layer's other settings, moe/options.py's moe_problem)."""
    if policy == "always" or (policy == "auto" and needs_padding(device)):
        return align
    return 1
