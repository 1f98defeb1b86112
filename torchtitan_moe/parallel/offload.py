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

The host memory is one pinned buffer per block and tensor, of the tensor's exact size, allocated at the first
step and reused by every step (`_HostMemory`): torch's pinned allocator rounds each allocation up to a power of
two, up to twice the memory (the full model's block input at local batch 36 is 0.56 GiB: 1 GiB there).

With `[activation_checkpoint] offload_attention` the offload is also the attention's keeper
(ops/attention.py): each offloaded block's attention output and log-sum-exp follow its input to host memory
and back, and the block's recompute takes them instead of running attention's forward again.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn


class _HostMemory:
    """Pinned host tensors of exact sizes, one per (block, tensor) of a forward, reused by every forward, and
    which record holds each block's (`owner`): a record whose buffers a later forward took cannot come back.
    Their pages are unregistered before they are freed: pages freed while registered stay registered, and a
    later allocation on them makes CUDA's copies from it fail ('invalid argument')."""

    PAGE = 4096

    def __init__(self):
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._pinned: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}  # key -> (its memory, registered ptr)
        self.owner: dict[int, _Offloaded] = {}
        weakref.finalize(self, _unpin, self._pinned)

    def buffer(self, key: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
        t = self._buffers.get(key)
        if t is None or (t.shape, t.stride(), t.dtype) != (like.shape, like.stride(), like.dtype):
            _unpin({key: self._pinned.pop(key)} if key in self._pinned else {})
            t = self._pinned_like(key, like) if like.is_cuda else torch.empty_like(like, device="cpu")
            self._buffers[key] = t
        return t

    def _pinned_like(self, key: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
        """A host tensor of like's shape, strides and dtype on pages of its own, page-locked (cudaHostRegister)."""
        nbytes = like.numel() * like.element_size()
        size = -(-nbytes // self.PAGE) * self.PAGE
        flat = torch.empty(size + self.PAGE, dtype=torch.uint8)
        pages = flat[-flat.data_ptr() % self.PAGE:][:size]
        error = cuda_error(lambda: torch.cuda.cudart().cudaHostRegister(pages.data_ptr(), size, 0))
        if error:
            raise RuntimeError(f"offload_inputs: cudaHostRegister of {size / 2**20:.0f} MiB of host memory failed "
                               f"({error}): the node is out of memory that can be pinned")
        self._pinned[key] = (flat, pages.data_ptr())
        return pages[:nbytes].view(like.dtype).as_strided(like.shape, like.stride())


def cuda_error(call) -> str:
    """What a torch.cuda.cudart() call returned or raised, as text ('' where it succeeded: cudaSuccess)."""
    try:
        code = call()
    except RuntimeError as e:  # torch raises some CUDA errors (AcceleratorError) instead of returning them
        return str(e).splitlines()[0]
    return "" if int(code) == 0 else f"CUDA error {int(code)}"


def _unpin(pinned: dict[tuple[int, int], tuple[torch.Tensor, int]]) -> None:
    """Unregister these buffers' pages once no copy reads them (the memory is freed after, with the last reference)."""
    if pinned:
        torch.cuda.synchronize()
    for _, ptr in pinned.values():
        torch.cuda.cudart().cudaHostUnregister(ptr)
    pinned.clear()


class _Offloaded:
    """One block's tensors in host memory: its input, then its attention's out and lse where they are kept.
    `gpu` holds them on the GPU too while that is needed: the tensors themselves until the next block's save
    lets them go (or the backward takes them), or their copies brought back, until the backward takes them;
    `ready` is the event of the last copy (out or back, on the one offload stream: it follows the others) the
    compute stream waits for before it reads `gpu` or lets it go."""

    __slots__ = ("index", "host", "device", "previous", "gpu", "ready")

    def __init__(self, index: int, device: torch.device, previous: _Offloaded | None):
        self.index = index  # the block's place among the offloaded: its host buffers
        self.host: list[torch.Tensor] = []
        self.device = device
        self.previous = previous  # the block before this one: its backward comes next
        self.gpu: list[torch.Tensor] | None = None
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
        self._memory = _HostMemory()
        self._shape: torch.Size | None = None  # the running block's input shape (None: no block running)
        self._last: _Offloaded | None = None  # this forward's latest offloaded input
        self._running: _Offloaded | None = None  # the running block's, once its input is saved
        self._ahead: _Offloaded | None = None  # brought back ahead of its backward, not yet taken
        self._recomputed: list[torch.Tensor] = []  # the attention outputs of the block being recomputed
        self.offloaded = 0  # inputs offloaded (for tests and the log)
        self.kept = 0  # attention outputs kept (out and lse: one a block)

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
            self._recomputed = []
        self._shape = x.shape

    def exit_block(self) -> None:
        self._shape = None
        self._running = None

    def pack(self, t: torch.Tensor):
        if self._shape is None or t.shape != self._shape or isinstance(t, nn.Parameter) or not t.is_floating_point():
            return t
        saved = _Offloaded(0 if self._last is None else self._last.index + 1, t.device, self._last)
        self._memory.owner[saved.index] = saved
        if t.is_cuda and self._last is not None:
            self._last.let_go()  # the block before: its copies out have had that block's compute to run
        self._copy_out(saved, [t])
        self._last = self._running = saved
        self.offloaded += 1
        return saved

    def keep(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """The keeper's half in the forward (ops/attention.py): the running block's attention outputs follow its
        input. Outside an offloaded block's forward (the last block, a forward that saves nothing): not kept."""
        if self._running is None:
            return
        self._copy_out(self._running, [out, lse])
        self.kept += 1

    def take(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keeper's half in the recompute: the attention outputs its block's first forward made (brought back
        with the block's input), or None where there are none (a forward, the last block)."""
        if self._shape is not None or not self._recomputed:
            return None
        out, lse = self._recomputed
        self._recomputed = []
        if out.shape != q.shape:
            raise RuntimeError(f"offload_attention: the recompute's attention has q {tuple(q.shape)}, but its block's "
                               f"forward kept an output of {tuple(out.shape)}")
        return out, lse

    def _copy_out(self, saved: _Offloaded, tensors: list[torch.Tensor]) -> None:
        first = len(saved.host)
        hosts = [self._memory.buffer((saved.index, first + i), t) for i, t in enumerate(tensors)]
        if tensors[0].is_cuda:
            stream = self.stream()
            stream.wait_stream(torch.cuda.current_stream(tensors[0].device))  # written on the compute stream
            with torch.cuda.stream(stream):
                for host, t in zip(hosts, tensors):
                    host.copy_(t, non_blocking=True)
                saved.ready = torch.cuda.Event()
                saved.ready.record(stream)
            saved.gpu = (saved.gpu or []) + tensors
        else:
            for host, t in zip(hosts, tensors):
                host.copy_(t)
        saved.host += hosts

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
        saved.previous = None  # the chain lets go: each record is freed with its block's backward
        if saved.ready is not None:
            torch.cuda.current_stream(saved.device).wait_event(saved.ready)
        (t, *self._recomputed), saved.gpu, saved.ready = saved.gpu, None, None  # the backward holds them
        return t  # (asked again: brought back again)

    def _bring_back(self, saved: _Offloaded) -> None:
        if self._memory.owner.get(saved.index) is not saved:
            raise RuntimeError("offload_inputs: a block's backward asks for its input, but a later forward has "
                               "written its host memory since: run each forward's backward before the next forward")
        gpu = [torch.empty_like(host, device=saved.device) for host in saved.host]
        if saved.device.type == "cuda":
            stream = self.stream()
            # the memory may be blocks the compute stream frees
            stream.wait_stream(torch.cuda.current_stream(saved.device))
            with torch.cuda.stream(stream):
                for t, host in zip(gpu, saved.host):
                    t.copy_(host, non_blocking=True)
                saved.ready = torch.cuda.Event()
                saved.ready.record(stream)
        else:
            for t, host in zip(gpu, saved.host):
                t.copy_(host)
        saved.gpu = gpu


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
