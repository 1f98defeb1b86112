"""All-gather and reduce-scatter of equal parts between the GPUs of one node, on their copy engines.

The all-gather dispatcher (dispatch/all_gather.py) moves whole tensors of a fixed size, so it needs
no counts, no layout and no kernel of its own: each rank pushes its part into the other ranks'
inboxes (symmetric memory, mapped into every rank's address space) with plain device copies, which
the GPU runs on its copy engines. No SM is held, unlike NCCL's or DeepEP's kernels, whose CTAs
delay a persistent grouped GEMM beside them. The
handshake is on stream memory operations (cuStreamWriteValue32 / cuStreamWaitValue32): the
GPU's front end waits for a flag, no kernel spins.

    all_gather([t [T, ...], ...])     -> [P T, ...] each, rank r's part at rows [r T, (r + 1) T)
    reduce_scatter([t [P T, ...]])    -> [T, ...] each: sum over ranks of their part r, in rank order,
                                         in fp32, rounded once to t's dtype (DeepEP's combine sums so)

Each in two halves, so that work can run while the copies do: start_all_gather(tensors).wait(), and
start_reduce_scatter({q: rank q's parts}).finish(our parts) (our parts computed after the others' left).

Every rank must make the same calls in the same order with the same shapes (equal tokens per rank).

Inbox: SLOTS slots, each message (one call, all its tensors) in slot n % SLOTS, tensor j at its own
offset with one part per source rank behind another, so that a gathered tensor is one [P T, ...]
view. Flags (int32, symmetric): ready[slot, src] = n when src's part of message n arrived, written by
src after its copy on the same stream (the write carries a memory fence); freed[slot, dst] = n when
dst has read its inbox slot's message n, written by dst; a sender waits for freed >= n - SLOTS
before it overwrites that slot. An all-gather's views stay readable until the next call started after
its wait() (whatever reads them is queued before it: that call releases them, on the current stream);
a reduce-scatter reads and releases its inbox itself.

`CollectiveTransport` does the same with torch.distributed's all_gather (any backend: gloo on CPU),
for CPU runs and as the reference of the tests.
"""

from __future__ import annotations

import ctypes
import math
import socket

import torch
import torch.distributed as dist

from torchtitan_moe.dispatch.seam import Unavailable

SLOTS = 3
_ALIGN = 256  # bytes: each tensor of a message starts aligned, so views of any dtype are
_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ


class PeerMemoryUnavailable(Unavailable):
    """Symmetric memory or peer access is missing; the message says what and what to do instead."""


def sum_in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """parts[0] + parts[1] + ... in fp32, rounded once to parts[0].dtype. Two bf16 tensors: torch's
    add computes in fp32 and rounds once, the same result in one kernel."""
    if len(parts) == 2:
        return torch.add(parts[0], parts[1])
    acc = parts[0].float()
    for part in parts[1:]:
        acc = acc + part
    return acc.to(parts[0].dtype)


def peers_problem(group: dist.ProcessGroup) -> str | None:
    """Why the ranks of `group` cannot map each other's memory (not all on one node, or GPUs without
    peer access between them), or None. Collective: every rank gathers every rank's host and GPU."""
    mine = (socket.gethostname(), torch.cuda.current_device())
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    hosts = sorted({host for host, _ in everyone})
    if len(hosts) > 1:
        return f"the EP group spans nodes {', '.join(hosts)}; its GPUs must share one node"
    blocked = [peer for _, peer in everyone if peer != mine[1] and not torch.cuda.can_device_access_peer(mine[1], peer)]
    if blocked:
        return f"GPU {mine[1]} cannot access GPU {blocked[0]} (no P2P/NVLink between them)"
    return None


