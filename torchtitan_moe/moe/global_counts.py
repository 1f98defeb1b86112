"""The global-batch balance loss's counts: every layer's, summed over the data-parallel ranks in ONE
all-reduce a micro-batch (not one a layer).

    forward, layer l     pending_l = counts.add(router_l.global_counts, tokens_per_expert_l [E], P_l [E])
                         balance_l = global_balance(P_l, pending_l)      # its value once reduced
    the first backward   counts.reduce(): the L layers' counts [L x E] in one all-reduce; for each layer
    that needs f         global_l += its row;  f_l = E * global_l / sum(global_l)   (router_losses.fractions)
    (the last layer's)   balance_l = sum_e f_l,e P_l,e, written into the forward's loss and added to its sums
    backward, layer l    dP_l = d balance_l * f_l                         # f is a constant

The loss is sum_e f_e P_e with f from counts, which carry no gradient (moe/router_losses.py): the forward
needs the other ranks' counts for the loss's value alone, and the value is only logged. So each layer's
forward leaves its micro-batch's counts here, and the backward reduces them all when it first needs f.
The value, the gradient and the counts are those of the per-layer all-reduce, bit for bit: the same
integer sums, then the same fp32 operations on the same values (tests/test_global_counts.py).

When the counts are reduced:
  - at the first backward that needs them: in the step's usual order (forward, backward, next
    micro-batch) one all-reduce a micro-batch. Forwards of several micro-batches before a backward
    wait together and go in one: each layer's rows are added to its buffer in forward order, so each
    micro-batch's f still counts the micro-batches up to its own;
  - at once where there is nothing to reduce over (no group, or a group of one rank): the loss's value
    is then known in the forward, as the other balance losses' are;
  - by `reduce` from the step's statistics hook (moe/balance.py), for a forward no backward followed.
Until then the forward's loss tensor holds NaN (so that a read of it too early shows) and is filled in
place; the aux loss built from it keeps its NaN value: it joins the objective through its gradient only.

A checkpointed recompute adds nothing: it finds the entry of the forward it repeats (Router.forward asks
seam.recomputing, eagerly: compiled code cannot tell a recompute) and reads the same f, already reduced
or reduced when its backward needs it. All this runs eagerly around the compiled router (`route`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchtitan_moe.moe.router_losses import fractions


class Pending:
    """One layer's counts of one micro-batch, until they are reduced over the ranks."""

    def __init__(self, buffer: torch.Tensor, counts: torch.Tensor, p: torch.Tensor, loss_sums: torch.Tensor | None):
        self.buffer = buffer  # [E] int64: the router's running counts of the step (router.global_counts)
        self.counts = counts  # [E] int64: this rank's slots per expert in this micro-batch
        self.p = p  # [E] fp32, detached: P, the value's other factor
        self.loss_sums = loss_sums  # where the value is added once known (the layer's router_loss_sums[:1])
        self.values: list[torch.Tensor] = []  # the forward's loss tensors (detached aliases), filled once known
        self.f: torch.Tensor | None = None  # [E] fp32 once reduced


class GlobalCounts:
    """The pending counts of the routers that share one data-parallel `group` (None: this process alone)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.pending: list[Pending] = []

    @property
    def across_ranks(self) -> bool:
        return self.group is not None and dist.get_world_size(self.group) > 1

    def add(self, buffer: torch.Tensor, counts: torch.Tensor, p: torch.Tensor,
            loss_sums: torch.Tensor | None) -> Pending:
        """A layer's real forward: its counts [E] and P [E] wait for the micro-batch's reduction."""
        entry = Pending(buffer, counts, p.detach(), loss_sums)
        self.pending.append(entry)
        if not self.across_ranks:  # nothing to wait for
            self.reduce()
        return entry

    @torch.no_grad()
    def reduce(self) -> None:
        """Every pending layer's counts summed over the ranks (one all-reduce), added to its step's buffer;
        its f and its loss's value computed, written and logged."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        counts = torch.cat([entry.counts for entry in pending])  # [L x E] int64
        if self.across_ranks:
            dist.all_reduce(counts, group=self.group)
        for entry, mine in zip(pending, counts.split([entry.counts.numel() for entry in pending])):
            entry.buffer.add_(mine)
            entry.f = fractions(entry.buffer.clone())
            value = (entry.f * entry.p).sum()
            for alias in entry.values:
                alias.copy_(value)
            if entry.loss_sums is not None:
                entry.loss_sums += value
            entry.values, entry.p, entry.counts = [], None, None

    def fractions_of(self, entry: Pending) -> torch.Tensor:
        """f [E] of `entry`, reducing the pending counts first if they are not yet."""
        if entry.f is None:
            self.reduce()
        return entry.f


class _GlobalBalance(torch.autograd.Function):
    """balance = sum_e f_e P_e with f known later: the backward reads it, reducing the counts if needed."""

    @staticmethod
    def forward(ctx, p: torch.Tensor, counts: GlobalCounts, entry: Pending) -> torch.Tensor:
        ctx.counts, ctx.entry = counts, entry
        if entry.f is not None:
            return (entry.f * p).sum()
        value = p.new_full((), float("nan"))
        entry.values.append(value.detach())  # an alias: filled in place, without a reference to this node
        return value

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        f = ctx.counts.fractions_of(ctx.entry)
        return grad.expand_as(f) * f, None, None  # as autograd differentiates (f * P).sum()


def global_balance(p: torch.Tensor, counts: GlobalCounts, entry: Pending) -> torch.Tensor:
    """P [E] (with its gradient) -> the global-batch balance loss, a scalar (NaN until reduced)."""
    return _GlobalBalance.apply(p, counts, entry)
