"""Triton kernels of routing_index: a stable counting sort of slots by expert, no atomics.

    slots (flat t*K + k) are cut into blocks of BLOCK_S
    1. _rank_in_block_kernel  per block: each slot's rank among the block's slots of its
                              expert, and the block's count of each expert
    2. _scan_blocks_kernel    per expert: exclusive prefix sum of its counts over blocks,
                              and its total (tokens_per_expert)
    3. _layout_kernel         one program: group sizes (aligned), offsets, num_rows, starts
    4. _place_kernel          per block: row = start[e] + earlier blocks' count of e + rank;
                              inv[slot] = row, row_slot[row] = slot

A slot's rank comes from a one-hot [CHUNK, E] tile and a cumsum down its slot axis, so
earlier slots get lower rows (stable) and every run is identical. The work is O(T*K*E)
integer ops, small next to the expert GEMMs for E up to a few hundred.
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import INTERPRET

# Slots per block. Small under the interpreter so that the tests cross block boundaries.
BLOCK_S = 64 if INTERPRET else 1024
ONE_HOT_ELEMENTS = 8192  # CHUNK * E_PAD: the one-hot tile a program holds at once


@triton.jit
def _rank_in_block_kernel(
    experts_ptr, rank_ptr, block_counts_ptr, num_slots, num_experts,
    BLOCK_S: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
):
    block = tl.program_id(0)
    expert_ids = tl.arange(0, E_PAD)
    seen = tl.zeros([E_PAD], tl.int32)  # slots of each expert in this block so far
    for c0 in range(0, BLOCK_S, CHUNK):
        slots = block * BLOCK_S + c0 + tl.arange(0, CHUNK)
        e = tl.load(experts_ptr + slots, mask=slots < num_slots, other=-1)
        hot = (e[:, None] == expert_ids[None, :]).to(tl.int32)  # [CHUNK, E_PAD]; empty slots: all 0
        earlier = tl.cumsum(hot, axis=0) - hot  # same-expert slots before this one in the chunk
        rank = tl.sum(hot * (seen[None, :] + earlier), axis=1)
        tl.store(rank_ptr + slots, rank, mask=slots < num_slots)
        seen += tl.sum(hot, axis=0)
    tl.store(block_counts_ptr + block * num_experts + expert_ids, seen, mask=expert_ids < num_experts)


@triton.jit
def _scan_blocks_kernel(block_counts_ptr, tokens_per_expert_ptr, num_blocks, num_experts, BLOCKS_PAD: tl.constexpr):
    e = tl.program_id(0)
    blocks = tl.arange(0, BLOCKS_PAD)
    ptrs = block_counts_ptr + blocks * num_experts + e
    counts = tl.load(ptrs, mask=blocks < num_blocks, other=0)
    tl.store(ptrs, tl.cumsum(counts, 0) - counts, mask=blocks < num_blocks)  # in place: slots of e in earlier blocks
    tl.store(tokens_per_expert_ptr + e, tl.sum(counts, 0).to(tl.int64))


@triton.jit
def _layout_kernel(
    tokens_per_expert_ptr, offsets_ptr, starts_ptr, num_rows_ptr, num_experts,
    ALIGN: tl.constexpr, E_PAD: tl.constexpr,
):
    expert_ids = tl.arange(0, E_PAD)
    is_expert = expert_ids < num_experts
    sizes = tl.load(tokens_per_expert_ptr + expert_ids, mask=is_expert, other=0).to(tl.int32)
    if ALIGN > 1:  # round up to the alignment; an empty expert still gets ALIGN rows
        sizes = tl.where(is_expert, tl.maximum((sizes + ALIGN - 1) // ALIGN * ALIGN, ALIGN), 0)
    ends = tl.cumsum(sizes, 0)
    tl.store(offsets_ptr + expert_ids, ends, mask=is_expert)
    tl.store(starts_ptr + expert_ids, ends - sizes, mask=is_expert)
    tl.store(num_rows_ptr, tl.sum(sizes, 0).to(tl.int64))


@triton.jit
def _place_kernel(
    experts_ptr, inv_ptr, block_counts_ptr, starts_ptr, row_slot_ptr, num_slots, num_experts, num_rows_alloc,
    BLOCK_S: tl.constexpr,
):
    block = tl.program_id(0)
    slots = block * BLOCK_S + tl.arange(0, BLOCK_S)
    in_range = slots < num_slots
    e = tl.load(experts_ptr + slots, mask=in_range, other=-1)
    has_expert = (e >= 0) & (e < num_experts)
    rank = tl.load(inv_ptr + slots, mask=has_expert, other=0)  # written by _rank_in_block_kernel
    earlier_blocks = tl.load(block_counts_ptr + block * num_experts + e, mask=has_expert, other=0)
    start = tl.load(starts_ptr + e, mask=has_expert, other=0)
    row = tl.where(has_expert, start + earlier_blocks + rank, -1)
    tl.store(inv_ptr + slots, row, mask=in_range)
    # row < N holds unless the caller's num_slots undercounts: then drop, never write out of bounds.
    tl.store(row_slot_ptr + row, slots.to(tl.int64), mask=has_expert & (row < num_rows_alloc))


def routing_index_triton(experts: torch.Tensor, num_experts: int, align: int, num_rows_alloc: int):
    """experts [T, K] -> (tokens_per_expert [E], offsets [E], inv [T, K], row_slot [N], num_rows [])."""
    T, K = experts.shape
    S, E, dev = T * K, num_experts, experts.device
    flat = experts.contiguous().view(-1)
    num_blocks = max(1, triton.cdiv(S, BLOCK_S))
    e_pad = triton.next_power_of_2(E)
    chunk = max(1, min(BLOCK_S, ONE_HOT_ELEMENTS // e_pad))

    inv = torch.empty(S, dtype=torch.int64, device=dev)  # holds ranks between kernels 1 and 4
    block_counts = torch.empty(num_blocks, E, dtype=torch.int32, device=dev)
    tokens_per_expert = torch.empty(E, dtype=torch.int64, device=dev)
    offsets = torch.empty(E, dtype=torch.int32, device=dev)
    starts = torch.empty(E, dtype=torch.int32, device=dev)
    num_rows = torch.empty((), dtype=torch.int64, device=dev)
    row_slot = torch.full((num_rows_alloc,), -1, dtype=torch.int64, device=dev)

    _rank_in_block_kernel[(num_blocks,)](flat, inv, block_counts, S, E, BLOCK_S=BLOCK_S, CHUNK=chunk, E_PAD=e_pad)
    _scan_blocks_kernel[(E,)](block_counts, tokens_per_expert, num_blocks, E, BLOCKS_PAD=triton.next_power_of_2(num_blocks))
    _layout_kernel[(1,)](tokens_per_expert, offsets, starts, num_rows, E, ALIGN=align, E_PAD=e_pad)
    _place_kernel[(num_blocks,)](flat, inv, block_counts, starts, row_slot, S, E, num_rows_alloc, BLOCK_S=BLOCK_S)
    return tokens_per_expert, offsets, inv.view(T, K), row_slot, num_rows
