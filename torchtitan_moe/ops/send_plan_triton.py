"""Triton kernels of send_plan and send_meta: one program per block of tokens (rows), K slots wide.

    _send_plan_kernel        per block of tokens: each slot's rank (expert // L), whether it is the
                             token's first slot on that rank, and the block's slot count per rank
    _send_meta_kernel        per block of send rows: the row's token and rank, then the token's K
                             slots masked to that rank (local expert ids, probs)
    _send_meta_back_kernel   the same walk, copying each slot's prob gradient from the one row
                             that carried it

No atomics: per-block counts are summed by the launcher, every other element is written once.
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import INTERPRET

BLOCK_T = 16 if INTERPRET else 128  # tokens (or rows) per program; small under the interpreter


@triton.jit
def _send_plan_kernel(
    experts_ptr, rank_slots_ptr, block_counts_ptr, num_tokens, num_local, ep_size,
    K: tl.constexpr, K_PAD: tl.constexpr, P_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    block = tl.program_id(0)
    t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.arange(0, K_PAD)
    valid = (t[:, None] < num_tokens) & (k[None, :] < K)
    e = tl.load(experts_ptr + t[:, None] * K + k[None, :], mask=valid, other=0)
    rank = e // num_local  # [BLOCK_T, K_PAD]
    # Slot k is the first of its rank when no earlier slot j < k of the token has that rank.
    same = rank[:, :, None] == rank[:, None, :]  # [BLOCK_T, K_PAD (k), K_PAD (j)]
    earlier = (k[None, None, :] < k[None, :, None]) & (k[None, None, :] < K)
    repeats = tl.sum((same & earlier).to(tl.int32), axis=2)
    first = valid & (repeats == 0)
    tl.store(rank_slots_ptr + t[:, None] * K + k[None, :], tl.where(first, rank, -1).to(tl.int64), mask=valid)
    p = tl.arange(0, P_PAD)
    hot = (rank[:, :, None] == p[None, None, :]) & valid[:, :, None]  # [BLOCK_T, K_PAD, P_PAD]
    counts = tl.sum(tl.sum(hot.to(tl.int32), axis=1), axis=0)
    tl.store(block_counts_ptr + block * ep_size + p, counts, mask=p < ep_size)


@triton.jit
def _row_slots(experts_ptr, row_slot_ptr, num_rows, num_local, K: tl.constexpr, K_PAD: tl.constexpr,
               BLOCK_T: tl.constexpr):
    """The rows of this program: their tokens, and which of the token's K slots go to the row's rank."""
    r = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = r < num_rows
    s = tl.load(row_slot_ptr + r, mask=in_range, other=-1)
    has_slot = s >= 0
    token = tl.where(has_slot, s // K, 0)
    row_rank = tl.load(experts_ptr + tl.where(has_slot, s, 0), mask=has_slot, other=0) // num_local
    k = tl.arange(0, K_PAD)
    slot_ok = has_slot[:, None] & (k[None, :] < K)
    e = tl.load(experts_ptr + token[:, None] * K + k[None, :], mask=slot_ok, other=0)
    here = slot_ok & (e // num_local == row_rank[:, None])
    return r, in_range, token, k, e, here


@triton.jit
def _send_meta_kernel(
    experts_ptr, probs_ptr, row_slot_ptr, meta_ptr, num_rows, num_local,
    K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    r, in_range, token, k, e, here = _row_slots(experts_ptr, row_slot_ptr, num_rows, num_local, K, K_PAD, BLOCK_T)
    p = tl.load(probs_ptr + token[:, None] * K + k[None, :], mask=here, other=0.0)
    out = in_range[:, None] & (k[None, :] < K)
    ids = tl.where(here, e % num_local, -1).to(tl.float32)
    tl.store(meta_ptr + r[:, None] * (2 * K) + k[None, :], ids, mask=out)
    tl.store(meta_ptr + r[:, None] * (2 * K) + K + k[None, :], tl.where(here, p, 0.0), mask=out)


@triton.jit
def _send_meta_back_kernel(
    experts_ptr, dmeta_ptr, row_slot_ptr, dprobs_ptr, num_rows, num_local,
    K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    r, in_range, token, k, e, here = _row_slots(experts_ptr, row_slot_ptr, num_rows, num_local, K, K_PAD, BLOCK_T)
    g = tl.load(dmeta_ptr + r[:, None] * (2 * K) + K + k[None, :], mask=here, other=0.0)
    tl.store(dprobs_ptr + token[:, None] * K + k[None, :], g, mask=here)


def send_plan_triton(experts: torch.Tensor, num_local: int, ep_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    T, K = experts.shape
    experts = experts.contiguous()
    num_blocks = max(1, triton.cdiv(T, BLOCK_T))
    rank_slots = torch.empty(T, K, dtype=torch.int64, device=experts.device)
    block_counts = torch.empty(num_blocks, ep_size, dtype=torch.int32, device=experts.device)
    _send_plan_kernel[(num_blocks,)](
        experts, rank_slots, block_counts, T, num_local, ep_size,
        K=K, K_PAD=triton.next_power_of_2(K), P_PAD=triton.next_power_of_2(ep_size), BLOCK_T=BLOCK_T,
    )
    return rank_slots, block_counts.sum(0, dtype=torch.int64)


def send_meta_triton(row_slot: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor, num_local: int) -> torch.Tensor:
    N, K = row_slot.shape[0], experts.shape[1]
    meta = torch.empty(N, 2 * K, dtype=torch.float32, device=experts.device)
    _send_meta_kernel[(max(1, triton.cdiv(N, BLOCK_T)),)](
        experts.contiguous(), probs.contiguous(), row_slot.contiguous(), meta, N, num_local,
        K=K, K_PAD=triton.next_power_of_2(K), BLOCK_T=BLOCK_T,
    )
    return meta


def send_meta_backward_triton(dmeta: torch.Tensor, row_slot: torch.Tensor, experts: torch.Tensor, num_local: int) -> torch.Tensor:
    N, K = row_slot.shape[0], experts.shape[1]
    dprobs = torch.zeros(experts.shape, dtype=torch.float32, device=experts.device)  # a slot no row carries: 0
    _send_meta_back_kernel[(max(1, triton.cdiv(N, BLOCK_T)),)](
        experts.contiguous(), dmeta.contiguous(), row_slot.contiguous(), dprobs, N, num_local,
        K=K, K_PAD=triton.next_power_of_2(K), BLOCK_T=BLOCK_T,
    )
    return dprobs
