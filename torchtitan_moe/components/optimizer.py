"""The optimizer: torchtitan's AdamW, or ours ([optimizer] update = "triton"), which can store its moments in
bf16 ([optimizer] moments_dtype) and writes the experts' bf16 working copies in its update.

AdamW keeps two fp32 moments per parameter next to the fp32 master weight and its gradient: 8 of
the 16 bytes each parameter costs before activations. `moments_dtype = "bfloat16"` stores both
moments in bf16 (Megatron-Core's precision-aware optimizer offers the same), which saves 4 bytes
per parameter (22 GB of a 5.6B-parameter model) and moves 20 instead of 28 bytes per parameter in
the update. The update itself is fp32 (ops/adamw.py); only the stored moments are rounded
(stochastically: unbiased). The master weights stay fp32. What the rounding costs in learning is
measured, not assumed (a 500-step loss comparison, docs/performance.md). With fp32 moments ours is torch's AdamW
up to fp32 rounding order, in one Triton pass over each parameter, one launch for each group of parameters
that share dtypes and step (28 bytes moved per parameter, torch's fused
AdamW 1.14x slower on an H100, kernels/bench_adamw.py), and it writes the experts' bf16 working copies
in that pass (moe/experts.py) where torch's leaves them to be cast after the step: on a GPU it is the
default (1.035x the training step on 2 H200s).

Both our model and the torchtitan baseline build their optimizer here, so a comparison of the two
uses the same optimizer.

Gradient clipping is applied inside the update: torchtitan's step computes the gradients' norm and
multiplies every gradient by min(1, max_norm / norm), a read and a write of all fp32 gradients
(6.2 ms of a 280 ms step at EP = 2). `clip_in_optimizer` computes the same norm and hands its
inverse coefficient to the optimizers as `grad_scale`, which torch's fused AdamW (as for GradScaler)
and ours divide each gradient by as they read it; optimizers that cannot take it are clipped as before.

`[optimizer] expert_grad_dtype` (keep_expert_gradients; "auto" where a step reads them) leaves the experts'
weight gradients on their bf16 working copies instead of fp32 copies on the master weights; ours and the
clip's norm read them there (1.006x the step at local batch 4 on 2 H200s, 1.06-1.16x at local batch 2).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from torchtitan_moe import ops
from torchtitan_moe.config.sections import ConfigError
from torchtitan_moe.moe.experts import GroupedExperts
from torchtitan_moe.ops.adamw import adamw_foreach_
from torchtitan_moe.compat.torchtitan import OptimizersContainer, build_optimizers as build_torchtitan_optimizers, logger

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
        grad_scale = getattr(self, "grad_scale", None)  # set by clip_in_optimizer, as torch's AdamW reads it
        working_copies = getattr(self, "working_copies", {})  # set by attach_working_copies
        # One adamw_foreach_ call (one launch) per set of parameters it can update together.
        batches: dict[tuple, tuple[list, ...]] = {}
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                index += 1
                experts, name = working_copies.get(p, (None, None))
                grad = p.grad if experts is None else experts.gradient(name)  # the experts': maybe bf16
                if grad is None:
                    continue
                state = self._state(p)
                state["step"] += 1
                step = int(state["step"])
                working = experts.working_copy(name) if experts is not None else None
                key = (g, step, p.device, grad.dtype, working.dtype if working is not None else None)
                params, grads, exp_avgs, exp_avg_sqs, seeds, workings = batches.setdefault(key, ([], [], [], [], [], []))
                params.append(_local(p))
                grads.append(_local(grad).contiguous())
                exp_avgs.append(_local(state["exp_avg"]))
                exp_avg_sqs.append(_local(state["exp_avg_sq"]))
                seeds.append((step * 1_000_003 + index) % 2**31)
                if working is not None:
                    workings.append(working)
                    experts.current.add(name)  # the copy is the new weight's cast: no cast before the next forward
        for (g, step, device, _, _), (params, grads, exp_avgs, exp_avg_sqs, seeds, workings) in batches.items():
            group = self.param_groups[g]
            beta1, beta2 = group["betas"]
            adamw_foreach_(params, grads, exp_avgs, exp_avg_sqs, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                           eps=group["eps"], weight_decay=group["weight_decay"], step=step, seeds=seeds,
                           grad_scale=grad_scale, workings=workings or None,
                           backend="triton" if device.type == "cuda" else "torch")
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for experts in {experts for experts, _ in getattr(self, "working_copies", {}).values()}:
            experts.clear_working_gradients()

    def load_state_dict(self, state_dict) -> None:
        # torch.optim.Optimizer casts loaded state to each parameter's dtype (fp32): store it back.
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.moments_dtype)


def uses_our_update(optimizer_config) -> bool:
    """[optimizer] update: ours ('triton'; 'auto' with bf16 moments, or AdamW on a GPU) rather than
    torchtitan's ('torch'; 'auto' on the CPU, where ours would run its torch reference)."""
    update = optimizer_config.update
    if update != "auto":
        return update == "triton"
    if optimizer_config.moments_dtype != "float32":
        return True
    return optimizer_config.name == "AdamW" and not optimizer_config.early_step_in_backward and torch.cuda.is_available()


