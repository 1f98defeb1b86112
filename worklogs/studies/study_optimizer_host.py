"""A study (worklogs/2026-11-27-session10-h200x2.md): the host's time for one step of our AdamW over the parameters
one rank of Qwen3-30B-A3B at 8 layers holds at EP = 2 (91 tensors: each layer's attention, norms and router
halved by FSDP over 2 ranks, its 64 local experts whole; the embeddings and the output halved), fp32 moments,
fp32 gradients. The host's time is what a step whose host is the bottleneck (local batch 2) waits for.

    python worklogs/studies/study_optimizer_host.py [--label NAME] [--blocks 1024x4,4096x8]   # ~45 GB of GPU memory

Run it from two trees (PYTHONPATH) to compare their optimizers: it uses only AdamW's constructor and step.
--blocks (a tree with adamw_foreach_) also times the one-launch kernel's GPU time over the same tensors at
each BLOCKxWARPS."""
import argparse
import statistics
import time

import torch

import torchtitan_moe
from torchtitan_moe.components.optimizer import AdamW

parser = argparse.ArgumentParser()
parser.add_argument("--label", default=torchtitan_moe.__file__)
parser.add_argument("--blocks", default="", help="comma list of BLOCKxWARPS, e.g. 1024x4,4096x8")
args = parser.parse_args()

D, Q, KV, E, I, V, L = 2048, 4096, 512, 64, 768, 151936, 8
shapes = []
for _ in range(L):
    shapes += [(Q // 2, D), (KV // 2, D), (KV // 2, D), (D // 2, Q), (64,), (64,), (D // 2,), (D // 2,), (64, D)]
    shapes += [(E, 2 * I, D), (E, D, I)]
shapes += [(V // 2, D), (D // 2,), (V // 2, D)]
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
for p in params:
    p.grad = torch.randn_like(p) * 1e-3
opt = AdamW(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, moments_dtype=torch.float32)
host, gpu = [], []
for i in range(14):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    t0 = time.perf_counter()
    opt.step()
    host.append((time.perf_counter() - t0) * 1e3)
    end.record()
    torch.cuda.synchronize()
    gpu.append(start.elapsed_time(end))
n = sum(p.numel() for p in params)
h, g = statistics.median(host[4:]), statistics.median(gpu[4:])
print(f"| {args.label} | {len(params)} | {n / 1e9:.2f}B | {h:.2f} | {g:.2f} | {n * 28 / g / 1e6:.0f} |")

if args.blocks:
    import triton

    from torchtitan_moe.ops.adamw_triton import adamw_foreach_triton

    state = [opt.state[p] for p in params]
    roles = ([p.data for p in params], [p.grad for p in params], [s["exp_avg"] for s in state],
             [s["exp_avg_sq"] for s in state])
    print("| BLOCK | warps | GPU ms | GB/s at 28 B |\n|---|---|---|---|")
    for spec in args.blocks.split(","):
        block, warps = (int(x) for x in spec.split("x"))
        ms = triton.testing.do_bench(lambda: adamw_foreach_triton(*roles, 3e-4, 0.9, 0.95, 1e-8, 0.1, 1000.0,
                                                                 list(range(len(params))), None, [None] * len(params),
                                                                 block=block, num_warps=warps), return_mode="median")
        print(f"| {block} | {warps} | {ms:.2f} | {n * 28 / ms / 1e6:.0f} |")
