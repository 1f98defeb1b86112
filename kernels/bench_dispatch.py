"""Dispatch + combine, forward and backward: one row per (token, rank) against one per (token, expert).

    torchrun --nproc_per_node 8 kernels/bench_dispatch.py [--tokens 8192] [--ep 2,4,8] [--json out.json]

For each EP degree (the first EP ranks of the launch form the group):
  exchange   NCCL all_to_all_single of the rows alone: per-rank rows (ours) vs per-expert rows
             (torchtitan 0.2.2's way). Remote GB/s = bytes a rank sends to other ranks / time,
             against the NVLink per-direction limit (--link-gbs, default 18 links x 26.6 GB/s).
  layer path dispatch + combine forward + backward through the dispatcher (no expert GEMMs;
             y = rows), AllToAllDispatcher vs a per-expert-rows dispatcher built from the
             same ops, so the difference is the exchange volume.
Times are medians over --iters iterations after --warmup, the max over ranks (the
slowest rank sets the step). Routing: each token picks top_k distinct random experts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from torchtitan_moe import ops
from torchtitan_moe.dispatch.all_to_all import AllToAllDispatcher
from torchtitan_moe.dispatch.base import ExpertBatch, slots_to_rows
from torchtitan_moe.dispatch.exchange import exchange
from torchtitan_moe.moe.router import Routing, count_tokens


class PerExpertRowsDispatcher:
    """The baseline: a token travels once per chosen expert (torchtitan 0.2.2's ExpertParallel)."""

    def __init__(self, num_experts: int, group, kernels: str):
        self.group, self.kernels = group, kernels
        self.ep_size = dist.get_world_size(group)
        self.local_experts = num_experts // self.ep_size
        self.num_experts = num_experts

    def dispatch(self, x: torch.Tensor, routing: Routing) -> ExpertBatch:
        index = ops.routing_index(routing.experts, self.num_experts, backend=self.kernels)  # rows by expert = by rank
        counts = index.tokens_per_expert.view(self.ep_size, self.local_experts).sum(1)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        flat = torch.cat([counts, recv_counts]).tolist()
        send, recv = flat[: self.ep_size], flat[self.ep_size :]
        rows = ops.gather_rows(x, index, backend=self.kernels)
        probs = slots_to_rows(routing.probs, index.inv, rows.shape[0])
        local = routing.experts.reshape(-1)[index.row_slot.clamp(min=0)] % self.local_experts
        meta = torch.stack([local.to(probs.dtype), probs], dim=1)
        recv_x = exchange([rows], send, recv, self.group)[0]
        recv_meta = exchange([meta], send, recv, self.group)[0]
        local_index = ops.routing_index(recv_meta[:, :1].long(), self.local_experts, backend=self.kernels)
        expert_rows = ops.gather_rows(recv_x, local_index, backend=self.kernels)
        return ExpertBatch(expert_rows, slots_to_rows(recv_meta[:, 1:], local_index.inv, expert_rows.shape[0]),
                           local_index.offsets, local_index.num_rows, local_index.tokens_per_expert,
                           ctx=SimpleNamespace(index=index, local_index=local_index, send_rows=send, recv_rows=recv))

    def combine(self, y: torch.Tensor, batch: ExpertBatch) -> torch.Tensor:
        c = batch.ctx
        (back,) = exchange([ops.combine(y, c.local_index, backend=self.kernels)], c.recv_rows, c.send_rows, self.group)
        return ops.combine(back, c.index, backend=self.kernels)


def random_routing(tokens: int, num_experts: int, top_k: int, device) -> Routing:
    experts = torch.rand(tokens, num_experts, device=device).topk(top_k, dim=1).indices
    probs = torch.rand(tokens, top_k, device=device).softmax(-1).requires_grad_()
    return Routing(probs, experts, count_tokens(experts, num_experts), None, None)


def timed(fn, warmup: int, iters: int, group) -> float:
    """Median milliseconds of fn() on this rank, max over the group's ranks."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    median = torch.tensor(statistics.median(times), dtype=torch.float64, device="cuda" if cuda else "cpu")
    dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group)
    return float(median)


def bench_ep(ep: int, args, device) -> dict:
    group = dist.new_group(list(range(ep)))
    rank = dist.get_rank()
    if rank >= ep:
        return {}
    torch.manual_seed(1000 + rank)
    x = torch.randn(args.tokens, args.dim, device=device, dtype=args.dtype)
    routing = random_routing(args.tokens, args.experts, args.top_k, device)
    result = {"ep": ep}
    for name, dispatcher in (
        ("per_rank", AllToAllDispatcher(args.experts, group, kernels=args.kernels)),
        ("per_expert", PerExpertRowsDispatcher(args.experts, group, args.kernels)),
    ):
        plan = dispatcher.dispatch(x, routing).ctx
        send_rows, recv_rows = plan.send_rows, plan.recv_rows
        remote_bytes = (sum(send_rows) - send_rows[dist.get_rank(group)]) * args.dim * x.element_size()
        rows = torch.randn(sum(send_rows), args.dim, device=device, dtype=args.dtype)
        recv = torch.empty(sum(recv_rows), args.dim, device=device, dtype=args.dtype)

        def wire():
            dist.all_to_all_single(recv, rows, recv_rows, send_rows, group=group)

        def layer_path():
            xg = x.detach().requires_grad_()
            b = dispatcher.dispatch(xg, routing)
            out = dispatcher.combine(b.x, b)
            out.backward(torch.ones_like(out))

        ms = timed(wire, args.warmup, args.iters, group)
        remote = torch.tensor(remote_bytes, dtype=torch.float64, device=x.device)
        dist.all_reduce(remote, op=dist.ReduceOp.MAX, group=group)
        result[name] = {
            "exchange_ms": ms,
            "remote_GBps": float(remote) / (ms * 1e-3) / 1e9,
            "rows_sent": sum(send_rows),
            "layer_path_ms": timed(layer_path, args.warmup, args.iters, group),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--ep", default="2,4,8")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--link-gbs", type=float, default=18 * 26.6, help="NVLink GB/s per direction per GPU")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    args.dtype = torch.bfloat16 if cuda else torch.float32
    args.kernels = "triton" if cuda else "torch"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    eps = [e for e in map(int, args.ep.split(",")) if e <= dist.get_world_size()]
    results = [bench_ep(ep, args, device) for ep in eps]
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name() if cuda else "cpu"
        print(f"\ndispatch + combine, {args.tokens} tokens/rank, dim {args.dim}, {args.experts} experts, top-{args.top_k}, "
              f"{args.dtype}, {name}; NVLink limit {args.link_gbs:.0f} GB/s per direction")
        print("| EP | rows/rank ours | rows/rank per-expert | exchange ours (us) | exchange per-expert (us) | ratio "
              "| remote GB/s ours | % NVLink | layer path ours (us) | layer path per-expert (us) | ratio |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            ours, base = r["per_rank"], r["per_expert"]
            print(f"| {r['ep']} | {ours['rows_sent']} | {base['rows_sent']} | {ours['exchange_ms'] * 1e3:.0f} | "
                  f"{base['exchange_ms'] * 1e3:.0f} | {base['exchange_ms'] / ours['exchange_ms']:.2f}x | "
                  f"{ours['remote_GBps']:.0f} | {100 * ours['remote_GBps'] / args.link_gbs:.0f}% | "
                  f"{ours['layer_path_ms'] * 1e3:.0f} | {base['layer_path_ms'] * 1e3:.0f} | "
                  f"{base['layer_path_ms'] / ours['layer_path_ms']:.2f}x |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": name, "args": {k: str(v) for k, v in vars(args).items()}, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
