"""The global-batch balance loss does not depend on the layout: the same global micro-batches
spread over 1, 2 or 4 data-parallel ranks, with EP = 1, 2 or 4, under gradient accumulation,
give the same objective value and the same gate gradient as one float64 reference.

Four gloo processes run every layout in turn (ranks past a layout's data-parallel degree
wait); rank 0 compares. The micro-batch loss, on the same layouts, does change with them.
"""


import torch
import torch.distributed as dist

from spawn_ranks import rank_group, run_ranks
from torchtitan_moe.dispatch.all_to_all import AllToAllDispatcher
from torchtitan_moe.moe import MoE, MoEArgs, RouterOptions
from torchtitan_moe.moe.balance import reduce_step_stats, set_aux_loss_scale

DIM, EXPERTS, TOP_K, INTER = 16, 8, 2, 12
SEQS, SEQ_LEN, MICRO_BATCHES = 8, 6, 2  # one global micro-batch: 8 sequences, on every layout
COEFF, Z_COEFF = 0.05, 0.002
LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]  # (data-parallel ranks, EP degree)


def make_layer(recipe: str) -> MoE:
    torch.manual_seed(0)  # the same weights on every rank and layout
    layer = MoE(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, inter_dim=INTER, padding="none", kernels="torch",
                        router=RouterOptions(balance_loss=recipe, balance_loss_coeff=COEFF, z_loss_coeff=Z_COEFF)), DIM)
    layer.init_weights(out_std=0.1)
    layer.router.gate.weight.data.normal_(std=0.5)
    return layer


def global_batches() -> list[torch.Tensor]:
    torch.manual_seed(7)
    return [torch.randn(SEQS, SEQ_LEN, DIM) for _ in range(MICRO_BATCHES)]


def run_layout(recipe: str, dp: int, ep: int, rank: int, groups: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One optimizer step's forward/backward on this layout -> (gate grad summed over ranks,
    logged [balance, z]) on rank 0; None on ranks outside the layout."""
    dp_group, ep_group = groups["dp"], groups["ep"]
    if rank >= dp:
        return None
    layer = make_layer(recipe)
    layer.router.balance_group = dp_group
    if ep > 1:
        mine = slice((rank % ep) * EXPERTS // ep, (rank % ep + 1) * EXPERTS // ep)
        layer.experts.w13 = torch.nn.Parameter(layer.experts.w13.detach()[mine].clone())
        layer.experts.w2 = torch.nn.Parameter(layer.experts.w2.detach()[mine].clone())
        layer.set_dispatcher(AllToAllDispatcher(EXPERTS, ep_group, align=8, kernels="torch"))
    set_aux_loss_scale([layer], 1.0 / (MICRO_BATCHES * dp))  # as the trainer does
    share = SEQS // dp
    for batch in global_batches():
        out = layer(batch[rank * share : (rank + 1) * share])
        (out * 0).sum().backward()  # the gate's gradient is the router losses' alone
    grad = layer.router.gate.weight.grad.clone()
    dist.all_reduce(grad, group=dp_group)  # FSDP's sum over data-parallel ranks
    reduce_step_stats([layer], dp_group)
    return grad, layer.last_router_losses.clone()


def reference() -> tuple[torch.Tensor, torch.Tensor]:
    """float64, one process, from the formulas: the mean over micro-batches m of
    COEFF * sum_e f_e(m) P_e(m) + Z_COEFF * mean lse^2, f(m) over micro-batches 1..m, P(m) over m."""
    layer = make_layer("global_batch")
    weight = layer.router.gate.weight.detach().double().requires_grad_()
    seen, balance, z = [], 0.0, 0.0
    for batch in global_batches():
        tokens = batch.reshape(-1, DIM)
        with torch.no_grad():
            seen.append(layer.router(tokens).experts)  # the fp32 router's choices
        counts = torch.bincount(torch.cat(seen).flatten(), minlength=EXPERTS).double()
        f = EXPERTS * counts / counts.sum()
        logits = tokens.double() @ weight.T
        scores = torch.softmax(logits, -1)
        balance = balance + (f * scores.mean(0)).sum() / MICRO_BATCHES
        z = z + torch.logsumexp(logits, -1).square().mean() / MICRO_BATCHES
    (COEFF * balance + Z_COEFF * z).backward()
    return weight.grad, torch.stack([balance.detach(), z.detach()])


def worker(rank: int, world: int, port: int, failures) -> None:
    with rank_group(rank, world, port, failures):
        results = {}
        for recipe in ("global_batch", "micro_batch"):
            for dp, ep in LAYOUTS:
                # Every process makes every group, in the same order (torch.distributed's rule).
                dp_group = dist.new_group(list(range(dp)))
                ep_groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, dp, ep)]
                groups = {"dp": dp_group, "ep": ep_groups[rank // ep] if rank < dp else None}
                results[recipe, dp, ep] = run_layout(recipe, dp, ep, rank, groups)
                dist.barrier()
        if rank != 0:
            return
        ref_grad, ref_losses = reference()
        for dp, ep in LAYOUTS:
            grad, losses = results["global_batch", dp, ep]
            where = f"global_batch, dp = {dp}, ep = {ep}"
            torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0, msg=lambda m: f"{where}: {m}")
            torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-8, msg=lambda m: f"{where}: {m}")
        # The micro-batch loss counts f per rank: the same data on more ranks is another loss.
        single, split = results["micro_batch", 1, 1], results["micro_batch", 4, 1]
        assert abs(float(single[1][0]) - float(split[1][0])) > 1e-3, (single[1], split[1])



def test_global_batch_loss_is_the_same_on_every_layout():
    run_ranks(worker, 4)
