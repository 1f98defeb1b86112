"""gather_rows and combine (unweighted and weighted), forward and backward, Qwen3-30B-A3B shapes.

    python kernels/bench_combine.py [--tokens 16384 65536] [--json out.json]

T tokens, K = 8 slots each, N = T K rows of D = 2048 (bf16), indices int64. Minimum bytes:
    gather_rows  forward   read x [T, D] once, row_slot [N]; write rows [N, D]    = 2TD + 8N + 2ND
                 backward  read drows [N, D], inv [T, K]; write dx [T, D]         = 2ND + 8N + 2TD
    combine      forward   read y [N, D], inv (+ probs [T, K]); write out [T, D]   = 2ND + 8N (+4N) + 2TD
                 backward  read dout [T, D], row_slot (+ probs, y for dprobs); write dy [N, D] (+ dprobs)
"""

import torch

from _bench import Bench, parse_args
from torchtitan_moe.ops import combine, combine_reference, gather_rows, gather_rows_reference, routing_index

DIM, EXPERTS, TOP_K = 2048, 128, 8


def main() -> None:
    args = parse_args(__doc__)
    gather = Bench("gather_rows")
    comb = Bench("combine")
    gather_impls = {
        "triton": lambda x, idx: gather_rows(x, idx, backend="triton"),
        "eager": gather_rows_reference,
        "compile": torch.compile(gather_rows_reference),
    }
    combine_impls = {
        "triton": lambda y, idx, p=None: combine(y, idx, p, backend="triton"),
        "eager": combine_reference,
        "compile": torch.compile(combine_reference),
    }
    for tokens in args.tokens:
        n = tokens * TOP_K
        experts = torch.rand(tokens, EXPERTS, device="cuda").topk(TOP_K, dim=1).indices
        index = routing_index(experts, EXPERTS)
        td, nd = tokens * DIM, n * DIM
        case = f"T={tokens} N={n}"

        x = torch.randn(tokens, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        gather.forward(case, 2 * td + 8 * n + 2 * nd, gather_impls, (x, index))
        gather.backward(case, 2 * nd + 8 * n + 2 * td, gather_impls, (x, index),
                        torch.randn(n, DIM, device="cuda", dtype=torch.bfloat16))
        del x

        y = torch.randn(n, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(tokens, DIM, device="cuda", dtype=torch.bfloat16)
        comb.forward(case, 2 * nd + 8 * n + 2 * td, combine_impls, (y, index))
        comb.backward(case, 2 * td + 8 * n + 2 * nd, combine_impls, (y, index), dout)
        probs = torch.rand(tokens, TOP_K, device="cuda", requires_grad=True)
        comb.forward(case + " weighted", 2 * nd + 12 * n + 2 * td, combine_impls, (y, index, probs))
        comb.backward(case + " weighted", 2 * td + 12 * n + 2 * nd + 2 * nd + 4 * n, combine_impls, (y, index, probs), dout)
        del y, dout, probs
    gather.finish(args.json and args.json.replace(".json", "_gather.json"))
    comb.finish(args.json)


if __name__ == "__main__":
    main()
