"""adamw_step_: one AdamW update of one parameter, in place, with moments stored in their own dtype.

    adamw_step_(param [*], grad [*], exp_avg [*], exp_avg_sq [*], lr, beta1, beta2, eps,
                weight_decay, step, seed, grad_scale [] or None, working [*] or None)  -> None (in place)

    grad        = grad / grad_scale                           (if given; grad itself is not written)
    param      *= 1 - lr * weight_decay                      (decoupled decay, as torch.optim.AdamW)
    exp_avg     = beta1 * exp_avg + (1 - beta1) * grad
    exp_avg_sq  = beta2 * exp_avg_sq + (1 - beta2) * grad^2
    param      -= lr / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq / (1 - beta2^step)) + eps)
    working     = param.to(working.dtype)                      (if given: rounded to nearest even, a cast's bits)

The point is storing exp_avg and exp_avg_sq in bf16 (as Megatron-Core's precision-aware optimizer
can): 4 bytes less per parameter for each moment, and 20 instead of 28 bytes moved per parameter by
the update. The arithmetic is fp32: the moments are read and widened, updated, used for this
step's update unrounded, and stored once. bf16 moments are rounded stochastically (up or down, with
the probabilities that make the expected value exact; random bits from `seed`): rounded to nearest,
an update smaller than half a bf16 step (2^-9 relative) is lost every time (a bias a test shows);
over 500 steps of Qwen3-30B-A3B at 8 layers both roundings stayed within fp32 moments' run-to-run
spread (worklogs/2026-11-25-bf16-moments.md).
param stays fp32 (the master weights); grad may be any float dtype. With fp32 moments the result is
torch.optim.AdamW's up to fp32 rounding order, and `seed` is unused.

`grad_scale` is how gradient clipping reaches the update without a pass of its own over the
gradients (optimizer.py): the clip coefficient's inverse, a device scalar, as torch's fused AdamW
takes it from GradScaler. `working` is the parameter's low-precision copy that the GEMMs read
(experts outside FSDP2, moe/experts.py): written from the new fp32 value in the same pass, 2 bytes
per element, instead of a cast that reads 4 and writes 2 before the next forward. The Triton kernel reads each tensor once and writes param and the moments once. Not traced by
autograd; registered with torch.library (mutating param, the moments and working) so that a
compiled optimizer step would see one node.
"""

from __future__ import annotations

import torch

from ._backend import use_triton

MOMENT_DTYPES = (torch.float32, torch.bfloat16)
WORKING_DTYPES = (torch.bfloat16, torch.float16)


def _check(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           grad_scale: torch.Tensor | None, working: torch.Tensor | None) -> None:
    if grad_scale is not None and (grad_scale.dim() != 0 or grad_scale.dtype != torch.float32
                                   or grad_scale.device != param.device):
        raise ValueError(f"grad_scale must be a 0-dim float32 tensor on {param.device}, got "
                         f"{tuple(grad_scale.shape)} {grad_scale.dtype} on {grad_scale.device}")
    if param.dtype != torch.float32:
        raise ValueError(f"param must be float32 (the master weights), got {param.dtype}")
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != param.shape or t.device != param.device:
            raise ValueError(f"{name} must match param ({tuple(param.shape)} on {param.device}), "
                             f"got {tuple(t.shape)} on {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if not param.is_contiguous():
        raise ValueError("param must be contiguous")
    if not grad.is_floating_point():
        raise ValueError(f"grad must be a float tensor, got {grad.dtype}")
    if working is not None and (working.shape != param.shape or working.device != param.device
                                or not working.is_contiguous() or working.dtype not in WORKING_DTYPES):
        raise ValueError(f"working must be a contiguous bfloat16/float16 tensor matching param ({tuple(param.shape)} on "
                         f"{param.device}), got {tuple(working.shape)} {working.dtype} on {working.device}")
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype not in MOMENT_DTYPES:
            raise ValueError(f"{name} must be float32 or bfloat16, got {t.dtype}")


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


@torch.library.custom_op("torchtitan_moe::adamw_step_", mutates_args=("param", "exp_avg", "exp_avg_sq", "working"))
def _adamw_step_triton(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
                       seed: int, grad_scale: torch.Tensor | None, working: torch.Tensor | None) -> None:
    from .adamw_triton import adamw_step_triton

    adamw_step_triton(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, seed, grad_scale,
                      working)


@_adamw_step_triton.register_fake
def _(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, seed, grad_scale, working) -> None:
    return None


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int, seed: int = 0,
                grad_scale: torch.Tensor | None = None, working: torch.Tensor | None = None,
                backend: str = "triton") -> None:
    """One AdamW update of `param` (fp32) and its moments (fp32 or bf16), in place; `step` counts from 1;
    `seed` (0 <= seed < 2^31) draws the stochastic rounding of bf16 moments: vary it by step and parameter;
    the update uses grad / grad_scale where grad_scale is given; `working` (bf16/fp16) gets the new param cast."""
    _check(param, grad, exp_avg, exp_avg_sq, grad_scale, working)
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    if not 0 <= seed < 2**31:
        raise ValueError(f"seed must be in [0, 2^31), got {seed}")
    args = (param, grad, exp_avg, exp_avg_sq, float(lr), float(beta1), float(beta2), float(eps),
            float(weight_decay), float(step), int(seed), grad_scale, working)
    if use_triton(backend, param):
        _adamw_step_triton(*args)
    else:
        adamw_step_reference(*args)
