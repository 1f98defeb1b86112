"""Local dispatcher (EP = 1): sort each token's K slots by expert on this rank.

    x [T, D] ──gather_rows──► batch.x [N, D] ──experts──► y [N, D] ──combine──► out [T, D]

gather_rows and combine are adjoint (one's backward is the other's forward), both
deterministic and gather-based: no atomics, no scatter_add.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchtitan_moe import ops
from torchtitan_moe.dispatch.base import ExpertBatch, expert_major

if TYPE_CHECKING:  # the moe package imports this one: annotations only
    from torchtitan_moe.moe.router import Routing


class LocalDispatcher:
    def __init__(self, num_experts: int, align: int = 1, kernels: str = "torch"):
        self.num_experts = num_experts
        self.align = align
        self.kernels = kernels

    def dispatch(self, x: torch.Tensor, routing: Routing) -> ExpertBatch:
        batch, index = expert_major(x, routing.experts, routing.probs, self.num_experts, self.align, self.kernels)
        batch.ctx = index
        return batch

    def combine(self, y: torch.Tensor, batch: ExpertBatch) -> torch.Tensor:
        return ops.combine(y, batch.ctx, backend=self.kernels)
