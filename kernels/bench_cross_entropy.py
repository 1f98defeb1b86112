"""linear_cross_entropy (output layer + summed cross-entropy), forward + backward, Qwen3-30B-A3B's shapes.

    python kernels/bench_cross_entropy.py [--tokens 8192 16384] [--json out.json]

N tokens (8192: local batch 2 at seq 4096), D = 2048, V = 151,936, bf16 h and weight (the default chunks are the
fewest of at most 2 GiB of logits, 7,066 rows, in equal rows: 8192 tokens make 2 of 4,096, 16,384 make 3 of 5,462).
  triton   ops.linear_cross_entropy: per chunk of rows (at most 2 GiB of logits) the logits GEMM, one
           kernel (loss, gradient over the logits), the two gradient GEMMs (the weight's summed over
           the chunks in fp32), all in the forward; the backward scales them
  triton1  the same in one chunk (chunk_rows = N): what the chunks cost in time and save in memory
  eager    torchtitan's loss: nn.Linear logits, F.cross_entropy of their fp32 copy, autograd
  compile  torch.compile of the same
Floor: the three GEMMs (2 N D V FLOPs each) at the bf16 matmul rate measured in this run, plus
the kernel's minimum traffic (read the bf16 logits twice, write the gradient once: 3 x 2 N V
bytes) at the copy bandwidth measured in this run. Memory: peak allocated above the inputs
during one forward + backward.
"""

import json

import torch

from _bench import measure_ceilings, median_us, parse_args
from torchtitan_moe.ops import linear_cross_entropy, linear_cross_entropy_reference

DIM, VOCAB = 2048, 151936


def step(impl, h, w, labels):
    def run():
        loss = impl(h, w, labels)
        return torch.autograd.grad(loss, (h, w))

    return run


def peak_gib(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    args = parse_args(__doc__, tokens=(8192, 16384))  # local batch 2 and 4 at seq 4096
    c = measure_ceilings()
    impls = {
        "triton": lambda h, w, y: linear_cross_entropy(h, w, y, backend="triton"),
        "triton1": lambda h, w, y: linear_cross_entropy(h, w, y, backend="triton", chunk_rows=h.shape[0]),
        "eager": linear_cross_entropy_reference,
        "compile": torch.compile(linear_cross_entropy_reference),
    }
    rows = []
    for n in args.tokens:
        h = torch.randn(n, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(VOCAB, DIM, device="cuda") * DIM**-0.5).to(torch.bfloat16).requires_grad_()
        labels = torch.randint(0, VOCAB, (n,), device="cuda")
        floor_us = 3 * 2 * n * DIM * VOCAB / (c["matmul_bf16_TFLOPs"] * 1e6) + 3 * 2 * n * VOCAB / (c["copy_GBps"] * 1e3)
        times = {}
        for name, impl in impls.items():
            fn = step(impl, h, w, labels)
            fn()  # compiles
            times[name] = median_us(fn)
            rows.append({"tokens": n, "impl": name, "us": times[name], "floor_us": floor_us,
                         "peak_GiB": peak_gib(fn)})
        for r in rows[-len(impls):]:
            r["x_eager"], r["x_compile"] = times["eager"] / r["us"], times["compile"] / r["us"]
        del h, w, labels
        torch.cuda.empty_cache()

    print(f"\nlinear_cross_entropy on {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"D = {DIM}, V = {VOCAB}, bf16, forward + backward")
    print(f"ceilings: copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['matmul_bf16_TFLOPs']:.0f} TFLOP/s\n")
    print("| tokens | impl | fwd + bwd (us) | x eager | x compile | % of floor | peak memory above inputs (GiB) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['impl']} | {r['us']:.0f} | {r['x_eager']:.2f} | {r['x_compile']:.2f} | "
              f"{100 * r['floor_us'] / r['us']:.0f}% | {r['peak_GiB']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "ceilings": c, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
