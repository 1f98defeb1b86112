"""The optimizer: torchtitan's AdamW, or AdamW with its moments stored in bf16 ([optimizer] moments_dtype).

AdamW keeps two fp32 moments per parameter next to the fp32 master weight and its gradient: 8 of
the 16 bytes each parameter costs before activations. `moments_dtype = "bfloat16"` stores both
moments in bf16 (Megatron-Core's precision-aware optimizer offers the same), which saves 4 bytes
per parameter (22 GB of a 5.6B-parameter model) and moves 20 instead of 28 bytes per parameter in
the update. The update itself is fp32 (ops/adamw.py); only the stored moments are rounded
(stochastically: unbiased). The master weights stay fp32. What the rounding costs in learning is
measured, not assumed: worklogs/2026-11-25-bf16-moments.md.

Both our model and the torchtitan baseline build their optimizer here, so a comparison of the two
uses the same optimizer.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from torchtitan_moe.ops.adamw import adamw_step_
from torchtitan_moe.torchtitan_compat import OptimizersContainer, build_optimizers as build_torchtitan_optimizers

MOMENTS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's shard of a DTensor (FSDP2 parameters, their gradients and moments), else `t`."""
    return t._local_tensor if isinstance(t, DTensor) else t


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW (decoupled weight decay, bias-corrected) with exp_avg and exp_avg_sq kept
    in `moments_dtype`. Its state has torch's keys (step, exp_avg, exp_avg_sq), so checkpoints
    load either way; moments loaded from a checkpoint are stored in `moments_dtype` again."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, moments_dtype: torch.dtype = torch.bfloat16):
        if moments_dtype not in MOMENTS_DTYPES.values():
            raise ValueError(f"moments_dtype must be float32 or bfloat16, got {moments_dtype}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.moments_dtype = moments_dtype

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)  # on the host, as torch's non-capturable AdamW keeps it
            state["exp_avg"] = torch.zeros_like(p, dtype=self.moments_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moments_dtype)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0  # the parameter's place in the optimizer: with the step, the seed of its rounding
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self._state(p)
                state["step"] += 1
                step = int(state["step"])
                backend = "triton" if p.is_cuda else "torch"
                adamw_step_(_local(p), _local(p.grad).contiguous(), _local(state["exp_avg"]),
                            _local(state["exp_avg_sq"]), lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                            eps=group["eps"], weight_decay=group["weight_decay"], step=step,
                            seed=(step * 1_000_003 + index) % 2**31, backend=backend)
        return loss

    def load_state_dict(self, state_dict) -> None:
        # torch.optim.Optimizer casts loaded state to each parameter's dtype (fp32): store it back.
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.moments_dtype)


def build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager=None):
    """torchtitan's optimizers, or ours with bf16 moments when [optimizer] moments_dtype asks for them.
    The config check (config.py) has refused what bf16 moments do not support."""
    moments_dtype = MOMENTS_DTYPES[optimizer_config.moments_dtype]
    if moments_dtype == torch.float32:
        return build_torchtitan_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    kwargs = dict(lr=optimizer_config.lr, betas=(optimizer_config.beta1, optimizer_config.beta2),
                  eps=optimizer_config.eps, weight_decay=optimizer_config.weight_decay, moments_dtype=moments_dtype)
    return OptimizersContainer(model_parts, AdamW, kwargs)
