"""gate_logits (the router's fp32 gate of bf16 tokens on the bf16 tensor cores) forward and backward at
Qwen3-30B-A3B's router shapes (D = 2048, E = 128), against the fp32 GEMM it replaces.

    python kernels/bench_gate.py [--tokens 16384 65536] [--json out.json]

Minimum bytes (bf16 tokens, fp32 weight and logits); the FLOPs are few (2 T D E a GEMM), the bytes the floor:
    forward   read x [T, D], w [E, D]; write logits [T, E]                  = 2TD + 4ED + 4TE
    backward  read dlogits [T, E], x, w; write dx [T, D] bf16, dw [E, D]   = 4TE + 4TD + 8ED
"""

import torch

from _bench import Bench, parse_args
from torchtitan_moe.ops import gate_logits, gate_logits_reference

DIM, EXPERTS = 2048, 128


def main() -> None:
    args = parse_args(__doc__)
    bench = Bench("gate_logits")
    impls = {
        "triton": lambda x, w: gate_logits(x, w, backend="triton"),
        "eager": gate_logits_reference,
        "compile": torch.compile(gate_logits_reference),
    }
    for tokens in args.tokens:
        x = torch.randn(tokens, DIM, device="cuda").to(torch.bfloat16).requires_grad_()
        w = (torch.randn(EXPERTS, DIM, device="cuda") * 0.02).requires_grad_()
        case = f"T={tokens}"
        bench.forward(case, 2 * tokens * DIM + 4 * EXPERTS * DIM + 4 * tokens * EXPERTS, impls, (x, w))
        g = torch.randn(tokens, EXPERTS, device="cuda")
        bench.backward(case, 4 * tokens * EXPERTS + 4 * tokens * DIM + 8 * EXPERTS * DIM, impls, (x, w), g)
        del x, w, g
    bench.finish(args.json)


if __name__ == "__main__":
    main()
