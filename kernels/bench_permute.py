"""routing_index: the expert-major layout from the router's choices, on the device.

    python kernels/bench_permute.py [--tokens 16384 65536] [--json out.json]

E = 128 experts, K = 8, N = T K slots, int64. Minimum bytes: read experts [T, K], write
inv [T, K] and row_slot [N] = 24 N (counts and offsets are negligible). The torch
reference is a stable sort and cumsums; no host sync on either path. Forward only.
"""

import torch

from _bench import Bench, parse_args
from torchtitan_moe.ops import routing_index, routing_index_reference

EXPERTS, TOP_K = 128, 8


def main() -> None:
    args = parse_args(__doc__)
    bench = Bench("routing_index")
    impls = {
        "triton": lambda e: routing_index(e, EXPERTS, backend="triton"),
        "eager": lambda e: routing_index_reference(e, EXPERTS),
        "compile": torch.compile(lambda e: routing_index_reference(e, EXPERTS)),
    }
    for tokens in args.tokens:
        experts = torch.rand(tokens, EXPERTS, device="cuda").topk(TOP_K, dim=1).indices
        bench.forward(f"T={tokens} N={tokens * TOP_K}", 24 * tokens * TOP_K, impls, (experts,))
    bench.finish(args.json)


if __name__ == "__main__":
    main()
