"""Routed experts as stacked weights and two grouped GEMMs.

    rows [N, D] ──grouped_mm(w13)──► ab [N, 2I] ──swiglu_prob(·, probs)──► h [N, I]
                ──grouped_mm(w2)───► y [N, D]

w13 [E, 2I, D] holds w1 (gate, rows :I) and w3 (up, rows I:) so one GEMM produces both
halves side by side, the layout swiglu_prob reads contiguously. The router probability is
applied inside swiglu_prob, before w2, so its gradient reaches the router from there.

Experts outside FSDP2 (parallelize: their FSDP group would have one rank) keep fp32 master weights,
the optimizer's, and a bf16 working copy of them that the GEMMs read: cast before a forward when
the weights changed, or written by the optimizer in its update (components/optimizer.py), so no step casts
them more than once and the backward reads the forward's copy. The gradient reaches the master in fp32,
or, with `working_gradients` (one backward per optimizer step: [optimizer] expert_grad_dtype = "bfloat16"),
stays on the working copy in the GEMMs' dtype, its exact values without the fp32 copy (components/optimizer.py reads it).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_moe import ops
from torchtitan_moe.dispatch.seam import ExpertBatch


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


class _WorkingCopy(torch.autograd.Function):
    """master [*] (fp32, trained) -> working [*] (its bf16 copy, current): the forward reads the copy,
    the gradient reaches master in fp32, as through master.to(working.dtype) (ops.upcast: the same
    values, in one pass at the copy bandwidth where torch's cast runs at about half of it)."""

    @staticmethod
    def forward(ctx, master: torch.Tensor, working: torch.Tensor, kernels: str) -> torch.Tensor:
        ctx.kernels = kernels
        return working.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if grad.dtype != torch.bfloat16:  # an fp16 working copy: torch's cast
            return grad.to(torch.float32), None, None
        grad = grad if ops.upcast_takes(grad) else grad.contiguous()
        return ops.upcast(grad, backend=ctx.kernels), None, None


class GroupedExperts(nn.Module):
    WEIGHTS = ("w13", "w2")

    def __init__(self, dim: int, inter_dim: int, num_experts: int, kernels: str = "torch"):
        super().__init__()
        self.num_experts = num_experts
        self.inter_dim = inter_dim
        self.kernels = kernels
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, inter_dim))
        # Set by parallelize when the experts stay outside FSDP2 (their group would have one rank):
        # the GEMMs' dtype (FSDP2's param_dtype), in which working copies of the weights are kept.
        self.param_dtype: torch.dtype | None = None
        self.working: dict[str, torch.Tensor] = {}  # name -> working copy of this rank's shard
        self.current: set[str] = set()  # the names whose working copy equals the master's cast
        # The GEMMs' weight gradients stay on the working copies (`working[name].grad`, bf16) instead of
        # reaching the masters in fp32: set by optimizer.keep_expert_gradients where one backward makes a
        # step's gradient and our optimizer and clipping read them (through `gradient`).
        self.working_gradients = False
        self.register_load_state_dict_post_hook(lambda module, keys: module.mark_working_stale())

    def init_weights(self, out_std: float) -> None:
        """w13 at std 0.02; w2, an output projection, at the depth-scaled `out_std`."""
        nn.init.trunc_normal_(self.w13, std=0.02, a=-0.06, b=0.06)
        nn.init.trunc_normal_(self.w2, std=out_std, a=-3 * out_std, b=3 * out_std)
        self.mark_working_stale()

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of the experts' GEMMs: autocast's where autocast is on, else `param_dtype`
        outside FSDP2, else the weights' (under FSDP2, the unsharded weights' mixed-precision
        dtype: read it inside forward)."""
        return autocast_dtype(device) or self.param_dtype or self.w13.dtype

    @property
    def has_working_copies(self) -> bool:
        """Outside FSDP2 with GEMMs in a lower precision than the weights' (fp32 GEMMs read the weights)."""
        return self.param_dtype is not None and self.param_dtype != self.w13.dtype

    def mark_working_stale(self) -> None:
        """The master weights change by other means than an update that writes the copies: the next
        refresh casts them (the optimizer's step, a checkpoint load, init_weights call this)."""
        self.current.clear()

    @torch.no_grad()
    def refresh_working_copies(self) -> None:
        """Cast the master weights whose working copy is not current (none under FSDP2 or autocast).
        Called after each optimizer step (optimizer.attach_working_copies) and before every forward: by
        the model's pre-forward hook (parallelize) where the blocks are compiled, by forward itself
        where it runs eagerly; a call with nothing stale costs a set lookup."""
        if not self.has_working_copies:
            return
        for name in self.WEIGHTS:
            if name in self.current:
                continue
            master = _local(getattr(self, name).detach())
            copy = self.working.get(name)
            if copy is None or copy.shape != master.shape or copy.device != master.device:
                copy = self.working[name] = torch.empty_like(master, dtype=self.param_dtype,
                                                             memory_format=torch.contiguous_format)
                copy.requires_grad_(self.working_gradients)
            copy.copy_(master)
            self.current.add(name)

    def working_copy(self, name: str) -> torch.Tensor | None:
        """The working copy of weight `name` for the optimizer to write in its update, where there is one."""
        return self.working.get(name)

    def keep_working_gradients(self) -> None:
        """From the next forward on, the weight gradients stay on the working copies (bf16, the GEMMs'
        own): for runs with one backward per optimizer step, whose optimizer reads `gradient`."""
        if not self.has_working_copies:
            raise RuntimeError("GroupedExperts: no working copies (the experts are under FSDP2 or train in fp32): "
                               "their gradients reach the weights")
        self.working_gradients = True
        for copy in self.working.values():
            copy.requires_grad_(True)

    def gradient(self, name: str) -> torch.Tensor | None:
        """Weight `name`'s gradient as a step uses it: the master's .grad, or its working copy's
        (this rank's shard, bf16) where the gradients stay there."""
        grad = getattr(self, name).grad
        if grad is None and self.working_gradients and name in self.working:
            return self.working[name].grad
        return grad

    def clear_working_gradients(self) -> None:
        """Drop the working copies' gradients (a step consumed them; the next backward starts afresh)."""
        for copy in self.working.values():
            copy.grad = None

    def gemm_weights(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) as the GEMMs take them: this rank's shard in the compute dtype, autograd-connected
        to the weights; outside FSDP2 the working copies (current: see refresh_working_copies)."""
        w13, w2 = _local(self.w13), _local(self.w2)
        if self.has_working_copies and autocast_dtype(device) is None:
            if len(self.working) < len(self.WEIGHTS):
                raise RuntimeError("GroupedExperts: no working copies yet: a compiled forward reads them; call "
                                   "refresh_working_copies() first (the model's pre-forward hook from parallelize does)")
            if self.working_gradients:  # leaves: autograd leaves the GEMMs' gradients on them
                return self.working["w13"], self.working["w2"]
            return (_WorkingCopy.apply(w13, self.working["w13"], self.kernels),
                    _WorkingCopy.apply(w2, self.working["w2"], self.kernels))
        dtype = self.compute_dtype(device)
        return w13.to(dtype), w2.to(dtype)  # autograd keeps the cast copies for backward

    def forward(self, batch: ExpertBatch) -> torch.Tensor:
        """batch.x [N, D] -> y [N, D]; rows past batch.num_rows are left undefined."""
        if not torch.compiler.is_compiling():
            self.refresh_working_copies()
        dtype = self.compute_dtype(batch.x.device)
        w13, w2 = self.gemm_weights(batch.x.device)
        x = batch.x.to(dtype)
        ab = ops.grouped_mm(x, w13.transpose(-2, -1), batch.offsets)
        h = ops.swiglu_prob(ab, batch.probs, batch.num_rows, backend=self.kernels)
        return ops.grouped_mm(h, w2.transpose(-2, -1), batch.offsets)


@torch.no_grad()
def refresh_working_copies(model: nn.Module, *args) -> None:
    """A model forward pre-hook: every GroupedExperts' working copies current before the (compiled) blocks run."""
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.refresh_working_copies()


