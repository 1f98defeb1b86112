"""A study (worklogs/2026-11-27-session11-h200x2.md): the GPU time of a monitor step's two checks over what one
rank of Qwen3-30B-A3B at 8 layers holds at EP = 2: the rank's grad norm (checks/monitors.py: local_grad_norm)
and the experts' working-copy check (moe/experts.py: stale_working_copies), each as it is and as it was
(before 4058404: an fp32 copy of every gradient, then its norm; before copies_differ: a cast, a comparison
and a reduction per weight, in torch); and the clip's sum of squares of the experts' gradients, every step
(torch's foreach norm, then ops.sum_of_squares).

    python worklogs/studies/study_monitor_step.py        # one GPU, ~40 GB
    python worklogs/studies/study_monitor_step.py --smoke    # small shapes on the CPU (Triton's interpreter): the script runs

8 layers of 64 experts (2048 x 768, bf16 working copies keeping the weights' bf16 gradients) and the
rank's other 75 tensors with fp32 gradients (study_optimizer_host.py's shapes)."""
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import torch
from torch import nn

from torchtitan_moe import ops
from torchtitan_moe.components.checks.monitors import local_grad_norm
from torchtitan_moe.models.qwen3_moe.parallelize import keep_experts_unsharded
from torchtitan_moe.moe.experts import GroupedExperts, stale_working_copies

D, Q, KV, E, I, V, L = (64, 128, 32, 4, 32, 1000, 2) if SMOKE else (2048, 4096, 512, 64, 768, 151936, 8)
DEVICE = "cpu" if SMOKE else "cuda"
torch.manual_seed(0)
model = nn.ModuleList()
for _ in range(L):
    experts = GroupedExperts(D, I, E, kernels="triton").to(DEVICE)
    experts.init_weights(out_std=0.02)
    keep_experts_unsharded(experts, torch.bfloat16)
    experts.keep_working_gradients()
    experts.refresh_working_copies()
    for copy in experts.working.values():
        copy.grad = torch.randn_like(copy) * 1e-3
    model.append(experts)
shapes = [s for _ in range(L) for s in ((Q // 2, D), (KV // 2, D), (KV // 2, D), (D // 2, Q), (64,), (64,), (D // 2,),
                                        (D // 2,), (64, D))] + [(V // 2, D), (D // 2,), (V // 2, D)]
others = nn.ParameterList([nn.Parameter(torch.randn(s, device=DEVICE) * 0.02) for s in shapes])
for p in others:
    p.grad = torch.randn_like(p) * 1e-3
parts = [model, others]
grads = [c.grad for e in model for c in e.working.values()] + [p.grad for p in others]


def old_grad_norm():
    return torch.nn.utils.get_total_norm([g.float() for g in grads], norm_type=2.0)


def old_stale_check():
    flags = [(e.working[n].view(torch.int16) != getattr(e, n).detach().to(torch.bfloat16).view(torch.int16)).any()
             for e in model for n in sorted(e.working)]
    return torch.stack(flags).tolist()


new, old = float(local_grad_norm(parts)), float(old_grad_norm())
assert abs(new / old - 1) < 1e-5, (new, old)
assert stale_working_copies(model) == [] and not any(old_stale_check())
n_expert = sum(c.numel() for e in model for c in e.working.values())
print(f"{n_expert / 1e9:.2f}B expert weights (bf16 gradients), {sum(p.numel() for p in others) / 1e9:.2f}B others (fp32)")
print("| check | before, ms | now, ms | before / now |\n|---|---|---|---|")


def median_ms(f) -> float:
    if SMOKE:
        t0 = time.perf_counter()
        f()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return do_bench(f, return_mode="median")


expert_grads = [c.grad for e in model for c in e.working.values()]
for name, before, now in (("grad norm", old_grad_norm, lambda: local_grad_norm(parts)),
                          ("working copies", old_stale_check, lambda: stale_working_copies(model)),
                          ("the experts' sum of squares (the clip's, every step)",
                           lambda: ops.sum_of_squares_reference(expert_grads),
                           lambda: ops.sum_of_squares(expert_grads, backend="triton"))):
    b, a = median_ms(before), median_ms(now)
    print(f"| {name} | {b:.2f} | {a:.2f} | {b / a:.2f}x |")
