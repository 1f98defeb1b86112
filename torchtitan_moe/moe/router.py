"""Token-choice top-k router: gate in fp32, scores, top-k with a selection-only expert bias.

    x [T, D] ──gate (fp32, or bf16 as torchtitan's)──► logits [T, E] ──softmax|sigmoid──► scores [T, E]
    top-k over (scores + expert_bias)  ──► experts [T, K]      (the bias picks, never weighs)
        group-limited (n_groups > 1): only inside each token's topk_groups best groups
    probs = scores[experts], optionally renormalized, times route_scale ──► probs [T, K] fp32
    training: balance loss and z-loss (moe/router_losses.py) ──► aux_loss, their weighted sum

`route` is all of it but the global-batch balance loss, and is what torch.compile compiles
(parallelize.apply_compile). That loss leaves each micro-batch's counts for the one all-reduce of every
layer's (moe/global_counts.py), once per real forward: only eager code can tell a checkpointed recompute
(seam.recomputing), so `forward` adds it around the compiled region.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_moe import ops
from torchtitan_moe.moe.global_counts import GlobalCounts, Pending, global_balance
from torchtitan_moe.moe.options import RouterOptions, router_problem
from torchtitan_moe.moe.router_losses import (
    balance_loss,
    mean_scores,
    sequence_balance_loss,
    z_loss,
)
from torchtitan_moe.compat.collectives import gathered_rows
from torchtitan_moe.dispatch.seam import Routing, recomputing


class Router(nn.Module):
    """Linear gate + top-k. Parameters: `gate.weight [E, D]`; buffers: `expert_bias [E]` fp32
    and, for the global-batch balance loss, `global_counts [E]` int64 (the step's counts so far)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, options: RouterOptions | None = None,
                 param_dtype: torch.dtype = torch.bfloat16):
        """`options`: the router's settings, whole (default: RouterOptions()); `param_dtype`: the gate's
        dtype where options.gate_precision = 'param' (the training's mixed_precision_param)."""
        super().__init__()
        options = RouterOptions() if options is None else options
        problem = router_problem(options, num_experts, top_k)
        if problem:
            raise ValueError(problem)
        self.num_experts = num_experts
        self.top_k = top_k
        self.options = options
        # fp32 unless matching torchtitan's gate in the parameters' dtype ([router] gate_precision)
        self.gate_dtype = torch.float32 if options.gate_precision == "float32" else param_dtype
        # The ops' backend (set with the layer's dispatcher): "triton" computes an fp32 gate of bf16 tokens
        # on the bf16 tensor cores (ops.gate_logits), "torch" as an fp32 GEMM.
        self.kernels = "torch"
        # The data-parallel ranks whose tokens the global-batch loss counts (the trainer's
        # "loss" mesh, set by moe/balance.py); None: this process alone.
        self.balance_group: dist.ProcessGroup | None = None
        # Where the global-batch loss's counts wait for their all-reduce (shared by the layers of a model:
        # moe/balance.py), and this router's entry of its last real forward (a recompute reads it again).
        self.balance_counts: GlobalCounts | None = None
        self.balance_entry: Pending | None = None
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("global_counts", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    def init_weights(self) -> None:
        std = self.options.init_std
        with torch.no_grad():
            if std == 0:
                self.gate.weight.zero_()
            else:
                nn.init.trunc_normal_(self.gate.weight, std=std, a=-3 * std, b=3 * std)
            self.expert_bias.zero_()
            self.global_counts.zero_()

    def forward(self, x: torch.Tensor, seq_len: int | None = None, loss_sums: torch.Tensor | None = None) -> Routing:
        """x [T, D] -> Routing. `seq_len` groups tokens into sequences for the sequence loss. `loss_sums` [2] fp32:
        where this forward's balance loss and z-loss (before their coefficients) are added, each once its value
        is known (the MoE layer's statistics); None: not counted (a recompute, a probe)."""
        weight = self.gate.weight
        if isinstance(weight, DTensor):  # sharded by rows outside FSDP2 (parallel/router_gate.py): gather it here
            weight = gathered_rows(weight)
        routing = self.route(x, seq_len, weight)
        if loss_sums is not None:
            with torch.no_grad():
                for i, loss in enumerate((routing.balance_loss, routing.z_loss)):
                    if loss is not None:
                        loss_sums[i] += loss.detach()
        if self.options.balance_loss == "global_batch" and self.training and torch.is_grad_enabled():
            sink = None if loss_sums is None else loss_sums[:1]
            balance = self.global_balance_loss(routing.scores, routing.tokens_per_expert, sink)
            weighted = self.options.balance_loss_coeff * balance
            aux_loss = weighted if routing.aux_loss is None else weighted + routing.aux_loss
            routing = dataclasses.replace(routing, aux_loss=aux_loss, balance_loss=balance)
        return routing

    def route(self, x: torch.Tensor, seq_len: int | None = None, weight: torch.Tensor | None = None) -> Routing:
        """`forward` without the global-batch balance loss (the region torch.compile compiles). `weight`: the
        whole gate [E, D] where `gate.weight` holds this rank's rows only (forward gathers them)."""
        weight = self.gate.weight if weight is None else weight
        options = self.options
        with torch.autocast(x.device.type, enabled=False):  # router math stays fp32
            dtype = self.gate_dtype
            if dtype == torch.float32 and x.dtype == torch.bfloat16 and self.kernels == "triton":
                logits = ops.gate_logits(x, weight.to(torch.float32), backend=self.kernels)
            else:
                logits = F.linear(x.to(dtype), weight.to(dtype)).float()
        if options.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)

        if options.force_balance:
            experts = balanced_experts(x.shape[0], self.top_k, self.num_experts, x.device)
        else:
            choice = scores.detach() + self.expert_bias
            if options.n_groups > 1:
                experts = group_limited_topk(choice, self.top_k, options.n_groups, options.topk_groups)
            else:
                experts = torch.topk(choice, self.top_k, dim=-1).indices

        probs = scores.gather(1, experts)
        if options.route_norm:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        probs = probs * options.route_scale

        tokens_per_expert = count_tokens(experts, self.num_experts)
        balance = zloss = aux_loss = None
        if self.training and torch.is_grad_enabled():  # not in eval, probes or no_grad passes
            if options.balance_loss in ("sequence", "micro_batch"):
                balance = self.compute_balance_loss(scores, experts, tokens_per_expert, seq_len or x.shape[0])
                aux_loss = options.balance_loss_coeff * balance
            if options.z_loss_coeff > 0:
                zloss = z_loss(logits)
                weighted = options.z_loss_coeff * zloss
                aux_loss = weighted if aux_loss is None else aux_loss + weighted
        return Routing(probs, experts, tokens_per_expert, scores, aux_loss, balance, zloss)

    def compute_balance_loss(self, scores: torch.Tensor, experts: torch.Tensor, tokens_per_expert: torch.Tensor,
                             seq_len: int) -> torch.Tensor:
        """The sequence or micro-batch balance loss (before its coefficient) of this micro-batch."""
        if self.options.balance_loss == "sequence":
            return sequence_balance_loss(scores, experts, seq_len)
        return balance_loss(scores, tokens_per_expert)

    def global_balance_loss(self, scores: torch.Tensor, tokens_per_expert: torch.Tensor,
                            loss_sums: torch.Tensor | None = None) -> torch.Tensor:
        """The global-batch balance loss (before its coefficient): f from the step's counts so far on every
        data-parallel rank, this micro-batch's included; P from `scores` [T, E]. Across ranks its value is
        known once the micro-batch's counts are reduced, and then added to `loss_sums` [1]
        (moe/global_counts.py). A recompute adds no counts: it reads its forward's."""
        if self.balance_group is None and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(
                "balance_loss = 'global_batch' under torch.distributed needs the data-parallel group: "
                "set Router.balance_group (moe.balance.register_balancing_hook does)"
            )
        if self.balance_counts is None or self.balance_counts.group is not self.balance_group:
            self.balance_counts = GlobalCounts(self.balance_group)
        p = mean_scores(scores)
        if not recomputing():
            self.balance_entry = self.balance_counts.add(self.global_counts, tokens_per_expert, p, loss_sums)
        return global_balance(p, self.balance_counts, self.balance_entry)


