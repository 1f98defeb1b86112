"""[dispatch] overlap = "wgrad" (seam.WeightGradients) against the plain backward, on 2 gloo ranks.

Two MoE layers on the all_gather dispatcher, the experts outside FSDP2 with bf16 working copies: the
same weights, tokens and output gradient with and without the deferral. The deferred GEMMs are the same
calls on the same tensors, so everything must agree bitwise: the output, the tokens' and the gates'
gradients, and the experts' (on their working copies, or in fp32 on the masters over two micro-batches).
And they must run where they pay: each backward exchange runs one between queueing its copies and waiting
for them, and what is left runs before backward() returns. On 2 GPUs the same on the copy-engine transport
with the Triton kernels.
"""

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from spawn_ranks import rank_group, run_ranks
from torchtitan_moe.dispatch import peer_memory
from torchtitan_moe.dispatch.all_gather import AllGatherDispatcher, build_transport
from torchtitan_moe.models.qwen3_moe.parallelize import keep_experts_unsharded
from torchtitan_moe.moe import MoE, MoEArgs
from torchtitan_moe.seam import WeightGradients

DIM, EXPERTS, TOP_K, INTER, LAYERS = 64, 8, 3, 32, 2


def make_layers(rank: int, world: int, later: WeightGradients | None, working_gradients: bool,
                keep_exchanges: bool, transport, kernels: str, device: str) -> list[MoE]:
    mine = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    layers = []
    for i in range(LAYERS):
        torch.manual_seed(i)  # the same weights on every rank (this rank's experts), other ones per layer
        layer = MoE(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, inter_dim=INTER, padding="always", kernels=kernels,
                            router_init_std=0.5, bias_update_rate=0.0, balance_loss="micro_batch",
                            balance_loss_coeff=0.1), DIM)
        layer.init_weights(out_std=0.1)
        for name in ("w13", "w2"):
            setattr(layer.experts, name, torch.nn.Parameter(getattr(layer.experts, name).detach()[mine].clone()))
        layer.to(device)
        keep_experts_unsharded(layer.experts, torch.bfloat16)  # as parallelize leaves a one-rank FSDP group
        layer.experts.refresh_working_copies()
        if working_gradients:
            layer.experts.keep_working_gradients()
        dispatcher = AllGatherDispatcher(EXPERTS, transport, align=8, kernels=kernels)
        dispatcher.keep_exchanges = keep_exchanges
        layer.set_dispatcher(dispatcher)
        dispatcher.weight_gradients = layer.experts.deferred = later
        layers.append(layer)
    return layers


def forward(layers: list[MoE], x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    for layer in layers:
        x = x + (checkpoint(layer, x, use_reentrant=False) if use_checkpoint else layer(x))
    return x


def record(events: list, later: WeightGradients | None) -> None:
    """Append 'start' and 'end' for each half of the transport's calls, 'wgrad' for each deferred GEMM run."""
    halves = {peer_memory.CollectiveTransport: ("start_all_gather", "start_reduce_scatter"),
              peer_memory.PeerMemoryTransport: ("start_all_gather", "start_reduce_scatter"),
              peer_memory._Finished: ("wait", "finish"), peer_memory._Gathering: ("wait",),
              peer_memory._Summing: ("finish",)}
    for cls, names in halves.items():
        for name in names:
            original = getattr(cls, name)
            event = "start" if name.startswith("start") else "end"
            setattr(cls, name, lambda self, *a, _f=original, _e=event: events.append(_e) or _f(self, *a))
    if later is not None:
        defer = later.defer
        later.defer = lambda gradient: defer(lambda: events.append("wgrad") or gradient())


def worker(rank: int, world: int, port: int, working_gradients: bool, use_checkpoint: bool, device: str, failures):
    if device == "cuda":
        torch.cuda.set_device(rank)
    with rank_group(rank, world, port, failures, "nccl" if device == "cuda" else "gloo"):
        transport = build_transport(dist.group.WORLD, torch.device(device, rank) if device == "cuda" else torch.device(device))
        kernels = "triton" if device == "cuda" else "torch"
        torch.manual_seed(100 + rank)  # other tokens on every rank
        micro_batches = 1 if working_gradients else 2  # the masters' fp32 gradients accumulate
        tokens = 2048 if device == "cuda" else 5  # a GPU's GEMMs and copies at sizes that take time
        xs = [torch.randn(2, tokens, DIM, dtype=torch.bfloat16, device=device) for _ in range(micro_batches)]
        grads = [torch.randn(2, tokens, DIM, dtype=torch.bfloat16, device=device) for _ in range(micro_batches)]
        results, orders = {}, {}
        for overlap in ("none", "wgrad"):
            later = WeightGradients() if overlap == "wgrad" else None
            layers = make_layers(rank, world, later, working_gradients, use_checkpoint, transport, kernels, device)
            events: list = []
            record(events, later)
            outs, dxs = [], []
            for x, grad in zip(xs, grads):
                x = x.clone().requires_grad_()
                out = forward(layers, x, use_checkpoint)
                events.clear()  # the backward's
                out.backward(grad)
                outs.append(out.detach())
                dxs.append(x.grad)
                orders.setdefault(overlap, list(events))
                assert later is None or not later.pending, "deferred gradients left after backward()"
            experts = [layer.experts for layer in layers]
            weights = ([e.working[n].grad for e in experts for n in ("w13", "w2")] if working_gradients else
                       [getattr(e, n).grad for e in experts for n in ("w13", "w2")])
            assert all(w is not None for w in weights), "an expert weight without a gradient"
            results[overlap] = [*outs, *dxs, *[layer.router.gate.weight.grad for layer in layers], *weights]
        for i, (a, b) in enumerate(zip(results["wgrad"], results["none"])):
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {rank}: result {i} differs by {(a - b).abs().max()}"
        # Top layer first: its combine's all-gather (nothing deferred yet), its dispatch's reduce-scatter under its
        # w2 gradient, the lower layer's all-gather under the upper layer's w13 gradient, ...; the last one after.
        assert orders["wgrad"] == ["start", "end"] + ["start", "wgrad", "end"] * 3 + ["wgrad"], orders["wgrad"]
        assert orders["none"] == ["start", "end"] * 4, orders["none"]


CASES = [(True, False), (False, False), (True, True)]  # working_gradients, use_checkpoint


@pytest.mark.parametrize("working_gradients, use_checkpoint", CASES)
def test_deferred_weight_gradients_match_the_plain_backward_and_run_under_the_exchanges(working_gradients,
                                                                                        use_checkpoint):
    run_ranks(worker, 2, working_gradients, use_checkpoint, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the copy-engine transport needs 2 GPUs")
@pytest.mark.parametrize("working_gradients, use_checkpoint", CASES)
def test_deferred_weight_gradients_on_gpus(working_gradients, use_checkpoint):
    run_ranks(worker, 2, working_gradients, use_checkpoint, "cuda")
