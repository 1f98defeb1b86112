"""exchange: all_to_all_single over an EP group, as one opaque autograd op.

    exchange([x0 [S, ...], x1 [S, ...]], send_splits [P], recv_splits [P], group)
        -> [y0 [R, ...], y1 [R, ...]]      R = sum(recv_splits); rows of x_i go to ranks in order
    backward: the gradients go back the way they came (send and receive splits swapped)

A `torch.library` custom op with a fake implementation and registered autograd: under
torch.compile it is one node of known shape, and the collectives run eagerly inside it,
blocking (the current stream waits for NCCL before the next kernel). The tensors of one
call travel in one fixed order, so no compiler can order them differently on two ranks.

Why not `dist.all_to_all_single` inside an `autograd.Function`, traced by dynamo: dynamo
rewrites it into a functional collective copied into a fresh buffer, and on NCCL the
compiled backward returned wrong gradients (relative error 1.0 in every gradient of an
EP = 2 layer, the forward bitwise equal; also with the aot_eager backend; gloo was right).

`replay` serves activation checkpointing: the recomputed forward returns what the first
forward kept, without communicating; its backward is the usual reverse exchange.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchtitan_moe.dispatch.backward import with_backward


def _received(xs: list[torch.Tensor], recv_splits: list[int]) -> list[torch.Tensor]:
    rows = sum(recv_splits)
    return [x.new_empty((rows, *x.shape[1:])) for x in xs]


@torch.library.custom_op("torchtitan_moe::exchange", mutates_args=())
def _exchange(
    xs: list[torch.Tensor], send_splits: list[int], recv_splits: list[int], group_name: str
) -> list[torch.Tensor]:
    group = torch._C._distributed_c10d._resolve_process_group(group_name)
    outs = _received(xs, recv_splits)
    for out, x in zip(outs, xs):
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return outs


@_exchange.register_fake
def _(xs, send_splits, recv_splits, group_name):
    return _received(xs, recv_splits)


def _setup_exchange(ctx, inputs, output) -> None:
    _, ctx.send_splits, ctx.recv_splits, ctx.group_name = inputs
    ctx.received = [(y.shape, y.dtype, y.device) for y in output]


def _backward(ctx, grads):
    # An output without a gradient still travels back, as zeros: every rank makes the same calls.
    grads = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
             for g, (shape, dtype, device) in zip(grads, ctx.received)]
    return _exchange(grads, ctx.recv_splits, ctx.send_splits, ctx.group_name), None, None, None


_exchange.register_autograd(_backward, setup_context=_setup_exchange)


def exchange(
    xs: list[torch.Tensor], send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """Rows xs[i][sum(send_splits[:p]) : ...] go to rank p; rows from rank p arrive in order."""
    return _exchange(xs, send_splits, recv_splits, group.group_name)


def replay(
    xs: list[torch.Tensor], kept: list[torch.Tensor], send_splits: list[int], recv_splits: list[int],
    group: dist.ProcessGroup,
) -> list[torch.Tensor]:
    """`kept` (an earlier `exchange(xs, ...)` result) with the gradient path of a new exchange: the
    forward communicates nothing, the backward is the reverse exchange."""
    name = group.group_name
    return list(with_backward(kept, xs, lambda grads, needs: _exchange(grads, recv_splits, send_splits, name)))
