"""swiglu_prob, forward and backward, both backends, against float64.

Rows >= num_rows are NaN in ab, probs and dh, as torch._grouped_mm can leave them: no NaN may
come out of the rows below num_rows, and dprobs must be 0 past it; h and dab past num_rows are
undefined with the Triton kernel (nothing reads them) and zeros with the torch reference.
"""

import pytest
import torch
from ops_helpers import assert_sum, assert_ulp, elementwise_ulps

from torchtitan_moe import ops

BACKENDS = ["triton", "torch"]
F64 = torch.float64


def inputs(N: int, I: int, num_rows: int, dtype, device, seed: int):
    """ab [N, 2I] (spread over silu's curved range), probs [N] fp32, dh [N, I]; NaN past num_rows."""
    g = torch.Generator().manual_seed(seed)
    ab = 3 * torch.randn(N, 2 * I, generator=g, dtype=F64)
    probs = torch.rand(N, generator=g, dtype=F64)
    dh = torch.randn(N, I, generator=g, dtype=F64)
    ab[num_rows:], probs[num_rows:], dh[num_rows:] = float("nan"), float("nan"), float("nan")
    return ab.to(dtype).to(device), probs.float().to(device), dh.to(dtype).to(device)


def exact(ab, probs, dh, num_rows: int):
    """float64 h, dab, dprobs and sum |terms| of dprobs, from the formulas; 0 past num_rows.

    Also `slack` for dab's a half: silu'(a) = sig + a * sig * (1 - sig) cancels near
    a = -1.28, so an fp32 kernel is only accurate to rounding of those terms there.
    """
    live = torch.arange(ab.shape[0]) < num_rows
    ab, p, dh = (t.detach().cpu().double()[live] for t in (ab, probs, dh))
    I = ab.shape[1] // 2
    a, b, p = ab[:, :I], ab[:, I:], p[:, None]
    sig = torch.sigmoid(a)
    silu = a * sig
    h = silu * b * p
    dab = torch.cat([dh * p * b * (sig + a * sig * (1 - sig)), dh * p * silu], 1)
    slack = torch.cat([(dh * p * b).abs() * (sig + (a * sig * (1 - sig)).abs()) * 2**-20, torch.zeros_like(h)], 1)
    terms = dh * silu * b

    def pad(t):  # rows past num_rows: exact zeros
        return torch.cat([t, t.new_zeros(live.numel() - t.shape[0], *t.shape[1:])])

    return pad(h), pad(dab), pad(terms.sum(1)), pad(terms.abs().sum(1)), pad(slack)


def run(ab, probs, dh, num_rows, backend):
    ab, probs = ab.clone().requires_grad_(), probs.clone().requires_grad_()
    h = ops.swiglu_prob(ab, probs, num_rows, backend=backend)
    return (h, *torch.autograd.grad(h, (ab, probs), dh))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_rows", [None, 0, 97, 150])
def test_swiglu_prob(num_rows, dtype, backend, device, poison_empty):
    N, I = 150, 40  # I is no block multiple
    ab, probs, dh = inputs(N, I, N if num_rows is None else num_rows, dtype, device, seed=N + (num_rows or 0))
    nr = None if num_rows is None else torch.tensor(num_rows, device=device)
    h, dab, dprobs = run(ab, probs, dh, nr, backend)
    n = N if num_rows is None else num_rows
    h64, dab64, dprobs64, abs_terms, slack = exact(ab, probs, dh, n)
    assert h.dtype == dab.dtype == dtype and dprobs.dtype == torch.float32
    assert_ulp("h", h[:n].cpu(), h64[:n], elementwise_ulps(dtype))
    assert_ulp("dab", dab[:n].cpu(), dab64[:n], elementwise_ulps(dtype), slack[:n])
    assert_sum("dprobs", dprobs.cpu(), dprobs64, abs_terms)
    if backend == "torch":  # the reference writes its tail: zeros
        assert not h[n:].any() and not dab[n:].any()
    else:  # the kernels leave it (poisoned with NaN here): no bandwidth spent on rows nothing reads
        assert h[n:].isnan().all() and dab[n:].isnan().all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck(backend, device):
    """float64 end to end (the Triton kernels compute in fp64 for fp64 data), with tail rows."""
    g = torch.Generator().manual_seed(0)
    ab = torch.randn(10, 6, generator=g, dtype=F64).to(device).requires_grad_()
    probs = torch.rand(10, generator=g, dtype=F64).to(device).requires_grad_()
    assert torch.autograd.gradcheck(lambda ab, p: ops.swiglu_prob(ab, p, backend=backend), (ab, probs))
    # With num_rows = 7 only the first 7 rows are defined, forward and backward: the rest is a constant tail.
    tail = ab[7:].detach()
    seven = torch.tensor(7, device=device)
    assert torch.autograd.gradcheck(
        lambda live, p: ops.swiglu_prob(torch.cat([live, tail]), p, seven, backend=backend)[:7], (ab[:7].detach().requires_grad_(), probs))


def test_bad_arguments(device):
    ab, probs = torch.zeros(8, 6, device=device), torch.zeros(8, device=device)
    with pytest.raises(ValueError, match=r"ab must be a float tensor \[N, 2I\]"):
        ops.swiglu_prob(ab[:, :5], probs)
    with pytest.raises(ValueError, match="probs must be float32"):
        ops.swiglu_prob(ab, probs[:7])
    with pytest.raises(ValueError, match="probs must be float32"):
        ops.swiglu_prob(ab, probs.bfloat16())
    with pytest.raises(ValueError, match="num_rows must be a 0-dim"):
        ops.swiglu_prob(ab, probs, 5)
    with pytest.raises(ValueError, match="backend"):
        ops.swiglu_prob(ab, probs, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [16384, 65536])
def test_gpu_real_size(tokens):
    """Qwen3-30B-A3B: N = tokens * 8 rows (+ padding), I = 768. triton runs are bitwise
    identical, and triton and torch are both within the bounds of the float64 result."""
    N, I = tokens * 8 + 128 * 16, 768
    num_rows = N - 1000
    ab, probs, dh = inputs(N, I, num_rows, torch.bfloat16, "cuda", seed=tokens)
    nr = torch.tensor(num_rows, device="cuda")
    first, again = run(ab, probs, dh, nr, "triton"), run(ab, probs, dh, nr, "triton")
    for a, b in zip(first, again):  # h's and dab's rows past num_rows are undefined; dprobs' are 0
        assert torch.equal(a[:num_rows], b[:num_rows]) and torch.equal(first[2], again[2]), "two triton runs differ"
    if tokens > 16384:
        return  # the float64 check needs ~5x the inputs' memory: the smaller size is enough
    h64, dab64, dprobs64, abs_terms, slack = exact(ab, probs, dh, num_rows)
    for h, dab, dprobs in (first, run(ab, probs, dh, nr, "torch")):
        assert_ulp("h", h[:num_rows].cpu(), h64[:num_rows])
        assert_ulp("dab", dab[:num_rows].cpu(), dab64[:num_rows], 1, slack[:num_rows])
        assert_sum("dprobs", dprobs.cpu(), dprobs64, abs_terms)
