"""Benchmark routing_index at Qwen3-30B-A3B shapes: E = 128, K = 8, uniform random top-8 routing.

No backward (integer outputs). Minimum bytes moved, S = T*K slots, N rows:
    read experts S*8, write inv S*8 + row_slot N*8 (+ tokens_per_expert, offsets: E*12, negligible)
The inputs are small (T = 65536: 4 MB), so these rows measure latency more than bandwidth;
the copy percentage is printed for uniformity.

Run from the repository root: python -m kernels.bench_permute [--tokens T ...] [--json PATH]
"""

import torch

from kernels._bench import Bench, parse_args
from torchtitan_moe.ops import routing_index, routing_index_reference
from torchtitan_moe.ops.permute import allocated_rows

E, K = 128, 8


def main() -> None:
    args = parse_args(__doc__)
    bench = Bench("routing_index")
    impls = {
        "triton": routing_index,
        "eager": routing_index_reference,
        "compile": torch.compile(routing_index_reference, dynamic=False),
    }
    for T in args.tokens:
        experts = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
        for align in (1, 16):
            N = allocated_rows(T * K, E, align)
            bench.forward(f"T={T} align={align} N={N}", T * K * 16 + N * 8, impls, (experts, E, align))
    bench.finish(args.json)


if __name__ == "__main__":
    main()
