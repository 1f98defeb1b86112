"""The MoE layer at EP = 1 captured in a CUDA graph, forward and backward: replays equal eager.

Capture fails on any host sync (a `.item()`, a `.tolist()`, a data-dependent shape), so this is
also the GPU check that the layer's path has none. Marked gpu: the lead runs it
(`pytest -m gpu tests/test_cuda_graph.py`); skipped without CUDA.
"""

import copy

import pytest
import torch

from torchtitan_moe.moe import MoE, MoEArgs, RouterOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DIM, EXPERTS, TOP_K, INTER, TOKENS = 256, 16, 4, 128, 512


def grads(layer: MoE, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad, layer.router.gate.weight.grad, layer.experts.w13.grad, layer.experts.w2.grad]


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_moe_layer_forward_backward_replays_a_cuda_graph_as_eager(kernels):
    torch.manual_seed(0)
    layer = MoE(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, inter_dim=INTER, kernels=kernels,
                        router=RouterOptions(init_std=0.5, bias_update_rate=0.0)), DIM).cuda()
    layer.init_weights(out_std=0.02)
    layer.to(torch.bfloat16)
    layer.router.float()  # the router's gate and bias stay fp32, as under FSDP2's mixed precision
    eager = copy.deepcopy(layer)
    static_x = torch.randn(1, TOKENS, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_grad = torch.randn(1, TOKENS, DIM, device="cuda", dtype=torch.bfloat16)

    side = torch.cuda.Stream()  # warm up (Triton compiles, the allocator settles) off the default stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            layer(static_x).backward(static_grad)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
        static_out.backward(static_grad)

    for step in range(2):  # new tokens each replay, copied into the captured input
        x = torch.randn_like(static_x)
        grad = torch.randn_like(static_grad)
        static_x.data.copy_(x)
        static_grad.copy_(grad)
        for g in grads(layer, static_x):
            g.zero_()
        graph.replay()
        torch.cuda.synchronize()

        eager.zero_grad(set_to_none=True)
        x_eager = x.clone().requires_grad_()
        out = eager(x_eager)
        out.backward(grad)
        torch.testing.assert_close(static_out, out, rtol=0, atol=0, msg=lambda m: f"replay {step}: out: {m}")
        for name, got, expected in zip(("x", "gate", "w13", "w2"), grads(layer, static_x), grads(eager, x_eager)):
            torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m: f"replay {step}: grad {name}: {m}")
