"""Host time per call of one op (gather_rows) under each way of registering it, on a GPU.

    python kernels/bench_op_host.py [--tokens 8192] [--dim 2048] [--experts 128] [--top-k 8] [--reps 15]

The dispatch path is host-bound (kernels/bench_dispatch.py --profile: 80-92% GPU idle at 8192 tokens),
so what a call costs the host is what it costs. The same Triton kernels, called:

  torch.library.custom_op   torch's generic wrapper (the baseline: how the ops were registered before)
  ops (_library.custom_op)  how the ops register now: Library.define, the function as the CUDA kernel,
                            a fake, an autograd.Function at the Autograd key (torchtitan_moe/ops/_library.py)
  autograd.Function         no dispatcher at all: not an op torch.compile can see, the floor with autograd
  kernels alone             the launches, no autograd (forward only): the floor

Host microseconds per call: the CPU time of `--calls` calls, the GPU left to drain after (the queue
never fills: the host is the slower side, checked by the wall time printed beside it). Variants
alternate order over --reps repetitions; medians and minima over them. Forward: the call with an
input that requires grad (the autograd node is made); forward + backward: the call and its backward.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from torchtitan_moe import ops
from torchtitan_moe.ops.combine import _combine_triton, _gather_rows_triton


def host_us(fn, calls: int) -> tuple[float, float]:
    """(host us per call, wall us per call) of `calls` calls after 5 warm-up calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6, (time.perf_counter() - t0) / calls * 1e6


def baseline_op():
    """gather_rows registered with torch.library.custom_op, the same kernels and autograd formula."""
    from torchtitan_moe.ops.combine_triton import gather

    @torch.library.custom_op("bench_op_host::gather_rows", mutates_args=())
    def gather_rows(x: torch.Tensor, row_slot: torch.Tensor, inv: torch.Tensor, num_rows: torch.Tensor) -> torch.Tensor:
        return gather(x, inv, row_slot, num_rows)[0]

    gather_rows.register_fake(lambda x, row_slot, inv, num_rows: x.new_empty(row_slot.shape[0], x.shape[1]))

    def setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[1], inputs[2], inputs[3])

    def backward(ctx, dxs):
        row_slot, inv, num_rows = ctx.saved_tensors
        return _combine_triton(dxs, inv, row_slot, num_rows, None), None, None, None

    gather_rows.register_autograd(backward, setup_context=setup)
    return gather_rows


class GatherRowsFunction(torch.autograd.Function):
    """The same forward and backward with no dispatcher in between."""

    @staticmethod
    def forward(ctx, x, row_slot, inv, num_rows):
        from torchtitan_moe.ops.combine_triton import gather

        ctx.save_for_backward(row_slot, inv)
        return gather(x, inv, row_slot, num_rows)[0]

    @staticmethod
    def backward(ctx, dxs):
        from torchtitan_moe.ops.combine_triton import combine_rows

        row_slot, inv = ctx.saved_tensors
        return combine_rows(dxs, inv), None, None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_op_host: needs a CUDA GPU (it times the host side of GPU kernel launches)")
    from torchtitan_moe.ops.combine_triton import gather

    torch.manual_seed(0)
    experts = torch.rand(args.tokens, args.experts, device="cuda").topk(args.top_k, dim=1).indices
    x = torch.randn(args.tokens, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    index = ops.routing_index(experts, args.experts)
    row_slot, inv, num_rows = index.row_slot, index.inv, index.num_rows
    grad = torch.ones(row_slot.shape[0], args.dim, device="cuda", dtype=torch.bfloat16)
    baseline = baseline_op()
    variants = {
        "torch.library.custom_op": lambda: baseline(x, row_slot, inv, num_rows),
        "ops (_library.custom_op)": lambda: _gather_rows_triton(x, row_slot, inv, num_rows),
        "autograd.Function": lambda: GatherRowsFunction.apply(x, row_slot, inv, num_rows),
    }
    fwd = {name: [] for name in variants}
    both = {name: [] for name in variants}
    walls = []
    for rep in range(args.reps):
        order = list(variants.items()) if rep % 2 == 0 else list(variants.items())[::-1]
        for name, call in order:
            host, wall = host_us(call, args.calls)
            fwd[name].append(host)
            walls.append(wall / host)
            both[name].append(host_us(lambda: call().backward(grad), args.calls)[0])  # noqa: B023
    alone = [host_us(lambda: gather(x.detach(), inv, row_slot, num_rows), args.calls)[0] for _ in range(args.reps)]
    floor = statistics.median(alone)
    base_f, base_b = statistics.median(fwd["torch.library.custom_op"]), statistics.median(both["torch.library.custom_op"])
    print(f"gather_rows [{row_slot.shape[0]}, {args.dim}] bf16 from [{args.tokens}, {args.dim}], "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call, medians (minima) of "
          f"{args.reps} x {args.calls} calls; wall / host {min(walls):.2f}-{max(walls):.2f}")
    print("| registration | forward | forward / baseline | forward + backward | fwd + bwd / baseline |")
    print("|---|---|---|---|---|")
    for name in variants:
        f, b = statistics.median(fwd[name]), statistics.median(both[name])
        print(f"| {name} | {f:.1f} ({min(fwd[name]):.1f}) | {f / base_f:.2f}x | {b:.1f} ({min(both[name]):.1f}) "
              f"| {b / base_b:.2f}x |")
    print(f"| kernels alone (no autograd) | {floor:.1f} ({min(alone):.1f}) | {floor / base_f:.2f}x | - | - |")
    print(f"\nwrapper cost over the kernels alone, forward: torch.library.custom_op {base_f - floor:.1f} us, "
          f"ops {statistics.median(fwd['ops (_library.custom_op)']) - floor:.1f} us")


if __name__ == "__main__":
    main()
