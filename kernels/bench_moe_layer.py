"""The whole MoE layer, forward + backward, against torchtitan 0.2.2's and the grouped-GEMM floor.

    python kernels/bench_moe_layer.py [--tokens 16384 32768] [--json out.json]
        [--dim 2048 --experts 128 --top-k 8 --inter 768]

Qwen3-30B-A3B shapes by default (dim 2048, 128 experts, top-8, expert dim 768); large experts
with, e.g., --dim 4096 --experts 8 --top-k 2 --inter 14336 (Mixtral-8x7B). bf16, one GPU, EP = 1.
Per token count and routing (a freshly initialized router: 'learned'; round-robin: 'balanced'):

  ours triton        MoE layer, Triton kernels (what training runs)
  ours torch eager   the same layer on the plain-torch reference ops
  ours torch compile torch.compile of that reference layer
  torchtitan eager   torchtitan.models.moe.MoE (0.2.2), same shapes and routing settings
  torchtitan compile torch.compile of it
  floor 3 GEMMs      grouped_mm x @ w1, x @ w3, h @ w2 with their backward: the GEMM work alone
  floor 2 GEMMs      grouped_mm x @ w13 (fused), h @ w2 with backward: our layer's GEMMs

Medians of triton.testing.do_bench; the bf16 matmul rate and copy bandwidth measured in the
same run are the ceilings (kernels/_bench.py). Inputs (64+ MB at 16k tokens) exceed L2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import measure_ceilings, median_us  # noqa: E402

from torchtitan_moe.moe import MoE, MoEArgs, RouterOptions  # noqa: E402
from torchtitan_moe.moe.router import balanced_experts  # noqa: E402
from torchtitan_moe.compat.torchtitan import TorchtitanMoE, TorchtitanMoEArgs  # noqa: E402

@dataclass(frozen=True)
class Shape:
    dim: int = 2048
    experts: int = 128
    top_k: int = 8
    inter: int = 768


def ours(s: Shape, kernels: str, balanced: bool) -> MoE:
    layer = MoE(MoEArgs(num_experts=s.experts, top_k=s.top_k, inter_dim=s.inter, padding="auto", kernels=kernels,
                        router=RouterOptions(force_balance=balanced, bias_update_rate=0.0)), s.dim)
    layer.to("cuda")
    with torch.no_grad():
        layer.init_weights(out_std=0.02 / 2**0.5, buffer_device=torch.device("cuda"))
    return layer.to(torch.bfloat16)


def torchtitan(s: Shape, balanced: bool):
    args = TorchtitanMoEArgs(num_experts=s.experts, num_shared_experts=0, top_k=s.top_k, score_func="softmax",
                             route_norm=True, route_scale=1.0, score_before_experts=False, load_balance_coeff=None,
                             _debug_force_load_balance=balanced)
    layer = TorchtitanMoE(args, dim=s.dim, hidden_dim=s.inter).to("cuda")
    with torch.no_grad():  # as torchtitan's Trainer calls it
        layer.init_weights(0.02 / 2**0.5, torch.device("cuda"))
    return layer.to(torch.bfloat16)


def layer_step(layer, x: torch.Tensor, grad: torch.Tensor):
    def step():
        xg = x.detach().requires_grad_()
        layer(xg).backward(grad)

    return step


def gemm_floor(s: Shape, tokens: int, balanced: bool, fused: bool):
    """The grouped GEMMs of one layer, forward + backward, on the offsets of real routing."""
    if balanced:
        experts = balanced_experts(tokens, s.top_k, s.experts, "cuda")
    else:
        experts = torch.randn(tokens, s.experts, device="cuda").topk(s.top_k, dim=1).indices
    counts = torch.zeros(s.experts, dtype=torch.int64, device="cuda").scatter_add_(0, experts.flatten(), torch.ones_like(experts.flatten()))
    offs = counts.cumsum(0).to(torch.int32)
    rows = tokens * s.top_k
    x = torch.randn(rows, s.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    h = torch.randn(rows, s.inter, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    widths = [2 * s.inter] if fused else [s.inter, s.inter]
    w_in = [torch.randn(s.experts, w, s.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for w in widths]
    w2 = torch.randn(s.experts, s.dim, s.inter, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        outs = [torch._grouped_mm(x, w.transpose(-2, -1), offs=offs) for w in w_in]
        outs.append(torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs))
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    flops = 3 * 2 * rows * s.dim * s.inter * 3  # 3 GEMMs' worth (fused w13 counts twice), x3 for backward
    return step, flops


def kernel_breakdown(step, top: int = 12) -> str:
    """GPU time per kernel over 5 steps (torch.profiler), the largest first, as a table."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events)
    lines = ["| kernel | ms per step | share |", "|---|---|---|"]
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        lines.append(f"| {e.key[:90]} | {e.device_time_total / 5e3:.3f} | {100 * e.device_time_total / total:.1f}% |")
    lines.append(f"| all kernels | {total / 5e3:.3f} | 100% |")
    return "\n".join(lines)


