"""Checkpointed blocks' inputs in host memory between their forward and their backward
([activation_checkpoint] offload_inputs).

Under full recompute a block keeps one tensor for its backward: its input x [B, S, D], where the recompute
starts. Over the full Qwen3-30B-A3B's 48 layers at local batch 16 that is 12 GiB a GPU, the largest part of the
step's activations. With offloading, each block's input is copied to pinned host memory on a side stream while
the block computes, and copied back one block ahead of its backward:

    forward   block k saves x_k        -> D2H on the offload stream; x_k is let go at block k+1's save, after the
                                          compute stream waits for that copy
    backward  block k's recompute asks for x_k (waits for its copy back) and starts the copy back of x_{k-1}

No tensor is marked with `record_stream`: the caching allocator would hold each one until the offload stream
passes the point of its release, and the host runs several blocks ahead of the GPU, so about as many block
inputs as it runs ahead stayed allocated (9 at the backward's peak of the full model, 2.25 GiB at local batch
16). Instead the compute stream waits for each copy before the tensor is let go, and the allocator reuses its
memory in the compute stream's order. The same bits come back. The last block's input stays on the GPU (its
backward follows the forward at once), and so does the input offloaded last until the backward takes it: no copy
back. What is offloaded is the tensor the checkpoint saves of the block's first argument's shape; the other saved
inputs (the rope cache, positions: shared by every block, or small) stay. On a CPU the copies are plain copies
(the tests' path): nothing is saved there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class _Offloaded:
    """One block input in host memory. `gpu` holds it on the GPU too while that is needed: the input itself
    until the next block's save lets it go (or the backward takes it), or its copy brought back, until the
    backward takes it; `ready` is the copy's event (out or back) the compute stream waits for before it reads
    `gpu` or lets it go."""

    __slots__ = ("host", "device", "previous", "gpu", "ready")

    def __init__(self, host: torch.Tensor, device: torch.device, previous: _Offloaded | None):
        self.host = host
        self.device = device
        self.previous = previous  # the block before this one: its backward comes next
        self.gpu: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None

    def let_go(self) -> None:
        """Drop `gpu` once the compute stream has waited for its copy (the allocator may reuse it from there)."""
        if self.gpu is not None and self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
        self.gpu = None


class InputOffload:
    """The saved-tensor hooks of the offloaded blocks, one side stream for their copies."""

    def __init__(self):
        self._stream: torch.cuda.Stream | None = None
        self._shape: torch.Size | None = None  # the running block's input shape (None: no block running)
        self._last: _Offloaded | None = None  # this forward's latest offloaded input
        self._ahead: _Offloaded | None = None  # brought back ahead of its backward, not yet taken
        self.offloaded = 0  # inputs offloaded (for tests and the log)

    def stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def enter_block(self, first: bool, x: torch.Tensor) -> None:
        if first:  # a new forward: its blocks chain from here
            if self._ahead is not None:  # a backward that stopped early left a copy back unread
                self._ahead.let_go()
                self._ahead = None
            self._last = None
        self._shape = x.shape

    def exit_block(self) -> None:
        self._shape = None

    def pack(self, t: torch.Tensor):
        if self._shape is None or t.shape != self._shape or isinstance(t, nn.Parameter) or not t.is_floating_point():
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        saved = _Offloaded(host, t.device, self._last)
        if t.is_cuda:
            if self._last is not None:
                self._last.let_go()  # the block before: its copy out has had that block's compute to run
            stream = self.stream()
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written on the compute stream
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
                saved.ready = torch.cuda.Event()
                saved.ready.record(stream)
            saved.gpu = t
        else:
            host.copy_(t)
        self._last = saved
        self.offloaded += 1
        return saved

    def unpack(self, saved):
        if not isinstance(saved, _Offloaded):
            return saved
        if saved.gpu is None:
            self._bring_back(saved)
        if saved.previous is not None and saved.previous.gpu is None:
            self._bring_back(saved.previous)  # ahead of the next block's backward
            self._ahead = saved.previous
        if self._ahead is saved:
            self._ahead = None
        saved.previous = None  # the chain lets go: each host copy is freed with its block's backward
        if saved.ready is not None:
            torch.cuda.current_stream(saved.device).wait_event(saved.ready)
        t, saved.gpu, saved.ready = saved.gpu, None, None  # the backward holds it (asked again: brought back again)
        return t

    def _bring_back(self, saved: _Offloaded) -> None:
        t = torch.empty(saved.host.shape, dtype=saved.host.dtype, device=saved.device)
        if t.is_cuda:
            stream = self.stream()
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t's memory may be a block the compute stream frees
            with torch.cuda.stream(stream):
                t.copy_(saved.host, non_blocking=True)
                saved.ready = torch.cuda.Event()
                saved.ready.record(stream)
        else:
            t.copy_(saved.host)
        saved.gpu = t


def offload_block_inputs(blocks: Sequence[nn.Module]) -> InputOffload:
    """Offload the inputs of every block but the last (checkpointed blocks, in forward order): each block's
    forward runs under the offload's saved-tensor hooks, entered by a forward pre-hook and left by a forward hook
    that also runs when the forward raises."""
    offload = InputOffload()
    for index, block in enumerate(blocks[:-1]):
        hooks = torch.autograd.graph.saved_tensors_hooks(offload.pack, offload.unpack)

        def enter(module, args, first=index == 0, hooks=hooks):
            offload.enter_block(first, args[0])
            hooks.__enter__()

        def leave(module, args, output, hooks=hooks):
            hooks.__exit__(None, None, None)
            offload.exit_block()

        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave, always_call=True)
    return offload
