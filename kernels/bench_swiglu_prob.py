"""swiglu_prob forward and backward at Qwen3-30B-A3B shapes (I = 768, top-8).

    python kernels/bench_swiglu_prob.py [--tokens 16384 65536] [--json out.json]

Rows N = tokens x 8. Minimum bytes (bf16 activations, fp32 probs):
    forward   read ab [N, 2I] + probs [N], write h [N, I]               = N (6I + 4)
    backward  read ab, dh [N, I], probs; write dab [N, 2I], dprobs [N]  = N (10I + 8)
"""

import torch

from _bench import Bench, parse_args
from torchtitan_moe.ops import swiglu_prob, swiglu_prob_reference

INTER, TOP_K = 768, 8


def main() -> None:
    args = parse_args(__doc__)
    bench = Bench("swiglu_prob")
    impls = {
        "triton": lambda ab, p, n: swiglu_prob(ab, p, n, backend="triton"),
        "eager": swiglu_prob_reference,
        "compile": torch.compile(swiglu_prob_reference),
    }
    for tokens in args.tokens:
        n = tokens * TOP_K
        ab = torch.randn(n, 2 * INTER, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        probs = torch.rand(n, device="cuda", dtype=torch.float32, requires_grad=True)
        num_rows = torch.tensor(n, device="cuda")
        case = f"T={tokens} N={n}"
        bench.forward(case, n * (6 * INTER + 4), impls, (ab, probs, num_rows))
        dh = torch.randn(n, INTER, device="cuda", dtype=torch.bfloat16)
        bench.backward(case, n * (10 * INTER + 8), impls, (ab, probs, num_rows), dh)
        del ab, probs, dh
    bench.finish(args.json)


if __name__ == "__main__":
    main()
