"""The MoE layer (local dispatcher, experts, combine) against a dense float64 reference."""

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close_to_max

from torchtitan_moe.moe import MoE, MoEArgs, RouterOptions


def make_layer(dim=24, num_experts=8, top_k=2, inter_dim=16, padding="none", align=8, kernels="torch", seed=0, **router):
    torch.manual_seed(seed)
    layer = MoE(MoEArgs(num_experts=num_experts, top_k=top_k, inter_dim=inter_dim, padding=padding, align=align,
                        kernels=kernels, router=RouterOptions(**router)), dim)
    layer.init_weights(out_std=0.05)
    layer.router.gate.weight.data.normal_(std=0.5)  # decisive routing: no near-ties in top-k
    return layer


def dense_reference(layer, x, experts):
    """Per-token float64 MoE output for the same expert choices, differentiable in every input."""
    r = layer.router
    x64 = x.detach().double().requires_grad_()
    gate = r.gate.weight.detach().double().requires_grad_()
    w13 = layer.experts.w13.detach().double().requires_grad_()
    w2 = layer.experts.w2.detach().double().requires_grad_()
    logits = x64.reshape(-1, x.shape[-1]) @ gate.T
    scores = torch.softmax(logits, -1) if r.options.score_func == "softmax" else torch.sigmoid(logits)
    probs = scores.gather(1, experts)
    if r.options.route_norm:
        probs = probs / probs.sum(-1, keepdim=True)
    probs = probs * r.options.route_scale
    tokens, inter = x64.reshape(-1, x.shape[-1]), layer.experts.inter_dim
    out = torch.zeros_like(tokens)
    for k in range(experts.shape[1]):
        e = experts[:, k]
        a = torch.einsum("tid,td->ti", w13[e, :inter], tokens)
        b = torch.einsum("tid,td->ti", w13[e, inter:], tokens)
        out = out + torch.einsum("tdi,ti->td", w2[e], F.silu(a) * b * probs[:, k : k + 1])
    return out.view_as(x64), (x64, gate, w13, w2)


def run(layer, x, grad):
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(grad)
    params = (layer.router.gate.weight, layer.experts.w13, layer.experts.w2)
    return out.detach(), (x.grad, *(p.grad for p in params))


def check_against_reference(layer, x, rel=1e-5, zero_grads=()):
    """Output and gradients within `rel` x their largest value of the float64 reference.
    `zero_grads`: names whose exact gradient is 0 (checked against the other gradients' scale)."""
    grad = torch.randn(x.shape, dtype=x.dtype)
    with torch.no_grad():
        experts = layer.router(x.reshape(-1, x.shape[-1])).experts
    out, grads = run(layer, x, grad)
    ref, leaves = dense_reference(layer, x, experts)
    ref.backward(grad.double())
    assert_close_to_max(out, ref, rel, "out")
    scale = max(float(leaf.grad.abs().max()) for leaf in leaves)
    for name, g, leaf in zip(("x", "gate", "w13", "w2"), grads, leaves):
        if name in zero_grads:
            assert float(leaf.grad.abs().max()) <= 1e-12 and float(g.abs().max()) <= rel * scale, f"grad {name}"
        else:
            assert_close_to_max(g, leaf.grad, rel, f"grad {name}")
    return out, grads


def test_learned_routing_matches_reference():
    layer = make_layer()
    check_against_reference(layer, torch.randn(2, 13, 24))


def test_sigmoid_unnormalized_scaled_matches_reference():
    layer = make_layer(score_func="sigmoid", route_norm=False, route_scale=1.7)
    check_against_reference(layer, torch.randn(3, 7, 24))


def test_zero_token_experts_get_zero_gradients():
    layer = make_layer(num_experts=8, top_k=2)
    layer.router.expert_bias.copy_(torch.tensor([5.0, 5.0, 5.0, 0, 0, 0, 0, 0]))  # only experts 0-2 win
    _, grads = check_against_reference(layer, torch.randn(2, 10, 24))
    assert (grads[2][3:] == 0).all() and (grads[3][3:] == 0).all()


def test_one_expert_takes_every_token():
    layer = make_layer(num_experts=6, top_k=1)
    layer.router.expert_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 9.0]))
    # top-1 with route_norm: every probability is p / p = 1, so the gate gets no gradient.
    check_against_reference(layer, torch.randn(4, 9, 24), zero_grads=("gate",))
    assert layer.tokens_per_expert.tolist() == [0, 0, 0, 0, 0, 36]


