"""The seam between the MoE layer (moe/) and the dispatchers (dispatch/): the types both speak.

    dispatcher.send_tokens(x [T, D])                    # may start moving x before its routing exists
    routing = router(x)                                 # Routing
    batch   = dispatcher.start_dispatch(x, routing).wait()  # ExpertBatch, rows expert-major, padded
    y       = experts(batch)                            # [N, D], probabilities already applied
    out     = dispatcher.start_combine(y, batch).wait() # [T, D], sum over each token's experts

Both packages import this module and never each other; choosing and building a dispatcher
sits above both (parallelization). Every dispatcher fills the same `ExpertBatch`
(`expert_major`), so the experts never know how rows arrived.

The calls are staged: `start_*` queues the work (on CUDA, communication may run on its own
stream) and returns a handle; `wait()` makes the result usable on the current stream; `send()`
queues the call's communication before then where `start_*` could not (the chunked schedule,
moe/chunks.py, puts one chunk's exchange under the other chunk's experts that way). What a
call keeps for its combine and its backward travels in the handle and the batch, not in the
dispatcher. Not yet the exchanges kept for an activation-checkpointing recompute: those are
still replayed in call order from the dispatcher (dispatch/replay.py), which holds as long as
a recompute makes the same calls in the same order. `LocalDispatcher` (EP = 1) is
the seam's own: a sort on this rank, the default of a layer used on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.utils._pytree

from torchtitan_moe import ops

T = TypeVar("T", covariant=True)

# How a dispatcher sizes what it receives ([dispatch] buffers): "exact", from the received counts
# (one host sync per layer: the CPU waits for them); "worst_case", for the most a rank can receive
# (no host sync, CUDA-graph capturable; more memory: see dispatch/all_to_all.py).
BUFFERS = ("exact", "worst_case")


@dataclass
class Routing:
    """What the router decided for T tokens, K experts each, E experts in all."""

    probs: torch.Tensor  # [T, K] fp32: weight of each chosen expert's output
    experts: torch.Tensor  # [T, K] int64: chosen expert ids
    tokens_per_expert: torch.Tensor  # [E] int64: slots routed to each expert
    scores: torch.Tensor  # [T, E] fp32: scores before top-k (for the aux loss and checks)
    aux_loss: torch.Tensor | None  # scalar fp32: the weighted router losses the objective adds, or None
    balance_loss: torch.Tensor | None = None  # scalar fp32: the balance loss before its coefficient
    z_loss: torch.Tensor | None = None  # scalar fp32: the z-loss before its coefficient


# FSDP2 hooks the router's outputs to all-gather its weights again for backward; torch 2.11
# finds those tensors with pytree, which sees into a dataclass only once it is registered.
torch.utils._pytree.register_dataclass(Routing)


@dataclass
class ExpertBatch:
    """N rows for this rank's E_local experts, grouped by expert (the torch._grouped_mm layout).

    Rows past `num_rows` (the tail) are never read; pad rows inside groups are zeros.
    """

    x: torch.Tensor  # [N, D] tokens, expert-major
    probs: torch.Tensor  # [N] fp32 router probability of each row (0 for pad and tail rows)
    offsets: torch.Tensor  # [E_local] int32 cumulative end row of each expert's group
    num_rows: torch.Tensor  # 0-dim int64 on the device: offsets[-1]
    tokens_per_expert: torch.Tensor  # [E_local] int64 rows that hold tokens (no padding)
    ctx: Any  # the dispatch call's state for its combine


class Pending(Protocol[T]):
    """A started dispatch or combine. `wait()` once: the result, usable on the current stream.

    `send()` queues the call's communication now where `start_*` could not (exact buffers: the
    split sizes must reach the host first); a no-op where it is under way. `wait()` implies it.
    """

    def send(self) -> None: ...

    def wait(self) -> T: ...


class Dispatcher(Protocol):
    kernels: str  # "torch" or "triton": the ops backend, also the experts'

    # Called with the tokens before the router runs, then start_dispatch with the same tensor: a dispatcher
    # that sends every token whatever its experts (all_gather) starts sending here, under the router.
    # A no-op for the others, whose sends depend on the routing.
    def send_tokens(self, x: torch.Tensor) -> None: ...

    # chunk: this dispatch's place among the layer forward's dispatches (the chunked schedule,
    # moe/chunks.py, makes 2): what an earlier forward kept for a recompute is dropped at chunk 0 only.
    def start_dispatch(self, x: torch.Tensor, routing: Routing, chunk: int = 0) -> Pending[ExpertBatch]: ...

    def start_combine(self, y: torch.Tensor, batch: ExpertBatch) -> Pending[torch.Tensor]: ...


class Unavailable(RuntimeError):
    """A dispatcher cannot run on this machine (a library, symmetric memory, peer access missing); the
    message says why in one line."""


class Done(Generic[T]):
    """The handle of a call that finished when it started (EP = 1, gloo, the all-gather dispatcher, a
    recompute's replay): every dispatcher's finished call returns this one."""

    def __init__(self, value: T):
        self.value = value

    def send(self) -> None:
        pass

    def wait(self) -> T:
        return self.value


def recomputing() -> bool:
    """True while eager activation checkpointing re-runs a forward inside the backward pass.

    Statistics are counted, and exchanges made, once per real forward. Asked in code that
    torch.compile traces it would be a graph break, so there it is not asked and is False: the
    callers that must know (the layer's statistics, the dispatchers' exchange replay) run
    eagerly. A compiled region re-run by an eager recompute does run again in full, so nothing
    that counts is compiled (the global-batch balance loss's counts: Router.forward, not route).
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


# ---------------------------------------------------------------------------------------
# The layout every dispatcher ends with, and the EP = 1 dispatcher that is nothing else.
# ---------------------------------------------------------------------------------------


def expert_major(
    x: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor, num_experts: int, align: int, kernels: str,
    num_slots: int | None = None,
) -> tuple[ExpertBatch, ops.RoutingIndex]:
    """Rows x [R, D] with K slots each (experts [R, K], -1 for none; probs [R, K]) -> the ExpertBatch
    (ctx unset: the dispatcher's) and its RoutingIndex. Every dispatcher ends its dispatch here."""
    index = ops.routing_index(experts, num_experts, align, num_slots=num_slots, backend=kernels)
    rows = ops.gather_rows(x, index, backend=kernels)
    batch = ExpertBatch(x=rows, probs=slots_to_rows(probs, index.inv, rows.shape[0]), offsets=index.offsets,
                        num_rows=index.num_rows, tokens_per_expert=index.tokens_per_expert, ctx=None)
    return batch, index


def slots_to_rows(values: torch.Tensor, inv: torch.Tensor, num_rows_alloc: int) -> torch.Tensor:
    """Place per-slot values [T, K] at their rows: out [N] with out[inv[t, k]] = values[t, k].

    Slots with inv = -1 go nowhere; rows no slot points at stay 0. A scatter with unique
    indices forward, a gather backward: deterministic either way.
    """
    flat_inv = inv.reshape(-1).long()
    dump = num_rows_alloc  # one extra row collects the -1 slots and is dropped
    target = torch.where(flat_inv >= 0, flat_inv, torch.full_like(flat_inv, dump))
    out = values.new_zeros(num_rows_alloc + 1)
    out = out.index_put((target,), values.reshape(-1))
    return out[:num_rows_alloc]


class LocalDispatcher:
    """EP = 1: sort each token's K slots by expert on this rank.

        x [T, D] ──gather_rows──► batch.x [N, D] ──experts──► y [N, D] ──combine──► out [T, D]

    gather_rows and combine are adjoint (one's backward is the other's forward), both
    deterministic and gather-based: no atomics, no scatter_add. Nothing travels, so both
    calls are finished when they start.
    """

    def __init__(self, num_experts: int, align: int = 1, kernels: str = "torch"):
        self.num_experts = num_experts
        self.align = align
        self.kernels = kernels

    def send_tokens(self, x: torch.Tensor) -> None:
        pass  # nothing travels

    def start_dispatch(self, x: torch.Tensor, routing: Routing, chunk: int = 0) -> Done[ExpertBatch]:
        batch, index = expert_major(x, routing.experts, routing.probs, self.num_experts, self.align, self.kernels)
        batch.ctx = index
        return Done(batch)

    def start_combine(self, y: torch.Tensor, batch: ExpertBatch) -> Done[torch.Tensor]:
        return Done(ops.combine(y, batch.ctx, backend=self.kernels))
