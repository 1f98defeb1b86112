"""gate_logits (the router's fp32 gate from bf16 tokens on the bf16 tensor cores) against float64: the
forward's products all exact, the backward's left-out terms below 2^-16 of the sums of |terms|. On CPU the
fast path runs with its bf16 GEMMs emulated (TRITON_INTERPRET=1); on a GPU on the tensor cores."""

import pytest
import torch

from torchtitan_moe import ops
from torchtitan_moe.ops.gate import split_bf16

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def inputs(T, D, E, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16).to(device).requires_grad_()
    w = (torch.randn(E, D, generator=g) * 0.02).to(device).requires_grad_()  # fp32 weights, not bf16-valued
    dlogits = torch.randn(T, E, generator=g).to(device) * torch.logspace(-3, 0, E).to(device)  # mixed scales
    return x, w, dlogits


def exact(x, w, g):
    x64, w64, g64 = x.detach().double().cpu(), w.detach().double().cpu(), g.double().cpu()
    return x64 @ w64.t(), g64 @ w64, g64.t() @ x64, x64.abs() @ w64.abs().t(), g64.abs() @ w64.abs(), g64.abs().t() @ x64.abs()


def check_against_float64(x, w, g, logits, dx, dw):
    """fp32 sums (within 2^-24 x terms of the sum of |terms|); dx rounded once to bf16 (2^-8 of |dx|) with the
    left-out terms below 2^-16 of the |terms|' sum, so nearly every element is float64's value correctly rounded
    (a term too few would miss half of them)."""
    (T, D), E = x.shape, w.shape[0]
    out64, dx64, dw64, out_abs, dx_abs, dw_abs = exact(x, w, g)
    assert ((logits.detach().double().cpu() - out64).abs() <= 2.0**-24 * D * out_abs).all()
    assert ((dw.double().cpu() - dw64).abs() <= 2.0**-24 * T * dw_abs).all()
    assert ((dx.double().cpu() - dx64).abs() <= 2.0**-8 * dx64.abs() + 2.0**-16 * dx_abs).all()
    assert (dx.cpu() != dx64.to(torch.bfloat16)).float().mean() < 0.02


def test_three_bf16_parts_sum_to_the_fp32_value():
    t = torch.randn(4096) * torch.logspace(-20, 20, 4096)
    parts = split_bf16(t, 3)
    assert all(p.dtype == torch.bfloat16 for p in parts)
    rebuilt = sum(p.double() for p in parts)
    assert ((rebuilt - t.double()).abs() <= 2.0**-24 * t.double().abs()).all()
    two = sum(p.double() for p in split_bf16(t, 2))
    assert ((two - t.double()).abs() <= 2.0**-16 * t.double().abs()).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")  # inf - inf, on purpose
def test_split_blocks_lays_out_split_bf16s_parts(device):
    # The kernel's parts are split_bf16's bit for bit (inf and NaN included), in the blocks each pattern names,
    # for a gradient-like [T, E] (two outputs) and a weight flattened to one row; sizes off the kernel's block.
    from torchtitan_moe.ops.gate_triton import split_blocks

    g = torch.Generator().manual_seed(3)
    t = torch.randn(37, 29, generator=g) * torch.logspace(-20, 20, 37 * 29).view(37, 29)
    t[0, :4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    parts = split_bf16(t, 3)
    for rows in (t, t.reshape(1, -1)):
        a, b = split_blocks(rows.to(device), (0, 0, 1), (2, 1, 0))
        for out, pattern in ((a, (0, 0, 1)), (b, (2, 1, 0))):
            expected = torch.cat([parts[k].reshape(rows.shape) for k in pattern], dim=1)
            torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0, equal_nan=True)
    (only,) = split_blocks(t.to(device), (0, 1, 2))
    torch.testing.assert_close(only.cpu(), torch.cat(parts, dim=1), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gate_logits_against_float64(backend, device):
    x, w, g = inputs(96, 256, 16, device)
    logits = ops.gate_logits(x, w, backend=backend)
    assert logits.dtype == torch.float32 and logits.shape == (96, 16)
    dx, dw = torch.autograd.grad(logits, (x, w), g)
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    check_against_float64(x, w, g, logits, dx, dw)


def test_gate_logits_fast_path_tracks_the_fp32_gemm(device):
    # The fast path is no coarser than an fp32 GEMM: within a few of its own errors of float64.
    x, w, g = inputs(128, 512, 32, device, seed=1)
    out64, _, dw64, *_ = exact(x, w, g)
    fast, ref = ops.gate_logits(x, w, backend="triton"), ops.gate_logits(x, w, backend="torch")
    scale = float(out64.abs().max())
    err = lambda a, b: float((a.detach().double().cpu() - b).abs().max())  # noqa: E731
    assert err(fast, out64) <= 4 * err(ref, out64) + 1e-7 * scale
    dw_fast = torch.autograd.grad(fast, w, g)[0]
    dw_ref = torch.autograd.grad(ref, w, g)[0]
    assert err(dw_fast, dw64) <= 4 * err(dw_ref, dw64) + 1e-7 * float(dw64.abs().max())


def test_gate_logits_opcheck(device):
    x, w, _ = inputs(24, 64, 8, device)
    torch.library.opcheck(torch.ops.torchtitan_moe.gate_logits, (x, w), test_utils=OPCHECK_TESTS)


def test_bad_arguments(device):
    x, w, _ = inputs(8, 32, 4, device)
    with pytest.raises(ValueError, match="x must be bfloat16 and w float32"):
        ops.gate_logits(x.float(), w)
    with pytest.raises(ValueError, match=r"x \[T, D\] and w \[E, D\]"):
        ops.gate_logits(x, w[:, :16])


@pytest.mark.gpu
def test_gpu_router_size():
    # One rank's tokens at local batch 4 of Qwen3-30B-A3B: T = 16,384, D = 2048, E = 128.
    x, w, g = inputs(16384, 2048, 128, "cuda")
    logits = ops.gate_logits(x, w)
    dx, dw = torch.autograd.grad(logits, (x, w), g)
    check_against_float64(x, w, g, logits, dx, dw)


def test_router_takes_the_fast_gate_for_bf16_tokens_compiled_too(device):
    # The router's fp32 gate of bf16 tokens (its inputs stay bf16 under FSDP2, parallelize): the same scores
    # as the fp32 GEMM to fp32 rounding and the same experts, eager and as parallelize compiles `route`.
    from torchtitan_moe.moe.router import Router, RouterOptions

    torch.manual_seed(0)
    router = Router(256, 16, 4, RouterOptions(init_std=0.5)).to(device)
    router.init_weights()
    x = torch.randn(64, 256, device=device).to(torch.bfloat16)
    ref = router.route(x)
    router.kernels = "triton"
    calls = []
    original = ops.gate_logits
    try:
        ops.gate_logits = lambda *a, **k: calls.append(1) or original(*a, **k)
        fast = router.route(x)
    finally:
        ops.gate_logits = original
    assert calls, "the router did not take ops.gate_logits"
    compiled = torch.compile(router.route, backend="aot_eager", fullgraph=True)(x)
    for got in (fast, compiled):
        assert torch.allclose(got.scores, ref.scores, rtol=1e-5, atol=1e-7)
        assert torch.equal(got.experts, ref.experts)
