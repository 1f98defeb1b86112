"""A study (worklogs/2026-11-27-session12-h200x2.md): linear_cross_entropy's backward scales its two saved
gradients, dweight [151936, 2048] and dh [16384, 2048] bf16 (Qwen3's output layer, local batch 4 at seq 4096),
by the loss's incoming gradient, a 0-dim fp32 CUDA tensor. Five ways, their time and their bits against the
fp32 product rounded once:

    torch multiply       dw * dloss (the op's backward before 66a842d)
    foreach multiply     torch._foreach_mul([dw, dh], dloss)
    fp32 then round      (dw.float() * dloss).to(bf16): the exact result, through an fp32 copy
    dloss rounded first  dw * dloss.to(bf16)
    the op's kernel      cross_entropy_triton.scaled (the backward since 66a842d)

for dloss = 2^-15 (which bf16 holds) and 1/12345 (which it does not).

    python worklogs/studies/study_loss_scaling.py    # one GPU, ~4 GB
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))
from _bench import measure_ceilings, median_us  # noqa: E402

from torchtitan_moe.ops.cross_entropy_triton import scaled  # noqa: E402

torch.manual_seed(0)
dw = torch.randn(151936, 2048, device="cuda").to(torch.bfloat16)
dh = torch.randn(16384, 2048, device="cuda").to(torch.bfloat16)
copy_GBps = measure_ceilings()["copy_GBps"]
nbytes = 4 * (dw.numel() + dh.numel())  # read and write 2 bytes an element
print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | copy ceiling {copy_GBps:.0f} GB/s (this run)\n")
print("| dloss | way | us | % of copy ceiling | bits = fp32 then round | bits = torch multiply |")
print("|---|---|---|---|---|---|")
for value in (2.0**-15, 1 / 12345.0):
    dloss = torch.tensor(value, device="cuda")
    ways = {
        "torch multiply": lambda: (dw * dloss, dh * dloss),
        "foreach multiply": lambda: tuple(torch._foreach_mul([dw, dh], dloss)),
        "fp32 then round": lambda: ((dw.float() * dloss).to(torch.bfloat16), (dh.float() * dloss).to(torch.bfloat16)),
        "dloss rounded first": lambda: (dw * dloss.to(torch.bfloat16), dh * dloss.to(torch.bfloat16)),
        "the op's kernel": lambda: (scaled(dw, dloss), scaled(dh, dloss)),
    }
    exact, torch_way = ways["fp32 then round"](), ways["torch multiply"]()
    for name, fn in ways.items():
        out = fn()
        us = median_us(fn)
        same_exact = all(torch.equal(a, b) for a, b in zip(out, exact))
        same_torch = all(torch.equal(a, b) for a, b in zip(out, torch_way))
        print(f"| {value:.3e} | {name} | {us:.0f} | {100 * nbytes / (us * 1e3) / copy_GBps:.0f}% | {same_exact} | {same_torch} |")
