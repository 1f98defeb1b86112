"""The shard loader alone: tokens per second that one data-parallel rank's loader makes.

    python -m torchtitan_moe.tools.bench_data [SOURCE ...] [--seq-len 4096] [--batch 2] [--ranks 8] [--rank 0]
        [--attention causal|document] [--workers 0] [--seconds 10] [--vocab 151936] [--tokens 33554432]

SOURCE: folders of token shards (`prepare`'s), weighted equally; without one, a temporary source of --tokens
random ids below --vocab (uint32 past 65,536) in documents of 1 to ~8,000 tokens is written first (and read
from the page cache). The loader is torchtitan's DataLoader over our ShardDataset, as training builds it:
--workers 0 makes the batches in this process (one core's rate), more in worker processes. Prints tokens/s
for the rank, and the factor over the training step's rate it is compared with (--step-rate, tokens/s/GPU:
75,000 is about a Qwen3-30B-A3B step on one H200).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

from torchtitan_moe.components.data.packed import ShardDataloader, ShardDataset, Source
from torchtitan_moe.components.data.shards import list_shards, open_shard, write_shard


def random_source(folder: str, tokens: int, vocab: int, shards: int = 4, seed: int = 0) -> str:
    """`shards` shards of random ids in documents of geometric lengths (mean ~1,000 tokens, at most 8,192)."""
    rng = np.random.default_rng(seed)
    identity = {"name": "random", "sha256": "0" * 64, "vocab_size": vocab, "eos_id": vocab - 1}
    for i in range(shards):
        ids = rng.integers(0, vocab - 1, tokens // shards, dtype=np.int64)
        lengths = np.minimum(rng.geometric(1e-3, size=tokens // shards // 500 + 1), 8192)
        cuts = np.cumsum(lengths)
        documents = np.split(ids, cuts[cuts < len(ids)])
        for d in documents:
            d[-1] = vocab - 1  # each ends with EOS
        write_shard(os.path.join(folder, f"shard-{i:05d}.bin"), documents, identity, [{"kind": "random"}])
    return folder


def bench(sources: list[str], seq_len: int, batch: int, ranks: int, rank: int, attention: str, workers: int,
          seconds: float, vocab: int) -> dict:
    opened = [Source([open_shard(p) for p in list_shards(s)], seq_len) for s in sources]
    dataset = ShardDataset(opened, [1.0] * len(opened), seq_len, rank, ranks, batch, seed=0, vocab_size=vocab,
                           positions=attention == "document")
    loader = ShardDataloader(dataset, dp_rank=rank, dp_world_size=ranks, batch_size=batch, num_workers=workers,
                             persistent_workers=workers > 0, prefetch_factor=2 if workers else None)
    it = iter(loader)
    for _ in range(5):  # warm-up: workers started, first pages mapped
        next(it)
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        inputs, labels = next(it)
        count += labels.numel()
    return {"tokens_per_s": count / elapsed, "batches": count // (batch * seq_len), "seconds": elapsed,
            "windows": sum(s.num_windows for s in opened), "tokens": sum(s.num_tokens for s in opened)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtitan_moe.tools.bench_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="*", help="folders of token shards (default: a temporary random source)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2, help="local batch size")
    parser.add_argument("--ranks", type=int, default=8, help="data-parallel ranks (this process is one of them)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--attention", choices=("causal", "document"), default="document")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (0: this process)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--vocab", type=int, default=151936, help="the random source's vocabulary")
    parser.add_argument("--tokens", type=int, default=32 << 20, help="the random source's size")
    parser.add_argument("--step-rate", type=float, default=75_000, help="the training step's tokens/s/GPU")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        sources = args.sources or [random_source(tmp, args.tokens, args.vocab)]
        r = bench(sources, args.seq_len, args.batch, args.ranks, args.rank, args.attention, args.workers,
                  args.seconds, args.vocab)
    what = ", ".join(args.sources) if args.sources else f"random ids < {args.vocab} ({args.tokens:,} tokens)"
    print(f"bench_data: rank {args.rank} of {args.ranks}, seq_len {args.seq_len}, batch {args.batch}, "
          f"attention {args.attention}, {args.workers} workers, {what}: {r['tokens_per_s']:,.0f} tokens/s "
          f"({r['batches']} batches in {r['seconds']:.1f} s), {r['tokens_per_s'] / args.step_rate:.1f}x a step's "
          f"{args.step_rate:,.0f} tokens/s/GPU; {os.cpu_count()} CPUs here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
