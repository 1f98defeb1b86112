"""Each threshold of the router-init checks and the training monitors (components/checks/) at values a
few percent either side of it: quiet just inside, firing just outside, with the value it reports. (The
crafted bad and healthy cases far from the thresholds are in test_checks.py.)"""

import math

import pytest
import torch
from torch import nn

from torchtitan_moe.components.checks import monitors as mon
from torchtitan_moe.components.checks import router_init as ri
from torchtitan_moe.moe.router import Router


def fired(findings, statistic: str):
    """The finding of `statistic` (a prefix of its name), or None."""
    found = [f for f in findings if f.statistic.startswith(statistic)]
    assert len(found) <= 1
    return found[0] if found else None


# ---------------------------------------------------------------------------------------
# Router-init checks.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio, fires", [(9.8, False), (10.2, True), (0.102, False), (0.098, True)])
def test_gate_std_against_init_std_at_its_10x_bounds(ratio, fires):
    # A small gate (4 experts x 4): its std over 16 values, as the check takes it (the population std).
    init_std = 0.02
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    w = (w - w.mean()) / w.std(unbiased=False) * ratio * init_std
    finding = fired(ri.gate_findings("r", w.float(), init_std), "gate weight std / [router] init_std")
    assert (finding is not None) is fires
    if fires:
        assert finding.value == pytest.approx(ratio, rel=1e-5)


def uniform_over(active: int, experts: int, tokens: int = 1000) -> torch.Tensor:
    """Loads of `tokens` on each of the first `active` experts, none on the others."""
    loads = torch.zeros(experts, dtype=torch.long)
    loads[:active] = tokens
    return loads


@pytest.mark.parametrize("active, fires", [(38, True), (39, False)])
def test_load_entropy_at_its_threshold(active, fires):
    # Tokens even over m of 128 experts: H / ln E = ln m / ln 128 = 0.7497 at m = 38, 0.7550 at m = 39.
    finding = fired(ri.load_findings("r", uniform_over(active, 128), top_k=8), "load entropy / ln E")
    assert (finding is not None) is fires
    if fires:
        assert finding.value == pytest.approx(math.log(active) / math.log(128), rel=1e-9)


@pytest.mark.parametrize("busiest, fires", [(3044, False), (3153, True)])
def test_busiest_expert_at_its_threshold(busiest, fires):
    # 63 experts at 1000 tokens and one at `busiest`: max / mean = 2.950 and 3.050.
    loads = torch.full((64,), 1000, dtype=torch.long)
    loads[5] = busiest
    expected = busiest / ((63 * 1000 + busiest) / 64)
    findings = ri.load_findings("r", loads, top_k=8)
    finding = fired(findings, "busiest expert tokens / mean")
    assert (finding is not None) is fires
    if fires:
        assert finding.value == pytest.approx(expected, rel=1e-9)
    assert fired(findings, "load entropy") is None and fired(findings, "load CV") is None


@pytest.mark.parametrize("active, fires", [(63, True), (65, False)])
def test_load_cv_at_its_threshold(active, fires):
    # Even over m of 128 experts: CV = sqrt(128 / m - 1) = 1.016 at m = 63, 0.985 at m = 65.
    finding = fired(ri.load_findings("r", uniform_over(active, 128), top_k=8), "load CV")
    assert (finding is not None) is fires
    if fires:
        assert finding.value == pytest.approx(math.sqrt(128 / active - 1), rel=1e-9)


@pytest.mark.parametrize("dead, fires", [(16, False), (17, True)])
def test_dead_experts_at_their_threshold(dead, fires):
    # 64 experts, 1000 tokens each on the live ones (a balanced router would leave none empty): 16 dead is 25%.
    finding = fired(ri.load_findings("r", uniform_over(64 - dead, 64), top_k=8), "share of experts with no tokens")
    assert (finding is not None) is fires
    if fires:
        assert finding.value == pytest.approx(dead / 64)


@pytest.mark.parametrize("ep, share, fires", [(2, 1.49, False), (2, 1.51, True), (4, 1.98, False), (4, 2.02, True),
                                              (8, 1.98, False), (8, 2.02, True)])
def test_busiest_ep_rank_at_its_threshold(ep, share, fires):
    # The limit is min(2, (1 + ep) / 2): 1.5 at EP = 2, 2 at EP = 4 and 8. EP rank 1's experts (the second
    # contiguous block) get `share` x the mean tokens per EP rank; the other ranks share the rest evenly.
    experts, total = 64, 64_000_000
    per_rank = experts // ep
    loads = torch.full((experts,), (total - share * total / ep) / (ep - 1) / per_rank, dtype=torch.float64)
    loads[per_rank : 2 * per_rank] = share * total / ep / per_rank
    finding = fired(ri.load_findings("r", loads.round().long(), top_k=8, ep=ep), "busiest EP rank")
    assert (finding is not None) is fires
    if fires:
        assert finding.statistic == "busiest EP rank (rank 1) tokens / mean"
        assert finding.value == pytest.approx(share, rel=1e-6)


class RouterOnFeatures(nn.Module):
    """A model whose 'tokens' are the router's inputs: logits = x (the gate is the identity)."""

    def __init__(self, experts: int, top_k: int):
        super().__init__()
        self.router = Router(experts, experts, top_k)
        with torch.no_grad():
            self.router.gate.weight.copy_(torch.eye(experts))

    def forward(self, x):
        return self.router(x)


