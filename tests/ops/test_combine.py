"""gather_rows and combine, forward and backward, both backends, against float64.

Rows that hold no slot (pad and tail rows) are NaN in every input that has them
(y, and the gradient of xs), as torch._grouped_mm can leave them: no NaN may come out.
The outputs in expert-major order (xs, and the gradient of y) are compared up to num_rows:
the rows past it are undefined with the Triton kernels (nothing reads them).
"""

import pytest
import torch
from ops_helpers import assert_sum, assert_ulp, elementwise_ulps, random_routing

from torchtitan_moe import ops

BACKENDS = ["triton", "torch"]
F64 = torch.float64

# (T, K, E, align, experts_used, empty): D = 72 throughout, no block multiple
CASES = {
    "plain": (37, 4, 8, 1, None, 0.0),
    "aligned": (37, 4, 8, 16, None, 0.0),
    "zero_token_experts": (40, 2, 12, 8, 3, 0.0),
    "one_expert_k1": (30, 1, 5, 32, 1, 0.0),
    "empty_slots": (45, 4, 10, 16, None, 0.3),
}
D = 72


def make_index(case: str, device: str):
    T, K, E, align, used, empty = CASES[case]
    experts = random_routing(T, K, E, seed=case_seed(case), experts_used=used, empty=empty)
    return ops.routing_index(experts.to(device), E, align, backend="torch")


def case_seed(case: str) -> int:
    """A seed of its own for each case; tensor i of the case draws from case_seed + i."""
    return 100 * list(CASES).index(case)


def randn(*shape, dtype, device, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype).to(device)


def poison_rows_without_slot(t: torch.Tensor, index) -> torch.Tensor:
    return t.masked_fill((index.row_slot < 0)[:, None], float("nan"))


