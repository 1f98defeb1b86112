"""Router losses and group-limited routing against float64 references written from the papers.

    balance loss  DeepSeek-V3 (arXiv:2412.19437) eqs. 17-20: alpha * sum_i f_i P_i,
                  f_i = E / (K T) * #{t : i in top-k(t)},  P_i = 1/T sum_t s_it / sum_j s_jt
    z-loss        ST-MoE (arXiv:2202.08906) eq. 5: 1/B sum_i (log sum_j exp x_ij)^2
    global batch  Qiu et al. 2025 (arXiv:2501.11873): f over the step's micro-batches so far
    group-limited DeepSeek-V3 sec. 2.1.2: groups ranked by the sum of their best K/M scores
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from torchtitan_moe.models.qwen3_moe.parallelize import compile_router
from torchtitan_moe.moe import MoE, MoEArgs, Router, RouterOptions
from torchtitan_moe.moe.balance import reduce_step_stats, set_aux_loss_scale
from torchtitan_moe.moe.router import balanced_experts, group_limited_topk
from torchtitan_moe.moe.router_losses import balance_loss, sequence_balance_loss

DIM, EXPERTS, TOP_K = 16, 8, 2


# ---------------------------------------------------------------------------------------
# References: float64, one token or sequence at a time, differentiable in the gate weight.
# ---------------------------------------------------------------------------------------


def ref_logits_scores(x, weight, score_func):
    logits = x.double() @ weight.T
    return logits, (torch.softmax(logits, -1) if score_func == "softmax" else torch.sigmoid(logits))


def ref_f(experts, num_experts, top_k, num_tokens):
    """f_i = E / (K T) * (tokens whose top-k holds i), counted token by token."""
    hits = torch.zeros(num_experts, dtype=torch.float64)
    for row in experts.tolist():
        for e in row:
            hits[e] += 1
    return hits * num_experts / (top_k * num_tokens)


def ref_p(scores):
    """P_i = mean over tokens of s_it / sum_j s_jt."""
    return torch.stack([s / s.sum() for s in scores]).mean(0)


def ref_balance(scores, experts, num_experts, top_k):
    return (ref_f(experts, num_experts, top_k, len(experts)) * ref_p(scores)).sum()


def ref_sequence_balance(scores, experts, seq_len, num_experts, top_k):
    seqs = [slice(s, s + seq_len) for s in range(0, len(experts), seq_len)]
    return sum(ref_balance(scores[s], experts[s], num_experts, top_k) for s in seqs) / len(seqs)


def ref_z_loss(logits):
    return sum(torch.log(torch.exp(row).sum()) ** 2 for row in logits) / len(logits)


def make_router(seed=0, **kwargs):
    torch.manual_seed(seed)
    router = Router(DIM, EXPERTS, TOP_K, RouterOptions(**kwargs))
    router.init_weights()
    router.gate.weight.data.normal_(std=0.5)  # decisive routing: no near-ties in top-k
    return router


def aux_and_grads(router, x, seq_len):
    x = x.clone().requires_grad_()
    routing = router(x, seq_len=seq_len)
    routing.aux_loss.backward()
    return routing, router.gate.weight.grad.clone(), x.grad


def ref_grads(loss_fn, router, x):
    weight = router.gate.weight.detach().double().requires_grad_()
    x64 = x.double().requires_grad_()
    loss = loss_fn(x64, weight)
    loss.backward()
    return loss.detach(), weight.grad, x64.grad


# ---------------------------------------------------------------------------------------
# Each loss: value and gradients.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("recipe", ["sequence", "micro_batch", "global_batch"])
def test_balance_loss_value_and_gradients_match_the_formula(recipe, score_func):
    seq_len, coeff = 7, 0.03
    router = make_router(score_func=score_func, balance_loss=recipe, balance_loss_coeff=coeff)
    x = torch.randn(3 * seq_len, DIM)
    routing, gate_grad, x_grad = aux_and_grads(router, x, seq_len)
    experts = routing.experts

    def loss_fn(x64, weight):
        _, scores = ref_logits_scores(x64, weight, score_func)
        if recipe == "sequence":
            return coeff * ref_sequence_balance(scores, experts, seq_len, EXPERTS, TOP_K)
        return coeff * ref_balance(scores, experts, EXPERTS, TOP_K)  # one process: the batch is global

    ref, ref_gate, ref_x = ref_grads(loss_fn, router, x)
    assert routing.z_loss is None
    assert routing.balance_loss.item() == pytest.approx(float(ref) / coeff, rel=1e-6)
    assert routing.aux_loss.item() == pytest.approx(float(ref), rel=1e-6)
    torch.testing.assert_close(gate_grad.double(), ref_gate, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(x_grad.double(), ref_x, rtol=1e-5, atol=1e-9)


def test_sequence_and_micro_batch_losses_differ_on_uneven_sequences():
    # One sequence all on experts 0-1, the other all on 2-3: each sequence is unbalanced, the
    # micro-batch less so. The sequence loss must see each sequence alone.
    scores = torch.full((8, 4), 0.25)
    experts = torch.tensor([[0, 1]] * 4 + [[2, 3]] * 4)
    seq = float(sequence_balance_loss(scores, experts, seq_len=4))
    micro = float(balance_loss(scores, torch.bincount(experts.flatten(), minlength=4)))
    assert seq == pytest.approx(float(ref_sequence_balance(scores.double(), experts, 4, 4, 2)))
    assert micro == pytest.approx(float(ref_balance(scores.double(), experts, 4, 2)))
    assert micro == pytest.approx(1.0) and seq == pytest.approx(1.0)  # uniform scores: P = 1/E
    peaked = torch.tensor([[0.4, 0.4, 0.1, 0.1]] * 4 + [[0.1, 0.1, 0.4, 0.4]] * 4)
    assert float(sequence_balance_loss(peaked, experts, 4)) == pytest.approx(1.6)  # 2 x 2 x 0.4
    assert float(balance_loss(peaked, torch.bincount(experts.flatten(), minlength=4))) == pytest.approx(1.0)


def test_balance_loss_is_one_at_a_balanced_load():
    experts = balanced_experts(64, TOP_K, EXPERTS, "cpu")
    uniform = torch.full((64, EXPERTS), 1 / EXPERTS)
    assert float(sequence_balance_loss(uniform, experts, 16)) == pytest.approx(1.0)
    assert float(balance_loss(uniform, torch.bincount(experts.flatten(), minlength=EXPERTS))) == pytest.approx(1.0)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_z_loss_and_the_weighted_sum_match_the_formulas(score_func):
    seq_len, cb, cz = 5, 0.01, 0.002
    router = make_router(score_func=score_func, balance_loss="micro_batch", balance_loss_coeff=cb, z_loss_coeff=cz)
    x = torch.randn(4 * seq_len, DIM)
    routing, gate_grad, x_grad = aux_and_grads(router, x, seq_len)

    def z_only(x64, weight):
        return ref_z_loss(ref_logits_scores(x64, weight, score_func)[0])

    def both(x64, weight):
        logits, scores = ref_logits_scores(x64, weight, score_func)
        return cb * ref_balance(scores, routing.experts, EXPERTS, TOP_K) + cz * ref_z_loss(logits)

    ref_z = ref_grads(z_only, router, x)[0]
    ref, ref_gate, ref_x = ref_grads(both, router, x)
    assert routing.z_loss.item() == pytest.approx(float(ref_z), rel=1e-6)
    assert routing.aux_loss.item() == pytest.approx(float(ref), rel=1e-6)
    torch.testing.assert_close(gate_grad.double(), ref_gate, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(x_grad.double(), ref_x, rtol=1e-5, atol=1e-9)


def test_no_losses_in_eval_or_without_grad_and_no_counts_either():
    router = make_router(balance_loss="global_batch", balance_loss_coeff=0.01, z_loss_coeff=0.001)
    x = torch.randn(10, DIM)
    with torch.no_grad():
        routing = router(x)
    router.eval()
    assert routing.aux_loss is None and router(x).aux_loss is None
    assert router.global_counts.sum() == 0  # a probe or an eval pass leaves the step's counts alone


# ---------------------------------------------------------------------------------------
# Global batch under gradient accumulation: the buffer of the paper (and Megatron-LM).
# ---------------------------------------------------------------------------------------


def make_layer(seed=0, **router):
    torch.manual_seed(seed)
    layer = MoE(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, inter_dim=12, padding="none", kernels="torch",
                        router=RouterOptions(**router)), DIM)
    layer.init_weights(out_std=0.1)
    layer.router.gate.weight.data.normal_(std=0.5)
    return layer


def test_global_batch_counts_the_step_so_far_and_starts_each_step_afresh():
    """Micro-batch m's f counts micro-batches 1..m of the step; the step hook empties the buffer."""
    coeff, micro_batches = 0.05, 3
    layer = make_layer(balance_loss="global_batch", balance_loss_coeff=coeff)
    set_aux_loss_scale([layer], 1 / micro_batches)  # as the trainer does
    xs = [torch.randn(2, 5, DIM) for _ in range(micro_batches + 1)]
    with torch.no_grad():
        experts = [layer.router(x.reshape(-1, DIM)).experts for x in xs]
    values = []
    for x in xs[:micro_batches]:
        (layer(x) * 0).sum().backward()  # the gate's gradient is the balance loss's alone
    gate_grad = layer.router.gate.weight.grad.clone()
    assert layer.router.global_counts.tolist() == torch.bincount(
        torch.cat(experts[:micro_batches]).flatten(), minlength=EXPERTS).tolist()
    reduce_step_stats([layer], group=None)
    values.append(float(layer.last_router_losses[0]))

    def objective(x64, weight):
        total = 0.0
        for m in range(micro_batches):
            seen = torch.cat(experts[: m + 1])
            f = ref_f(seen, EXPERTS, TOP_K, len(seen))
            p = ref_p(ref_logits_scores(xs[m].reshape(-1, DIM).double(), weight, "softmax")[1])
            total = total + (f * p).sum() / micro_batches
        return total

    ref, ref_gate, _ = ref_grads(objective, layer.router, xs[0].reshape(-1, DIM))
    assert values[0] == pytest.approx(float(ref), rel=1e-6)  # the logged mean over micro-batches
    torch.testing.assert_close(gate_grad.double(), coeff * ref_gate, rtol=1e-5, atol=1e-9)

    # The next step's first micro-batch counts itself alone: its loss is the micro-batch one.
    assert layer.router.global_counts.sum() == 0
    routing = layer.router(xs[-1].reshape(-1, DIM))
    assert routing.balance_loss.item() == pytest.approx(
        float(balance_loss(routing.scores, routing.tokens_per_expert)), rel=1e-6)


