"""ops.causal_attention: causal SDPA with grouped KV heads against F.scaled_dot_product_attention in float64 (CPU)
and bf16 (GPU: cuDNN, the kernels torchtitan's SDPA wrapper picks), its layout, the op registration and compile,
and the keeper: a recompute that takes the first forward's outputs runs no attention forward."""

import pytest
import torch
import torch.nn.functional as F

from torchtitan_moe.ops import attention as attention_module
from torchtitan_moe.ops.attention import causal_attention, causal_attention_reference, register_keeper

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def qkv(device, dtype, batch=2, heads=8, groups=2, seq=24, dim=16, seed=0):
    """q, k, v as torchtitan's attention makes them: [B, S, H, D] projections transposed to [B, H, S, D]."""
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(batch, seq, h, dim, generator=g).to(device, dtype).transpose(1, 2).requires_grad_()
    return make(heads), make(groups), make(groups)


@pytest.mark.parametrize("device", DEVICES)
def test_the_output_and_gradients_are_the_reference_s(device):
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    q, k, v = qkv(device, dtype)
    scale = 0.3
    out = causal_attention(q, k, v, scale)
    assert out.shape == q.shape and out.stride() == torch.empty_like(q).stride()  # [B, S, H, D] in memory
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    if device == "cpu":  # against the float64 reference: the same math, summed in another order
        ref = causal_attention_reference(q, k, v, scale)
        ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION], set_priority=True):  # what torchtitan's wrapper picks
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    assert torch.equal(out, ref)  # cuDNN's forward: the same bits
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    # cuDNN's backward of both, against float64: within a few bf16 ulps of the largest gradient
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    exact = torch.autograd.grad(causal_attention_reference(q64, k64, v64, scale), (q64, k64, v64), dout.double())
    for a, b, e in zip(grads, ref_grads, exact):
        bound = 4 * 2**-8 * e.abs().max().item()
        assert (a.double() - e).abs().max().item() <= bound
        assert (a.double() - e).abs().max().item() <= 2 * (b.double() - e).abs().max().item() + 2**-8 * bound


def test_bad_shapes_and_dtypes_are_named():
    q, k, v = qkv("cpu", torch.float32)
    with pytest.raises(ValueError, match=r"q \[B, H, S, Dh\], k and v \[B, Hkv, S, Dh\], got \(2, 8, 24, 16\), "
                                         r"\(2, 2, 23, 16\)"):
        causal_attention(q, k[:, :, 1:], v[:, :, 1:], 0.25)
    with pytest.raises(ValueError, match=r"query heads \(8\) must be a multiple of the KV heads \(3\)"):
        causal_attention(q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1), 0.25)
    with pytest.raises(ValueError, match="of one dtype, got torch.float32, torch.bfloat16 and torch.float32"):
        causal_attention(q, k.bfloat16(), v, 0.25)


def test_the_op_registration_passes_opcheck():
    q, k, v = qkv("cpu", torch.float32)
    torch.library.opcheck(torch.ops.torchtitan_moe.causal_attention.default, (q, k, v, 0.25, -1))


def test_compiled_as_one_opaque_node_it_gives_the_eager_bits():
    q, k, v = qkv("cpu", torch.float32)

    def f(q, k, v):
        return causal_attention(q * 1.5, k, v, 0.25).transpose(1, 2).contiguous() * 2  # exact: the op's bits

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    dout = torch.randn_like(eager)
    for a, b in zip(torch.autograd.grad(compiled, (q, k, v), dout), torch.autograd.grad(eager, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class Keeper:
    """Holds what each forward keeps; hands it back on take while `replaying`."""

    def __init__(self):
        self.kept, self.replaying = [], False

    def keep(self, out, lse):
        self.kept.append((out.clone(), lse.clone()))

    def take(self, q):
        return self.kept.pop() if self.replaying else None


def test_a_recompute_takes_what_the_keeper_kept_and_runs_no_attention(monkeypatch):
    keeper = Keeper()
    index = register_keeper(keeper)
    q, k, v = qkv("cpu", torch.float64)
    first = causal_attention(q, k, v, 0.25, index)
    assert len(keeper.kept) == 1
    out, lse = keeper.kept[0]
    assert torch.equal(out, first)
    # lse: each query's log-sum-exp of its scaled scores over the keys up to it
    scores = (q @ k.repeat_interleave(4, 1).transpose(-1, -2) * 0.25).masked_fill(
        torch.ones(24, 24, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=1e-12, atol=1e-12)
    keeper.replaying = True
    monkeypatch.setattr(attention_module, "_compute", lambda *a: pytest.fail("attention computed in the recompute"))
    again = causal_attention(q, k, v, 0.25, index)
    assert torch.equal(again, first) and not keeper.kept
    # the backward of what was taken: the reference's gradients
    dout = torch.randn_like(again)
    ref_grads = torch.autograd.grad(causal_attention_reference(q, k, v, 0.25), (q, k, v), dout)
    for a, b in zip(torch.autograd.grad(again, (q, k, v), dout), ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