def gather_exact(x: torch.Tensor, index, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [N, D]: row r = w[s] * x[s // K] for s = row_slot[r] >= 0, else 0."""
    x, w = x.detach().cpu().double(), None if weights is None else weights.detach().flatten().tolist()
    out = torch.zeros(index.row_slot.shape[0], x.shape[1], dtype=F64)
    for r, s in enumerate(index.row_slot.tolist()):
        if s >= 0:
            out[r] = x[s // index.top_k] * (1.0 if w is None else w[s])
    return out


def combine_exact(y: torch.Tensor, index, weights: torch.Tensor | None = None):
    """float64 (out [T, D], sum of |terms| [T, D]): out[t] = sum_k w[t, k] * y[inv[t, k]]."""
    y, w = y.detach().cpu().double(), None if weights is None else weights.detach().tolist()
    out, abs_terms = torch.zeros(2, index.inv.shape[0], y.shape[1], dtype=F64)
    for t, rows in enumerate(index.inv.tolist()):
        for k, r in enumerate(rows):
            if r >= 0:
                term = y[r] * (1.0 if w is None else w[t][k])
                out[t] += term
                abs_terms[t] += term.abs()
    return out, abs_terms


def dprobs_exact(dout: torch.Tensor, y: torch.Tensor, index):
    """float64 (dprobs [T, K], sum of |terms| [T, K]): dprobs[t, k] = <dout[t], y[inv[t, k]]>."""
    dout, y = dout.cpu().double(), y.detach().cpu().double()
    dprobs, abs_terms = torch.zeros(2, *index.inv.shape, dtype=F64)
    for t, rows in enumerate(index.inv.tolist()):
        for k, r in enumerate(rows):
            if r >= 0:
                dprobs[t, k] = (dout[t] * y[r]).sum()
                abs_terms[t, k] = (dout[t] * y[r]).abs().sum()
    return dprobs, abs_terms


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_gather_rows(case, dtype, backend, device, poison_empty):
    index, seed = make_index(case, device), case_seed(case)
    T, N = index.inv.shape[0], index.row_slot.shape[0]
    x = randn(T, D, dtype=dtype, device=device, seed=seed + 1).requires_grad_()
    xs = ops.gather_rows(x, index, backend=backend)
    n = int(index.num_rows)
    assert xs.dtype == dtype and torch.equal(xs[:n].cpu().double(), gather_exact(x, index)[:n])  # a copy: exact

    dxs = poison_rows_without_slot(randn(N, D, dtype=dtype, device=device, seed=seed + 2), index)
    (dx,) = torch.autograd.grad(xs, x, dxs)
    assert_sum("dx", dx.cpu(), *combine_exact(dxs, index))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_combine(case, dtype, weighted, backend, device, poison_empty):
    index, seed = make_index(case, device), case_seed(case)
    (T, K), N = index.inv.shape, index.row_slot.shape[0]
    y = poison_rows_without_slot(randn(N, D, dtype=dtype, device=device, seed=seed + 3), index).requires_grad_()
    probs = torch.rand(T, K, generator=torch.Generator().manual_seed(seed + 4)).to(device).requires_grad_()
    probs = probs if weighted else None
    out = ops.combine(y, index, probs, backend=backend)
    exact, abs_terms = combine_exact(y, index, probs)
    assert out.dtype == dtype
    if K == 1:  # one term per token: a product, rounded once
        assert_ulp("out", out.cpu(), exact, elementwise_ulps(dtype))
    else:
        assert_sum("out", out.cpu(), exact, abs_terms)

    dout = randn(T, D, dtype=dtype, device=device, seed=seed + 5)
    grads = torch.autograd.grad(out, (y, probs) if weighted else (y,), dout)
    n = int(index.num_rows)
    assert_ulp("dy", grads[0][:n].cpu(), gather_exact(dout, index, probs)[:n], elementwise_ulps(dtype))
    if weighted:
        assert grads[1].dtype == torch.float32
        assert_sum("dprobs", grads[1].cpu(), *dprobs_exact(dout, y, index))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["empty_slots", "zero_token_experts"])
def test_combine_tokens_is_combine_of_those_tokens(case, backend, device, poison_empty):
    # The all-gather dispatcher sums another rank's tokens first: the same bits as the whole combine's rows.
    index, seed = make_index(case, device), case_seed(case)
    T, N = index.inv.shape[0], index.row_slot.shape[0]
    y = poison_rows_without_slot(randn(N, D, dtype=torch.bfloat16, device=device, seed=seed + 3), index)
    whole = ops.combine(y, index, backend=backend)
    for start, end in ((0, T // 3), (T // 3, T)):
        part = ops.combine_tokens(y, index, start, end, backend=backend)
        assert part.shape == (end - start, D) and torch.equal(part, whole[start:end]), (start, end)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck(backend, device):
    """float64 end to end (the Triton kernels compute in fp64 for fp64 data): the backward
    of each op is the true adjoint of its forward, pad rows and -1 slots included. On the rows
    up to num_rows: past them the expert-major outputs are undefined."""
    experts = random_routing(6, 2, 3, seed=9)
    experts[1, 0] = -1
    index = ops.routing_index(experts.to(device), 3, 8, backend="torch")
    index = index._replace(row_slot=index.row_slot[: int(index.num_rows)])  # the groups' rows, pads included
    x = randn(6, 5, dtype=F64, device=device, seed=10).requires_grad_()
    y = randn(index.row_slot.shape[0], 5, dtype=F64, device=device, seed=11).requires_grad_()
    probs = torch.rand(6, 2, dtype=F64, device=device).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: ops.gather_rows(x, index, backend=backend), (x,))
    assert torch.autograd.gradcheck(lambda y: ops.combine(y, index, backend=backend), (y,))
    assert torch.autograd.gradcheck(lambda y, p: ops.combine(y, index, p, backend=backend), (y, probs))


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_index_and_trimmed_rows(backend, device):
    """A dispatcher may pass its own index: int32 fields, and row_slot cut to the rows that exist."""
    index = make_index("plain", device)
    small = index._replace(inv=index.inv.int(), row_slot=index.row_slot[: int(index.num_rows)].int())
    x = randn(37, D, dtype=torch.bfloat16, device=device, seed=12)
    assert torch.equal(ops.gather_rows(x, small, backend=backend), ops.gather_rows(x, index, backend=backend))
    y = randn(int(index.num_rows), D, dtype=torch.bfloat16, device=device, seed=13)
    assert torch.equal(ops.combine(y, small, backend=backend), ops.combine(y, index, backend=backend))


def test_reference_backward_gathers_without_repeated_indices():
    """The torch references' backward is a gather, never an accumulating index_put: autograd
    sorts and serializes repeated indices there, and a gather by row_slot (or by inv) repeats
    the one index that pad, tail and -1 slots fall back to. At EP = 2 that was 0.9 s a step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Accumulating(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.__name__
            put_adds = name.startswith(("index_put", "_index_put_impl")) and (kwargs.get("accumulate") or args[3:4] == (True,))
            if put_adds or name.startswith(("index_add", "scatter_add")):
                self.calls.append(name)
            return func(*args, **kwargs)

    index = make_index("empty_slots", "cpu")
    x = randn(45, D, dtype=torch.bfloat16, device="cpu", seed=19).requires_grad_()
    y = randn(index.row_slot.shape[0], D, dtype=torch.bfloat16, device="cpu", seed=20).requires_grad_()
    probs = torch.rand(45, 4).requires_grad_()
    losses = (ops.gather_rows_reference(x, index).float().sum(), ops.combine_reference(y, index, probs).float().sum())
    with Accumulating() as mode:
        torch.autograd.backward(losses)
    assert mode.calls == []


def test_bad_arguments(device):
    index = make_index("plain", device)
    x = torch.zeros(37, D, device=device)
    with pytest.raises(ValueError, match="x must be a 2-D float"):
        ops.gather_rows(x.long(), index)
    with pytest.raises(ValueError, match="index.inv has 37 tokens"):
        ops.gather_rows(x[:5], index)
    with pytest.raises(ValueError, match="index.row_slot has"):
        ops.combine(x, index)
    y = torch.zeros(index.row_slot.shape[0], D, device=device)
    with pytest.raises(ValueError, match="probs must be float32"):
        ops.combine(y, index, torch.ones(37, 3, device=device))
    with pytest.raises(ValueError, match="backend"):
        ops.combine(y, index, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("weighted", [False, True])
def test_gpu_real_size(weighted):
    """Qwen3-30B-A3B shapes: triton runs are bitwise identical, and triton and torch are
    both within the bounds of the float64 result."""
    T, K, E, D_ = 16384, 8, 128, 2048
    index = ops.routing_index(random_routing(T, K, E, seed=14).cuda(), E, 16, backend="triton")
    N = index.row_slot.shape[0]
    x = randn(T, D_, dtype=torch.bfloat16, device="cuda", seed=15).requires_grad_()
    y = poison_rows_without_slot(randn(N, D_, dtype=torch.bfloat16, device="cuda", seed=16), index).requires_grad_()
    probs = torch.rand(T, K, device="cuda").requires_grad_() if weighted else None
    dxs = poison_rows_without_slot(randn(N, D_, dtype=torch.bfloat16, device="cuda", seed=17), index)
    dout = randn(T, D_, dtype=torch.bfloat16, device="cuda", seed=18)
    inputs = (y, probs) if weighted else (y,)

    n = int(index.num_rows)  # rows past it (xs, dy) are left undefined by the Triton kernels

    def run(backend):
        xs = ops.gather_rows(x, index, backend=backend)
        out = ops.combine(y, index, probs, backend=backend)
        dy, *dprobs = torch.autograd.grad(out, inputs, dout)
        return (xs[:n], *torch.autograd.grad(xs, x, dxs), out, dy[:n], *dprobs)

    first, again, torch_ = run("triton"), run("triton"), run("torch")
    assert all(torch.equal(a, b) for a, b in zip(first, again)), "two triton runs differ"

    # float64 results and sum(|terms|) from the reference on float64 (checked against the oracles above)
    x64, y64, dxs64, dout64 = (t.detach().double() for t in (x, y, dxs, dout))
    p64 = None if probs is None else probs.detach().double().requires_grad_()
    y64.requires_grad_()
    out64 = ops.combine_reference(y64, index, p64)
    grads64 = torch.autograd.grad(out64, (y64, p64) if weighted else (y64,), dout64)
    abs_p = None if probs is None else p64.detach().abs().requires_grad_()
    abs_y = y64.detach().abs().requires_grad_()
    abs_out = ops.combine_reference(abs_y, index, abs_p)
    if weighted:  # once: the graph of abs_out is freed by the first grad
        (abs_dprobs,) = torch.autograd.grad(abs_out, abs_p, dout64.abs())
    for got in (first, torch_):
        xs, dx, out, dy = got[:4]
        assert torch.equal(xs.double(), ops.gather_rows_reference(x64, index)[:n])
        assert_sum("dx", dx, ops.combine_reference(dxs64, index), ops.combine_reference(dxs64.abs(), index))
        assert_sum("out", out, out64, abs_out)
        assert_ulp("dy", dy, grads64[0][:n])
        if weighted:
            assert_sum("dprobs", got[4], grads64[1], abs_dprobs)


@pytest.mark.parametrize("case", ["aligned", "empty_slots"])
def test_triton_gather_zeroes_pad_rows_and_leaves_the_tail(case, device):
    """The zeroing kernel alone, on an output poisoned with NaN: pad rows (no slot, below num_rows)
    become zeros; owned rows (the gather's) and rows past num_rows are not written."""
    from torchtitan_moe.ops.combine_triton import _zero_pad_rows_kernel

    index = make_index(case, device)
    N, n = index.row_slot.shape[0], int(index.num_rows)
    assert 0 < n < N and bool((index.row_slot[:n] < 0).any())  # the case has pad rows and a tail
    out = torch.full((N, D), float("nan"), device=device)
    _zero_pad_rows_kernel[(N + 7) // 8,](index.row_slot, index.num_rows, out, N, D, BLOCK_R=8, BLOCK_D=32)
    rows = torch.arange(N, device=device)
    pad = (index.row_slot < 0) & (rows < n)
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))
    assert out[~pad].isnan().all()  # owned rows and the tail: untouched
