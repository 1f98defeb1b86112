"""The Triton ops as torch.library custom ops: schema, fake kernels, autograd, torch.compile.

`torch.library.opcheck` runs each op for real and under FakeTensor/AOTAutograd and checks
that the fake implementation gives the real output's shapes, dtypes and strides and that
autograd is registered the way the dispatcher expects. A compiled MoE layer (each op one
opaque node, `fullgraph=True`: a graph break fails) matches eager, forward and backward.
"""

import pytest
import torch
from ops_helpers import random_routing

from torchtitan_moe import ops
from torchtitan_moe.moe import MoE, MoEArgs, RouterOptions

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def index_for(T=24, K=3, E=6, align=8, empty=0.2, seed=0):
    experts = random_routing(T, K, E, seed, empty=empty).to(DEVICE)
    return experts, ops.routing_index(experts, E, align, backend="triton")


@pytest.mark.parametrize("align", [1, 8])
def test_routing_index_opcheck(align):
    experts, index = index_for(align=align)
    N = index.row_slot.shape[0]
    torch.library.opcheck(torch.ops.torchtitan_moe.routing_index, (experts, 6, align, N), test_utils=OPCHECK_TESTS)


def test_gather_rows_and_combine_opcheck():
    _, index = index_for()
    # The rows past num_rows are undefined in the outputs (eager and AOT would differ there): trimmed.
    index = index._replace(row_slot=index.row_slot[: int(index.num_rows)])
    T, D = index.inv.shape[0], 32
    x = torch.randn(T, D, device=DEVICE, requires_grad=True)
    y = torch.randn(index.row_slot.shape[0], D, device=DEVICE, requires_grad=True)
    probs = torch.rand(index.inv.shape, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.torchtitan_moe.gather_rows, (x, index.row_slot, index.inv, index.num_rows),
                          test_utils=OPCHECK_TESTS)
    for p in (None, probs):
        torch.library.opcheck(torch.ops.torchtitan_moe.combine, (y, index.inv, index.row_slot, index.num_rows, p),
                              test_utils=OPCHECK_TESTS)
    dout = torch.randn(T, D, device=DEVICE)
    torch.library.opcheck(torch.ops.torchtitan_moe.combine_backward,
                          (dout, index.inv, index.row_slot, index.num_rows, probs.detach(), y.detach()))


