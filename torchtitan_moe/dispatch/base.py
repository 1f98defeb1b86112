"""The dispatcher seam: send tokens to their experts, bring the experts' outputs back.

    batch = dispatcher.dispatch(x [T, D], routing)   # rows in expert-major order, padded
    y     = experts(batch)                           # [N, D], probabilities already applied
    out   = dispatcher.combine(y, batch)             # [T, D], sum over each token's experts

Every dispatcher fills the same `ExpertBatch`, so the experts never know how rows arrived.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from torchtitan_moe import ops

if TYPE_CHECKING:  # the moe package imports this one: annotations only
    from torchtitan_moe.moe.router import Routing


@dataclass
class ExpertBatch:
    """N rows for this rank's E_local experts, grouped by expert (the torch._grouped_mm layout).

    Rows past `num_rows` (the tail) are never read; pad rows inside groups are zeros.
    """

    x: torch.Tensor  # [N, D] tokens, expert-major
    probs: torch.Tensor  # [N] fp32 router probability of each row (0 for pad and tail rows)
    offsets: torch.Tensor  # [E_local] int32 cumulative end row of each expert's group
    num_rows: torch.Tensor  # 0-dim int64 on the device: offsets[-1]
    tokens_per_expert: torch.Tensor  # [E_local] int64 rows that hold tokens (no padding)
    ctx: Any  # the dispatcher's state for combine


class Dispatcher(Protocol):
    def dispatch(self, x: torch.Tensor, routing: Routing) -> ExpertBatch: ...

    def combine(self, y: torch.Tensor, batch: ExpertBatch) -> torch.Tensor: ...


def expert_major(
    x: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor, num_experts: int, align: int, kernels: str,
    num_slots: int | None = None,
) -> tuple[ExpertBatch, ops.RoutingIndex]:
    """Rows x [R, D] with K slots each (experts [R, K], -1 for none; probs [R, K]) -> the ExpertBatch
    (ctx unset: the dispatcher's) and its RoutingIndex. Every dispatcher ends its dispatch here."""
    index = ops.routing_index(experts, num_experts, align, num_slots=num_slots, backend=kernels)
    rows = ops.gather_rows(x, index, backend=kernels)
    batch = ExpertBatch(x=rows, probs=slots_to_rows(probs, index.inv, rows.shape[0]), offsets=index.offsets,
                        num_rows=index.num_rows, tokens_per_expert=index.tokens_per_expert, ctx=None)
    return batch, index


def slots_to_rows(values: torch.Tensor, inv: torch.Tensor, num_rows_alloc: int) -> torch.Tensor:
    """Place per-slot values [T, K] at their rows: out [N] with out[inv[t, k]] = values[t, k].

    Slots with inv = -1 go nowhere; rows no slot points at stay 0. A scatter with unique
    indices forward, a gather backward: deterministic either way.
    """
    flat_inv = inv.reshape(-1).long()
    dump = num_rows_alloc  # one extra row collects the -1 slots and is dropped
    target = torch.where(flat_inv >= 0, flat_inv, torch.full_like(flat_inv, dump))
    out = values.new_zeros(num_rows_alloc + 1)
    out = out.index_put((target,), values.reshape(-1))
    return out[:num_rows_alloc]
