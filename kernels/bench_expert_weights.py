"""The experts' weights in a step where their FSDP group has one rank: under FSDP2 against outside it.

    python kernels/bench_expert_weights.py [--layers 8] [--experts 64] [--rows 65536 131072] [--json F]

At EP = the processes of a replica (EP = 2 on 2 GPUs), each rank's experts have an FSDP group of
one rank (`efsdp` = 1). FSDP2 there shards nothing and reduces nothing, yet each step it casts the
fp32 weights into its all-gather buffer, all-gathers over one rank and copies them out (again
for backward when it reshards after forward), and copies the bf16 gradients into an fp32 buffer
to reduce-scatter them over one rank. Outside FSDP2 (parallelize.keep_experts_unsharded) the
GEMMs read a bf16 working copy of the fp32 weights in forward and backward, cast once per step
(after torch's AdamW) or written by our AdamW in its update (no cast in the step: 2 more bytes per
weight written by the optimizer, outside what this times), and the gradient is cast back to fp32 once. One GPU stands for one rank of EP = 2: a one-process NCCL
group gives FSDP2 its one-rank mesh. Per step, `layers` MoE layers' experts (Qwen3-30B-A3B at
EP = 2 by default: 64 experts of dim 2048, expert dim 768) run forward and backward on `rows`
expert-major rows (8192 tokens x top-8 over 2 ranks = 65536 at local batch 2).

  fsdp reshard       FSDP2 over the one-rank mesh, bf16 params, fp32 reduce (the path before)
  fsdp keep          the same, reshard_after_forward = False
  outside cast       outside FSDP2, the working copies cast once in the step (torch's AdamW)
  outside written    outside FSDP2, the working copies current (our AdamW wrote them)
  floor              bf16 weights and gradients: the GEMMs and swiglu alone, no cast, no copy

Each row: median ms per step (triton.testing.do_bench), x the FSDP2 path in the same run, the
floor's share of its time, and the step's peak memory above the weights and the batch (max
allocated; it includes the gradients: fp32, except the floor's bf16).
The copy bandwidth and bf16 matmul rate of the same run are printed with the table. The script
also checks that every variant's fp32 weight gradients (the first layer's) equal the FSDP2 path's
bit for bit.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import measure_ceilings, median_us  # noqa: E402

from torchtitan_moe.models.qwen3_moe.parallelize import keep_experts_unsharded  # noqa: E402
from torchtitan_moe.moe.experts import GroupedExperts  # noqa: E402
from torchtitan_moe.dispatch.seam import ExpertBatch  # noqa: E402

VARIANTS = ("fsdp reshard", "fsdp keep", "outside cast", "outside written", "floor")


class Stack(nn.Module):
    """`layers` experts modules on one batch: what a step's MoE layers do to their weights."""

    def __init__(self, layers: int, experts: int, dim: int, inter: int):
        super().__init__()
        self.layers = nn.ModuleList(GroupedExperts(dim, inter, experts, kernels="triton") for _ in range(layers))
        for i, layer in enumerate(self.layers):
            torch.manual_seed(i)
            layer.init_weights(out_std=0.02 / 2**0.5)

    def forward(self, batch: ExpertBatch, dy: torch.Tensor) -> torch.Tensor:
        return sum((layer(batch).float() * dy).sum() for layer in self.layers)


def build(variant: str, args, mesh) -> Stack:
    stack = Stack(args.layers, args.experts, args.dim, args.inter).cuda()
    if variant.startswith("fsdp"):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
        for layer in stack.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=variant == "fsdp reshard")
        fully_shard(stack, mesh=mesh, mp_policy=mp)
    elif variant.startswith("outside"):
        for layer in stack.layers:
            keep_experts_unsharded(layer, torch.bfloat16)
    else:
        stack.to(torch.bfloat16)
    return stack


def expert_batch(rows: int, experts: int, dim: int) -> tuple[ExpertBatch, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, dim, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    per_expert = torch.full((experts,), rows // experts, dtype=torch.int64, device="cuda")
    offsets = per_expert.cumsum(0).to(torch.int32)
    probs = torch.rand(rows, device="cuda", generator=g)
    batch = ExpertBatch(x=x, probs=probs, offsets=offsets, num_rows=offsets[-1].long(), tokens_per_expert=per_expert,
                        ctx=None)
    return batch, torch.randn(rows, dim, device="cuda", generator=g)


def step_fn(stack: Stack, batch: ExpertBatch, dy: torch.Tensor, cast: bool):
    def step():
        stack.zero_grad(set_to_none=True)
        if cast:  # as after an update that did not write the copies: the forward casts them
            for layer in stack.layers:
                layer.mark_working_stale()
        stack(batch, dy).backward()
    return step


def first_layer_grads(stack: Stack) -> list[torch.Tensor]:
    """Copies of layer 0's fp32 weight gradients (this rank's local shard under FSDP2)."""
    layer = stack.layers[0]
    return [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().clone() for p in (layer.w13, layer.w2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64, help="experts per rank")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--rows", type=int, nargs="+", default=[65536, 131072], help="expert-major rows per step")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_expert_weights needs a CUDA GPU")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("efsdp",))
    ceilings = measure_ceilings()
    weights_gib = args.layers * args.experts * 3 * args.dim * args.inter * 4 / 2**30
    print(f"{torch.cuda.get_device_name()}: copy {ceilings['copy_GBps']:.0f} GB/s, bf16 matmul "
          f"{ceilings['matmul_bf16_TFLOPs']:.0f} TFLOP/s; {args.layers} layers x {args.experts} experts "
          f"({args.dim} x {args.inter}): {weights_gib:.2f} GiB of fp32 expert weights")
    rows_out = []
    for rows in args.rows:
        batch, dy = expert_batch(rows, args.experts, args.dim)
        results, reference = {}, None
        for variant in VARIANTS:
            stack = build(variant, args, mesh)
            step = step_fn(stack, batch, dy, cast=variant == "outside cast")
            step()  # autotune, lazy init
            grads = first_layer_grads(stack)
            if variant != "floor":
                reference = reference or grads
                same = all(torch.equal(a, b) for a, b in zip(reference, grads))
                assert same, f"{variant}: weight gradients differ from the FSDP2 path's"
            stack.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()  # the weights (and the batch)
            torch.cuda.reset_peak_memory_stats()
            step()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            results[variant] = (median_us(step) / 1e3, peak)
            del stack, step, grads
            gc.collect()  # FSDP2's hooks hold the modules in reference cycles
            torch.cuda.empty_cache()
        fsdp_ms, floor_ms = results["fsdp reshard"][0], results["floor"][0]
        print(f"\n{rows} rows per layer, {args.layers} layers, forward + backward")
        print("| variant | median ms | x fsdp reshard | floor / this | peak GiB above the weights |")
        print("|---|---|---|---|---|")
        for variant, (ms, peak) in results.items():
            print(f"| {variant} | {ms:.2f} | {fsdp_ms / ms:.2f}x | {100 * floor_ms / ms:.1f}% | {peak:.2f} |")
            rows_out.append({"rows": rows, "variant": variant, "ms": ms, "peak_GiB": peak})
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "ceilings": ceilings,
                                               "args": vars(args), "rows": rows_out}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
