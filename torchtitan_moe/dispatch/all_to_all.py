"""All-to-all dispatcher (EP > 1, torch.distributed): each token travels once per rank.

A token routed to three experts on one rank crosses the network once and is expanded to
those experts on arrival; on the way back that rank first sums its experts' outputs for
the token (the probabilities were already applied in the experts) and returns one row.
torchtitan sends one row per (token, expert) instead: up to top_k copies of a token.

    start_dispatch  experts [T, K] ─send_plan, routing_index by rank─► counts (rows, slots) per rank
              ─all_to_all─► on their way to the host, while x [T, D] ─gather_rows─► send [T min(K, P), D]
              rows grouped by destination rank, send_meta [., 2K] (local expert ids | probs) are queued
      .wait() the one host sync: split sizes; send[:S] + meta[:S] ─all_to_all─► recv [R, D]
              recv ─gather_rows (by local expert)─► ExpertBatch [N, D]
    start_combine  y [N, D] ─combine─► per (token, source rank) [R, D] ─all_to_all─► [S, D]
      .wait() ─combine─► out [T, D]

On CUDA (eager) the exchanges run on a communication stream (one per device): `start_*` queues
them there and returns, `wait()` makes the current stream wait for their end (an event). On
CPU/gloo and under torch.compile they run where they are called (the custom op of exchange.py).
What a call needs later travels in its handle and its ExpertBatch's ctx, not in the dispatcher.

Worst-case buffers (`buffers = "worst_case"`, [dispatch] buffers): no host sync. Every rank sends
T rows to every rank, rank p's rows at [p T, p T + n_p) and tail rows (no slot, experts -1, values unread)
after them (`fixed_capacity`), so the splits are [T] * P, known without asking the device; every
rank must have the same T (training's local batch x seq_len). The receiver finds its rows' experts
in their metadata, and lays out expert-major rows for the most it can receive: P T min(K, E/P)
slots (rows past num_rows are never read: grouped_mm takes device offsets). What that costs, at
Qwen3-30B-A3B (D = 2048, I = 768, E = 128, K = 8), T = 8192 tokens/rank, align 1:

    received rows      P T             vs  P T (1 - (1 - 1/P)^K) used    EP 2: +0.4%    EP 8: +52%
    expert-major rows  P T min(K, E/P) vs  ~T K = 65,536 (balanced)      EP 2: 131,072 (2x)  EP 8: 524,288 (8x)
    per expert-major row: 2D (x) + 4I (ab) + 2I (h) + 4 (prob) = 8,708 bytes held for backward,
    plus 2D (y) in the forward: EP 2 holds +544 MiB per MoE layer, EP 8 +3.7 GiB

(per layer held until its backward: times the layers without activation checkpointing). The send
side costs nothing more (T min(K, P) rows either way at P <= K). Hence a switch, "exact" by default.

Everything but the exchanges is gather-based and deterministic (ops.gather_rows/combine).
Under activation checkpointing (`keep_exchanges`) the recomputed forward either replays the
exchanges it kept from the first forward, or exchanges the rows again with the split sizes the
first forward kept: no host sync either way (dispatch/replay.py, [dispatch] recompute).

`chunk` (start_dispatch): the chunked schedule's dispatches of one forward (moe/chunks.py); a
dispatch with exact buffers queues its exchange at `send()`, which that schedule calls before the
other chunk's experts so that the exchange runs under them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from torchtitan_moe import ops
from torchtitan_moe.dispatch.exchange import exchange, replay
from torchtitan_moe.dispatch.replay import ReplaysExchanges
from torchtitan_moe.dispatch.seam import BUFFERS, ExpertBatch, Routing, expert_major


class _Rows(NamedTuple):
    """A RoutingIndex trimmed to the rows that exist (the fields ops.gather_rows/combine read)."""

    inv: torch.Tensor
    row_slot: torch.Tensor
    top_k: int
    num_rows: torch.Tensor


class _Counts:
    """Split sizes on their way to the host: a copy started on the stream, waited for later, so
    the CPU queues independent work before it blocks (the GPU then has work while the CPU waits
    and catches up; on a one-rank group the gain was within run-to-run noise). Built from the kept
    sizes in an activation-checkpointing recompute."""

    def __init__(self, sizes, ep_size: int = 0):
        self.ep_size = ep_size
        self.sizes, self.done = sizes, None
        if isinstance(sizes, torch.Tensor) and sizes.is_cuda:
            self.sizes = torch.empty(sizes.shape, dtype=sizes.dtype, pin_memory=True).copy_(sizes, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()

    def wait(self) -> tuple[list[int], list[int], int]:
        """-> rows to each rank, rows from each rank, slots received."""
        if not isinstance(self.sizes, torch.Tensor):
            return self.sizes
        if self.done is not None:
            self.done.synchronize()
        flat, p = self.sizes.tolist(), self.ep_size
        return flat[:p], flat[p : 2 * p], flat[2 * p]


@dataclass
class _Plan:
    """What combine (and a checkpointed recompute) needs from dispatch."""

    send_index: _Rows  # token slots -> send rows, one per (token, destination rank)
    local_index: Any  # ops.RoutingIndex: received rows -> expert-major rows
    send_rows: list[int]  # rows sent to each rank
    recv_rows: list[int]  # rows received from each rank


class AllToAllDispatcher(ReplaysExchanges):
    def __init__(self, num_experts: int, group: dist.ProcessGroup, align: int = 1, kernels: str = "torch",
                 buffers: str = "exact"):
        super().__init__()
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts = {num_experts} is not divisible by the EP degree {self.ep_size}")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.ep_size
        if buffers not in BUFFERS:
            raise ValueError(f"buffers = {buffers!r}: expected one of {', '.join(map(repr, BUFFERS))}")
        self.align = align
        self.kernels = kernels
        self.buffers = buffers

    # -- exchanges, kept for activation-checkpointing replay (dispatch/replay.py) -------------

    def _exchange(self, xs: list[torch.Tensor], send: list[int], recv: list[int]) -> list[torch.Tensor]:
        if self._replaying():
            return replay(xs, self._replayed(), send, recv, self.group)
        outs = exchange(xs, send, recv, self.group)
        self._keep([y.detach() for y in outs])
        return outs

    def _plan_exchange(self, counts: torch.Tensor, chunk: int) -> _Counts:
        """counts [P, 2] (rows, slots) to each rank -> rows to/from each rank, slots received,
        on their way to the host (read them with `.wait()`)."""
        if self._recomputing():
            return _Counts(self._replayed())
        self._first_exchange(chunk)
        one_row = [1] * self.ep_size
        (recv,) = exchange([counts], one_row, one_row, self.group)
        return _Counts(torch.cat([counts[:, 0], recv[:, 0], recv[:, 1].sum().view(1)]), self.ep_size)

    # -- the communication stream (CUDA, eager) ----------------------------------------------

    def _start_exchange(self, xs: list[torch.Tensor], send: list[int], recv: list[int]):
        """-> (outs, done). On CUDA outside torch.compile the exchange runs on the device's
        communication stream (one for all layers) after the work queued so far, and `done` marks
        its end; elsewhere (CPU/gloo, compiled) it runs where it is called and `done` is None."""
        if not xs[0].is_cuda or torch.compiler.is_compiling():
            return self._exchange(xs, send, recv), None
        comm = _comm_stream(xs[0].device)
        comm.wait_stream(torch.cuda.current_stream(xs[0].device))
        with torch.cuda.stream(comm):
            outs = self._exchange(xs, send, recv)
        for x in xs:  # the caller may free them on the compute stream while the exchange reads
            x.record_stream(comm)
        done = torch.cuda.Event()
        done.record(comm)
        return outs, done

    # -- the dispatcher seam ------------------------------------------------------------------

    def send_tokens(self, x: torch.Tensor) -> None:
        pass  # which rows go where is the routing's

    def start_dispatch(self, x: torch.Tensor, routing: Routing, chunk: int = 0) -> _PendingDispatch:
        experts, probs = routing.experts, routing.probs
        num_tokens, top_k = experts.shape
        # One row per (token, rank): routing_index over each token's first slot on every rank.
        rank_slots, slots_per_rank = ops.send_plan(experts, self.local_experts, self.ep_size, backend=self.kernels)
        # A token makes at most min(K, P) rows: allocate for that, not for T*K.
        send_index = ops.routing_index(rank_slots, self.ep_size, num_slots=num_tokens * min(top_k, self.ep_size),
                                       backend=self.kernels)
        if self.buffers == "worst_case":
            return self._start_fixed(x, experts, probs, rank_slots, send_index, chunk)
        counts = torch.stack([send_index.tokens_per_expert, slots_per_rank], dim=1)
        pending = self._plan_exchange(counts, chunk)

        # Queued while the counts travel to the host: the rows and their metadata, for every row
        # that may be sent (rows past the sent ones are never read). Each row carries its
        # token's slots on that rank: local expert ids and probs.
        rows = ops.gather_rows(x, send_index, backend=self.kernels)  # [T min(K, P), D]
        meta = ops.send_meta(send_index.row_slot, experts, probs, self.local_experts, backend=self.kernels)  # [., 2K]
        return _PendingDispatch(self, top_k, launch=lambda: self._launch_exact(rows, meta, send_index, pending, top_k))

    def _launch_exact(self, rows, meta, send_index, counts: _Counts, top_k: int) -> _Started:
        send_rows, recv_rows, recv_slots = sizes = counts.wait()  # the host sync
        self._keep_plan(sizes)
        num_send = sum(send_rows)
        outs, done = self._start_exchange([rows[:num_send], meta[:num_send]], send_rows, recv_rows)
        sent = _Rows(send_index.inv, send_index.row_slot[:num_send], top_k, send_index.num_rows)
        return _Started(outs, done, sent, send_rows, recv_rows, recv_slots)

    def _start_fixed(self, x, experts, probs, rank_slots, send_index, chunk: int) -> _PendingDispatch:
        """Every rank sends T rows to every rank (rank p's rows first, then tail rows that carry
        no slot): the splits are known without asking the device, and the receiver finds its
        rows' experts in their metadata (-1: a tail row)."""
        num_tokens, top_k = experts.shape
        if not self._recomputing():
            self._first_exchange(chunk)
        sent = fixed_capacity(send_index, rank_slots, num_tokens, self.ep_size)
        rows = ops.gather_rows(x, sent, backend=self.kernels)  # [P T, D]
        meta = ops.send_meta(sent.row_slot, experts, probs, self.local_experts, backend=self.kernels)  # [P T, 2K]
        splits = [num_tokens] * self.ep_size
        outs, done = self._start_exchange([rows, meta], splits, splits)
        # Worst case: every token of every rank sends all its slots here (at most E_local each).
        worst_slots = self.ep_size * num_tokens * min(top_k, self.local_experts)
        return _PendingDispatch(self, top_k, _Started(outs, done, sent, splits, splits, worst_slots))

    def start_combine(self, y: torch.Tensor, batch: ExpertBatch) -> _PendingCombine:
        plan: _Plan = batch.ctx
        per_row = ops.combine(y, plan.local_index, backend=self.kernels)  # [R, D]: this rank's experts
        (back,), done = self._start_exchange([per_row], plan.recv_rows, plan.send_rows)  # [S, D]
        return _PendingCombine(back, done, plan.send_index, self.kernels)


