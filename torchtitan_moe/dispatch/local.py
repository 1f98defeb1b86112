"""Local dispatcher (EP = 1): sort each token's K slots by expert on this rank.

    x [T, D] ──gather_rows──► batch.x [N, D] ──experts──► y [N, D] ──combine──► out [T, D]

gather_rows and combine are adjoint (one's backward is the other's forward), both
deterministic and gather-based: no atomics, no scatter_add.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchtitan_moe import ops
from torchtitan_moe.dispatch.base import ExpertBatch, slots_to_rows

if TYPE_CHECKING:  # the moe package imports this one: annotations only
    from torchtitan_moe.moe.router import Routing


class LocalDispatcher:
    def __init__(self, num_experts: int, align: int = 1, kernels: str = "torch"):
        self.num_experts = num_experts
        self.align = align
        self.kernels = kernels

    def dispatch(self, x: torch.Tensor, routing: Routing) -> ExpertBatch:
        index = ops.routing_index(routing.experts, self.num_experts, self.align, backend=self.kernels)
        rows = ops.gather_rows(x, index, backend=self.kernels)
        probs = slots_to_rows(routing.probs, index.inv, rows.shape[0])
        return ExpertBatch(
            x=rows,
            probs=probs,
            offsets=index.offsets,
            num_rows=index.num_rows,
            tokens_per_expert=index.tokens_per_expert,
            ctx=index,
        )

    def combine(self, y: torch.Tensor, batch: ExpertBatch) -> torch.Tensor:
        return ops.combine(y, batch.ctx, backend=self.kernels)
