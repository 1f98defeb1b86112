"""Benchmark swiglu_prob at Qwen3-30B-A3B shapes: I = 768, K = 8, N = T * K rows, bf16.

Every row holds data (num_rows = N), the case that moves the most bytes.
Minimum bytes moved (s = 2 bytes per bf16 element, probs and dprobs fp32):
    forward   read ab N*2I*s + probs N*4, write h N*I*s
    backward  read dh N*I*s + ab N*2I*s + probs N*4, write dab N*2I*s + dprobs N*4

Run from the repository root: python -m kernels.bench_swiglu_prob [--tokens T ...] [--json PATH]
"""

import torch

from kernels._bench import Bench, parse_args
from torchtitan_moe.ops import swiglu_prob, swiglu_prob_reference

I, K = 768, 8


def main() -> None:
    args = parse_args(__doc__)
    bench = Bench("swiglu_prob")
    impls = {"triton": swiglu_prob, "eager": swiglu_prob_reference, "compile": torch.compile(swiglu_prob_reference, dynamic=False)}
    for T in args.tokens:
        N, s = T * K, 2
        ab = torch.randn(N, 2 * I, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        probs = torch.rand(N, device="cuda", requires_grad=True)
        num_rows = torch.tensor(N, device="cuda")
        dh = torch.randn(N, I, dtype=torch.bfloat16, device="cuda")
        case = f"T={T} N={N} I={I}"
        bench.forward(case, N * (2 * I * s + 4 + I * s), impls, (ab, probs, num_rows))
        bench.backward(case, N * (I * s + 2 * I * s + 4 + 2 * I * s + 4), impls, (ab, probs, num_rows), dh)
        del ab, probs, dh
    bench.finish(args.json)


if __name__ == "__main__":
    main()
