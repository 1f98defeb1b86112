"""linear_cross_entropy, both backends, against float64 from the same rounded logits.

The kernel (cross_entropy_rows_) is checked on its own: per-row loss within fp32 reduction
error, the gradient written over the logits within one rounding of their dtype. The op is
checked whole: loss, dh and dweight (the gradient GEMMs, the backward's scaling, ignored rows),
in one chunk of rows and in several (dweight summed over the chunks in fp32, rounded once).
"""

import pytest
import torch
from ops_helpers import REDUCTION_EPS, assert_sum, assert_ulp, elementwise_ulps
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_moe import ops
from torchtitan_moe.ops.cross_entropy import IGNORE_INDEX

F64 = torch.float64
BACKENDS = ["triton", "torch"]


class DispatchLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def inputs(N: int, D: int, V: int, dtype, device, seed: int, ignored: float = 0.2):
    """h [N, D], weight [V, D] (logits of a few units: a peaked softmax), labels [N] with a
    fraction `ignored` set to IGNORE_INDEX, and labels 0 and V - 1 (the first and last block)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=F64)
    w = torch.randn(V, D, generator=g, dtype=F64) * 3 / D**0.5
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.rand(N, generator=g) < ignored] = IGNORE_INDEX
    labels[: min(N, 2)] = torch.tensor([0, V - 1])[: min(N, 2)]
    return h.to(dtype).to(device), w.to(dtype).to(device), labels.to(device)


def exact_rows(logits: torch.Tensor, labels: torch.Tensor):
    """float64 loss per row, |terms| bound, dloss/dlogits, and that gradient's slack, from the
    given (rounded) logits. The slack: an fp32 kernel's logsumexp is off by a few ulps of
    |lse|, and so is every exp(x - lse): a relative error of (|x| + |lse|) 2^-20 at most."""
    x = logits.detach().cpu().double()
    labels = labels.cpu()
    counted = labels != IGNORE_INDEX
    safe = torch.where(counted, labels, 0)
    lse = torch.logsumexp(x, 1)
    x_label = x.gather(1, safe[:, None])[:, 0]
    loss = torch.where(counted, lse - x_label, 0.0)
    terms = torch.where(counted, lse.abs() + x_label.abs() + x.abs().max(1).values, 0.0)
    softmax = torch.softmax(x, 1)
    grad = torch.where(counted[:, None], softmax - torch.nn.functional.one_hot(safe, x.shape[1]).double(), 0.0)
    slack = torch.where(counted[:, None], softmax * (x.abs() + lse.abs()[:, None]) * 2**-20, 0.0)
    return loss, terms, grad, slack


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("N, V", [(1, 7), (19, 256), (33, 1000)])  # one block, an exact block, a partial last block
def test_kernel_rows(N, V, dtype, device, poison_empty):
    from torchtitan_moe.ops.cross_entropy_triton import cross_entropy_rows_

    g = torch.Generator().manual_seed(N + V)
    logits = (4 * torch.randn(N, V, generator=g, dtype=F64)).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[N // 2] = IGNORE_INDEX
    loss, terms, grad, slack = exact_rows(logits, labels)
    buf = logits.to(device).contiguous()
    got = cross_entropy_rows_(buf, labels.to(device), IGNORE_INDEX)
    assert got.dtype == torch.float32
    assert_sum("loss rows", got.cpu(), loss, terms)
    assert_ulp("dloss/dlogits", buf.cpu(), grad, ulps=elementwise_ulps(dtype), slack=slack)
    assert (buf[N // 2] == 0).all() and got[N // 2] == 0  # the ignored row


def test_kernel_is_stable_for_large_logits(device):
    from torchtitan_moe.ops.cross_entropy_triton import cross_entropy_rows_

    logits = torch.tensor([[1e4, 0.0, -1e4] + [0.0] * 300, [-1e4] * 303], device=device)
    got = cross_entropy_rows_(logits, torch.tensor([1, 0], device=device), IGNORE_INDEX)
    assert torch.allclose(got.cpu(), torch.tensor([1e4, 0.0]) + torch.tensor([0.0, torch.log(torch.tensor(303.0))]))


def run(h, w, labels, backend, dloss=0.75, chunk_rows=None):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = ops.linear_cross_entropy(h, w, labels, backend=backend, chunk_rows=chunk_rows)
    return (loss, *torch.autograd.grad(loss, (h, w), torch.tensor(dloss, device=loss.device)))


@pytest.mark.parametrize("backend, chunk_rows", [("triton", None), ("triton", 7), ("torch", None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N, ignored", [(0, 0.0), (40, 0.0), (40, 0.3), (40, 1.0)])
def test_linear_cross_entropy(N, ignored, dtype, backend, chunk_rows, device, poison_empty):
    D, V, dloss = 24, 700, 0.75
    h, w, labels = inputs(N, D, V, dtype, device, seed=N, ignored=ignored)
    loss, dh, dw = run(h, w, labels, backend, dloss, chunk_rows)
    assert loss.dtype == torch.float32 and dh.dtype == dw.dtype == dtype
    rows, terms, grad, _ = exact_rows(h @ w.t(), labels)  # the op's own logits, rounded to dtype
    assert_sum("loss", loss.cpu().view(1), rows.sum().view(1), terms.sum().view(1))
    h64, w64 = h.cpu().double(), w.cpu().double()
    # dh = dloss G @ w, dweight = dloss G.T @ h. Bound: G's rounding (half an ulp of each term)
    # and the output's, then the scaling's: 2^-5 of sum |terms| for 16-bit types.
    eps = 2**-5 if dtype != torch.float32 else REDUCTION_EPS[torch.float32]
    assert_sum("dh", dh.cpu(), dloss * grad @ w64, dloss * grad.abs() @ w64.abs() * eps / REDUCTION_EPS[dtype])
    assert_sum("dweight", dw.cpu(), dloss * grad.t() @ h64, dloss * grad.abs().t() @ h64.abs() * eps / REDUCTION_EPS[dtype])
    if N:
        ignored_rows = (labels == IGNORE_INDEX).cpu()
        assert (dh.cpu()[ignored_rows] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunks_sum_the_weight_gradient_in_fp32(dtype, device):
    # Against float64 from the same G the op makes chunk by chunk: dh one rounding of each row's G @ w,
    # dweight one rounding of the sum over all 13 chunks (a 16-bit sum of the chunks' products is off by several).
    N, D, V, chunk = 64, 24, 700, 5
    h, w, labels = inputs(N, D, V, dtype, device, seed=7, ignored=0.1)
    _, dh, dw = run(h, w, labels, "triton", dloss=1.0, chunk_rows=chunk)
    grad = torch.cat([_gradient_rows(h[i:i + chunk] @ w.t(), labels[i:i + chunk]) for i in range(0, N, chunk)])
    h64, w64, g64 = h.cpu().double(), w.cpu().double(), grad.cpu().double()
    fp32_sum = REDUCTION_EPS[torch.float32]
    assert_ulp("dh", dh.cpu(), g64 @ w64, slack=g64.abs() @ w64.abs() * fp32_sum)
    assert_ulp("dweight", dw.cpu(), g64.t() @ h64, slack=g64.abs().t() @ h64.abs() * fp32_sum)


def _gradient_rows(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from torchtitan_moe.ops.cross_entropy_triton import cross_entropy_rows_

    cross_entropy_rows_(logits, labels, IGNORE_INDEX)  # overwrites the logits with G
    return logits


def test_logits_are_made_a_chunk_at_a_time(device, monkeypatch):
    # The default chunk: as many rows as LOGITS_CHUNK_BYTES of logits hold, never the whole [N, V].
    from torchtitan_moe.ops import cross_entropy, cross_entropy_triton

    seen = []
    kernel = cross_entropy_triton.cross_entropy_rows_
    monkeypatch.setattr(cross_entropy_triton, "cross_entropy_rows_",
                        lambda logits, *args: seen.append(tuple(logits.shape)) or kernel(logits, *args))
    monkeypatch.setattr(cross_entropy, "LOGITS_CHUNK_BYTES", 8 * 700 * 2)  # 8 rows of bf16
    h, w, labels = inputs(30, 24, 700, torch.bfloat16, device, seed=8)
    run(h, w, labels, "triton")
    assert seen == [(8, 700)] * 3 + [(6, 700)]  # 4 chunks: as even as 30 rows split
    seen.clear()
    run(*inputs(25, 24, 700, torch.bfloat16, device, seed=8), "triton")
    assert seen == [(7, 700)] * 3 + [(4, 700)]  # 4 chunks of at most 8 rows, not 8 + 8 + 8 + 1
    seen.clear()
    run(*inputs(8, 24, 700, torch.bfloat16, device, seed=8), "triton")
    assert seen == [(8, 700)]


def test_chunk_rows_must_be_positive():
    h, w, labels = inputs(4, 8, 50, torch.float32, "cpu", seed=3)
    with pytest.raises(ValueError, match="chunk_rows must be >= 1, got 0"):
        ops.linear_cross_entropy(h, w, labels, chunk_rows=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_scales_by_the_unrounded_dloss(dtype, device):
    # The op's gradients at dloss = 1, scaled by an fp32 dloss that no 16-bit type holds and rounded once
    # (torch's bf16 tensor times a 0-dim fp32 CUDA tensor rounds the scalar to bf16 first; on the CPU it does not).
    h, w, labels = inputs(40, 24, 700, dtype, device, seed=5)
    dloss = torch.tensor(1 / 3, dtype=torch.float32)
    _, dh1, dw1 = run(h, w, labels, "triton", dloss=1.0)
    _, dh, dw = run(h, w, labels, "triton", dloss=dloss.item())
    for name, got, unscaled in (("dh", dh, dh1), ("dweight", dw, dw1)):
        want = (unscaled.float() * dloss.to(unscaled.device)).to(dtype)
        assert torch.equal(got, want), f"{name}: not the unscaled gradient times dloss rounded once"


def test_scaled_takes_any_layout(device):
    from torchtitan_moe.ops.cross_entropy_triton import scaled

    x = torch.randn(6, 10, dtype=torch.float64).to(torch.bfloat16).to(device)
    scale = torch.tensor(1 / 3, device=device)
    for view in (x, x.t(), x[:, ::3]):
        assert torch.equal(scaled(view, scale), (view.float() * scale).to(torch.bfloat16))


def test_backward_is_one_multiply(device):
    # The op's two gradient outputs get no gradient: no tensors of zeros made for them ([V, D] each).
    h, w, labels = inputs(16, 24, 700, torch.bfloat16, device, seed=6)
    h, w = h.requires_grad_(), w.requires_grad_()
    loss = ops.linear_cross_entropy(h, w, labels, backend="triton")
    with DispatchLog() as log:
        loss.backward()
    assert [op for op in log.ops if op not in ("aten.detach.default", "aten.ones_like.default")] == [
        "torchtitan_moe.linear_cross_entropy_backward.default"], log.ops


def test_backends_agree_with_torchtitans_loss(device):
    h, w, labels = inputs(64, 32, 900, torch.bfloat16, device, seed=1)
    triton, torch_ = run(h, w, labels, "triton"), run(h, w, labels, "torch")
    assert torch.allclose(triton[0], torch_[0], rtol=1e-5)
    for a, b in zip(triton[1:], torch_[1:]):
        assert (a.float() - b.float()).abs().max() <= 2**-6 * b.float().abs().max()


def test_out_of_range_label_gives_a_nan_loss_not_a_wild_read(device):
    h, w, labels = inputs(8, 16, 300, torch.float32, device, seed=2, ignored=0.0)
    labels[3] = 300
    assert torch.isnan(ops.linear_cross_entropy(h, w, labels, backend="triton"))
    if device == "cpu":
        with pytest.raises(IndexError):
            ops.linear_cross_entropy(h, w, labels, backend="torch")


@pytest.mark.parametrize("bad, message", [
    (lambda h, w, y: (h[0], w, y), "h must be a float tensor"),
    (lambda h, w, y: (h, w.double(), y), "weight must be"),
    (lambda h, w, y: (h, w[:, :3], y), "weight must be"),
    (lambda h, w, y: (h, w, y.int()), "labels must be int64"),
    (lambda h, w, y: (h, w, y[:2]), "labels must be int64 of shape"),
])
def test_bad_arguments_are_named(bad, message):
    h, w, labels = inputs(4, 8, 50, torch.float32, "cpu", seed=3)
    with pytest.raises(ValueError, match=message):
        ops.linear_cross_entropy(*bad(h, w, labels), backend="torch")


def test_triton_refuses_float64(device):
    h, w, labels = inputs(4, 8, 50, torch.float64, device, seed=3)
    with pytest.raises(ValueError, match="backend='torch'"):
        ops.linear_cross_entropy(h, w, labels, backend="triton")


@pytest.mark.gpu
def test_qwen3_vocabulary_on_gpu():
    # 151,936 columns: 19 blocks of 8192, the last partial; 2^31 / 151,936 rows would overflow int32 offsets.
    h, w, labels = inputs(96, 256, 151936, torch.bfloat16, "cuda", seed=4)
    loss, dh, dw = run(h, w, labels, "triton", dloss=1.0)
    rows, terms, grad, _ = exact_rows(h @ w.t(), labels)
    assert_sum("loss", loss.cpu().view(1), rows.sum().view(1), terms.sum().view(1))
    eps = 2**-5 / REDUCTION_EPS[torch.bfloat16]
    assert_sum("dh", dh.cpu(), grad @ w.cpu().double(), grad.abs() @ w.cpu().double().abs() * eps)