def test_linear_cross_entropy_opcheck():
    h = torch.randn(12, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(40, 8, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, 40, (12,), device=DEVICE)
    labels[5] = -100
    for chunk_rows in (12, 5):  # one chunk, and three (the weight's gradient summed over them)
        torch.library.opcheck(torch.ops.torchtitan_moe.linear_cross_entropy, (h, w, labels, -100, chunk_rows),
                              test_utils=OPCHECK_TESTS)
    dh, dw = torch.randn(12, 8, device=DEVICE).bfloat16(), torch.randn(40, 8, device=DEVICE).bfloat16()
    torch.library.opcheck(torch.ops.torchtitan_moe.linear_cross_entropy_backward, (dh, dw, torch.tensor(0.3, device=DEVICE)),
                          test_utils=OPCHECK_TESTS)


def test_send_plan_and_send_meta_opcheck():
    experts = random_routing(24, 4, 12, 0).to(DEVICE)
    torch.library.opcheck(torch.ops.torchtitan_moe.send_plan, (experts, 4, 3), test_utils=OPCHECK_TESTS)
    rank_slots, _ = ops.send_plan(experts, 4, 3, backend="triton")
    row_slot = ops.routing_index(rank_slots, 3, backend="triton").row_slot
    probs = torch.rand(experts.shape, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.torchtitan_moe.send_meta, (row_slot, experts, probs, 4), test_utils=OPCHECK_TESTS)
    dmeta = torch.randn(row_slot.shape[0], 8, device=DEVICE)
    torch.library.opcheck(torch.ops.torchtitan_moe.send_meta_backward, (dmeta, row_slot, experts, 4))


def test_swiglu_prob_opcheck():
    N, I = 40, 16
    ab = torch.randn(N, 2 * I, device=DEVICE, requires_grad=True)
    probs = torch.rand(N, device=DEVICE, requires_grad=True)
    num_rows = torch.tensor(N, device=DEVICE)  # no tail: the kernel leaves one undefined, eager and AOT would differ there
    for rows in (num_rows, None):
        torch.library.opcheck(torch.ops.torchtitan_moe.swiglu_prob, (ab, probs, rows), test_utils=OPCHECK_TESTS)


def test_grouped_mm_opcheck():
    E, D, F = 4, 16, 32
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    # Expert 1 has no rows; no tail rows (their output is undefined, so eager and AOT differ there).
    offsets = torch.tensor([3, 3, 11, 16], dtype=torch.int32, device=DEVICE)
    x = torch.randn(16, D, device=DEVICE, dtype=dtype, requires_grad=True)
    w = torch.randn(E, F, D, device=DEVICE, dtype=dtype).transpose(-2, -1).requires_grad_()
    torch.library.opcheck(torch.ops.torchtitan_moe.grouped_mm, (x, w, offsets), test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["EDF", "EFD_view"])
def test_grouped_mm_matches_per_expert_matmuls(layout, dtype):
    """Forward and both gradients against one matmul per expert in float64; the expert
    without rows gets an exact-zero weight gradient; rows past offsets[-1] are never read, of x
    nor of dy (NaN there: the layer leaves the tails of its expert-major buffers unwritten); the weight
    gradient has the weight's strides (the experts pass a transposed [E, F, D] view: a gradient
    in another layout costs a transposing pass over the weight when accumulated). bf16 is the
    layer's dtype, and on sm_90 another kernel than fp32's."""
    E, D, F, N = 4, 16, 32, 16
    offsets = torch.tensor([3, 3, 11, 14], dtype=torch.int32, device=DEVICE)
    x = torch.randn(N, D, device=DEVICE).to(dtype)
    x[14:] = float("nan")
    w = torch.randn(E, D, F, device=DEVICE) if layout == "EDF" else torch.randn(E, F, D, device=DEVICE).transpose(-2, -1)
    w = w.to(dtype)
    dy = torch.randn(N, F, device=DEVICE).to(dtype)
    dy[14:] = float("nan")  # the backward's input past the last offset: swiglu_prob leaves dab's tail too
    x.requires_grad_(), w.requires_grad_()
    y = ops.grouped_mm(x, w, offsets)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert dw.stride() == w.stride(), (dw.stride(), w.stride())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    starts = [0, 3, 3, 11]
    for e, (s, t) in enumerate(zip(starts, offsets.tolist())):
        xe, we, dye = x[s:t].double(), w[e].double(), dy[s:t].double()
        torch.testing.assert_close(y[s:t].double(), xe @ we, **tol)
        torch.testing.assert_close(dx[s:t].double(), dye @ we.T, **tol)
        torch.testing.assert_close(dw[e].double(), xe.T @ dye, **tol)
    assert torch.equal(dw[1], torch.zeros_like(dw[1]))


def test_grouped_mm_takes_weights_in_the_rows_dtype():
    """Casting is the caller's (the experts' working copies, moe/experts.py): fp32 weights with bf16 rows
    are refused by name rather than cast on every call."""
    offsets = torch.tensor([3, 3, 11, 16], dtype=torch.int32, device=DEVICE)
    x = torch.randn(16, 16, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="w must have x's dtype, got x torch.bfloat16 and w torch.float32"):
        ops.grouped_mm(x, torch.randn(4, 16, 32, device=DEVICE), offsets)


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_compiled_layer_matches_eager(kernels):
    """The MoE layer under torch.compile(fullgraph=True): no graph break, same results."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    layer = MoE(MoEArgs(num_experts=8, top_k=2, inter_dim=32, kernels=kernels, router=RouterOptions(init_std=0.5)), 64).to(DEVICE)
    layer.init_weights(out_std=0.05)
    layer.experts.to(dtype)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    for seed in range(2):  # a second routing: a fresh layout, no recompile needed
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(2, 24, 64, generator=g).to(DEVICE)
        results = []
        for fn in (layer, compiled):
            xi = x.clone().requires_grad_()
            out = fn(xi)
            out.backward(torch.ones_like(out))
            results.append([out, xi.grad, layer.router.gate.weight.grad, layer.experts.w13.grad, layer.experts.w2.grad])
            results[-1] = [t.detach().clone() for t in results[-1]]
            layer.zero_grad()
        for name, a, b in zip(["out", "dx", "dgate", "dw13", "dw2"], *results):
            # fp32: summation order only. bf16 results: one rounding step of the largest value, the
            # most that a GEMM choosing another reduction order can move them (a wrong gradient
            # such as the old compiled all-to-all's is off by the whole value).
            rtol = 1e-5 if a.dtype == torch.float32 else 2.0 ** -7
            assert (a - b).abs().max() <= rtol * a.abs().max(), f"{name}: compiled differs from eager"
