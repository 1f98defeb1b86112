"""Dispatch + combine, forward and backward: NCCL all-to-all (per-rank, per-expert rows) and DeepEP.

    torchrun --nproc_per_node 8 kernels/bench_dispatch.py [--tokens 8192] [--ep 2,4,8] [--layer]
        [--tuned-file FILE] [--json out.json] [--profile DIR]

For each EP degree (the first EP ranks of the launch form the group):
  exchange   the rows alone: NCCL all_to_all_single of per-rank rows (ours) vs per-expert rows
             (torchtitan 0.2.2's way), each way; DeepEP's dispatch (with the cached layout, as the
             combine's backward runs it) and combine kernels, at DeepEP's default 24 SMs and at the
             tuned file's settings for these shapes. Remote GB/s = bytes a rank sends to other
             ranks / time, against the NVLink per-direction limit (--link-gbs, 18 x 26.6 GB/s).
  + layout   DeepEP's dispatch as the forward runs it: layout, counts (the host sync), rows.
  layer path dispatch + combine forward + backward through each dispatcher (no expert GEMMs;
             y = rows): AllToAllDispatcher (exact and worst-case buffers), a per-expert-rows
             dispatcher built from the same ops, DeepEPDispatcher, and at EP = 1 LocalDispatcher.
  --layer    also the whole MoE layer forward + backward (router, dispatch, the experts' GEMMs at
             --inter, combine; bf16, this rank's expert shard) through AllToAllDispatcher, and at
             EP = 1 through LocalDispatcher too: on one GPU (a one-rank group, the exchange a local
             copy) what the all-to-all path costs over the local one inside a layer, where the
             GEMMs give the host time to run ahead.
  --profile  also traces 3 runs of each layer path (torch.profiler, after one warm-up run) into
             DIR/ep<EP>_<path>_rank<R>.json and prints rank 0's breakdown (torchtitan_moe.tools.step_profile:
             GPU busy and idle, launches, host syncs, the top kernels): where a path's time goes.
Times are medians over --iters iterations after --warmup, the max over ranks (the slowest rank
sets the step). The layer paths, host-bound, are timed in turn (tune_dispatch.timed_interleaved:
their time drifts with the host's by tens of percent within one call), each DeepEP row beside the
all_to_all path again, so the ratios compare like with like. Routing: each token picks top_k distinct random experts.
"""

from __future__ import annotations

import argparse
import json
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from torchtitan_moe import ops

from torchtitan_moe.tools import step_profile
from torchtitan_moe.parallel import tuned
from torchtitan_moe.dispatch.all_to_all import AllToAllDispatcher
from torchtitan_moe.dispatch.deepep import DeepEPDispatcher
from torchtitan_moe.dispatch.exchange import exchange
from torchtitan_moe.dispatch.deepep_backend import (
    EP_SIZES,
    DeepEPUnavailable,
    DeepEPV1,
    default_settings,
    import_deep_ep,
    release_buffers,
)
from torchtitan_moe.moe import MoE, MoEArgs
from torchtitan_moe.moe.router import count_tokens
from torchtitan_moe.dispatch.seam import Done, ExpertBatch, LocalDispatcher, Routing, slots_to_rows
from torchtitan_moe.tools.tune_dispatch import max_over_ranks, timed_interleaved, timed_ms