def run(s: Shape, tokens: int, balanced: bool, breakdown: bool = False) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randn(1, tokens, s.dim, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    variants = {
        "ours triton": ours(s, "triton", balanced),
        "ours torch eager": ours(s, "torch", balanced),
        "ours torch compile": torch.compile(ours(s, "torch", balanced)),
        "torchtitan eager": torchtitan(s, balanced),
        "torchtitan compile": torch.compile(torchtitan(s, balanced)),
    }
    rows = []
    for name, layer in variants.items():
        try:
            ms = median_us(layer_step(layer, x, grad)) / 1e3
        except Exception as e:  # noqa: BLE001 - a baseline that does not run is reported, not hidden
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            ms = None
        rows.append({"variant": name, "ms": ms})
    if breakdown:
        print(f"\nours triton, {tokens} tokens, {'balanced' if balanced else 'learned'}: GPU time per kernel")
        print(kernel_breakdown(layer_step(variants["ours triton"], x, grad)))
    for fused in (False, True):
        step, flops = gemm_floor(s, tokens, balanced, fused)
        ms = median_us(step) / 1e3
        rows.append({"variant": f"floor {'2 GEMMs (w13 fused)' if fused else '3 GEMMs'}", "ms": ms,
                     "tflops": flops / (ms * 1e-3) / 1e12})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--json", default=None)
    parser.add_argument("--dim", type=int, default=Shape.dim)
    parser.add_argument("--experts", type=int, default=Shape.experts)
    parser.add_argument("--top-k", type=int, default=Shape.top_k)
    parser.add_argument("--inter", type=int, default=Shape.inter, help="expert (intermediate) dim")
    parser.add_argument("--routings", default="learned,balanced")
    parser.add_argument("--breakdown", action="store_true", help="also print our layer's GPU time per kernel")
    args = parser.parse_args()
    shape = Shape(args.dim, args.experts, args.top_k, args.inter)
    rates = measure_ceilings()
    print(f"{torch.cuda.get_device_name()}: bf16 matmul {rates['matmul_bf16_TFLOPs']:.0f} TFLOP/s, "
          f"copy {rates['copy_GBps']:.0f} GB/s (measured in this run); {shape}")
    results = []
    for tokens in args.tokens:
        for routing in args.routings.split(","):
            balanced = {"learned": False, "balanced": True}[routing]
            rows = run(shape, tokens, balanced, args.breakdown)
            floor = next(r["ms"] for r in rows if r["variant"] == "floor 3 GEMMs")
            titan_compiled = next(r["ms"] for r in rows if r["variant"] == "torchtitan compile")
            print(f"\n{tokens} tokens, {routing} routing, forward + backward")
            print("| variant | median ms | x floor (3 GEMMs) | speedup vs torchtitan compile | GEMM TFLOP/s (% of matmul) |")
            print("|---|---|---|---|---|")
            for r in rows:
                ms = r["ms"]
                if ms is None:
                    print(f"| {r['variant']} | n/a | | | |")
                    continue
                vs_titan = f"{titan_compiled / ms:.2f}x" if titan_compiled else "n/a"
                gemm = f"{r['tflops']:.0f} ({100 * r['tflops'] / rates['matmul_bf16_TFLOPs']:.0f}%)" if "tflops" in r else ""
                print(f"| {r['variant']} | {ms:.3f} | {ms / floor:.2f} | {vs_titan} | {gemm} |")
            results.append({"tokens": tokens, "routing": routing, "rows": rows})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": asdict(shape), "ceilings": rates, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
