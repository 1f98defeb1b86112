"""Aux-loss-free balancing: the expert-bias update against its formula, and the optimizer
pre-hook that applies it once per step from the step's token counts."""

import torch
from host_reads import HostReads

from torchtitan_moe.moe import MoE, MoEArgs, RouterOptions
from torchtitan_moe.moe.balance import register_balancing_hook, update_expert_bias


def test_update_moves_the_bias_toward_balance_by_the_formula():
    layer = MoE(MoEArgs(num_experts=4, top_k=1, router=RouterOptions(bias_update_rate=0.01)), dim=8)
    loads = torch.tensor([[10.0, 0.0, 5.0, 5.0]], dtype=torch.float64)  # mean 5
    update_expert_bias([layer], loads)
    # rate * sign(mean - load) = [-1, 1, 0, 0] x 0.01, minus its mean (0)
    torch.testing.assert_close(layer.router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]), rtol=0, atol=1e-9)
    update_expert_bias([layer], torch.tensor([[8.0, 8.0, 8.0, 0.0]], dtype=torch.float64))  # mean 6
    # [-1, -1, -1, 1] x 0.01, minus its mean (-0.005)
    torch.testing.assert_close(layer.router.expert_bias, torch.tensor([-0.015, 0.005, -0.005, 0.015]), rtol=0, atol=1e-9)


def test_rate_zero_and_no_tokens_leave_the_bias_alone():
    off = MoE(MoEArgs(num_experts=4, router=RouterOptions(bias_update_rate=0.0)), dim=8)
    update_expert_bias([off], torch.tensor([[10.0, 0.0, 5.0, 5.0]], dtype=torch.float64))
    idle = MoE(MoEArgs(num_experts=4, router=RouterOptions(bias_update_rate=0.01)), dim=8)
    update_expert_bias([idle], torch.zeros(1, 4, dtype=torch.float64))
    assert off.router.expert_bias.abs().sum() == 0 and idle.router.expert_bias.abs().sum() == 0


def test_update_reads_nothing_back_to_the_host():
    # It runs before every optimizer step: a read per layer was a host sync per layer on a GPU.
    layers = [MoE(MoEArgs(num_experts=4, router=RouterOptions(bias_update_rate=0.01)), dim=8) for _ in range(3)]
    with HostReads() as reads:
        update_expert_bias(layers, torch.tensor([[10.0, 0.0, 5.0, 5.0], [0.0] * 4, [1.0, 2.0, 3.0, 4.0]], dtype=torch.float64))
    assert reads.count == 0
    assert layers[0].router.expert_bias.abs().sum() > 0 and layers[1].router.expert_bias.abs().sum() == 0


def test_optimizer_step_updates_the_bias_from_the_steps_counts_and_clears_them():
    torch.manual_seed(0)
    layer = MoE(MoEArgs(num_experts=4, top_k=1, inter_dim=8, kernels="torch", router=RouterOptions(bias_update_rate=0.01)), dim=8)
    layer.init_weights(out_std=0.02)
    layer.router.expert_bias.copy_(torch.tensor([3.0, 0.0, 0.0, -3.0]))  # expert 0 takes every token
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.0)
    register_balancing_hook(optimizer, [layer], group=None)
    for _ in range(2):  # two micro-batches before the step
        layer(torch.randn(1, 6, 8)).sum().backward()
    assert layer.tokens_per_expert.tolist() == [12, 0, 0, 0]
    optimizer.step()
    assert layer.last_tokens_per_expert.tolist() == [12, 0, 0, 0] and layer.tokens_per_expert.sum() == 0
    # sign(mean - load) = [-1, 1, 1, 1] x 0.01, minus its mean (0.005)
    torch.testing.assert_close(layer.router.expert_bias, torch.tensor([2.985, 0.005, 0.005, -2.995]),
                               rtol=0, atol=1e-6)