_COMM_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The all-to-all dispatchers' communication stream on `device`, made on first use."""
    if device not in _COMM_STREAMS:
        _COMM_STREAMS[device] = torch.cuda.Stream(device)
    return _COMM_STREAMS[device]


def _wait_for_comm_stream(outs: list[torch.Tensor], done) -> list[torch.Tensor]:
    """Make an exchange's results usable on the current stream (`done`: its end on the communication
    stream, or None: it ran on this one)."""
    if done is not None:
        stream = torch.cuda.current_stream(outs[0].device)
        stream.wait_event(done)
        for out in outs:  # made on the communication stream, read on this one
            out.record_stream(stream)
    return outs


class _Started(NamedTuple):
    """An exchange of rows and metadata under way, and what the rest of the call needs."""

    outs: list[torch.Tensor]  # [R, D] rows, [R, 2K] metadata (valid once `done`)
    done: Any  # a CUDA event, or None: finished
    sent: _Rows  # token slots -> send rows
    send_rows: list[int]
    recv_rows: list[int]
    num_slots: int  # slots the received rows may carry: expert-major rows are allocated for them


class _PendingDispatch:
    """A started dispatch. Exact buffers: its split sizes on their way to the host, its rows queued
    (`launch`: the host sync, then the exchange); worst-case buffers: the exchange under way.
    `wait()` makes the rows usable and lays them out expert-major."""

    def __init__(self, dispatcher: AllToAllDispatcher, top_k: int, started: _Started | None = None, launch=None):
        self.dispatcher, self.top_k, self.started, self.launch = dispatcher, top_k, started, launch

    def send(self) -> None:
        """Exact buffers: the host sync, then the exchange queued (on CUDA, on the communication stream)."""
        if self.started is None:
            self.started = self.launch()

    def wait(self) -> ExpertBatch:
        d, top_k = self.dispatcher, self.top_k
        self.send()
        s = self.started
        recv, recv_meta = _wait_for_comm_stream(s.outs, s.done)  # [R, D], [R, 2K]
        local_ids, local_probs = recv_meta[:, :top_k].long(), recv_meta[:, top_k:]
        batch, local_index = expert_major(recv, local_ids, local_probs, d.local_experts, d.align, d.kernels,
                                          num_slots=s.num_slots)
        batch.ctx = _Plan(s.sent, local_index, s.send_rows, s.recv_rows)
        return batch


