"""The global-batch balance loss with one all-reduce of every layer's counts a micro-batch
(moe/global_counts.py) against the per-layer all-reduce it replaces, on 2 gloo ranks.

A stack of 3 MoE layers, 2 micro-batches a step (gradient accumulation), different tokens on each rank.
Each variant runs twice: as the code is, and with each router's global-batch loss done the way it was
(`per_layer_loss` below: each layer's counts all-reduced in its own forward, the loss from them at
once). Everything must be bitwise equal: the step's per-layer counts, the logged losses and counts
(before and after the step hook), every gradient and their norm. And the all-reduces of counts during
the micro-batches must number one per micro-batch (the per-layer way: one per layer and micro-batch).

Variants: plain; each layer checkpointed (a recompute must not count or reduce again); checkpointed with
the router compiled as parallelize does it; two forwards before one backward (both micro-batches' counts
in one all-reduce, each f still over the micro-batches up to its own); a last micro-batch with no backward
(reduced by the step hook).
"""

import types

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.utils.checkpoint import checkpoint

from spawn_ranks import rank_group, run_ranks
from torchtitan_moe.dispatch.seam import recomputing
from torchtitan_moe.models.qwen3_moe.parallelize import compile_router
from torchtitan_moe.moe import MoE, MoEArgs
from torchtitan_moe.moe.balance import reduce_step_stats, register_balancing_hook, set_aux_loss_scale
from torchtitan_moe.moe.options import RouterOptions
from torchtitan_moe.moe.router_losses import balance_loss

DIM, EXPERTS, TOP_K, INTER, LAYERS, MICRO_BATCHES = 16, 8, 2, 12, 3, 2
VARIANTS = ("plain", "checkpoint", "compiled checkpoint", "two forwards", "no backward")


class Stack(nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        torch.manual_seed(0)  # the same weights on both ranks and in both ways
        self.layers = nn.ModuleList(
            MoE(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, inter_dim=INTER, padding="none", kernels="torch",
                        router=RouterOptions(bias_update_rate=0.0, balance_loss="global_batch",
                                             balance_loss_coeff=0.05, z_loss_coeff=0.002)), DIM)
            for _ in range(LAYERS))
        for layer in self.layers:
            layer.init_weights(out_std=0.1)
            layer.router.gate.weight.data.normal_(std=0.5)
        self.checkpointed = checkpointed

    def forward(self, x):
        for layer in self.layers:
            x = x + (checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x))
        return x


def per_layer_loss(router, scores, tokens_per_expert, loss_sums=None):
    """The way it was: this layer's counts all-reduced in its forward, the loss from them at once."""
    if not recomputing():
        router.global_counts.add_(funcol.all_reduce(tokens_per_expert, "sum", router.balance_group))
    balance = balance_loss(scores, router.global_counts.clone())
    if loss_sums is not None:
        loss_sums += balance.detach()
    return balance


def count_all_reduces(calls: list) -> None:
    """From here on in this process, each all-reduce (in place or functional) appends to `calls`."""
    for module, name in ((dist, "all_reduce"), (funcol, "all_reduce")):
        original = getattr(module, name)

        def counting(*args, _original=original, **kwargs):
            calls.append(1)
            return _original(*args, **kwargs)

        setattr(module, name, counting)


def run(variant: str, per_layer: bool, rank: int, calls: list) -> dict[str, torch.Tensor]:
    model = Stack(checkpointed="checkpoint" in variant)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    register_balancing_hook(optimizer, [model], dist.group.WORLD)
    for layer in model.layers:
        if per_layer:
            layer.router.global_balance_loss = types.MethodType(per_layer_loss, layer.router)
        if "compiled" in variant:
            compile_router(layer.router, "aot_eager")
    set_aux_loss_scale(list(model.layers), 1.0 / (MICRO_BATCHES * dist.get_world_size()))  # as the trainer does
    torch.manual_seed(10 + rank)  # different tokens on each rank
    batches = [torch.randn(2, 5, DIM) for _ in range(MICRO_BATCHES)]
    targets = [torch.randn(2, 5, DIM) for _ in range(MICRO_BATCHES)]
    del calls[:]
    if variant == "two forwards":
        sum((model(x) * t).sum() for x, t in zip(batches, targets)).backward()
    else:
        for i, (x, t) in enumerate(zip(batches, targets)):
            loss = (model(x) * t).sum()
            if not (variant == "no backward" and i == MICRO_BATCHES - 1):
                loss.backward()
    stats = {f"{name} {i}": t.clone() for i, layer in enumerate(model.layers)
             for name, t in (("global counts", layer.router.global_counts), ("tokens", layer.tokens_per_expert),
                             ("loss sums", layer.router_loss_sums))}
    if variant == "no backward":  # its last counts wait for the step hook (the per-layer way added them at once)
        stats = {name: t for name, t in stats.items() if not name.startswith(("global counts", "loss sums"))}
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    stats["grad norm"] = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    reduce_step_stats(list(model.layers), dist.group.WORLD)  # the step hook, as optimizer.step() calls it
    reductions = len(calls) - 1  # the hook's own all-reduce of the step's statistics left out
    for i, layer in enumerate(model.layers):
        stats[f"logged tokens {i}"] = layer.last_tokens_per_expert
        stats[f"logged losses {i}"] = layer.last_router_losses
    return {"reductions": torch.tensor(reductions), **stats, **grads}


def worker(rank: int, world: int, port: int, failures) -> None:
    with rank_group(rank, world, port, failures):
        calls: list = []
        count_all_reduces(calls)
        for variant in VARIANTS:
            torch._dynamo.reset()
            ours, theirs = run(variant, False, rank, calls), run(variant, True, rank, calls)
            backwards = 1 if variant == "two forwards" else MICRO_BATCHES
            assert int(ours.pop("reductions")) == backwards, (variant, "one all-reduce a micro-batch")
            assert int(theirs.pop("reductions")) == MICRO_BATCHES * LAYERS, (variant, "the counter counts")
            for name, expected in theirs.items():
                assert torch.equal(ours[name], expected), (rank, variant, name, ours[name], expected)
            assert torch.isfinite(ours["logged losses 0"]).all()
            assert ours["logged tokens 0"].sum() == world * MICRO_BATCHES * 10 * TOP_K  # every rank's slots
        check_a_router_alone(rank)


def check_a_router_alone(rank: int) -> None:
    """Across ranks the loss's value is known once reduced: NaN before (a read too early shows), then
    the per-layer way's value."""
    model = Stack(checkpointed=False)
    router = model.layers[0].router
    router.balance_group = dist.group.WORLD
    torch.manual_seed(20 + rank)
    x = torch.randn(6, DIM)
    routing = router(x)
    assert routing.balance_loss.isnan()
    routing.aux_loss.backward()
    reference = model.layers[1].router
    reference.balance_group = dist.group.WORLD
    reference.load_state_dict(router.state_dict())
    expected = per_layer_loss(reference, reference.route(x).scores, reference.route(x).tokens_per_expert)
    assert torch.equal(routing.balance_loss, expected), (routing.balance_loss, expected)


def test_one_all_reduce_a_micro_batch_gives_the_per_layer_results_bit_for_bit():
    run_ranks(worker, 2)
