"""The router's auxiliary losses, each written from its published formula.

Load-balance loss, for E experts, top-K, over some set of T tokens:

    L_bal = sum_e f_e * P_e                          1 at a perfectly balanced load
    f_e   = E / (K T) * (slots of the T tokens routed to expert e)        no gradient
    P_e   = mean over the T tokens of s'_e,  s' = scores / sum_e scores   the gradient path

(DeepSeek-V3, arXiv:2412.19437, eqs. 17-20; the Switch Transformer's N * sum f_i P_i with top-K
slots counted. HF's Qwen3-MoE loss is K times this one.) The recipe is which tokens f and P
count, `balance_loss`:

    sequence      each sequence alone, then the mean over sequences (DeepSeek-V2/V3)
    micro_batch   every token of this rank's micro-batch (Switch, GShard, Megatron's aux_loss)
    global_batch  f over every data-parallel rank's tokens and over the micro-batches of the step
                  so far; P over this rank's micro-batch (Qwen3; Qiu et al. 2025, "Demons in the
                  Detail", arXiv:2501.11873). The ranks' counts of every layer travel in one
                  all-reduce a micro-batch (moe/global_counts.py)

Under gradient accumulation the paper keeps the synchronized counts of a step's micro-batches in a
buffer and computes each micro-batch's loss with what the buffer holds so far; Megatron-LM's
`global_aux_loss` does the same (running counts, reset every optimizer step). So does
moe/global_counts.py: micro-batch m of a step uses the counts of micro-batches 1..m on every rank;
the last one sees the whole global batch. With the trainer's weights (each rank's micro-batch loss
counts 1 / (micro-batches x ranks)) the objective is sum_e f_e * P_e with P over all ranks'
tokens, so value and gradients do not depend on how a micro-batch is split over ranks.

Router z-loss (ST-MoE, Zoph et al. 2022, arXiv:2202.08906, eq. 5), over this rank's tokens:

    L_z = mean over tokens of (log sum_e exp(logits_e))^2
"""

from __future__ import annotations

from typing import Literal

import torch

BalanceLoss = Literal["none", "sequence", "micro_batch", "global_batch"]
BALANCE_LOSSES = ("none", "sequence", "micro_batch", "global_batch")


def normalized_scores(scores: torch.Tensor) -> torch.Tensor:
    """scores [T, E] -> s' [T, E], each row summing to 1 (softmax scores already do)."""
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def balance_loss(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """sum_e f_e * P_e with P over the tokens of `scores` [T, E] and f from `counts` [E].

    counts: slots per expert of the tokens f counts (these or more); they sum to K x their
    tokens, so f_e = E * counts_e / sum(counts) = E / (K T) * counts_e.
    """
    return (fractions(counts) * mean_scores(scores)).sum()


def fractions(counts: torch.Tensor) -> torch.Tensor:
    """counts [E] (slots per expert, any integer or float dtype) -> f [E] fp32, E * counts / sum(counts);
    no gradient."""
    num_experts = counts.shape[-1]
    counts = counts.detach().float()
    return counts * (num_experts / counts.sum().clamp_min(1.0))


def mean_scores(scores: torch.Tensor) -> torch.Tensor:
    """scores [T, E] -> P [E], the mean over tokens of the normalized scores: the loss's gradient path."""
    return normalized_scores(scores).mean(dim=0)


def sequence_balance_loss(scores: torch.Tensor, experts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """scores [B*S, E], experts [B*S, K] -> the mean over the B sequences of their balance loss."""
    num_tokens, top_k = experts.shape
    num_experts = scores.shape[-1]
    if num_tokens % seq_len:
        raise ValueError(f"seq_len = {seq_len} does not divide the {num_tokens} tokens")
    num_seqs = num_tokens // seq_len
    p = normalized_scores(scores).view(num_seqs, seq_len, num_experts).mean(dim=1)  # [B, E]
    # Slots per (sequence, expert): one scatter over the flattened [B, E] grid.
    seq_of_slot = torch.arange(num_tokens, device=scores.device).div(seq_len, rounding_mode="floor")
    cell = (seq_of_slot.unsqueeze(1) * num_experts + experts).reshape(-1)
    hits = torch.zeros(num_seqs * num_experts, device=scores.device, dtype=torch.float32)
    hits = hits.scatter_add_(0, cell, torch.ones_like(cell, dtype=torch.float32)).view(num_seqs, num_experts)
    f = hits * (num_experts / (top_k * seq_len))
    return (f * p).sum(dim=-1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """logits [T, E] fp32 -> mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits, dim=-1).square().mean()