@pytest.mark.parametrize("compiled", [False, True])
def test_checkpointed_recompute_counts_once_and_gives_the_same_gradients(compiled):
    # Compiled as parallelize does it: the recompute runs the compiled region again in full, so the
    # global counts must stay outside it (they were inside it once, and counted twice).
    x, grad = torch.randn(2, 6, DIM), torch.randn(2, 6, DIM)
    results = []
    for use_checkpoint in (False, True):
        layer = make_layer(balance_loss="global_batch", balance_loss_coeff=0.1, z_loss_coeff=0.01)
        if compiled:
            torch._dynamo.reset()
            compile_router(layer.router, "aot_eager")
        for _ in range(2):  # two micro-batches: the second one's f counts both
            inp = x.clone().requires_grad_()
            out = checkpoint(layer, inp, use_reentrant=False) if use_checkpoint else layer(inp)
            out.backward(grad)
        results.append((layer.router.global_counts.clone(), layer.router_loss_sums.clone(),
                        layer.tokens_per_expert.clone(), layer.router.gate.weight.grad.clone()))
    for plain, checkpointed in zip(*results):
        torch.testing.assert_close(checkpointed, plain, rtol=0, atol=0)
    assert results[0][0].sum() == 2 * 12 * TOP_K


# ---------------------------------------------------------------------------------------
# Group-limited routing.
# ---------------------------------------------------------------------------------------


