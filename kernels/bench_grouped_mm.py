"""The experts' six grouped GEMMs: torch._grouped_mm (CUTLASS) against Inductor's Triton grouped-mm template.

    python kernels/bench_grouped_mm.py [--tokens 32768] [--json out.json]
        [--dim 2048 --experts 64 --top-k 8 --total-experts 128 --inter 768]

On 2 H200s at local batch 4 (Qwen3-30B-A3B, EP = 2: each rank's 64 experts get the rows of both ranks'
32,768 tokens) the grouped GEMMs take 52 ms of a 216 ms step at 574-682 TFLOP/s, all in one CUTLASS
configuration (cooperative, 128 x 256 x 64), slowest where K is short.
torch.compile's max-autotune can lower `aten._grouped_mm` to a persistent TMA Triton template with its own
tile configurations (torch/_inductor/kernel/mm_grouped.py); this times it, alone (max_autotune_gemm_backends
= "TRITON"), against the ATen call on every GEMM of one layer's forward and backward:

    w13 forward   x [N, D] @ w13^T            K = D        w13 dx   d_ab [N, 2I] @ w13      K = 2I
    w2 forward    h [N, I] @ w2^T             K = I        w2 dx    dy [N, D] @ w2          K = D
    w13 dW        d_ab^T @ x, per group      K = rows     w2 dW    dy^T @ h, per group     K = rows

Rows: a random router's top-k over all experts, the slots of this rank's experts kept, each group padded to
8 (the layer's alignment). Medians of triton.testing.do_bench; the bf16 matmul rate measured in the same run
is the ceiling (kernels/_bench.py). Each Triton result is checked against ATen's (the largest difference,
relative to the largest value: both accumulate in fp32, in other orders).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import measure_ceilings, measure_or_why  # noqa: E402


def routed_offsets(tokens: int, top_k: int, total_experts: int, experts: int, align: int = 8) -> torch.Tensor:
    """offsets [experts] int32: each local expert's group end, its rows padded to `align`."""
    chosen = torch.randn(tokens, total_experts, device="cuda").topk(top_k, dim=1).indices.flatten()
    chosen = chosen[chosen < experts]
    counts = torch.bincount(chosen, minlength=experts)
    return ((counts + align - 1) // align * align).cumsum(0).to(torch.int32)


def cases(args, offs: torch.Tensor) -> list[tuple[str, int, torch.Tensor, torch.Tensor]]:
    """(name, K, a, b): torch._grouped_mm(a, b, offs=offs) is the GEMM."""
    n = int(offs[-1])
    d, i, e = args.dim, args.inter, args.experts

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    x, h, dy, dab = rand(n, d), rand(n, i), rand(n, d), rand(n, 2 * i)
    w13, w2 = rand(e, 2 * i, d), rand(e, d, i)
    return [("w13 forward", d, x, w13.transpose(-2, -1)), ("w2 forward", i, h, w2.transpose(-2, -1)),
            ("w2 dx", d, dy, w2), ("w13 dx", 2 * i, dab, w13),
            ("w2 dW", 0, dy.t(), h), ("w13 dW", 0, dab.t(), x)]


def triton_grouped_mm():
    """torch._grouped_mm compiled by Inductor with its Triton template as the only choice."""
    import torch._inductor.config as inductor

    inductor.max_autotune_gemm_backends = "TRITON"

    @torch.compile(mode="max-autotune-no-cudagraphs", dynamic=False, fullgraph=True)
    def grouped_mm(a, b, offs):
        return torch._grouped_mm(a, b, offs=offs)

    return grouped_mm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768, help="tokens whose slots reach this rank (both ranks')")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64, help="this rank's experts")
    parser.add_argument("--total-experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_grouped_mm needs a CUDA GPU")
    torch.manual_seed(0)
    ceilings = measure_ceilings()
    offs = routed_offsets(args.tokens, args.top_k, args.total_experts, args.experts)
    rows = int(offs[-1])
    compiled = triton_grouped_mm()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {rows} rows for {args.experts} experts; "
          f"bf16 matmul {ceilings['matmul_bf16_TFLOPs']:.0f} TFLOP/s measured")
    print("\n| GEMM | K | ATen µs | TFLOP/s | % matmul | Triton µs | TFLOP/s | ATen / Triton | max diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = []
    for name, k, a, b in cases(args, offs):
        m_n_k = a.shape[0] * b.shape[-1] * (a.shape[1] if k else rows)  # dW: K is the rows
        flops = 2 * m_n_k
        aten_us, _ = measure_or_why(lambda: lambda: torch._grouped_mm(a, b, offs=offs))
        triton_us, why = measure_or_why(lambda: lambda: compiled(a, b, offs))
        diff = "-"
        if triton_us is not None:
            ref, got = torch._grouped_mm(a, b, offs=offs), compiled(a, b, offs)
            if k:  # rows past the last group are undefined
                ref, got = ref[:rows], got[:rows]
            diff = f"{float((got.float() - ref.float()).abs().max() / ref.float().abs().max()):.1e}"
        row = {"gemm": name, "K": k or rows, "aten_us": aten_us, "triton_us": triton_us, "triton_failed": why,
               "flops": flops, "max_rel_diff": diff}
        results.append(row)
        tf = lambda us: f"{flops / us / 1e6:.0f}" if us else "-"  # noqa: E731
        print(f"| {name} | {k or 'rows'} | {aten_us:.0f} | {tf(aten_us)} | "
              f"{100 * flops / aten_us / 1e6 / ceilings['matmul_bf16_TFLOPs']:.0f}% | "
              + (f"{triton_us:.0f} | {tf(triton_us)} | {aten_us / triton_us:.3f}x | {diff} |" if triton_us else
                 f"n/a: {why} | | | |"))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "rows": rows, "ceilings": ceilings, "results": results}, indent=1))


if __name__ == "__main__":
    main()
