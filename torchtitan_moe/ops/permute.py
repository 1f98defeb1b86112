"""routing_index: where each (token, k) slot lives in the expert-major row layout.

The router gives every token K experts. torch._grouped_mm wants the rows sorted by
expert, each expert's group ending at offsets[e]. This op computes that layout once
per layer; gather_rows and combine then move data through it.

    experts [T, K] int    expert of slot (t, k); -1 = no expert (the slot gets no row)
    ->  tokens_per_expert [E] int64   slots routed to each expert
        offsets           [E] int32   END row of each expert's group (grouped_mm's offs)
        inv            [T, K] int64   row of slot (t, k); -1 for slots without an expert
        row_slot          [N] int64   flat slot t*K + k of row r; -1 for pad and tail rows
        num_rows           [] int64   offsets[-1], on the device

Within an expert, rows follow the flat slot index t*K + k (a stable sort), so the layout
is deterministic. With align > 1 each group is rounded up to a multiple of `align` rows
and an expert without tokens still gets `align` (zero) rows: grouped_mm gives wrong
weight gradients to empty groups on Blackwell. N is a static upper bound on the rows,
T*K (+ E*align when aligned), so nothing waits on a host sync; rows
num_rows <= r < N are the tail.

Expert ids are not range-checked (that would need a host sync): every entry outside
[0, num_experts), -1 by convention, is an empty slot, on both backends.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._backend import use_triton
from ._library import custom_op

ALIGNS = (1, 8, 16, 32)


class RoutingIndex(NamedTuple):
    tokens_per_expert: torch.Tensor  # [E] int64: slots routed to each expert
    offsets: torch.Tensor  # [E] int32: end row of each expert's group
    inv: torch.Tensor  # [T, K] int64: row of slot (t, k), -1 if no expert
    row_slot: torch.Tensor  # [N] int64: flat slot t*K + k of row r, -1 for pad and tail rows
    num_rows: torch.Tensor  # [] int64: offsets[-1], rows that hold tokens or padding
    top_k: int  # K


def allocated_rows(num_slots: int, num_experts: int, align: int) -> int:
    """N: rows that fit any routing of `num_slots` slots (a padded group adds < align rows)."""
    return num_slots if align == 1 else num_slots + num_experts * align


def _check_args(experts: torch.Tensor, num_experts: int, align: int, num_slots: int | None) -> None:
    if experts.dim() != 2 or experts.dtype.is_floating_point or experts.dtype.is_complex or experts.dtype == torch.bool:
        raise ValueError(f"experts must be a 2-D integer tensor [T, K], got {tuple(experts.shape)} {experts.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if align not in ALIGNS:
        raise ValueError(f"align must be one of {ALIGNS}, got {align}")
    if num_slots is not None and not 0 <= num_slots <= experts.numel():
        raise ValueError(f"num_slots must be in [0, T*K = {experts.numel()}], got {num_slots}")


def routing_index_reference(
    experts: torch.Tensor, num_experts: int, align: int = 1, *, num_slots: int | None = None
) -> RoutingIndex:
    """Plain torch: a stable sort by expert and cumsums, no host sync."""
    _check_args(experts, num_experts, align, num_slots)
    T, K = experts.shape
    E, S = num_experts, T * K
    N = allocated_rows(S if num_slots is None else num_slots, E, align)
    dev = experts.device

    flat = experts.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < E), flat, E)  # empty slots sort after every expert
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    tokens_per_expert = counts[:E]
    sizes = tokens_per_expert
    if align > 1:
        sizes = ((sizes + align - 1) // align * align).clamp_min(align)
    ends = torch.cumsum(sizes, 0)
    group_start = torch.cat([ends - sizes, ends.new_zeros(1)])  # one more entry for key == E

    order = torch.sort(key, stable=True).indices  # slots in expert-major order
    sorted_key = key[order]
    first_in_order = torch.cumsum(counts, 0) - counts  # position in `order` of each expert's first slot
    rank = torch.arange(S, device=dev) - first_in_order[sorted_key]
    has_row = sorted_key < E
    sorted_row = torch.where(has_row, group_start[sorted_key] + rank, -1)

    inv = torch.empty(S, dtype=torch.int64, device=dev).scatter_(0, order, sorted_row)
    # Slots without a row write to distinct dummy entries past N: no duplicate indices.
    target = torch.where(has_row, sorted_row, N + torch.arange(S, device=dev))
    row_slot = torch.full((N + S,), -1, dtype=torch.int64, device=dev).scatter_(0, target, order)[:N]
    return RoutingIndex(tokens_per_expert, ends.to(torch.int32), inv.view(T, K), row_slot, ends[-1], K)


@custom_op("torchtitan_moe::routing_index")
def _routing_index_triton(
    experts: torch.Tensor, num_experts: int, align: int, num_rows_alloc: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One opaque node for torch.compile (integer outputs: no autograd)."""
    from .permute_triton import routing_index_triton  # here: backend="torch" must work without Triton

    return routing_index_triton(experts, num_experts, align, num_rows_alloc)


@_routing_index_triton.register_fake
def _(experts, num_experts, align, num_rows_alloc):
    new = experts.new_empty
    return (
        new(num_experts, dtype=torch.int64),
        new(num_experts, dtype=torch.int32),
        new(experts.shape, dtype=torch.int64),
        new(num_rows_alloc, dtype=torch.int64),
        new((), dtype=torch.int64),
    )


def routing_index(
    experts: torch.Tensor,
    num_experts: int,
    align: int = 1,
    *,
    num_slots: int | None = None,
    backend: str = "triton",
) -> RoutingIndex:
    """The RoutingIndex of experts [T, K] (entries in [0, num_experts), or -1 for no expert).

    Both backends take any entry outside [0, num_experts) as no expert, as they take -1 (not checked:
    that would cost a host sync or a device assert).

    num_slots: where many slots are -1 (a dispatcher's received rows), the number of slots
    with an expert, known on the host; rows are then allocated for it instead of for T*K.
    It must not undercount (not checked: a host sync); a kernel drops rows past N.
    """
    _check_args(experts, num_experts, align, num_slots)
    if not use_triton(backend, experts):
        return routing_index_reference(experts, num_experts, align, num_slots=num_slots)
    T, K = experts.shape
    N = allocated_rows(T * K if num_slots is None else num_slots, num_experts, align)
    return RoutingIndex(*_routing_index_triton(experts, num_experts, align, N), K)