@pytest.mark.parametrize("top_k", [2, 4])
@pytest.mark.parametrize("tied, fires", [(9, False), (11, True)])
def test_the_probes_tie_share_at_its_threshold(top_k, tied, fires):
    # 1000 tokens, `tied` of them with two equal logits among their top k + 1 (the rest distinct): a share of
    # tokens, 0.9% or 1.1% against the 1% allowed, however many experts each token picks.
    experts, tokens = 8, 1000
    g = torch.Generator().manual_seed(3)
    x = torch.stack([torch.randperm(experts, generator=g).double() for _ in range(tokens)]).float()
    x[:tied, 2] = x[:tied, 3] = experts  # experts 2 and 3 tie at the top (within every token's top k + 1)
    stats = ri.probe_routers(RouterOnFeatures(experts, top_k), x)["router"]
    assert (stats["ties"], stats["tokens"]) == (tied, tokens)
    assert stats["tie_pairs"][2, 3] == tied and stats["loads"].sum() == tokens * top_k
    finding = fired(ri.tie_findings("router", stats["ties"], stats["tokens"], stats["tie_pairs"]), "tokens with tied")
    assert (finding is not None) is fires
    if fires:
        assert finding.value == pytest.approx(tied / tokens) and "experts 2 and 3" in finding.cause


@pytest.mark.parametrize("mean, fires", [(0.95e-3, False), (1.05e-3, True), (-1.05e-3, True)])
def test_expert_bias_mean_at_its_threshold(mean, fires):
    bias = torch.tensor([0.03, -0.02, 0.01, -0.02, 0.0, 0.005, -0.005, 0.0], dtype=torch.float64)
    bias = (bias - bias.mean() + mean).float()  # a spread a balancing update leaves, and a mean next to the limit
    finding = fired(ri.bias_findings("r", bias), "expert_bias mean")
    assert (finding is not None) is fires
    if fires:
        assert finding.value == pytest.approx(mean, rel=1e-4)


# ---------------------------------------------------------------------------------------
# Monitors.
# ---------------------------------------------------------------------------------------


def spikes(values, name: str):
    """Feed `values` as that series (the others flat) -> [(step, metric over its EMA, warned)]."""
    monitor = mon.TrainingMonitor(freq=1000)
    seen = []
    for step, value in enumerate(values, start=1):
        loss = value if name == "loss" else 2.0
        grad_norm = value if name == "grad_norm" else 1.0
        router = {"z_loss": value} if name == "z_loss" else None
        metrics, warnings = monitor.check(step, loss, grad_norm, router_losses=router)
        key = f"health/{name}_over_ema"
        seen.append((step, metrics.get(key), any(f"{name} spike" in w for w in warnings)))
    return seen


def test_loss_spike_against_its_ema_at_1_5x():
    # Ten steps at 2.0 (the EMA 2.0), then 2.8 (1.4x: quiet; the EMA becomes 0.9 x 2 + 0.1 x 2.8 = 2.08), then
    # 3.1 (3.1 / 2.08 = 1.490: quiet) or 3.14 (1.510: warned).
    for last, warned in ((3.1, False), (3.14, True)):
        seen = spikes([2.0] * 10 + [2.8, last], "loss")
        assert [s[1] for s in seen[:5]] == [None] * 5  # the warm-up: not judged
        assert seen[10][1:] == (pytest.approx(1.4), False)
        assert seen[11][1:] == (pytest.approx(last / 2.08), warned)


def test_grad_norm_spike_at_10x_and_router_losses_at_1_5x():
    for value, warned in ((9.9, False), (10.1, True)):
        assert spikes([1.0] * 8 + [value], "grad_norm")[-1][1:] == (pytest.approx(value), warned)
    for value, warned in ((1.49 * 4.4, False), (1.51 * 4.4, True)):
        assert spikes([4.4] * 8 + [value], "z_loss")[-1][1:] == (pytest.approx(value / 4.4), warned)


@pytest.mark.parametrize("largest, warned", [(99.0, False), (101.0, True)])
def test_grad_norm_spread_between_ranks_at_100x(largest, warned):
    rank_stats = torch.tensor([[2.0, 1.0], [2.0, 3.0], [2.0, largest]], dtype=torch.float64)
    metrics, warnings = mon.TrainingMonitor(freq=5).check(5, 2.0, 1.0, rank_stats=rank_stats)
    assert metrics["health/grad_norm_rank_max_over_min"] == pytest.approx(largest)
    assert bool(warnings) is warned
    if warned:
        assert "largest on rank 2, smallest on rank 0" in warnings[0]


@pytest.mark.parametrize("share, warned", [(1.98, False), (2.02, True)])
def test_ep_rank_load_at_2x_the_mean(share, warned):
    # 4 EP ranks of 2 experts; EP rank 2 gets `share` x the mean, the others the rest evenly.
    total = 4_000_000
    rank_tokens = [(total - share * total / 4) / 3] * 4
    rank_tokens[2] = share * total / 4
    loads = torch.tensor([[t / 2 for t in rank_tokens for _ in range(2)]]).round().long()
    metrics, warnings = mon.TrainingMonitor(freq=5, ep=4).check(5, 2.0, 1.0, loads=loads)
    assert metrics["moe/ep_load_max_over_mean"] == pytest.approx(share, rel=1e-6)
    assert any("EP rank 2 receives" in w for w in warnings) is warned
