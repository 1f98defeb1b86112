"""adamw_step_ (bf16 and fp32 moments) against torch's AdamW, over one Qwen3-30B-A3B layer's parameters.

    python kernels/bench_adamw.py [--json out.json]

The parameters of one MoE layer with 128 experts (w13 [128, 1536, 2048], w2 [128, 2048, 768]), its
attention (q [4096, 2048], k and v [512, 2048], o [2048, 4096]), the gate [128, 2048] and the norms
(2048, 128): 623M parameters, fp32 weights and fp32 gradients, as the optimizer sees them. Minimum
bytes per parameter: read weight, gradient and both moments, write weight and both moments:
    bf16 moments  4 + 4 + 2 + 2 + 4 + 2 + 2 = 20        fp32 moments  4 * 7 = 28
Rows per moments dtype: "triton" (ours: adamw_foreach_, one launch for all parameters, as the optimizer
calls it), "eager" (the torch reference, one
parameter at a time), "compile" (torch.compile of that reference), and for fp32 moments torch's
AdamW as torchtitan builds it ("fused": torch.optim.AdamW(fused=True), 3 launches for all
parameters) and its default "foreach". x eager / x compile are against this moments dtype's
reference; the last lines compare with torch's fused AdamW.
"""

import torch

from _bench import Bench, parse_args
from torchtitan_moe.ops.adamw import adamw_foreach_, adamw_step_, adamw_step_reference

SHAPES = [(128, 1536, 2048), (128, 2048, 768), (4096, 2048), (512, 2048), (512, 2048), (2048, 4096), (128, 2048),
          (2048,), (2048,), (128,), (128,)]
HYPER = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
SEED = 12345  # the stochastic rounding's stream; its cost does not depend on the value


def tensors(dtype: torch.dtype):
    params = [torch.randn(s, device="cuda") for s in SHAPES]
    grads = [torch.randn(s, device="cuda") * 1e-3 for s in SHAPES]
    moments = [(torch.zeros(s, device="cuda", dtype=dtype), torch.rand(s, device="cuda").to(dtype) * 1e-6)
               for s in SHAPES]
    return params, grads, moments


def ours(params, grads, moments, backend):
    if backend == "triton":
        exp_avgs, exp_avg_sqs = [m for m, _ in moments], [v for _, v in moments]
        return lambda: adamw_foreach_(params, grads, exp_avgs, exp_avg_sqs, **HYPER, step=10, seeds=[SEED] * len(params))

    def step():
        for p, g, (m, v) in zip(params, grads, moments):
            adamw_step_(p, g, m, v, **HYPER, step=10, seed=SEED, backend=backend)
    return step


def reference(params, grads, moments, compiled):
    fn = torch.compile(adamw_step_reference, dynamic=False) if compiled else adamw_step_reference

    def step():
        for p, g, (m, v) in zip(params, grads, moments):
            fn(p, g, m, v, HYPER["lr"], HYPER["beta1"], HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"], 10.0,
               SEED)
    return step


def torch_adamw(params, grads, fused: bool):
    weights = [torch.nn.Parameter(p) for p in params]
    for w, g in zip(weights, grads):
        w.grad = g
    optimizer = torch.optim.AdamW(weights, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                                  weight_decay=HYPER["weight_decay"], fused=fused, foreach=not fused)
    optimizer.step()  # creates the fp32 moments
    return optimizer.step


def main() -> None:
    args = parse_args(__doc__)
    bench = Bench("adamw_step_")
    n = sum(torch.Size(s).numel() for s in SHAPES)
    for dtype, per_param in ((torch.bfloat16, 20), (torch.float32, 28)):
        case = f"{n / 1e6:.0f}M params, {str(dtype).removeprefix('torch.')} moments"
        params, grads, moments = tensors(dtype)
        impls = {
            "triton": lambda: ours(params, grads, moments, "triton"),
            "eager": lambda: reference(params, grads, moments, compiled=False),
            "compile": lambda: reference(params, grads, moments, compiled=True),
        }
        if dtype == torch.float32:
            impls |= {"fused": lambda: torch_adamw(params, grads, fused=True),
                      "foreach": lambda: torch_adamw(params, grads, fused=False)}
        # Bench times impl(*inputs): each impl here makes its step function once.
        steps = {name: make() for name, make in impls.items()}
        bench.forward(case, per_param * n, {name: (lambda s=s: s()) for name, s in steps.items()}, ())
        del params, grads, moments, steps
    bench.finish(args.json)
    by = {(r["case"].split(", ")[1], r["impl"]): r["us"] for r in bench.rows}
    fused = by.get(("float32 moments", "fused"))
    for key in (("bfloat16 moments", "triton"), ("float32 moments", "triton")):
        if fused and by.get(key):
            print(f"ours with {key[0]}: {by[key]:.0f} us, {fused / by[key]:.2f}x torch's fused AdamW with fp32 moments "
                  f"({fused:.0f} us)")


if __name__ == "__main__":
    main()
