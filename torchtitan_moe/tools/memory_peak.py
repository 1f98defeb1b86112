"""What one rank's GPU memory holds at its peak, from a CUDA memory snapshot.

    python -m torchtitan_moe.tools.memory_peak SNAPSHOT.pickle [--top 20]

SNAPSHOT is `torch.cuda.memory._snapshot()` as torchtitan's `[profiling] enable_memory_snapshot` writes it
(<dump>/<save_memory_snapshot_folder>/iteration_N/rankR_memory_snapshot.pickle, after step N; torchtitan
records the allocator's last 100,000 events). Each block the trace allocates or frees lives from its `alloc`
to its `free_completed` (a block freed while another stream still used it stays active until then, as the
allocator counts it); blocks allocated before the trace began and the blocks still active at the dump bound the
window. It prints the moment in that window with the most active memory, where the allocation that made it came
from, and what was active then, grouped by where each block was allocated, largest first. A place is the innermost
Python frame of ours or torchtitan's, then torch's innermost Python frame; allocations the autograd engine made (no
Python frames) are named by their backward node or op.
"""

from __future__ import annotations

import argparse
import pickle
import re
import sys
from collections import defaultdict
from dataclasses import dataclass

GiB = 2**30
OURS = ("torchtitan_moe/", "torchtitan/")
# C++ frames that name what allocated: the backward node, else the op
NODE = re.compile(r"torch::autograd::generated::(\w+)::apply")
OP = re.compile(r"at::_ops::(\w+)::call")


@dataclass
class Block:
    start: int  # index of its `alloc` event; -1: allocated before the trace
    end: int  # index of its `free_completed` event; len(trace): active at the dump
    size: int
    frames: list[dict]


def place(frames: list[dict]) -> str:
    """Where a block was allocated, from its frames (innermost first)."""
    python = [f for f in frames if f.get("filename", "").endswith(".py")]
    ours = next((f for f in python if any(o in f["filename"] for o in OURS)), None)
    names = [where for where in (ours, python[0] if python else None) if where is not None]
    if names:
        return " <- ".join(dict.fromkeys(f"{short(f['filename'])}:{f['line']} {f['name']}" for f in names))
    for pattern in (NODE, OP):
        for f in frames:
            found = pattern.search(f.get("name", ""))
            if found:
                return found.group(1)
    return "(no frames)"


def short(filename: str) -> str:
    for root in OURS + ("torch/",):
        at = filename.rfind(root)
        if at >= 0:
            return filename[at:]
    return filename


def blocks(snapshot: dict, device: int = 0) -> tuple[list[Block], int]:
    """Every block active at some point of the trace, and the trace's length."""
    trace = snapshot["device_traces"][device]
    open_: dict[int, Block] = {}
    found = []
    for index, event in enumerate(trace):
        action = event["action"]
        if action == "alloc":
            open_[event["addr"]] = Block(index, len(trace), event["size"], event.get("frames", []))
        elif action == "free_completed":
            block = open_.pop(event["addr"], None)
            if block is None:  # allocated before the trace; its own frames are lost, the free's are kept
                block = Block(-1, index, event["size"], event.get("frames", []))
            block.end = index
            found.append(block)
    for segment in snapshot["segments"]:
        if segment.get("device", device) != device:
            continue
        for b in segment["blocks"]:
            if b["state"] in ("active_allocated", "active_pending_free") and b["address"] not in open_:
                found.append(Block(-1, len(trace), b["size"], b.get("frames", [])))
    return found + list(open_.values()), len(trace)


def peak(found: list[Block], length: int) -> tuple[int, int]:
    """(index of the event after which the most memory was active, bytes active then)."""
    delta = [0] * (length + 1)
    active = 0
    for b in found:
        if b.start < 0:
            active += b.size
        else:
            delta[b.start] += b.size
        delta[b.end] -= b.size
    best, at = active, -1
    for index in range(length):
        active += delta[index]
        if active > best:
            best, at = active, index
    return at, best


def report(snapshot: dict, top: int = 20, device: int = 0) -> str:
    found, length = blocks(snapshot, device)
    if not length:
        raise SystemExit("memory_peak: the snapshot has no trace (record it with "
                         "torch.cuda.memory._record_memory_history, as [profiling] enable_memory_snapshot does)")
    at, best = peak(found, length)
    live = [b for b in found if b.start <= at < b.end]
    groups: dict[str, list[Block]] = defaultdict(list)
    for b in live:
        groups[place(b.frames)].append(b)
    trace = snapshot["device_traces"][device]
    lines = [f"trace: {length:,} events; peak active {best / GiB:.2f} GiB in {len(live):,} blocks, "
             f"after event {at:,}" + (f" ({place(trace[at].get('frames', []))})" if at >= 0 else " (before the trace)"),
             "", "| GiB | blocks | largest MiB | allocated at |", "|---|---|---|---|"]
    ranked = sorted(groups.items(), key=lambda item: -sum(b.size for b in item[1]))
    for where, members in ranked[:top]:
        lines.append(f"| {sum(b.size for b in members) / GiB:.2f} | {len(members)} | "
                     f"{max(b.size for b in members) / 2**20:.0f} | {where} |")
    rest = ranked[top:]
    if rest:
        lines.append(f"| {sum(b.size for _, m in rest for b in m) / GiB:.2f} | "
                     f"{sum(len(m) for _, m in rest)} | | {len(rest)} other places |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshot", help="a rank's memory snapshot pickle")
    parser.add_argument("--top", type=int, default=20, help="places to list")
    args = parser.parse_args(argv)
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    print(report(snapshot, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
