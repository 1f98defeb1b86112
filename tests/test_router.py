"""Router math against a dense per-token float64 reference."""

import pytest
import torch

from torchtitan_moe.moe.router import Router, RouterOptions, balanced_experts, count_tokens


def reference_route(x, weight, bias, top_k, score_func, route_norm, route_scale):
    """Per token, in float64: scores, top-k over scores + bias, probabilities."""
    experts, probs = [], []
    for token in x.double():
        logits = weight.detach().double() @ token
        scores = torch.softmax(logits, 0) if score_func == "softmax" else torch.sigmoid(logits)
        chosen = sorted(range(len(scores)), key=lambda e: -(scores[e] + bias[e]).item())[:top_k]
        p = scores[chosen]
        if route_norm:
            p = p / p.sum()
        experts.append(sorted(chosen))
        probs.append({e: float(v) * route_scale for e, v in zip(chosen, p)})
    return experts, probs


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("route_norm", [True, False])
def test_router_matches_dense_reference(score_func, route_norm):
    torch.manual_seed(0)
    router = Router(32, num_experts=8, top_k=3,
                    options=RouterOptions(score_func=score_func, route_norm=route_norm, route_scale=2.5))
    router.init_weights()
    router.gate.weight.data.normal_(std=0.3)
    router.expert_bias.copy_(torch.randn(8) * 0.05)
    x = torch.randn(50, 32, dtype=torch.bfloat16)

    routing = router(x)
    ref_experts, ref_probs = reference_route(x, router.gate.weight, router.expert_bias, 3, score_func, route_norm, 2.5)

    assert routing.probs.dtype == torch.float32 and routing.experts.dtype == torch.int64
    for t in range(50):
        chosen = routing.experts[t].tolist()
        assert sorted(chosen) == ref_experts[t]
        for e, p in zip(chosen, routing.probs[t].tolist()):
            assert p == pytest.approx(ref_probs[t][e], rel=1e-5)
    assert routing.tokens_per_expert.tolist() == torch.bincount(routing.experts.flatten(), minlength=8).tolist()


def test_expert_bias_selects_but_does_not_weigh():
    torch.manual_seed(1)
    router = Router(16, num_experts=4, top_k=1, options=RouterOptions(route_norm=False))
    router.init_weights()
    x = torch.randn(20, 16)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 10.0, 0.0]))  # overwhelms every score
    routing = router(x)
    assert (routing.experts == 2).all()
    scores = torch.softmax(x @ router.gate.weight.T, dim=-1)
    torch.testing.assert_close(routing.probs[:, 0], scores[:, 2])


def test_gate_is_computed_in_fp32_under_bf16_autocast():
    torch.manual_seed(2)
    router = Router(64, num_experts=16, top_k=2)
    router.init_weights()
    x = torch.randn(32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = router(x)
    fp32_scores = torch.softmax(x @ router.gate.weight.T, dim=-1)
    assert routing.scores.dtype == torch.float32
    torch.testing.assert_close(routing.scores, fp32_scores, rtol=1e-6, atol=1e-7)  # bf16 logits miss by ~1e-3


def test_a_bf16_gate_with_bf16_tokens_still_gives_fp32_logits():
    # Under FSDP2's bf16 mixed precision the gate's weight and the tokens arrive in bf16: the logits are
    # still the fp32 sums of their products, and the gradients reach both in bf16.
    torch.manual_seed(3)
    router = Router(64, num_experts=16, top_k=2)
    router.init_weights()
    router.gate.weight.data = (0.3 * torch.randn(16, 64)).bfloat16()
    x = torch.randn(32, 64).bfloat16().requires_grad_()
    routing = router(x)
    fp32_scores = torch.softmax(x.float() @ router.gate.weight.float().T, dim=-1)
    torch.testing.assert_close(routing.scores, fp32_scores, rtol=1e-6, atol=1e-7)  # bf16 logits miss by ~1e-3
    (routing.probs * torch.randn(32, 2)).sum().backward()
    assert x.grad.dtype == router.gate.weight.grad.dtype == torch.bfloat16


def test_probabilities_carry_gradient_to_the_gate():
    router = Router(16, num_experts=4, top_k=2)
    router.init_weights()
    routing = router(torch.randn(10, 16))
    (routing.probs * torch.randn(10, 2)).sum().backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0


def test_forced_balance_is_exactly_balanced():
    experts = balanced_experts(num_tokens=64, top_k=4, num_experts=16, device="cpu")
    assert count_tokens(experts, 16).tolist() == [16] * 16
    assert all(len(set(row.tolist())) == 4 for row in experts)  # no expert twice for a token


def test_zero_init_gate_sends_every_token_to_the_same_experts():
    router = Router(16, num_experts=8, top_k=2, options=RouterOptions(init_std=0.0))
    router.init_weights()
    routing = router(torch.randn(30, 16))
    assert (routing.tokens_per_expert > 0).sum() == 2  # the failure the init checks catch


def test_routing_is_a_pytree_of_its_tensors():
    # FSDP2 (torch 2.11) finds the router's outputs to hook for backward with pytree: an
    # opaque Routing left the gate's weights freed in backward ("storage of size 0").
    import torch.utils._pytree as pytree

    router = Router(8, num_experts=4, top_k=2,
                    options=RouterOptions(balance_loss="sequence", balance_loss_coeff=0.1, z_loss_coeff=0.01))
    router.init_weights()
    routing = router(torch.randn(6, 8), seq_len=3)
    leaves = pytree.tree_flatten(routing)[0]
    assert len(leaves) == 7 and all(isinstance(t, torch.Tensor) for t in leaves)
