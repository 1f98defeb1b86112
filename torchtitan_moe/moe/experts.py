"""Routed experts as stacked weights and two grouped GEMMs.

    rows [N, D] ──grouped_mm(w13)──► ab [N, 2I] ──swiglu_prob(·, probs)──► h [N, I]
                ──grouped_mm(w2)───► y [N, D]

w13 [E, 2I, D] holds w1 (gate, rows :I) and w3 (up, rows I:) so one GEMM produces both
halves side by side, the layout swiglu_prob reads contiguously. The router probability is
applied inside swiglu_prob, before w2, so its gradient reaches the router from there.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_moe import ops
from torchtitan_moe.seam import ExpertBatch


def _local(weight: torch.Tensor) -> torch.Tensor:
    # Under EP the weights are DTensors sharded on the expert dim; grouped_mm takes our shard.
    return weight.to_local() if isinstance(weight, DTensor) else weight


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """Autocast's dtype where autocast is on for `device`, else None.

    torchtitan trains one device without FSDP under autocast, with fp32 weights. Autocast does
    not reach into our custom ops, which then ran fp32 GEMMs (one cuBLAS call per expert:
    torch._grouped_mm has no fp32 kernel on CUDA), 13.4k tokens/s against 36.1k in bf16 on an
    H200. Under FSDP2 the weights arrive in the mixed-precision dtype already.
    """
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, inter_dim: int, num_experts: int, kernels: str = "torch"):
        super().__init__()
        self.num_experts = num_experts
        self.inter_dim = inter_dim
        self.kernels = kernels
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, inter_dim))
        # Set by parallelize when the experts stay outside FSDP2 (their group would have one rank):
        # the GEMMs' dtype (FSDP2's param_dtype), and whether the cast copy of the fp32 weights
        # is made again in backward rather than kept (FSDP2's reshard_after_forward).
        self.param_dtype: torch.dtype | None = None
        self.recast_weights = False

    def init_weights(self, out_std: float) -> None:
        """w13 at std 0.02; w2, an output projection, at the depth-scaled `out_std`."""
        nn.init.trunc_normal_(self.w13, std=0.02, a=-0.06, b=0.06)
        nn.init.trunc_normal_(self.w2, std=out_std, a=-3 * out_std, b=3 * out_std)

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of the experts' GEMMs: autocast's where autocast is on, else `param_dtype`
        outside FSDP2, else the weights' (under FSDP2, the unsharded weights' mixed-precision
        dtype: read it inside forward)."""
        return autocast_dtype(device) or self.param_dtype or self.w13.dtype

    def gemm_weights(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) as the GEMMs take them: this rank's shard in the compute dtype, or the fp32
        master weights where grouped_mm casts them itself (recast_weights)."""
        w13, w2 = _local(self.w13), _local(self.w2)
        if self.recast_weights:  # grouped_mm casts them, in forward and again in backward
            return w13, w2
        dtype = self.compute_dtype(device)
        return w13.to(dtype), w2.to(dtype)  # autograd keeps the cast copies for backward

    def shared_weights(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The weights for several calls of one layer forward (moe/chunks.py), or None: each call
        prepares its own. Shared only outside FSDP2 with the cast kept (`param_dtype` set, not
        recasting): one kept copy for all calls instead of one per call. Under FSDP2 the weights
        are whole only inside a call; recasting keeps no copy to share."""
        return self.gemm_weights(device) if self.param_dtype is not None and not self.recast_weights else None

    def forward(self, batch: ExpertBatch, weights: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """batch.x [N, D] -> y [N, D]; rows past batch.num_rows are left undefined. `weights`:
        from shared_weights, else this call's gemm_weights."""
        dtype = self.compute_dtype(batch.x.device)
        w13, w2 = weights or self.gemm_weights(batch.x.device)
        x = batch.x.to(dtype)
        ab = ops.grouped_mm(x, w13.transpose(-2, -1), batch.offsets)
        h = ops.swiglu_prob(ab, batch.probs, batch.num_rows, backend=self.kernels)
        return ops.grouped_mm(h, w2.transpose(-2, -1), batch.offsets)