def build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager=None):
    """torchtitan's optimizers, or our AdamW where [optimizer] update asks for it (bf16 moments always do).
    The config check (config/torchtitan_keys.py) has refused what ours does not support."""
    moments_dtype = MOMENTS_DTYPES[optimizer_config.moments_dtype]
    if not uses_our_update(optimizer_config):
        return build_torchtitan_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    kwargs = dict(lr=optimizer_config.lr, betas=(optimizer_config.beta1, optimizer_config.beta2),
                  eps=optimizer_config.eps, weight_decay=optimizer_config.weight_decay, moments_dtype=moments_dtype)
    return OptimizersContainer(model_parts, AdamW, kwargs)


def attach_working_copies(optimizers, model_parts) -> None:
    """Keep the experts' working copies (moe/experts.py) the casts of their weights across optimizer
    steps: every step of `optimizers` (torchtitan's container) marks them stale first; our AdamW
    writes each copy in its update and marks it current; after the step the copies still stale
    (torch's AdamW) are cast, so that the forward finds them current."""
    experts = [m for part in model_parts for m in part.modules()
               if isinstance(m, GroupedExperts) and m.has_working_copies]
    if not experts:
        return

    def mark_stale(*args, **kwargs) -> None:
        for e in experts:
            e.mark_working_stale()

    def refresh(*args, **kwargs) -> None:
        for e in experts:
            e.refresh_working_copies()

    optimizers.register_step_pre_hook(mark_stale)
    optimizers.register_step_post_hook(refresh)
    targets = {getattr(e, name): (e, name) for e in experts for name in e.WEIGHTS}
    for optimizer in getattr(optimizers, "optimizers", [optimizers]):
        if isinstance(optimizer, AdamW):
            optimizer.working_copies = targets


def keep_expert_gradients(setting: str, optimizers, model_parts, accumulation_steps: int, pipeline: bool) -> bool:
    """[optimizer] expert_grad_dtype: whether the experts' weight gradients stay on their bf16 working
    copies (moe/experts.py), their exact values, instead of an fp32 copy for each master weight: at EP = 2
    on 2 GPUs 2.4 billion expert weights a rank, whose fp32 gradients hold 9.7 GB (4.8 in bf16), a write of
    them (ops.upcast) and the extra bytes of reading them in the gradient norm and the update. Our AdamW and
    clipping (clip_in_optimizer, total_grad_norm) read them; after each step they are dropped.

    Only where one backward makes a step's gradient (no accumulation: a second micro-batch would add
    bf16 to bf16), our AdamW updates every parameter (attach_working_copies ran) and our clipping runs
    (no pipeline parallelism), and the experts have working copies (outside FSDP2). "bfloat16" anywhere
    else is refused here with what to change, before a step trains; "auto" keeps them where all of that
    holds and says which it chose; "float32" never keeps them."""
    if setting == "float32":
        return False
    experts = [m for part in model_parts for m in part.modules() if isinstance(m, GroupedExperts)]
    reason = _why_gradients_not_kept(optimizers, experts, accumulation_steps, pipeline)
    if reason is not None:
        if setting == "bfloat16":
            raise ConfigError(f'[optimizer] expert_grad_dtype = "bfloat16" {reason}: use expert_grad_dtype = "float32"')
        logger.info(f"[optimizer] expert_grad_dtype = 'auto': the experts' gradients in fp32 (bf16 {reason})")
        return False
    for e in experts:
        e.keep_working_gradients()
    optimizers.register_step_post_hook(lambda *args, **kwargs: [e.clear_working_gradients() for e in experts])
    logger.info(f"[optimizer] expert_grad_dtype = {setting!r}: the experts' gradients stay on their bf16 working copies")
    return True


def _why_gradients_not_kept(optimizers, experts: list, accumulation_steps: int, pipeline: bool) -> str | None:
    """What stops the experts' gradients staying on their working copies (completing "bf16 ..."), or None."""
    if accumulation_steps != 1:
        return (f"keeps one backward's gradients, but this run accumulates {accumulation_steps} micro-batches a "
                "step (global_batch_size > local_batch_size x data-parallel ranks)")
    if pipeline:
        return "is read by our gradient clipping, which pipeline parallelism replaces with torchtitan's"
    inner = getattr(optimizers, "optimizers", [optimizers])
    if type(optimizers) is not OptimizersContainer or not all(isinstance(o, AdamW) for o in inner):
        return ("needs our AdamW ([optimizer] name = 'AdamW', update = 'triton' or 'auto' on a GPU): torchtitan's "
                "optimizer reads only the weights' own gradients")
    if not experts or not all(e.has_working_copies for e in experts):
        return ("keeps the gradients on the experts' bf16 working copies, which exist where the experts stay "
                "outside FSDP2 (EP = the processes of a replica, bf16 mixed precision): this run has none")
    return None