def ref_group_limited(choice, top_k, n_groups, topk_groups):
    """Per token: rank groups by the sum of their best top_k // topk_groups scores, keep the
    best topk_groups, then the top_k experts among the kept groups' experts."""
    per_group = choice.shape[1] // n_groups
    picked, kept_groups = [], []
    for row in choice.double().tolist():
        groups = [row[g * per_group : (g + 1) * per_group] for g in range(n_groups)]
        score = [sum(sorted(g, reverse=True)[: top_k // topk_groups]) for g in groups]
        kept = sorted(range(n_groups), key=lambda g: -score[g])[:topk_groups]
        allowed = [g * per_group + i for g in kept for i in range(per_group)]
        picked.append(sorted(sorted(allowed, key=lambda e: -row[e])[:top_k]))
        kept_groups.append(set(kept))
    return picked, kept_groups


@pytest.mark.parametrize(
    "num_experts, top_k, n_groups, topk_groups",
    [(16, 4, 4, 2), (64, 8, 8, 4), (32, 6, 8, 3), (12, 3, 3, 1), (16, 4, 4, 4)],
)
@pytest.mark.parametrize("negative", [False, True])
def test_group_limited_routing_matches_the_definition_and_stays_in_its_groups(
        num_experts, top_k, n_groups, topk_groups, negative):
    torch.manual_seed(num_experts + top_k)
    choice = torch.sigmoid(torch.randn(200, num_experts) * 2)
    if negative:  # a large negative expert bias: masked experts must still never win
        choice = choice - 3.0
    experts = group_limited_topk(choice, top_k, n_groups, topk_groups)
    ref, kept = ref_group_limited(choice, top_k, n_groups, topk_groups)
    per_group = num_experts // n_groups
    for t in range(len(choice)):
        chosen = experts[t].tolist()
        assert len(set(chosen)) == top_k
        assert {e // per_group for e in chosen} <= kept[t], f"token {t}: {chosen} outside groups {kept[t]}"
        assert sorted(chosen) == ref[t]
    if topk_groups == n_groups:  # no limit: plain top-k
        assert torch.equal(experts.sort(-1).values, choice.topk(top_k, -1).indices.sort(-1).values)


def test_router_with_groups_routes_inside_them_and_limits_groups_per_token():
    torch.manual_seed(5)
    router = Router(DIM, 16, 4, RouterOptions(score_func="sigmoid", n_groups=4, topk_groups=2))
    router.init_weights()
    router.gate.weight.data.normal_(std=0.5)
    router.expert_bias.copy_(torch.randn(16) * 0.1)
    x = torch.randn(300, DIM)
    routing = router(x)
    choice = torch.sigmoid(x @ router.gate.weight.T) + router.expert_bias
    ref, kept = ref_group_limited(choice, 4, 4, 2)
    assert routing.experts.sort(-1).values.tolist() == ref
    groups_used = [len({e // 4 for e in row}) for row in routing.experts.tolist()]
    assert max(groups_used) == 2 and min(groups_used) >= 1
    # Without the limit some tokens would use more than 2 groups: the limit is doing something.
    free = Router(DIM, 16, 4, RouterOptions(score_func="sigmoid"))
    free.load_state_dict(router.state_dict())
    assert max(len({e // 4 for e in row}) for row in free(x).experts.tolist()) > 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n_groups=3), "n_groups = 3: must divide num_experts (8)"),
        (dict(n_groups=4, topk_groups=5), "topk_groups = 5: must be in 1..n_groups (4)"),
        (dict(n_groups=4, topk_groups=3), "topk_groups = 3: more than top_k (2) groups cannot all be used"),
        (dict(n_groups=4, force_balance=True), "force_balance sends tokens round-robin"),
        (dict(balance_loss="sequence"), "balance_loss = 'sequence' needs balance_loss_coeff > 0"),
        (dict(balance_loss_coeff=0.1), "balance_loss_coeff = 0.1 has no loss to weigh"),
        (dict(balance_loss="global", balance_loss_coeff=0.1), "balance_loss = 'global': expected one of"),
        (dict(z_loss_coeff=-1.0), "z_loss_coeff = -1.0: must be >= 0"),
    ],
)
def test_bad_router_arguments_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError) as err:
        Router(DIM, EXPERTS, TOP_K, RouterOptions(**kwargs))
    assert message in str(err.value) and "\n" not in str(err.value)
