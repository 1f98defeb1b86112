"""adamw_foreach_: one AdamW update of each parameter of a group, in place, with moments stored in their own dtype.

    adamw_foreach_(params [*] each, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay,
                   step, seeds, grad_scale [] or None, workings or None)  -> None (in place)
    adamw_step_(param, grad, exp_avg, exp_avg_sq, ..., seed, grad_scale, working)    the same for one parameter

    grad        = grad / grad_scale                           (if given; grad itself is not written)
    param      *= 1 - lr * weight_decay                      (decoupled decay, as torch.optim.AdamW)
    exp_avg     = beta1 * exp_avg + (1 - beta1) * grad
    exp_avg_sq  = beta2 * exp_avg_sq + (1 - beta2) * grad^2
    param      -= lr / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq / (1 - beta2^step)) + eps)
    working     = param.to(working.dtype)                      (if given: rounded to nearest even, a cast's bits)

A group shares the hyperparameters, the step, and a dtype for each of grads, moments and working
copies; each parameter has its own seed. The Triton kernel updates the whole group in one launch
(ops/adamw_triton.py): the host's cost of an optimizer step no longer grows with the parameter count.

The point is storing exp_avg and exp_avg_sq in bf16 (as Megatron-Core's precision-aware optimizer
can): 4 bytes less per parameter for each moment, and 20 instead of 28 bytes moved per parameter by
the update. The arithmetic is fp32: the moments are read and widened, updated, used for this
step's update unrounded, and stored once. bf16 moments are rounded stochastically (up or down, with
the probabilities that make the expected value exact; random bits from the parameter's seed and the
element's index): rounded to nearest, an update smaller than half a bf16 step (2^-9 relative) is lost
every time (a bias a test shows); over 500 steps of Qwen3-30B-A3B at 8 layers both roundings stayed
within fp32 moments' run-to-run spread.
param stays fp32 (the master weights); grad may be any float dtype. With fp32 moments the result is
torch.optim.AdamW's up to fp32 rounding order, and the seeds are unused.

`grad_scale` is how gradient clipping reaches the update without a pass of its own over the
gradients (components/optimizer.py): the clip coefficient's inverse, a device scalar, as torch's fused AdamW
takes it from GradScaler. `working` is the parameter's low-precision copy that the GEMMs read
(experts outside FSDP2, moe/experts.py): written from the new fp32 value in the same pass, 2 bytes
per element, instead of a cast that reads 4 and writes 2 before the next forward. The Triton kernel
reads each tensor once and writes param and the moments once. Not traced by autograd; registered
with torch.library (mutating the params, the moments and the working copies) so that a compiled
optimizer step would see one node.
"""

from __future__ import annotations

import torch

from ._backend import use_triton

MOMENT_DTYPES = (torch.float32, torch.bfloat16)
WORKING_DTYPES = (torch.bfloat16, torch.float16)


def _check(params, grads, exp_avgs, exp_avg_sqs, seeds, grad_scale, workings) -> None:
    count = len(params)
    for name, ts in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs), ("seeds", seeds)) + (
            (("workings", workings),) if workings is not None else ()):
        if len(ts) != count:
            raise ValueError(f"{name}: {len(ts)} entries for {count} params")
    if not count:
        return
    device = params[0].device
    if grad_scale is not None and (grad_scale.dim() != 0 or grad_scale.dtype != torch.float32
                                   or grad_scale.device != device):
        raise ValueError(f"grad_scale must be a 0-dim float32 tensor on {device}, got "
                         f"{tuple(grad_scale.shape)} {grad_scale.dtype} on {grad_scale.device}")
    # One dtype per role in a group (the kernel is compiled for them).
    for name, ts, allowed in (("grad", grads, None), ("exp_avg", exp_avgs, MOMENT_DTYPES),
                              ("exp_avg_sq", exp_avg_sqs, MOMENT_DTYPES)) + (
            (("working", workings, WORKING_DTYPES),) if workings is not None else ()):
        dtype = ts[0].dtype
        if allowed is not None and dtype not in allowed:
            names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
            raise ValueError(f"{name} must be {names}, got {dtype}")
        if allowed is None and not ts[0].is_floating_point():
            raise ValueError(f"grad must be a float tensor, got {dtype}")
        if any(t.dtype != dtype for t in ts):
            raise ValueError(f"every {name} of a group must have one dtype, got {sorted({str(t.dtype) for t in ts})}")
    for i, p in enumerate(params):
        if p.dtype != torch.float32:
            raise ValueError(f"param must be float32 (the master weights), got {p.dtype} (param {i})")
        for name, t in (("param", p), ("grad", grads[i]), ("exp_avg", exp_avgs[i]), ("exp_avg_sq", exp_avg_sqs[i])) + (
                (("working", workings[i]),) if workings is not None else ()):
            if t.shape != p.shape or t.device != device:
                raise ValueError(f"{name} must match param ({tuple(p.shape)} on {device}), got {tuple(t.shape)} on "
                                 f"{t.device} (param {i})")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous (param {i})")
        if not 0 <= seeds[i] < 2**31:
            raise ValueError(f"seed must be in [0, 2^31), got {seeds[i]} (param {i})")


