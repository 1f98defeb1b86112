"""The loss's chunks of rows at 16,384 tokens: fwd + bwd of ops.linear_cross_entropy by chunk_rows, and the
weight gradient's fp32-out addmm by K and layout. Cited by worklogs/2026-11-28-session25-offload.md (call 11).

    PYTHONPATH=. python worklogs/studies/study_loss_chunks.py      # one CUDA GPU
"""

import torch
import triton

from torchtitan_moe.ops import linear_cross_entropy

N, D, V = 16384, 2048, 151936


def ms(fn) -> float:
    return round(triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median"), 2)


def main() -> None:
    torch.manual_seed(0)
    h = (torch.randn(N, D, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, D, device="cuda") * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, V, (N,), device="cuda")

    def step(rows):
        return lambda: torch.autograd.grad(linear_cross_entropy(h, w, y, chunk_rows=rows), (h, w))

    for rows in (16384, 8192, 5462, 5632, 5120, 4096, 6144):
        print(rows, -(-N // rows), "chunks", ms(step(rows)), "ms", flush=True)
    acc = torch.zeros(V, D, device="cuda")
    for k in (5462, 5632, 4096):
        a = torch.randn(V, k, device="cuda").bfloat16()  # K contiguous
        at = torch.randn(k, V, device="cuda").bfloat16().t()  # the op's layout: a chunk's gradient, transposed
        b = torch.randn(k, D, device="cuda").bfloat16()
        for name, left in (("K contiguous", a), ("transposed", at)):
            print(f"K {k} {name}: addmm fp32-out", ms(lambda: torch.addmm(acc, left, b, out_dtype=torch.float32, out=acc)),
                  "ms; bf16 mm", ms(lambda: left @ b), "ms", flush=True)


if __name__ == "__main__":
    main()
