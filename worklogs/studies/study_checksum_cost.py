"""What the checkpoint checksums cost: a DCP save of one rank's shard with and without them.

    python worklogs/studies/study_checksum_cost.py [--gb 3] [--folder /tmp/checksum_cost] [--repeats 3]

Saves a state dict of --gb GiB of fp32 tensors (256 MiB each, the size of a large expert weight's
shard) with DCP's FileSystemWriter and with our ChecksummedWriter (train/checksums.py), alternately,
--repeats times each, and times the hashing of the saved files on its own. Prints the medians and the
checksums' share of the save. The files are removed afterwards.
"""

import argparse
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from torchtitan_moe.train.checksums import ChecksummedWriter, hash_files, hash_threads


def timed_save(state_dict, folder: Path, writer_cls) -> float:
    shutil.rmtree(folder, ignore_errors=True)
    start = time.perf_counter()
    dcp.save(state_dict, storage_writer=writer_cls(str(folder)), no_dist=True)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=3.0)
    parser.add_argument("--folder", default="/tmp/checksum_cost")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    per_tensor = 64 * 2**20  # fp32 elements: 256 MiB
    n = max(1, round(args.gb * 2**30 / (4 * per_tensor)))
    state_dict = {f"layers.{i}.moe.experts.w13": torch.randn(per_tensor) for i in range(n)}
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    root = Path(args.folder)
    plain, checked, hashing = [], [], []
    try:
        for _ in range(args.repeats):
            plain.append(timed_save(state_dict, root / "plain", dcp.FileSystemWriter))
            checked.append(timed_save(state_dict, root / "checked", ChecksummedWriter))
            files = {p.name: str(p) for p in (root / "checked").glob("*.distcp")}
            start = time.perf_counter()
            hash_files(files)
            hashing.append(time.perf_counter() - start)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    p, c, h = (statistics.median(x) for x in (plain, checked, hashing))
    print(f"{total / 2**30:.2f} GiB in {n} tensors, {hash_threads()} hash threads, medians of {args.repeats}:")
    print(f"  save without checksums {p:.2f} s ({total / p / 1e9:.2f} GB/s)   all: {', '.join(f'{x:.2f}' for x in plain)}")
    print(f"  save with checksums    {c:.2f} s ({total / c / 1e9:.2f} GB/s)   all: {', '.join(f'{x:.2f}' for x in checked)}")
    print(f"  hashing the files      {h:.2f} s ({total / h / 1e9:.2f} GB/s)   all: {', '.join(f'{x:.2f}' for x in hashing)}")
    print(f"  checksums' share of the save: {h / p:.1%} (hashing / plain save); "
          f"{(c - p) / p:+.1%} (difference of the saves)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