def round_stochastic(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """fp32 `x` as `dtype`: bf16 rounded stochastically (add 16 random low bits, drop them), else as is."""
    if dtype != torch.bfloat16:
        return x
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, device=x.device, dtype=torch.int32)
    rounded = ((x.view(torch.int32) + noise) & -(1 << 16)).view(torch.float32)
    return torch.where(x.isnan(), x, rounded).to(dtype)  # exact: the low 16 bits are zero


def adamw_step_reference(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, seed,
                         grad_scale=None, working=None) -> None:
    """The same update in torch ops, fp32 arithmetic, one rounding of each moment at its store
    (other random bits than the kernel's: the two agree in distribution, not bit for bit)."""
    g = grad.float() if grad_scale is None else grad.float() / grad_scale
    m = exp_avg.float().mul_(beta1).add_(g, alpha=1 - beta1)
    v = exp_avg_sq.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    param.mul_(1 - lr * weight_decay).addcdiv_(m, denom, value=-lr / (1 - beta1**step))
    generator = torch.Generator(device=param.device).manual_seed(seed)
    exp_avg.copy_(round_stochastic(m, exp_avg.dtype, generator))
    exp_avg_sq.copy_(round_stochastic(v, exp_avg_sq.dtype, generator))
    if working is not None:
        working.copy_(param)


@torch.library.custom_op("torchtitan_moe::adamw_foreach_",
                        mutates_args=("params", "exp_avgs", "exp_avg_sqs", "workings"))
def _adamw_foreach_triton(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                          exp_avg_sqs: list[torch.Tensor], lr: float, beta1: float, beta2: float, eps: float,
                          weight_decay: float, step: float, seeds: list[int], grad_scale: torch.Tensor | None,
                          workings: list[torch.Tensor | None]) -> None:
    from .adamw_triton import adamw_foreach_triton

    adamw_foreach_triton(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, seeds,
                         grad_scale, workings)


@_adamw_foreach_triton.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, seeds, grad_scale,
      workings) -> None:
    return None


def adamw_foreach_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                   exp_avg_sqs: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, step: int, seeds: list[int], grad_scale: torch.Tensor | None = None,
                   workings: list[torch.Tensor] | None = None, backend: str = "triton") -> None:
    """One AdamW update of each of `params` (fp32) and their moments (fp32 or bf16), in place; `step` counts
    from 1; `seeds[i]` (0 <= seed < 2^31) draws the stochastic rounding of params[i]'s bf16 moments: vary it by
    step and parameter; the update uses grad / grad_scale where grad_scale is given; `workings` (bf16/fp16) get
    the new params cast. One dtype for all grads, one for all moments, one for all workings."""
    _check(params, grads, exp_avgs, exp_avg_sqs, seeds, grad_scale, workings)
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    if not params:
        return
    scalars = (float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), float(step))
    if use_triton(backend, params[0]):
        _adamw_foreach_triton(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), *scalars,
                              [int(s) for s in seeds], grad_scale, [None] * len(params) if workings is None else list(workings))
        return
    for i in range(len(params)):
        adamw_step_reference(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], *scalars, int(seeds[i]), grad_scale,
                             None if workings is None else workings[i])


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int, seed: int = 0,
                grad_scale: torch.Tensor | None = None, working: torch.Tensor | None = None,
                backend: str = "triton") -> None:
    """adamw_foreach_ of one parameter."""
    adamw_foreach_([param], [grad], [exp_avg], [exp_avg_sq], lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                   weight_decay=weight_decay, step=step, seeds=[seed], grad_scale=grad_scale,
                   workings=None if working is None else [working], backend=backend)
