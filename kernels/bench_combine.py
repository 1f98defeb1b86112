"""Benchmark gather_rows and combine at Qwen3-30B-A3B shapes: D = 2048, E = 128, K = 8, bf16.

Random top-8 routing of T tokens over 128 experts, align = 1, so N = T * K rows, all data.
Minimum bytes moved (s = 2 bytes per bf16 element; index entries 8 bytes, probs 4):
    gather_rows  forward   read x T*D*s + row_slot N*8, write xs N*D*s
                 backward  read dxs N*D*s + inv T*K*8, write dx T*D*s
    combine      forward   read y N*D*s + inv T*K*8 (+ probs T*K*4), write out T*D*s
                 backward  read dout T*D*s + row_slot N*8 (+ probs T*K*4), write dy N*D*s
                           weighted also: read y N*D*s, write dprobs T*K*4
"Minimum": each x / dout row is counted once although K rows are built from it.

Run from the repository root: python -m kernels.bench_combine [--tokens T ...] [--json PATH]
"""

import torch

from kernels._bench import Bench, parse_args
from torchtitan_moe.ops import combine, combine_reference, gather_rows, gather_rows_reference, routing_index

D, E, K = 2048, 128, 8


def main() -> None:
    args = parse_args(__doc__)
    bench = Bench("gather_rows / combine")
    gather_impls = {"triton": gather_rows, "eager": gather_rows_reference, "compile": torch.compile(gather_rows_reference, dynamic=False)}
    combine_impls = {"triton": combine, "eager": combine_reference, "compile": torch.compile(combine_reference, dynamic=False)}
    for T in args.tokens:
        N, s, idx = T * K, 2, 8
        experts = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
        index = routing_index(experts, E)
        x = torch.randn(T, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        y = torch.randn(N, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        probs = torch.rand(T, K, device="cuda", requires_grad=True)
        rows_grad = torch.randn(N, D, dtype=torch.bfloat16, device="cuda")
        tokens_grad = torch.randn(T, D, dtype=torch.bfloat16, device="cuda")

        case = f"gather T={T} N={N}"
        bench.forward(case, T * D * s + N * idx + N * D * s, gather_impls, (x, index))
        bench.backward(case, N * D * s + T * K * idx + T * D * s, gather_impls, (x, index), rows_grad)

        case = f"combine T={T} N={N}"
        bench.forward(case, N * D * s + T * K * idx + T * D * s, combine_impls, (y, index))
        bench.backward(case, T * D * s + N * idx + N * D * s, combine_impls, (y, index), tokens_grad)

        case = f"combine+probs T={T} N={N}"
        weighted = (y, index, probs)
        bench.forward(case, N * D * s + T * K * (idx + 4) + T * D * s, combine_impls, weighted)
        bwd_bytes = T * D * s + N * idx + T * K * 4 + N * D * s + N * D * s + T * K * 4
        bench.backward(case, bwd_bytes, combine_impls, weighted, tokens_grad)
        del x, y, probs, rows_grad, tokens_grad
    bench.finish(args.json)


if __name__ == "__main__":
    main()
