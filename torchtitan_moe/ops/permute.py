"""routing_index: where each (token, k) slot lives in the expert-major row layout.

The router gives every token K experts. The grouped matmul wants the rows sorted
by expert, each expert's group ending at offsets[e]. This op computes that
layout once per layer; gather_rows / combine then move data through it.

    experts [T, K] int   expert of slot (t, k); -1 = "no expert" (no row)
    ->  tokens_per_expert [E] int64, offsets [E] int32 (group END rows),
        inv [T, K] int64 (row of each slot), row_slot [N] int64 (slot of each
        row, -1 for pad and tail rows), num_rows [] int64 = offsets[-1].

Within an expert, rows follow the flat slot index t*K + k (stable). With
align > 1 each group is padded to a multiple of align, and empty experts still
get `align` zero rows. N = T*K (+ E*align when aligned) is a static upper bound
so nothing needs a host sync; rows offsets[-1] <= r < N are the tail.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._triton_utils import check_backend, check_triton_device

ALIGNS = (1, 8, 16, 32)


class RoutingIndex(NamedTuple):
    tokens_per_expert: torch.Tensor  # [E] int64: slots routed to each expert
    offsets: torch.Tensor  # [E] int32: end row of each expert's group
    inv: torch.Tensor  # [T, K] int64: row of slot (t, k), -1 if no expert
    row_slot: torch.Tensor  # [N] int64: flat slot t*K+k of row r, -1 for pad/tail
    num_rows: torch.Tensor  # [] int64: offsets[-1], rows holding data or padding
    top_k: int  # K


def allocated_rows(num_slots: int, num_experts: int, align: int) -> int:
    """N: rows to allocate so that every routing fits (aligned groups add <= align each)."""
    return num_slots if align == 1 else num_slots + num_experts * align


def _check_args(experts: torch.Tensor, num_experts: int, align: int) -> None:
    if experts.dim() != 2 or experts.dtype.is_floating_point or experts.dtype == torch.bool:
        raise ValueError(
            f"experts must be a 2-D integer tensor [T, K], got {tuple(experts.shape)} {experts.dtype}"
        )
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if align not in ALIGNS:
        raise ValueError(f"align must be one of {ALIGNS}, got {align}")


def _group_sizes(tokens_per_expert: torch.Tensor, align: int) -> torch.Tensor:
    if align == 1:
        return tokens_per_expert
    return ((tokens_per_expert + align - 1) // align * align).clamp_min(align)


def routing_index_reference(experts: torch.Tensor, num_experts: int, align: int = 1) -> RoutingIndex:
    """Plain torch (stable sort + cumsum), no host sync."""
    _check_args(experts, num_experts, align)
    T, K = experts.shape
    E, S = num_experts, T * K
    N = allocated_rows(S, E, align)
    dev = experts.device

    flat = experts.reshape(-1).long()
    valid = flat >= 0
    key = torch.where(valid, flat, E)  # "no expert" slots sort after every expert
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    tokens_per_expert = counts[:E]
    sizes = _group_sizes(tokens_per_expert, align)
    ends = torch.cumsum(sizes, 0)
    group_start = torch.cat([ends - sizes, ends.new_zeros(1)])  # extra entry for key == E

    order = torch.sort(key, stable=True).indices  # slots in expert-major order
    sorted_key = key[order]
    first_in_order = torch.cumsum(counts, 0) - counts  # position in `order` of each expert's first slot
    rank = torch.arange(S, device=dev) - first_in_order[sorted_key]
    sorted_valid = sorted_key < E
    sorted_row = torch.where(sorted_valid, group_start[sorted_key] + rank, -1)

    inv = torch.empty(S, dtype=torch.int64, device=dev).scatter_(0, order, sorted_row)
    # Slots without a row write to distinct dummy entries past N (no duplicate indices).
    target = torch.where(sorted_valid, sorted_row, N + torch.arange(S, device=dev))
    row_slot = torch.full((N + S,), -1, dtype=torch.int64, device=dev).scatter_(0, target, order)[:N]
    return RoutingIndex(tokens_per_expert, ends.to(torch.int32), inv.view(T, K), row_slot, ends[-1], K)


def routing_index(
    experts: torch.Tensor, num_experts: int, align: int = 1, *, backend: str = "triton"
) -> RoutingIndex:
    """Build the RoutingIndex of experts [T, K] (values in [-1, num_experts))."""
    check_backend(backend)
    if backend == "torch":
        return routing_index_reference(experts, num_experts, align)
    _check_args(experts, num_experts, align)
    check_triton_device("experts", experts)
    raise NotImplementedError("routing_index: the triton kernel lands in a following commit")
