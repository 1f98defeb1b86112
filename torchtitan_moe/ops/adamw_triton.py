"""Triton kernel of adamw_foreach_ and its launcher: every parameter of a group in one launch.

Elementwise over each flat parameter: each program owns BLOCK contiguous elements of one parameter,
found through two tables (the program's parameter and its block within it; the parameter's row of
addresses, size and seed), loads param, grad and the two moments once (and the clip's grad_scale,
a scalar), computes in fp32 and stores param and the moments once (bf16 moments rounded
stochastically from Philox random bits of (seed, element index // 4)), and the param's bf16 working
copy where there is one (rounded to nearest even, as a cast). Bandwidth-bound: 20 bytes per element
with bf16 moments and fp32 param and grad, 28 with fp32 moments, 2 more with a working copy.

One launch for a group rather than one per parameter: the optimizer updates ~90 parameters a step
(30B-A3B at 8 layers, EP = 2), and a launch from the host costs ~100-160 us through the op, the
checks and Triton's launcher, on the hosts where local batch 2 waits for the host (15 ms of host time
a step in a profile).
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import device_table, program_table, round_stochastic_bf16, round_to

# One fixed config, no autotune: the autotuner times a kernel by running it again and again, and
# this one updates its inputs in place (the first step of a run would be applied many times).
# 1024 elements a program reaches the copy bandwidth on an H200 (kernels/bench_adamw.py).
BLOCK, NUM_WARPS = 1024, 4
ROW = 7  # a parameter's row of the table: param, grad, exp_avg, exp_avg_sq, working addresses, numel, seed
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _adamw_kernel(
    table_ptr, block_param_ptr, block_index_ptr, grad_scale_ptr,
    beta1, beta2, eps, decay, step_size, inv_sqrt_bias2,
    GRAD: tl.constexpr, MOMENT: tl.constexpr, WORKING: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = table_ptr + tl.load(block_param_ptr + pid).to(tl.int64) * ROW
    param_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
    grad_ptr = tl.load(row + 1).to(tl.pointer_type(GRAD))
    exp_avg_ptr = tl.load(row + 2).to(tl.pointer_type(MOMENT))
    exp_avg_sq_ptr = tl.load(row + 3).to(tl.pointer_type(MOMENT))
    n = tl.load(row + 5)
    seed = tl.load(row + 6)
    # The element's index within its parameter (each four draw the random bits of their bf16 moments' rounding).
    block = tl.load(block_index_ptr + pid).to(tl.int64)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
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
    if WORKING is not None:  # the GEMMs' copy, written here rather than cast again before the next forward
        working_ptr = tl.load(row + 4).to(tl.pointer_type(WORKING))
        tl.store(working_ptr + offs, round_to(p, WORKING), mask=mask)
    if MOMENT == tl.bfloat16:  # rounded stochastically: exp_avg by a word's low 16 bits, exp_avg_sq by its high 16
        bits = _random_words(seed, block * (BLOCK // 4), BLOCK)
        tl.store(exp_avg_ptr + offs, round_stochastic_bf16(m, bits), mask=mask)
        tl.store(exp_avg_sq_ptr + offs, round_stochastic_bf16(v, bits >> 16), mask=mask)
    else:
        tl.store(exp_avg_ptr + offs, round_to(m, MOMENT), mask=mask)
        tl.store(exp_avg_sq_ptr + offs, round_to(v, MOMENT), mask=mask)


@triton.jit
def _random_words(seed, first_group, BLOCK: tl.constexpr):
    """[BLOCK] uint32 words for BLOCK consecutive elements, from one Philox call (its four words) per four
    elements: group q = element // 4 draws randint4x(seed, q). A call per element (10 rounds of 32-bit
    multiplies) made the update ALU-bound at the clocks of a GPU at its power cap: 19.5 ms a step at local
    batch 4 on 2 H200s, now 17.0, 13.3 at 20 bytes an element and the copy rate."""
    r0, r1, r2, r3 = tl.randint4x(seed, first_group + tl.arange(0, BLOCK // 4))
    return tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), (BLOCK,))


def adamw_foreach_triton(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, seeds,
                         grad_scale, workings, block: int = BLOCK, num_warps: int = NUM_WARPS) -> None:
    """workings: a working copy for every param, or None for every param. block, num_warps: for benchmarks
    that sweep them; the op uses the defaults."""
    sizes = tuple(p.numel() for p in params)
    if not sum(sizes):
        return
    device = params[0].device
    block_param, block_index = program_table(device, sizes, block)
    rows = []
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        w = workings[i].data_ptr() if workings[i] is not None else 0
        rows += [p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), w, sizes[i], seeds[i]]
    table = device_table(rows, device)
    # Per-step scalars on the host (the step count is a host number, as in torch's non-capturable AdamW).
    step_size = lr / (1.0 - beta1**step)
    inv_sqrt_bias2 = 1.0 / (1.0 - beta2**step) ** 0.5
    working = _TL[workings[0].dtype] if workings[0] is not None else None
    _adamw_kernel[(block_param.numel(),)](table, block_param, block_index, grad_scale, beta1, beta2, eps,
                                          1.0 - lr * weight_decay, step_size, inv_sqrt_bias2,
                                          GRAD=_TL[grads[0].dtype], MOMENT=_TL[exp_avgs[0].dtype], WORKING=working,
                                          ROW=ROW, BLOCK=block, num_warps=num_warps)
