"""Token-choice top-k router: gate in fp32, scores, top-k with a selection-only expert bias.

    x [T, D] ──gate (fp32)──► logits [T, E] ──softmax|sigmoid──► scores [T, E]
    top-k over (scores + expert_bias)  ──► experts [T, K]      (the bias picks, never weighs)
    probs = scores[experts], optionally renormalized, times route_scale ──► probs [T, K] fp32
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
import torch.utils._pytree
from torch import nn


@dataclass
class Routing:
    """What the router decided for T tokens, K experts each, E experts in all."""

    probs: torch.Tensor  # [T, K] fp32: weight of each chosen expert's output
    experts: torch.Tensor  # [T, K] int64: chosen expert ids
    tokens_per_expert: torch.Tensor  # [E] int64: slots routed to each expert
    scores: torch.Tensor  # [T, E] fp32: scores before top-k (for the aux loss and checks)
    aux_loss: torch.Tensor | None  # scalar fp32: sequence-level balance loss, or None when off


# FSDP2 hooks the router's outputs to all-gather its weights again for backward; torch 2.11
# finds those tensors with pytree, which sees into a dataclass only once it is registered.
torch.utils._pytree.register_dataclass(Routing)


class Router(nn.Module):
    """Linear gate + top-k. Parameters: `gate.weight [E, D]`; buffer: `expert_bias [E]` fp32."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        score_func: Literal["softmax", "sigmoid"] = "softmax",
        route_norm: bool = True,
        route_scale: float = 1.0,
        init_std: float = 0.02,
        aux_loss_coeff: float = 0.0,
        force_balance: bool = False,
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k = {top_k}: must be in 1..num_experts ({num_experts})")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func = {score_func!r}: expected 'softmax' or 'sigmoid'")
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale
        self.init_std = init_std
        self.aux_loss_coeff = aux_loss_coeff
        self.force_balance = force_balance
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))

    def init_weights(self) -> None:
        with torch.no_grad():
            if self.init_std == 0:
                self.gate.weight.zero_()
            else:
                nn.init.trunc_normal_(
                    self.gate.weight, std=self.init_std, a=-3 * self.init_std, b=3 * self.init_std
                )
            self.expert_bias.zero_()

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> Routing:
        """x [T, D] -> Routing. `seq_len` groups tokens into sequences for the aux loss."""
        with torch.autocast(x.device.type, enabled=False):  # router math stays fp32
            logits = F.linear(x.float(), self.gate.weight.float())
        if self.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)

        if self.force_balance:
            experts = balanced_experts(x.shape[0], self.top_k, self.num_experts, x.device)
        else:
            choice = scores.detach() + self.expert_bias
            experts = torch.topk(choice, self.top_k, dim=-1).indices

        probs = scores.gather(1, experts)
        if self.route_norm:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        probs = probs * self.route_scale

        tokens_per_expert = count_tokens(experts, self.num_experts)
        aux_loss = None
        if self.aux_loss_coeff > 0 and self.training:
            aux_loss = self.aux_loss_coeff * sequence_balance_loss(
                scores, experts, self.num_experts, seq_len or x.shape[0]
            )
        return Routing(probs, experts, tokens_per_expert, scores, aux_loss)


def balanced_experts(num_tokens: int, top_k: int, num_experts: int, device) -> torch.Tensor:
    """Round-robin choice [T, K]: every expert gets the same number of slots (±1)."""
    slots = torch.arange(num_tokens * top_k, device=device, dtype=torch.int64)
    return (slots % num_experts).view(num_tokens, top_k)


def count_tokens(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """experts [T, K] -> tokens_per_expert [E] int64, without a host sync (unlike bincount)."""
    flat = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def sequence_balance_loss(
    scores: torch.Tensor, experts: torch.Tensor, num_experts: int, seq_len: int
) -> torch.Tensor:
    """Sequence-level balance loss (DeepSeek-V3): mean over sequences of sum_e f_e * P_e.

    f_e = E / (K * S) * (slots of the sequence on expert e), P_e = mean over the sequence of
    the normalized score of e. It is 1 for a perfectly balanced sequence.
    """
    num_tokens, top_k = experts.shape
    if num_tokens % seq_len:
        raise ValueError(f"seq_len = {seq_len} does not divide the {num_tokens} tokens")
    num_seqs = num_tokens // seq_len
    norm_scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    p = norm_scores.view(num_seqs, seq_len, num_experts).mean(dim=1)  # [B, E]
    hits = torch.zeros(num_seqs, num_experts, device=scores.device, dtype=torch.float32)
    seq_of_slot = torch.arange(num_tokens, device=scores.device).div(seq_len, rounding_mode="floor")
    hits.index_put_(
        (seq_of_slot.repeat_interleave(top_k), experts.reshape(-1)),
        torch.ones(num_tokens * top_k, device=scores.device),
        accumulate=True,
    )
    f = hits * (num_experts / (top_k * seq_len))
    return (f * p).sum(dim=-1).mean()