@torch.no_grad()
def working_copy_flags(model: nn.Module) -> tuple[list[str], torch.Tensor | None]:
    """The check of stale_working_copies, launched: each working copy's name and, on the device, a flag that
    is set where its bits differ from its master weight's cast (None without working copies). One pass over
    the weights and copies of each kernels backend (ops.copies_differ); nothing read back."""
    checks: dict[str, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}  # backend -> (name, weight, copy)
    for path, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for name in sorted(module.working):
                weight = _local(getattr(module, name).detach())
                checks.setdefault(module.kernels, []).append(
                    (f"{path}.{name}" if path else name, weight, module.working[name]))
    names, flags = [], []
    for backend, found in checks.items():
        names += [name for name, _, _ in found]
        flags.append(ops.copies_differ([w for _, w, _ in found], [c for _, _, c in found], backend=backend))
    return names, torch.cat(flags) if flags else None


def stale_working_copies(model: nn.Module) -> list[str]:
    """The working copies whose bits differ from their master weight's cast (between optimizer steps all
    are current: a weight changed behind the experts' back): a training-health check (working_copy_flags),
    read back at once (one host sync). Training reads it with its step's log (components/metrics.py)."""
    names, flags = working_copy_flags(model)
    return [] if flags is None else [name for name, differ in zip(names, flags.tolist()) if differ]
