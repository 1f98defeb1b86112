"""Aux-loss-free load balancing (Wang et al. 2024, arXiv:2408.15664): nudge a per-expert bias.

Before every optimizer step, for each MoE layer:

    load  = tokens_per_expert summed over the step's micro-batches and all data-parallel ranks
    bias += rate * sign(mean(load) - load);  bias -= mean(bias)

The bias only changes which experts are picked (router.py), never the weights of their
outputs. torchtitan 0.2.2's Qwen3 keeps such a bias but never updates it; this hook does.
The same single all-reduce also sums the layers' router losses; the reduced step statistics
are left in `moe.last_tokens_per_expert` and `moe.last_router_losses` for logging and monitors.
The hook also starts each step's global-batch counts afresh (moe/router_losses.py), over the
data-parallel group it hands to the routers, with one GlobalCounts for all of them: every layer's
counts in one all-reduce a micro-batch (moe/global_counts.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_moe.moe.global_counts import GlobalCounts
from torchtitan_moe.moe.layer import MoE


def moe_layers(model_parts: list[nn.Module]) -> list[MoE]:
    return [m for part in model_parts for m in part.modules() if isinstance(m, MoE)]


def set_aux_loss_scale(model_parts: list[nn.Module], scale: float) -> None:
    """Weigh each MoE layer's aux loss, and its logged router losses, by `scale`: 1 / (micro-batches per
    step x data-parallel ranks) makes the summed gradients those of the mean over the global batch."""
    for layer in moe_layers(model_parts):
        layer.aux_loss_scale = scale


@torch.no_grad()
def reduce_step_stats(layers: list[MoE], group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-reduce (one collective) and clear the layers' step statistics -> loads [L, E] fp64.

    Counts travel as float64, exact up to 2^53 tokens, so loads and router losses share it. Global-batch
    counts still waiting for their reduction (a forward no backward followed) are reduced first: their
    losses' values belong to this step.
    """
    for counts in {id(c): c for layer in layers if (c := layer.router.balance_counts) is not None}.values():
        counts.reduce()
    stats = torch.stack(
        [torch.cat([layer.tokens_per_expert.double(), layer.router_loss_sums.double()]) for layer in layers]
    )
    if group is not None and dist.is_initialized():
        dist.all_reduce(stats, group=group)
    for layer, row in zip(layers, stats):
        layer.tokens_per_expert.zero_()
        layer.router_loss_sums.zero_()
        layer.router.global_counts.zero_()
        layer.last_tokens_per_expert = row[:-2].long()
        # Mean over the step's micro-batches on all ranks: the same weights as the gradient.
        layer.last_router_losses = row[-2:] * layer.aux_loss_scale
    return stats[:, :-2]


@torch.no_grad()
def update_expert_bias(layers: list[MoE], loads: torch.Tensor) -> None:
    """loads [L, E]. No host sync: a layer that saw no tokens gets sign(0 - 0) = 0, no change."""
    signs = torch.sign(loads.mean(dim=1, keepdim=True) - loads).float()
    for layer, sign in zip(layers, signs):
        rate = layer.router.options.bias_update_rate
        if rate:
            delta = rate * sign
            layer.router.expert_bias.add_(delta - delta.mean())


def register_balancing_hook(optimizers, model_parts: list[nn.Module], group: dist.ProcessGroup | None) -> None:
    """Reduce statistics and update the bias as an optimizer step pre-hook (after all micro-batches).

    `group`: every data-parallel rank (the "loss" mesh); the global-batch balance loss counts over it.
    """
    layers = moe_layers(model_parts)
    if not layers:
        return
    counts = GlobalCounts(group)
    for layer in layers:
        layer.router.balance_group = group
        layer.router.balance_counts = counts

    def hook(*args, **kwargs) -> None:
        update_expert_bias(layers, reduce_step_stats(layers, group))

    optimizers.register_step_pre_hook(hook)
