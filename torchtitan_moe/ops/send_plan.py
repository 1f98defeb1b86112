"""send_plan and send_meta: the sending side of the all-to-all dispatcher, a kernel each.

A token goes once to each EP rank that holds one of its K experts (rank = expert // L, L experts
per rank). The dispatcher lays those (token, rank) rows out with routing_index, over the rank of
each token's first slot on that rank, and sends with every row its token's slots on that rank.

    send_plan(experts [T, K] int, L, P)
        -> rank_slots     [T, K] int64  rank of slot (t, k) if it is token t's first slot on that
                                        rank, else -1 (routing_index's "no row")
           slots_per_rank [P] int64     slots routed to each rank's experts
    send_meta(row_slot [S] int, experts [T, K], probs [T, K] fp32, L)
        -> meta [S, 2K] fp32            for the row of slot s = row_slot[r] (token t = s // K,
                                        rank p = rank of slot s), over the token's K slots:
                                        meta[r, k] = experts[t, k] % L, meta[r, K + k] = probs[t, k]
                                        where slot k's rank is p; -1 and 0 elsewhere and for rows
                                        with row_slot = -1
       backward: dprobs[t, k] = dmeta[r, K + k] of the one row r that carries slot (t, k)

Local expert ids travel as fp32 (exact below 2^24) beside the probs, so one exchange moves both.
Without these kernels the dispatcher spent about 25 small torch ops here, each a launch on the
host path between the router and the exchange.
"""

from __future__ import annotations

import torch

from ._backend import use_triton
from ._library import custom_op


def _check_args(experts: torch.Tensor, num_local: int) -> None:
    if experts.dim() != 2 or experts.dtype.is_floating_point or experts.dtype == torch.bool:
        raise ValueError(f"experts must be a 2-D integer tensor [T, K], got {tuple(experts.shape)} {experts.dtype}")
    if num_local < 1:
        raise ValueError(f"num_local (experts per rank) must be >= 1, got {num_local}")


# --------------------------------------------------------------------------- references


def send_plan_reference(experts: torch.Tensor, num_local: int, ep_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch."""
    _check_args(experts, num_local)
    rank = experts.long() // num_local
    same = rank.unsqueeze(2) == rank.unsqueeze(1)  # [T, K, K]: slots k and j go to one rank
    earlier = torch.ones(rank.shape[1], rank.shape[1], dtype=torch.bool, device=rank.device).tril(-1)
    first = ~(same & earlier).any(dim=2)
    counts = torch.zeros(ep_size, dtype=torch.int64, device=rank.device)
    flat = rank.reshape(-1)
    return torch.where(first, rank, -1), counts.scatter_add_(0, flat, torch.ones_like(flat))


def send_meta_reference(row_slot: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor, num_local: int) -> torch.Tensor:
    """Plain torch, differentiable in probs."""
    _check_args(experts, num_local)
    top_k = experts.shape[1]
    if experts.numel() == 0:  # no tokens: every row is a tail row (the sum keeps probs in the graph)
        rows = row_slot.shape[0]
        return torch.cat([probs.new_full((rows, top_k), -1.0), probs.new_zeros(rows, top_k) + probs.sum()], dim=1)
    slot = row_slot.long().clamp_min(0)
    token = slot // top_k
    rank = experts.long() // num_local
    here = (rank[token] == rank.reshape(-1)[slot].unsqueeze(1)) & (row_slot >= 0).unsqueeze(1)  # [S, K]
    ids = torch.where(here, experts[token] % num_local, -1).to(torch.float32)
    return torch.cat([ids, torch.where(here, probs[token], 0.0).to(torch.float32)], dim=1)


# ---------------------------------------------------------------------------- Triton ops


@custom_op("torchtitan_moe::send_plan")
def _send_plan_triton(experts: torch.Tensor, num_local: int, ep_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from .send_plan_triton import send_plan_triton  # here: backend="torch" must work without Triton

    return send_plan_triton(experts, num_local, ep_size)


@_send_plan_triton.register_fake
def _(experts, num_local, ep_size):
    return experts.new_empty(experts.shape, dtype=torch.int64), experts.new_empty(ep_size, dtype=torch.int64)


@custom_op("torchtitan_moe::send_meta")
def _send_meta_triton(row_slot: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor, num_local: int) -> torch.Tensor:
    from .send_plan_triton import send_meta_triton

    return send_meta_triton(row_slot, experts, probs, num_local)


@_send_meta_triton.register_fake
def _(row_slot, experts, probs, num_local):
    return probs.new_empty(row_slot.shape[0], 2 * experts.shape[1])


@custom_op("torchtitan_moe::send_meta_backward")
def _send_meta_backward(dmeta: torch.Tensor, row_slot: torch.Tensor, experts: torch.Tensor, num_local: int) -> torch.Tensor:
    from .send_plan_triton import send_meta_backward_triton

    return send_meta_backward_triton(dmeta, row_slot, experts, num_local)


@_send_meta_backward.register_fake
def _(dmeta, row_slot, experts, num_local):
    return dmeta.new_empty(experts.shape)


def _send_meta_setup(ctx, inputs, output) -> None:
    row_slot, experts, _, ctx.num_local = inputs
    ctx.save_for_backward(row_slot, experts)


def _send_meta_backward_fn(ctx, dmeta):
    row_slot, experts = ctx.saved_tensors
    return None, None, _send_meta_backward(dmeta, row_slot, experts, ctx.num_local), None


_send_meta_triton.register_autograd(_send_meta_backward_fn, setup_context=_send_meta_setup)


def send_plan(experts: torch.Tensor, num_local: int, ep_size: int, *, backend: str = "triton") -> tuple[torch.Tensor, torch.Tensor]:
    """(rank_slots [T, K], slots_per_rank [P]) of experts [T, K]; see the module docstring."""
    _check_args(experts, num_local)
    if not use_triton(backend, experts):
        return send_plan_reference(experts, num_local, ep_size)
    return _send_plan_triton(experts, num_local, ep_size)


def send_meta(row_slot: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor, num_local: int, *,
              backend: str = "triton") -> torch.Tensor:
    """meta [S, 2K] fp32 of the send rows row_slot [S]; see the module docstring."""
    _check_args(experts, num_local)
    if probs.shape != experts.shape or probs.dtype != torch.float32:
        raise ValueError(f"probs must be float32 of shape {tuple(experts.shape)}, got {tuple(probs.shape)} {probs.dtype}")
    if row_slot.dim() != 1 or row_slot.dtype.is_floating_point:
        raise ValueError(f"row_slot must be a 1-D integer tensor, got {tuple(row_slot.shape)} {row_slot.dtype}")
    if not use_triton(backend, row_slot, experts, probs):
        return send_meta_reference(row_slot, experts, probs, num_local)
    return _send_meta_triton(row_slot, experts, probs, num_local)
