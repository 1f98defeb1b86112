"""Results exchanged outside autograd, given the backward that sends their gradients back.

A dispatcher whose exchange autograd cannot see (DeepEP's kernels, the all-gather transport's copies,
torch.distributed under no_grad), or that hands back what a forward kept for its recompute
(dispatch/replay.py), attaches the results to the tensors they came from here:

    outs = with_backward(results, inputs, backward)   # the results, now outputs of the inputs
        backward(grads, needs) -> one gradient per input: the reverse exchange
            grads   one per result; zeros where a result got no gradient: every rank makes the same
                    calls, so a rank sends zeros rather than nothing
            needs   which inputs need a gradient (ctx.needs_input_grad)

The results travel in a list, so that autograd does not take them for inputs returned unchanged.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

Backward = Callable[[list[torch.Tensor], tuple[bool, ...]], Sequence[torch.Tensor | None]]


class _WithBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backward: Backward, results: list[torch.Tensor], *inputs: torch.Tensor):
        ctx.reverse = backward
        return tuple(results)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, None, *ctx.reverse(list(grads), ctx.needs_input_grad[2:]))


def with_backward(results: list[torch.Tensor], inputs: Sequence[torch.Tensor], backward: Backward) -> tuple[torch.Tensor, ...]:
    """`results` (computed from `inputs` outside autograd, or replayed) as differentiable outputs of `inputs`."""
    return _WithBackward.apply(backward, list(results), *inputs)