def fixed_capacity(send_index, rank_slots: torch.Tensor, num_tokens: int, ep_size: int) -> _Rows:
    """The send rows of `send_index` (grouped by rank, rank p's n_p rows from start_p) moved to fixed
    places: rank p's i-th row to p T + i; rows n_p <= i < T of each rank are tail rows (slot -1).
    rank_slots [T, K]: rank of each token's first slot on it, -1 elsewhere. Device ops only."""
    counts = send_index.tokens_per_expert  # [P] rows to each rank
    starts = send_index.offsets.long() - counts  # [P]
    rank = rank_slots.long().clamp_min(0)
    inv = torch.where(send_index.inv >= 0, send_index.inv - starts[rank] + rank * num_tokens, -1)
    j = torch.arange(ep_size * num_tokens, device=rank_slots.device)
    p, i = j // num_tokens, j % num_tokens
    compact = send_index.row_slot
    if compact.numel() == 0:
        row_slot = torch.full_like(j, -1)
    else:
        row_slot = torch.where(i < counts[p], compact[(starts[p] + i).clamp_max(compact.numel() - 1)], -1)
    return _Rows(inv, row_slot, rank_slots.shape[1], send_index.num_rows)


class _PendingCombine:
    """A started combine: this rank's per-row sums on their way back. `wait()` sums over ranks."""

    def __init__(self, back: torch.Tensor, done, send_index: _Rows, kernels: str):
        self.back, self.done, self.send_index, self.kernels = back, done, send_index, kernels

    def send(self) -> None:
        pass  # under way since start_combine

    def wait(self) -> torch.Tensor:
        (back,) = _wait_for_comm_stream([self.back], self.done)
        return ops.combine(back, self.send_index, backend=self.kernels)  # [T, D]: sum over ranks