def takes_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` divides each gradient by `optimizer.grad_scale`: ours, and torch's fused
    Adam/AdamW (its foreach and for-loop forms refuse a grad_scale)."""
    fused_torch = isinstance(optimizer, torch.optim.Adam) and bool(optimizer.defaults.get("fused"))
    return isinstance(optimizer, AdamW) or fused_torch


def total_grad_norm(parameters: Iterable[torch.Tensor], ep_enabled: bool,
                    working_copies: dict | None = None) -> torch.Tensor:
    """The L2 norm of all gradients, as torchtitan's clip_grad_norm_ computes it: with EP, the experts'
    gradients (on a mesh with an "ep" dimension) and the others in two reductions, then combined.
    `working_copies` (param -> (experts, name), attach_working_copies'): where the experts keep their
    gradients on their working copies (keep_expert_gradients), those count for their weights."""
    groups: dict[bool, list[torch.Tensor]] = {}
    kept: dict[bool, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # (weight, its working copy's bf16 gradient)
    for p in parameters:
        on_ep = ep_enabled and isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())
        experts, name = (working_copies or {}).get(p, (None, None))
        if p.grad is None and experts is not None and experts.working_gradients:
            if (grad := experts.gradient(name)) is not None:
                kept.setdefault(on_ep, []).append((p, grad))
        elif p.grad is not None:
            groups.setdefault(on_ep, []).append(p.grad)
    norms = {}
    for on_ep, grads in groups.items():
        norm = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
        norms[on_ep] = norm.full_tensor() if isinstance(norm, DTensor) else norm
    for on_ep, pairs in kept.items():
        squares = _sum_of_squares(pairs)
        norms[on_ep] = squares.sqrt() if on_ep not in norms else (norms[on_ep] ** 2.0 + squares) ** 0.5
    zero = next(iter(norms.values())).new_zeros(()) if norms else torch.tensor(0.0)
    if not ep_enabled:
        return norms.get(False, zero)
    # (a^2 + b^2)^(1/2), an empty group counting 0: torchtitan's order of operations, so its bits
    return (norms.get(True, zero) ** 2.0 + norms.get(False, zero) ** 2.0) ** 0.5


def _sum_of_squares(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Sum of squares (fp32) of the gradients, each this rank's shard of its weight, over the ranks that
    hold the weight's other shards (the mesh dimensions it is sharded on)."""
    by_layout = defaultdict(list)
    for weight, grad in pairs:
        layout = (weight.device_mesh, tuple(weight.placements)) if isinstance(weight, DTensor) else (None, ())
        by_layout[layout].append(grad)
    total = None
    for (mesh, placements), grads in by_layout.items():
        squares = ops.sum_of_squares(grads, backend="triton" if grads[0].is_cuda else "torch")
        for dim, placement in enumerate(placements):
            if placement.is_shard():
                squares = funcol.all_reduce(squares, "sum", (mesh, dim))
        total = squares if total is None else total + squares
    return total


def clip_in_optimizer(optimizers, torchtitan_clip: Callable) -> Callable:
    """A clip_grad_norm_ for torchtitan's train step that returns the norm it would and, instead of
    multiplying the gradients, sets grad_scale = max(1, (norm + 1e-6) / max_norm) on the optimizers,
    whose next step divides by it (cleared after that step). `torchtitan_clip` runs instead where an
    optimizer cannot take a grad_scale, or for what this does not cover (pipeline parallelism, norms
    other than 2), and for torchtitan's other containers (optimizers that step in backward, before
    the clip, or under torchft)."""
    if type(optimizers) is not OptimizersContainer:
        return torchtitan_clip
    inner = optimizers.optimizers

    def clear(*args, **kwargs) -> None:
        for optimizer in inner:
            optimizer.grad_scale = None

    optimizers.register_step_post_hook(clear)

    def clip(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
             foreach: bool | None = None, pp_mesh=None, ep_enabled: bool = False) -> torch.Tensor:
        working_copies = {}  # the experts' weights, whose gradients may stay on their working copies
        for optimizer in inner:
            working_copies.update(getattr(optimizer, "working_copies", {}))
        if pp_mesh is not None or norm_type != 2.0 or error_if_nonfinite or not all(map(takes_grad_scale, inner)):
            if any(experts.working_gradients for experts, _ in working_copies.values()):
                raise RuntimeError("the experts' gradients are on their working copies ([optimizer] expert_grad_dtype = "
                                   "'bfloat16' or 'auto'), which torchtitan's clip_grad_norm_ does not read: use 'float32'")
            return torchtitan_clip(parameters, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_enabled)
        norm = total_grad_norm(parameters, ep_enabled, working_copies)
        scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0).float()
        for optimizer in inner:
            optimizer.grad_scale = scale
        return norm

    return clip