class CollectiveTransport:
    """The same two calls on torch.distributed's all_gather: CPU runs (gloo), and the reference."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def all_gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.start_all_gather(tensors).wait()

    def reduce_scatter(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return _reduce_scatter(self, tensors)

    def start_all_gather(self, tensors: list[torch.Tensor]) -> _Finished:
        return _Finished([torch.cat(self._gather(t)) for t in tensors])

    def start_reduce_scatter(self, parts: dict[int, list[torch.Tensor]]) -> _Finished:
        def finish(own: list[torch.Tensor]) -> list[torch.Tensor]:
            by_rank = [own if q == self.rank else parts[q] for q in range(self.size)]
            return [sum_in_rank_order([everyone[self.rank] for everyone in
                                       (g.chunk(self.size) for g in self._gather(torch.cat([p[j] for p in by_rank])))])
                    for j in range(len(own))]
        return _Finished(finish)

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return parts


class _Finished:
    """The halves of a call that ran whole where it was started (CollectiveTransport)."""

    def __init__(self, result):
        self.result = result

    def wait(self):
        return self.result

    def finish(self, own):
        return self.result(own)


def _reduce_scatter(transport, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The whole call from its halves: rank q's rows of each tensor [P T, ...] to q, ours kept."""
    for t in tensors:
        if t.shape[0] % transport.size:
            raise ValueError(f"reduce_scatter: {t.shape[0]} rows do not split into {transport.size} equal parts")
    rows = [t.shape[0] // transport.size for t in tensors]

    def part(q: int) -> list[torch.Tensor]:
        return [t[q * r:(q + 1) * r] for t, r in zip(tensors, rows)]

    peers = {q: part(q) for q in range(transport.size) if q != transport.rank}
    return transport.start_reduce_scatter(peers).finish(part(transport.rank))


class _Driver:
    """cuStreamWriteValue32 / cuStreamWaitValue32 from the CUDA driver (torch loads it)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self.write, self.wait = lib.cuStreamWriteValue32_v2, lib.cuStreamWaitValue32_v2
        for fn in (self.write, self.wait):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int

    def write_value(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        _check(self.write(ctypes.c_void_p(stream.cuda_stream), address, value, 0), "cuStreamWriteValue32")

    def wait_value(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        _check(self.wait(ctypes.c_void_p(stream.cuda_stream), address, value, _GEQ), "cuStreamWaitValue32")


def _check(result: int, name: str) -> None:
    if result != 0:
        raise RuntimeError(f"{name} failed: CUresult {result}")


class PeerMemoryTransport:
    """The two calls on copy engines between the GPUs of `group` (one node, peer access between all).

    The inbox is sized by the first call (or a larger later one: then every rank waits for its
    streams and they all allocate anew, collectively)."""

    def __init__(self, group: dist.ProcessGroup):
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError as e:
            raise PeerMemoryUnavailable(f"torch.distributed._symmetric_memory cannot be imported ({e})") from None
        problem = peers_problem(group)
        if problem:
            raise PeerMemoryUnavailable(problem)
        self.symm_mem = symm_mem
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.driver = _Driver()
        self.copy_stream = torch.cuda.Stream(self.device, priority=-1)  # pushes to the peers
        self.self_stream = torch.cuda.Stream(self.device, priority=-1)  # the own part, beside them
        self.capacity = 0  # bytes of one slot
        self.seq = 0  # messages so far (the same on every rank)
        self.unreleased: list[tuple[int, int]] = []  # (seq, slot) of all-gathers waited for, views maybe read

    # -- buffers ------------------------------------------------------------------------------

    def _ensure(self, slot_bytes: int) -> None:
        if slot_bytes <= self.capacity:
            return
        if self.capacity:  # every rank gets here at the same call: drain, then reallocate together
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group)
        capacity = math.ceil(slot_bytes / _ALIGN) * _ALIGN
        sm = self.symm_mem
        inbox = sm.empty(SLOTS * capacity, dtype=torch.uint8, device=self.device)
        flags = sm.empty(2 * SLOTS * self.size, dtype=torch.int32, device=self.device).zero_()
        name = self.group.group_name
        inbox_handle, flags_handle = sm.rendezvous(inbox, name), sm.rendezvous(flags, name)
        self.inbox, self.flags = inbox, flags
        self.peer_inbox = {q: inbox_handle.get_buffer(q, (SLOTS * capacity,), torch.uint8)
                           for q in range(self.size) if q != self.rank}
        self.peer_flags = {q: flags_handle.get_buffer(q, (2 * SLOTS * self.size,), torch.int32)
                           for q in range(self.size) if q != self.rank}
        self.capacity, self.seq, self.unreleased = capacity, 0, []
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # every rank's flags are zero before anyone writes them

    def _ready(self, slot: int, src: int) -> int:
        return slot * self.size + src

    def _freed(self, slot: int, dst: int) -> int:
        return SLOTS * self.size + slot * self.size + dst

    @staticmethod
    def _layout(sizes: list[int]) -> list[int]:
        offsets, at = [], 0
        for size in sizes:
            offsets.append(at)
            at += math.ceil(size / _ALIGN) * _ALIGN
        return offsets + [at]

    # -- the two calls, each in two halves ----------------------------------------------------

    def all_gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.start_all_gather(tensors).wait()

    def reduce_scatter(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return _reduce_scatter(self, tensors)

    def start_all_gather(self, tensors: list[torch.Tensor]) -> _Gathering:
        """Queue the pushes of `tensors` [T, ...] to every rank (and to our own inbox); `.wait()` makes
        the current stream wait for everyone's and returns the [P T, ...] views."""
        tensors = [t.contiguous() for t in tensors]
        part_bytes = [t.numel() * t.element_size() for t in tensors]
        offsets = self._layout([self.size * b for b in part_bytes])
        seq, slot = self._start(offsets[-1])
        base = slot * self.capacity
        current = torch.cuda.current_stream(self.device)
        for stream, targets in ((self.copy_stream, self.peer_inbox.items()),
                                (self.self_stream, [(self.rank, self.inbox)])):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for q, inbox in targets:
                    for t, at, nbytes in zip(tensors, offsets, part_bytes):
                        start = base + at + self.rank * nbytes
                        inbox[start:start + nbytes].copy_(t.view(-1).view(torch.uint8))
                    if q != self.rank:
                        self._write(stream, self.peer_flags[q], self._ready(slot, self.rank), seq)
            for t in tensors:
                t.record_stream(stream)
        views = [self.inbox[base + at: base + at + self.size * nbytes].view(t.dtype).view(self.size * t.shape[0],
                                                                                           *t.shape[1:])
                 for t, at, nbytes in zip(tensors, offsets, part_bytes)]
        return _Gathering(self, seq, slot, views)

    def start_reduce_scatter(self, parts: dict[int, list[torch.Tensor]]) -> _Summing:
        """Queue the push of parts[q] (rank q's rows of each tensor) to every other rank q; `.finish(own)`
        waits for the others' parts for us and sums them with ours in rank order."""
        first = parts[next(iter(parts))]
        part_bytes = [t.numel() * t.element_size() for t in first]
        offsets = self._layout([self.size * b for b in part_bytes])
        seq, slot = self._start(offsets[-1])
        base = slot * self.capacity
        current = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(current)
        with torch.cuda.stream(self.copy_stream):
            for q, inbox in self.peer_inbox.items():
                for t, at, nbytes in zip(parts[q], offsets, part_bytes):
                    start = base + at + self.rank * nbytes
                    inbox[start:start + nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
                    t.record_stream(self.copy_stream)
                self._write(self.copy_stream, self.peer_flags[q], self._ready(slot, self.rank), seq)
        received = {src: [self.inbox[base + at + src * nbytes: base + at + (src + 1) * nbytes].view(t.dtype).view(t.shape)
                          for t, at, nbytes in zip(first, offsets, part_bytes)] for src in self.peer_inbox}
        return _Summing(self, seq, slot, received)

    # -- the handshake ------------------------------------------------------------------------

    def _start(self, slot_bytes: int) -> tuple[int, int]:
        """The next message's (seq, slot), once the all-gathers waited for so far are released and the
        peers have released this slot's previous message (the copy stream waits for that, not the host)."""
        self._ensure(slot_bytes)
        current = torch.cuda.current_stream(self.device)
        for seq, slot in self.unreleased:
            self._release(seq, slot, current)
        self.unreleased = []
        self.seq += 1
        seq, slot = self.seq, self.seq % SLOTS
        if seq > SLOTS:
            for q in self.peer_inbox:
                self.driver.wait_value(self.copy_stream, _address(self.flags, self._freed(slot, q)), seq - SLOTS)
        return seq, slot

    def _arrive(self, seq: int, slot: int) -> None:
        """The current stream waits for every peer's part of message `seq`."""
        current = torch.cuda.current_stream(self.device)
        for q in self.peer_inbox:
            self.driver.wait_value(current, _address(self.flags, self._ready(slot, q)), seq)

    def _release(self, seq: int, slot: int, stream: torch.cuda.Stream) -> None:
        """Tell the peers that we have read message `seq` (whatever reads it is queued on `stream`)."""
        for flags in self.peer_flags.values():
            self._write(stream, flags, self._freed(slot, self.rank), seq)

    def _write(self, stream: torch.cuda.Stream, flags: torch.Tensor, index: int, value: int) -> None:
        self.driver.write_value(stream, _address(flags, index), value)


class _Gathering:
    """A started all-gather (PeerMemoryTransport.start_all_gather)."""

    def __init__(self, transport: PeerMemoryTransport, seq: int, slot: int, views: list[torch.Tensor]):
        self.transport, self.seq, self.slot, self.views = transport, seq, slot, views

    def wait(self) -> list[torch.Tensor]:
        """The gathered [P T, ...] views, readable on the current stream until the transport's next call."""
        t = self.transport
        t._arrive(self.seq, self.slot)
        # Our own part; our pushes need no wait here (record_stream keeps their sources).
        torch.cuda.current_stream(t.device).wait_stream(t.self_stream)
        t.unreleased.append((self.seq, self.slot))
        return self.views


class _Summing:
    """A started reduce-scatter (PeerMemoryTransport.start_reduce_scatter)."""

    def __init__(self, transport: PeerMemoryTransport, seq: int, slot: int, received: dict[int, list[torch.Tensor]]):
        self.transport, self.seq, self.slot, self.received = transport, seq, slot, received

    def finish(self, own: list[torch.Tensor]) -> list[torch.Tensor]:
        """own: our rows of each tensor -> the sums over ranks in rank order (fp32, rounded once)."""
        t = self.transport
        t._arrive(self.seq, self.slot)
        out = [sum_in_rank_order([own[j] if src == t.rank else self.received[src][j] for src in range(t.size)])
               for j in range(len(own))]
        t._release(self.seq, self.slot, torch.cuda.current_stream(t.device))  # read by the sums just queued
        return out


def _address(flags: torch.Tensor, index: int) -> int:
    return flags.data_ptr() + index * flags.element_size()