class PerExpertRowsDispatcher:
    """The baseline: a token travels once per chosen expert (torchtitan 0.2.2's ExpertParallel)."""

    def __init__(self, num_experts: int, group, kernels: str):
        self.group, self.kernels = group, kernels
        self.ep_size = dist.get_world_size(group)
        self.local_experts = num_experts // self.ep_size
        self.num_experts = num_experts

    def exchange(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        return exchange([rows], send, recv, self.group)[0]  # the gradient goes back the way it came

    def start_dispatch(self, x: torch.Tensor, routing: Routing, chunk: int = 0) -> Done[ExpertBatch]:
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
        recv_x = self.exchange(rows, send, recv)
        recv_meta = self.exchange(meta, send, recv)
        local_index = ops.routing_index(recv_meta[:, :1].long(), self.local_experts, backend=self.kernels)
        expert_rows = ops.gather_rows(recv_x, local_index, backend=self.kernels)
        return Done(ExpertBatch(
            expert_rows, slots_to_rows(recv_meta[:, 1:], local_index.inv, expert_rows.shape[0]),
            local_index.offsets, local_index.num_rows, local_index.tokens_per_expert,
            ctx=SimpleNamespace(index=index, local_index=local_index, send_rows=send, recv_rows=recv)))

    def start_combine(self, y: torch.Tensor, batch: ExpertBatch) -> Done[torch.Tensor]:
        c = batch.ctx
        back = self.exchange(ops.combine(y, c.local_index, backend=self.kernels), c.recv_rows, c.send_rows)
        return Done(ops.combine(back, c.index, backend=self.kernels))


def random_routing(tokens: int, num_experts: int, top_k: int, device) -> Routing:
    experts = torch.rand(tokens, num_experts, device=device).topk(top_k, dim=1).indices
    probs = torch.rand(tokens, top_k, device=device).softmax(-1).requires_grad_()
    return Routing(probs, experts, count_tokens(experts, num_experts), None, None)


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def bench_ep(ep: int, args, device) -> dict:
    group = dist.new_group(list(range(ep)))
    rank = dist.get_rank()
    if rank >= ep:
        return {}
    me = dist.get_rank(group)
    torch.manual_seed(1000 + rank)
    x = torch.randn(args.tokens, args.dim, device=device, dtype=args.dtype)
    routing = random_routing(args.tokens, args.experts, args.top_k, device)
    row_bytes = args.dim * x.element_size()

    def timed(fn) -> float:
        return timed_ms(fn, group, args.warmup, args.iters)

    def layer_path(dispatcher):
        def step():
            xg = x.detach().requires_grad_()
            b = dispatcher.start_dispatch(xg, routing).wait()
            out = dispatcher.start_combine(b.x, b).wait()
            out.backward(torch.ones_like(out))

        return step

    def paths_ms(steps: dict, traced: tuple[str, ...] | None = None) -> dict[str, float]:
        """Layer paths timed in turn (timed_interleaved), then with --profile each of `traced`
        (default: all) traced once."""
        times = timed_interleaved(steps, group, args.warmup, args.iters)
        if args.profile:
            for name, step in steps.items():
                if traced is not None and name not in traced:
                    continue
                trace = f"{args.profile}/ep{ep}_{name}_rank{rank}.json"
                result.setdefault("profiles", {})[name] = profiled(step, trace)
        return times

    result = {"ep": ep}
    steps = {}
    for name, dispatcher in (
        ("per_rank", AllToAllDispatcher(args.experts, group, kernels=args.kernels)),
        ("per_expert", PerExpertRowsDispatcher(args.experts, group, args.kernels)),
    ):
        plan = dispatcher.start_dispatch(x, routing).wait().ctx
        send_rows, recv_rows = plan.send_rows, plan.recv_rows
        rows = torch.randn(sum(send_rows), args.dim, device=device, dtype=args.dtype)
        recv = torch.empty(sum(recv_rows), args.dim, device=device, dtype=args.dtype)
        ms = timed(lambda: dist.all_to_all_single(recv, rows, recv_rows, send_rows, group=group))  # noqa: B023
        back_ms = timed(lambda: dist.all_to_all_single(rows, recv, send_rows, recv_rows, group=group))  # noqa: B023
        remote = max_over_ranks((sum(send_rows) - send_rows[me]) * row_bytes, group)  # bytes to other ranks
        remote_back = max_over_ranks((sum(recv_rows) - recv_rows[me]) * row_bytes, group)
        result[name] = {
            "exchange_ms": ms, "remote_GBps": gbps(remote, ms),
            "exchange_back_ms": back_ms, "remote_back_GBps": gbps(remote_back, back_ms),
            "remote_bytes": (remote, remote_back), "rows_sent": sum(send_rows),
        }
        steps[name] = layer_path(dispatcher)
    # Without the host sync: every rank sends T rows to every rank ([dispatch] buffers = "worst_case").
    steps["per_rank_worst_case"] = layer_path(
        AllToAllDispatcher(args.experts, group, kernels=args.kernels, buffers="worst_case"))
    if ep == 1:  # nothing travels: the floor the exchanging dispatchers add to
        steps["local"] = layer_path(LocalDispatcher(args.experts, kernels=args.kernels))
    times = paths_ms(steps)
    for name in ("per_rank", "per_expert"):
        result[name]["layer_path_ms"] = times[name]
    result["per_rank"]["worst_case_path_ms"] = times["per_rank_worst_case"]
    if ep == 1:
        result["local_path_ms"] = times["local"]

    if args.layer:
        dispatchers = {"all_to_all": AllToAllDispatcher(args.experts, group, align=8, kernels=args.kernels)}
        if ep == 1:
            dispatchers["local"] = LocalDispatcher(args.experts, align=8, kernels=args.kernels)
        layer_steps = {name: moe_layer_step(d, x, ep, me, args) for name, d in dispatchers.items()}
        result["layer_ms"] = timed_interleaved(layer_steps, group, args.warmup, args.iters)

    # DeepEP moves the same rows as ours (one per token and destination rank).
    remote, remote_back = result["per_rank"]["remote_bytes"]

    for name, settings, note in deepep_settings(ep, args, routing):
        if settings is None:
            result[name] = {"note": note}
            continue
        backend = DeepEPV1(group, settings, args.dim)
        experts, probs = routing.experts, routing.probs.detach()
        d = backend.dispatch(x, experts, probs, args.experts)
        dispatch_ms = timed(lambda: backend.dispatch_again(x, d.handle))  # noqa: B023
        combine_ms = timed(lambda: backend.combine(d.x, d.handle))  # noqa: B023
        # Its path in turn with the all_to_all one (each DeepEP setting has its own buffers): the ratio holds.
        both = paths_ms({name: layer_path(DeepEPDispatcher(args.experts, backend, kernels=args.kernels)),
                         f"per_rank_beside_{name}": steps["per_rank"]}, traced=(name,))
        result[name] = {
            "settings": settings.describe(), "note": note,
            "dispatch_ms": dispatch_ms, "remote_GBps": gbps(remote, dispatch_ms),
            "dispatch_layout_ms": timed(lambda: backend.dispatch(x, experts, probs, args.experts)),  # noqa: B023
            "combine_ms": combine_ms, "remote_back_GBps": gbps(remote_back, combine_ms),
            "layer_path_ms": both[name], "all_to_all_path_ms": both[f"per_rank_beside_{name}"],
        }
    release_buffers(group)
    return result


def profiled(step, path: str, runs: int = 3) -> dict:
    """Trace `runs` calls of step() after one warm-up call; -> step_profile's breakdown of the trace."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=runs, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        for _ in range(runs + 1):
            step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # each profiler step holds its own GPU work (step_profile's assumption)
            prof.step()
    return step_profile.breakdown(step_profile.load(path))


def moe_layer_step(dispatcher, x: torch.Tensor, ep: int, me: int, args):
    """One MoE layer's forward + backward on x [T, D] through `dispatcher`, with this rank's experts."""
    torch.manual_seed(0)  # the same weights on every rank
    layer = MoE(MoEArgs(num_experts=args.experts, top_k=args.top_k, inter_dim=args.inter, kernels=args.kernels),
                args.dim).to(x.device)
    layer.init_weights(out_std=0.02)
    layer = layer.to(args.dtype)
    layer.router.float()  # the gate stays fp32, as FSDP2's policy keeps it
    mine = slice(me * args.experts // ep, (me + 1) * args.experts // ep)
    for name in ("w13", "w2"):
        setattr(layer.experts, name, torch.nn.Parameter(getattr(layer.experts, name).detach()[mine].clone()))
    layer.set_dispatcher(dispatcher)
    xs = x.detach().view(1, *x.shape).requires_grad_()
    grad = torch.randn_like(xs)

    def step():
        layer(xs).backward(grad)

    return step


def deepep_settings(ep: int, args, routing: Routing) -> list[tuple]:
    """[(row name, DeepEPSettings or None, note)]: DeepEP's defaults and the tuned entry's."""
    try:
        import_deep_ep()
    except DeepEPUnavailable as e:
        return [("deepep_default", None, str(e))]
    if ep not in EP_SIZES:
        return [("deepep_default", None, f"DeepEP takes EP 2, 4 or 8, not {ep}")]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    shape = tuned.Shape(gpu, ep, args.dim, args.top_k, args.experts, args.tokens)
    found = tuned.lookup(args.tuned_file, shape)
    rows = [("deepep_default", default_settings(ep), "DeepEP's defaults")]
    if found:
        rows.append(("deepep_tuned", found[2].deepep, f"{found[0]}, entry {found[1]}"))
    else:
        rows.append(("deepep_tuned", None, f"no entry for {shape.describe()} in {args.tuned_file or 'the shipped table'}"))
    return rows


def print_tables(results: list[dict], args, name: str) -> None:
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
    print("\nthe same rows (one per token and destination rank) moved by NCCL and by DeepEP; dispatch = the "
          "rows alone, + layout = DeepEP's forward dispatch (layout, counts with a host sync, rows)")
    print("| EP | dispatcher | settings | dispatch (us) | GB/s | % NVLink | + layout (us) | combine (us) | GB/s "
          "| % NVLink | layer path (us) | all_to_all / this |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    pct = lambda v: f"{100 * v / args.link_gbs:.0f}%"  # noqa: E731
    for r in results:
        ours = r["per_rank"]
        print(f"| {r['ep']} | all_to_all (NCCL) | - | {ours['exchange_ms'] * 1e3:.0f} | {ours['remote_GBps']:.0f} | "
              f"{pct(ours['remote_GBps'])} | - | {ours['exchange_back_ms'] * 1e3:.0f} | {ours['remote_back_GBps']:.0f} "
              f"| {pct(ours['remote_back_GBps'])} | {ours['layer_path_ms'] * 1e3:.0f} | 1.00x |")
        for key in ("deepep_default", "deepep_tuned"):
            d = r.get(key)
            if d is None:
                continue
            if "dispatch_ms" not in d:
                print(f"| {r['ep']} | {key} | n/a: {d['note']} | | | | | | | | | |")
                continue
            print(f"| {r['ep']} | {key} | {d['settings']} | {d['dispatch_ms'] * 1e3:.0f} | {d['remote_GBps']:.0f} | "
                  f"{pct(d['remote_GBps'])} | {d['dispatch_layout_ms'] * 1e3:.0f} | {d['combine_ms'] * 1e3:.0f} | "
                  f"{d['remote_back_GBps']:.0f} | {pct(d['remote_back_GBps'])} | {d['layer_path_ms'] * 1e3:.0f} | "
                  f"{d['all_to_all_path_ms'] / d['layer_path_ms']:.2f}x |")
    print("\nlayer path (dispatch + combine, forward + backward, no GEMMs) per dispatcher; all_to_all worst_case: "
          "[dispatch] buffers = 'worst_case' (no host sync); local: EP = 1, nothing travels")
    print("| EP | all_to_all exact (us) | all_to_all worst_case (us) | per-expert rows (us) | local (us) |")
    print("|---|---|---|---|---|")
    for r in results:
        local = f"{r['local_path_ms'] * 1e3:.0f}" if "local_path_ms" in r else "-"
        print(f"| {r['ep']} | {r['per_rank']['layer_path_ms'] * 1e3:.0f} | {r['per_rank']['worst_case_path_ms'] * 1e3:.0f} "
              f"| {r['per_expert']['layer_path_ms'] * 1e3:.0f} | {local} |")
    for r in results:
        for path, profile in r.get("profiles", {}).items():
            print(f"\nEP {r['ep']}, {path} layer path, rank 0's trace:\n")
            print(step_profile.render(profile, top=12))
    if args.layer:
        print(f"\nthe whole MoE layer, forward + backward (router, dispatch, experts at inter {args.inter}, combine)")
        print("| EP | all_to_all (us) | local (us) | all_to_all / local |")
        print("|---|---|---|---|")
        for r in results:
            t = r["layer_ms"]
            local = f"{t['local'] * 1e3:.0f} | {t['all_to_all'] / t['local']:.2f}x" if "local" in t else "- | -"
            print(f"| {r['ep']} | {t['all_to_all'] * 1e3:.0f} | {local} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--ep", default="2,4,8")
    parser.add_argument("--inter", type=int, default=768, help="expert (intermediate) dim, for --layer")
    parser.add_argument("--layer", action="store_true", help="also time the whole MoE layer per dispatcher")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--link-gbs", type=float, default=18 * 26.6, help="NVLink GB/s per direction per GPU")
    parser.add_argument("--tuned-file", default="", help="for the 'deepep_tuned' row, looked up before the shipped table")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", default=None, metavar="DIR", help="trace each layer path into DIR (see above)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    args.dtype = torch.bfloat16  # DeepEP moves bf16 rows; so does training
    args.kernels = "triton" if cuda else "torch"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    eps = [e for e in map(int, args.ep.split(",")) if e <= dist.get_world_size()]
    results = [bench_ep(ep, args, device) for ep in eps]
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name() if cuda else "cpu"
        print_tables(results, args, name)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": name, "args": {k: str(v) for k, v in vars(args).items()}, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