def group_limited_topk(choice: torch.Tensor, top_k: int, n_groups: int, topk_groups: int) -> torch.Tensor:
    """choice [T, E] -> experts [T, K], all inside each token's `topk_groups` best groups.

    Experts e of group g are [g E/G, (g+1) E/G). DeepSeek-V3's node-limited routing (arXiv:2412.19437,
    sec. 2.1.2) ranks groups by "the sum of the highest K/M affinity scores of the experts" in each
    (K = top_k, M = topk_groups): the best 2 for DeepSeek-V3's 8 and 4, the number HF's DeepseekV3
    router fixes, and top_k // topk_groups as in Megatron-LM's group_limited_topk. Scores here are
    the choice scores (scores + expert_bias), as in both. Experts of other groups are masked to -inf,
    not to 0 (HF): a biased choice score can be negative, and a 0 would then win.
    """
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, n_groups, num_experts // n_groups)
    group_scores = grouped.topk(top_k // topk_groups, dim=-1).values.sum(dim=-1)  # [T, G]
    groups = group_scores.topk(topk_groups, dim=-1).indices  # [T, topk_groups]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)
    return masked.topk(top_k, dim=-1).indices


def balanced_experts(num_tokens: int, top_k: int, num_experts: int, device) -> torch.Tensor:
    """Round-robin choice [T, K]: every expert gets the same number of slots (±1)."""
    slots = torch.arange(num_tokens * top_k, device=device, dtype=torch.int64)
    return (slots % num_experts).view(num_tokens, top_k)


def count_tokens(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """experts [T, K] -> tokens_per_expert [E] int64, without a host sync (unlike bincount)."""
    flat = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))
