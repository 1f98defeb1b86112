"""The MoE layer: router -> dispatcher -> grouped experts -> combine.

    x [B, S, D] ─► router ─► Routing ─► dispatcher.start_dispatch ... .wait() ─► ExpertBatch ─► experts ─► y
                                         dispatcher.start_combine(y) ... .wait() ─► out [B, S, D]

(dispatcher.send_tokens(x) comes first: all_gather starts moving the tokens under the router.)

The dispatcher speaks the seam (torchtitan_moe/dispatch/seam.py); which one a layer gets is decided above
this package (parallelization); a layer used on its own gets the seam's LocalDispatcher. With
`overlap = "chunks"` ([dispatch] overlap) the tokens after the router go through in two chunks,
one chunk's exchange in flight while the other's experts compute (moe/chunks.py).

It also keeps the per-step statistics that balancing and monitoring read:
`tokens_per_expert` accumulates over the micro-batches of one optimizer step (the bias
update in moe/balance.py reduces and clears it) and `router_loss_sums` the router's losses
(balance loss, z-loss) before their coefficients.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan_moe.moe.chunks import chunked_forward
from torchtitan_moe.moe.experts import GroupedExperts, autocast_dtype
from torchtitan_moe.moe.options import MoEArgs, moe_problem
from torchtitan_moe.moe.padding import resolve_alignment
from torchtitan_moe.moe.router import Router
from torchtitan_moe.dispatch.seam import LocalDispatcher, recomputing


def resolve_kernels(kernels: str, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA, 'torch' elsewhere. 'triton' is checked by the ops themselves."""
    if kernels not in ("auto", "torch", "triton"):
        raise ValueError(f"kernels = {kernels!r}: expected 'auto', 'torch' or 'triton'")
    if kernels != "auto":
        return kernels
    return "triton" if device.type == "cuda" else "torch"


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `out` whose backward also sends `scale` as the gradient of `aux_loss`.

    This adds `scale * aux_loss` to the training objective without touching the trainer's
    loss function (each layer's loss joins the graph through the layer's own output).
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape = aux_loss.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_aux = torch.full(ctx.aux_shape, ctx.scale, device=grad_out.device, dtype=torch.float32)
        return grad_out, grad_aux, None


class MoE(nn.Module):
    # [dispatch] overlap: "none", or "chunks" (moe/chunks.py). Set by parallelization with the dispatcher.
    overlap: str = "none"

    def __init__(self, args: MoEArgs, dim: int):
        super().__init__()
        problem = moe_problem(args)
        if problem:
            raise ValueError(problem)
        self.args = args
        self.num_experts = args.num_experts
        self.router = Router(dim, args.num_experts, args.top_k, args.router, param_dtype=getattr(torch, args.param_dtype))
        self.experts = GroupedExperts(dim, args.inter_dim, args.num_experts)
        self.dispatcher = None  # built on first use for the device (or set by parallelize)
        # Weight of each micro-batch's aux loss in the global objective: 1 / (micro-batches per step x
        # data-parallel ranks), so that the summed gradients are those of the mean. The trainer sets it
        # (moe.balance.set_aux_loss_scale); 1.0 for a single process without gradient accumulation.
        self.aux_loss_scale = 1.0
        # The last optimizer step's statistics over all ranks, set by moe/balance.py.
        self.last_tokens_per_expert: torch.Tensor | None = None  # [E] int64
        self.last_router_losses: torch.Tensor | None = None  # [2] fp64: balance loss, z-loss
        # Statistics, not model state: not saved in checkpoints.
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("router_loss_sums", torch.zeros(2, dtype=torch.float32), persistent=False)

    def init_weights(self, out_std: float, buffer_device: torch.device | None = None) -> None:
        self.router.init_weights()
        self.experts.init_weights(out_std)
        device = buffer_device or self.router.gate.weight.device
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        self.router_loss_sums = torch.zeros(2, dtype=torch.float32, device=device)

    def set_dispatcher(self, dispatcher) -> None:
        self.dispatcher = dispatcher
        self.experts.kernels = self.router.kernels = dispatcher.kernels

    def dispatch_settings(self, device: torch.device) -> tuple[str, int]:
        """(kernels, align) of this layer's dispatcher on `device`, from its MoEArgs."""
        return resolve_kernels(self.args.kernels, device), resolve_alignment(self.args.padding, self.args.align, device)

    def local_dispatcher(self, device: torch.device):
        """The EP = 1 dispatcher, also the default of a layer used on its own."""
        kernels, align = self.dispatch_settings(device)
        return LocalDispatcher(self.num_experts, align=align, kernels=kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, D] -> [B, S, D]."""
        if self.dispatcher is None:
            self.set_dispatcher(self.local_dispatcher(x.device))
        batch_size, seq_len, dim = x.shape
        tokens = x.reshape(-1, dim)
        # Under autocast the rows travel in its dtype, the experts' (half the bytes of fp32). Not
        # the weights' dtype: under FSDP2 they are still sharded fp32 here, unsharded in experts().
        dtype = autocast_dtype(tokens.device)
        rows = tokens if dtype is None else tokens.to(dtype)
        self.dispatcher.send_tokens(rows)  # all_gather: the rows travel while the router runs
        counted = self.training and not recomputing()  # count each real forward once
        routing = self.router(tokens, seq_len=seq_len, loss_sums=self.router_loss_sums if counted else None)
        if counted:
            with torch.no_grad():
                self.tokens_per_expert.add_(routing.tokens_per_expert)

        if self.overlap == "chunks":  # two chunks, one's exchange under the other's experts (moe/chunks.py)
            out = chunked_forward(self.dispatcher, self.experts, rows, routing)
        else:
            batch = self.dispatcher.start_dispatch(rows, routing).wait()
            out = self.dispatcher.start_combine(self.experts(batch), batch).wait()
        if routing.aux_loss is not None:
            out = _AttachAuxLoss.apply(out, routing.aux_loss, self.aux_loss_scale)
        return out.view(batch_size, seq_len, dim)