@pytest.mark.parametrize("align", [8, 16, 32])
def test_padding_gives_identical_results(align):
    x = torch.randn(2, 11, 24)
    grad = torch.randn(2, 11, 24)
    plain, plain_grads = run(make_layer(padding="none"), x, grad)
    padded_layer = make_layer(padding="always", align=align)
    padded, padded_grads = run(padded_layer, x, grad)
    assert_close_to_max(padded, plain, 1e-6, "out")
    for a, b in zip(padded_grads, plain_grads):
        assert_close_to_max(a, b, 1e-6, "grad")
    # The padded layout really was used: every group a non-empty multiple of `align`.
    tokens = x.reshape(-1, 24)
    batch = padded_layer.dispatcher.start_dispatch(tokens, padded_layer.router(tokens)).wait()
    sizes = torch.diff(batch.offsets.long(), prepend=torch.zeros(1, dtype=torch.long))
    assert batch.x.shape[0] == 22 * 2 + 8 * align
    assert ((sizes % align == 0) & (sizes >= align)).all()


def test_bf16_layer_is_close_to_reference():
    layer = make_layer().to(torch.bfloat16)
    check_against_reference(layer, torch.randn(2, 16, 24, dtype=torch.bfloat16), rel=2e-2)


def test_experts_run_in_the_autocast_dtype(monkeypatch):
    """torchtitan trains one device without FSDP under autocast, with fp32 weights: the expert GEMMs
    (custom ops, which autocast does not reach) must still run in bf16, and the fp32 weights get fp32 grads."""
    from torchtitan_moe import ops

    layer = make_layer()
    seen = []
    grouped_mm = ops.grouped_mm
    monkeypatch.setattr(ops, "grouped_mm", lambda x, w, offsets: seen.append((x.dtype, w.dtype)) or grouped_mm(x, w, offsets))
    x, grad = torch.randn(2, 13, 24), torch.randn(2, 13, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grads = run(layer, x, grad)
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 2
    assert all(g.dtype == torch.float32 for g in grads[1:])
    layer.zero_grad()
    ref, ref_grads = run(layer, x, grad)  # fp32, no autocast
    assert_close_to_max(out, ref, 2e-2, "out")
    for name, g, r in zip(("x", "gate", "w13", "w2"), grads, ref_grads):
        assert_close_to_max(g, r, 3e-2, f"grad {name}")


def test_dispatch_moves_the_tokens_dtype_outside_autocast(monkeypatch):
    # Under FSDP2 the tokens are bf16 while the experts' weights are still sharded fp32 until the
    # experts' own forward: casting to the weights' dtype there would send fp32 rows (twice the
    # bytes; DeepEP refuses them). Modelled here by fp32 weights and bf16 tokens.
    layer = make_layer()
    seen = []
    dispatch = layer.local_dispatcher(torch.device("cpu")).start_dispatch
    layer.set_dispatcher(layer.local_dispatcher(torch.device("cpu")))
    monkeypatch.setattr(layer.dispatcher, "start_dispatch", lambda x, routing: seen.append(x.dtype) or dispatch(x, routing))
    layer(torch.randn(2, 5, 24, dtype=torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(2, 5, 24))
    assert seen == [torch.bfloat16, torch.bfloat16]


def test_triton_kernels_match_torch_reference():
    # On a GPU the kernels run compiled; elsewhere under the interpreter (tests/conftest.py).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, grad = torch.randn(2, 9, 24, device=device), torch.randn(2, 9, 24, device=device)
    ref, ref_grads = run(make_layer(padding="always", kernels="torch").to(device), x, grad)
    out, grads = run(make_layer(padding="always", kernels="triton").to(device), x, grad)
    assert_close_to_max(out, ref, 1e-5, "out")
    for a, b in zip(grads, ref_grads):
        assert_close_to_max(a, b, 1e-5, "grad")


@pytest.mark.parametrize("router", [dict(balance_loss="sequence", balance_loss_coeff=0.1), dict(z_loss_coeff=0.01)])
def test_router_loss_gradient_reaches_the_gate_and_counts_once(router):
    layer = make_layer(**router)
    x = torch.randn(2, 8, 24)
    layer(x).sum().backward()
    with_aux = layer.router.gate.weight.grad.clone()
    plain = make_layer()
    plain(x).sum().backward()
    assert not torch.allclose(with_aux, plain.router.gate.weight.grad)
    # The layer adds aux_loss (scale 1 in one process): the difference is its gradient alone.
    layer.router.gate.weight.grad = None
    layer.router(x.reshape(-1, 24), seq_len=8).aux_loss.backward()
    torch.testing.assert_close(with_aux - plain.router.gate.weight.grad, layer.router.gate.weight.grad,
                               rtol=1e-4, atol=1e-7)
    assert (layer.router_loss_sums > 0).sum() == 1
