"""Triton kernel of adamw_step_ and its launcher.

Elementwise over the flat parameter: each program owns BLOCK contiguous elements, loads param,
grad and the two moments once (and the clip's grad_scale, a scalar), computes in fp32 and stores param and the moments once
(bf16 moments rounded stochastically from Philox random bits of (seed, element index)), and the param's bf16 working
copy where there is one (rounded to nearest even, as a cast). Bandwidth-bound: 20 bytes per element with bf16
moments and fp32 param and grad, 28 with fp32 moments, 2 more with a working copy.
"""

import triton
import triton.language as tl

from ._triton_utils import round_stochastic_bf16, round_to

# One fixed config, no autotune: the autotuner times a kernel by running it again and again, and
# this one updates its inputs in place (the first step of a run would be applied many times).
# 1024 elements a program reaches the copy bandwidth on an H200 (kernels/bench_adamw.py).
BLOCK, NUM_WARPS = 1024, 4


@triton.jit
def _adamw_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_scale_ptr, working_ptr, N,
    beta1, beta2, eps, decay, step_size, inv_sqrt_bias2, seed, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    p = tl.load(param_ptr + offs, mask=mask)
    g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
    if grad_scale_ptr is not None:  # clipping, folded in: no pass of its own over the gradients
        g = tl.div_rn(g, tl.load(grad_scale_ptr))
    m = tl.load(exp_avg_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask).to(tl.float32)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    # IEEE-rounded square root and division (tl.sqrt and / are approximate on the GPU), as torch's AdamW.
    denom = tl.sqrt_rn(v) * inv_sqrt_bias2 + eps
    p = p * decay - step_size * tl.div_rn(m, denom)
    tl.store(param_ptr + offs, p, mask=mask)
    if working_ptr is not None:  # the GEMMs' copy, written here rather than cast again before the next forward
        tl.store(working_ptr + offs, round_to(p, working_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_ptr + offs, _round(m, exp_avg_ptr.dtype.element_ty, seed, offs, 0), mask=mask)
    tl.store(exp_avg_sq_ptr + offs, _round(v, exp_avg_sq_ptr.dtype.element_ty, seed, offs, 1), mask=mask)


@triton.jit
def _round(x, dtype: tl.constexpr, seed, offs, stream: tl.constexpr):
    """bf16 moments round stochastically (the stream picks one of two independent random words of
    this element), fp32 ones are stored as computed."""
    if dtype == tl.bfloat16:
        r0, r1, _, _ = tl.randint4x(seed, offs)
        return round_stochastic_bf16(x, r0 if stream == 0 else r1)
    return round_to(x, dtype)


def adamw_step_triton(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, seed,
                      grad_scale=None, working=None) -> None:
    n = param.numel()
    if n == 0:
        return
    # Per-step scalars on the host (the step count is a host number, as in torch's non-capturable AdamW).
    step_size = lr / (1.0 - beta1**step)
    inv_sqrt_bias2 = 1.0 / (1.0 - beta2**step) ** 0.5
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](param, grad, exp_avg, exp_avg_sq, grad_scale, working, n, beta1, beta2, eps,
                                            1.0 - lr * weight_decay, step_size, inv_sqrt_bias2, seed,
                                            BLOCK=BLOCK, num_warps=NUM_WARPS)
