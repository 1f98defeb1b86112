"""DeepEP dispatcher (EP = 2, 4, 8 on one node): DeepEP's NVLink kernels move the rows.

Each token crosses NVLink once per destination rank, as with the all-to-all dispatcher, and
arrives with its slots' local expert ids (-1 for other ranks' slots) and probabilities; the
rows are then expanded to the experts by the shared index map, exactly as after the
all-to-all exchange, so both fill the same ExpertBatch, row for row.

    start_dispatch  x [T, D] bf16, experts, probs ─DeepEP layout + dispatch (one host sync)─►
      .wait()       recv [R, D], local ids [R, K], probs [R, K] ─gather_rows─► ExpertBatch [N, D]
    start_combine   y [N, D] ─ops.combine─► per (token, source rank) [R, D] ─DeepEP combine─►
      .wait()       [T, D]

DeepEP's kernels run on its communication stream after the work queued so far (its own events:
`previous_event`, `async_finish`, `allocate_on_comm_stream`); `wait()` makes the current stream
wait for their end. What a call needs later travels in its handle and its ExpertBatch's ctx.

Worst-case buffers (`buffers = "worst_case"`): DeepEP's `num_worst_tokens` = P T (every token of
every rank; the same T on every rank) skips its host sync and returns P T rows, those past the
received ones undefined with experts -1; the expert-major rows are then allocated for P T min(K,
E/P) slots. The memory it costs is the all-to-all dispatcher's (dispatch/all_to_all.py).

DeepEP's combine is a plain sum (fp32, in rank order, rounded to bf16): the probabilities were
applied in swiglu_prob. Backward: dispatch's is a DeepEP combine (of the rows' and the probs'
gradients), combine's a DeepEP dispatch with the cached handle. Under activation
checkpointing ([dispatch] recompute, dispatch/replay.py) the recompute replays the kept results,
or dispatches the rows again by the kept handle and slots; no second host sync either way.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from torchtitan_moe import ops
from torchtitan_moe.dispatch.backward import with_backward
from torchtitan_moe.dispatch.deepep_backend import MAX_LOCAL_EXPERTS, MAX_TOP_K, DeepEPBackend, Dispatched, Handle
from torchtitan_moe.dispatch.replay import ReplaysExchanges
from torchtitan_moe.dispatch.seam import BUFFERS, ExpertBatch, Routing, expert_major


class _Plan(NamedTuple):
    local_index: ops.RoutingIndex  # received rows -> expert-major rows
    handle: Handle


class DeepEPDispatcher(ReplaysExchanges):
    """Experts [r E/P, (r+1) E/P) live on EP rank r, as with the all-to-all dispatcher. `backend`
    (a DeepEPV1 or any DeepEPBackend) is shared by the layers: one buffer, one frozen setting."""

    def __init__(self, num_experts: int, backend: DeepEPBackend, align: int = 1, kernels: str = "torch",
                 buffers: str = "exact"):
        super().__init__()
        self.backend = backend
        self.ep_size = backend.num_ranks
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts = {num_experts} is not divisible by the EP degree {self.ep_size}")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.ep_size
        if self.local_experts > MAX_LOCAL_EXPERTS:
            raise ValueError(f"DeepEP: {self.local_experts} experts per EP rank; it takes at most {MAX_LOCAL_EXPERTS}")
        if buffers not in BUFFERS:
            raise ValueError(f"buffers = {buffers!r}: expected one of {', '.join(map(repr, BUFFERS))}")
        self.align = align
        self.kernels = kernels
        self.buffers = buffers

    def send_tokens(self, x: torch.Tensor) -> None:
        pass  # DeepEP's dispatch sends by the routing

    def start_dispatch(self, x: torch.Tensor, routing: Routing, chunk: int = 0) -> _PendingDispatch:
        if x.dtype != torch.bfloat16:
            raise ValueError(f"DeepEP dispatcher: tokens must be bfloat16 (DeepEP combines bf16 rows), got {x.dtype}; "
                             "train in bf16 (FSDP2 mixed precision)")
        if routing.experts.shape[1] > MAX_TOP_K:
            raise ValueError(f"DeepEP dispatcher: top_k = {routing.experts.shape[1]}; DeepEP takes at most {MAX_TOP_K}")
        recv_x, recv_probs, d = self._exchange(x, routing, chunk)
        return _PendingDispatch(self, recv_x, recv_probs, d)

    def start_combine(self, y: torch.Tensor, batch: ExpertBatch) -> _PendingCombine:
        plan: _Plan = batch.ctx
        per_row = ops.combine(y, plan.local_index, backend=self.kernels)  # [R, D]: this rank's experts summed
        if per_row.dtype != torch.bfloat16:
            raise ValueError(f"DeepEP dispatcher: expert outputs must be bfloat16 (DeepEP combines bf16 rows), got "
                             f"{per_row.dtype}; train in bf16 (FSDP2 mixed precision)")
        return _PendingCombine(*self._exchange_back(per_row, plan.handle))

    # -- the exchanges: outside torch.compile (DeepEP is opaque to it and syncs with the host) ----

    @torch.compiler.disable
    def _exchange(self, x: torch.Tensor, routing: Routing, chunk: int) -> tuple[torch.Tensor, torch.Tensor, Dispatched]:
        if self._recomputing():
            d = self._replayed()
            if self.recompute == "exchange":  # the rows again by the kept handle: no layout, no host sync
                with torch.no_grad():
                    d = d._replace(x=self.backend.dispatch_again(x.detach(), d.handle))
        else:
            self._first_exchange(chunk)
            # Worst case: every token of every rank comes here (equal T on every rank, as in training).
            worst = self.ep_size * x.shape[0] if self.buffers == "worst_case" else 0
            with torch.no_grad():
                d = self.backend.dispatch(x.detach(), routing.experts, routing.probs.detach(), self.num_experts,
                                          num_worst_tokens=worst)
            self._keep_plan(d if self.recompute == "replay" else d._replace(x=None, done=None))  # "exchange": no rows
        backend, handle, kept = self.backend, d.handle, self._kept  # not d: its rows would live until backward

        def back(grads, needs):
            # Dispatch's adjoint: a DeepEP combine of the rows' and the probabilities' gradients. A slot's
            # probability exists on one rank only (0 and id -1 on the others), so the combined probability
            # gradients are that rank's. A collective: every rank sends probability gradients, or none does
            # (DeepEP lays out its buffers by top-k), whichever of its rows got gradients. By this backward the
            # layer's recompute (if any) is over: what it left of the kept results is dropped (a recompute
            # stops once it has the tensors backward needs, before the combine's exchange).
            kept.clear()
            return backend.combine(grads[0], handle, grads[1] if needs[1] else None)

        recv_x, recv_probs = with_backward([d.x.detach(), d.probs.detach()], (x, routing.probs), back)
        return recv_x, recv_probs, d

    @torch.compiler.disable
    def _exchange_back(self, per_row: torch.Tensor, handle: Handle) -> tuple[torch.Tensor, Any]:
        done = None
        if self._replaying():
            out = self._replayed()
        else:
            with torch.no_grad():
                out, done = self.backend.start_combine(per_row.detach(), handle)
            self._keep(out)
        backend = self.backend  # combine's adjoint: a DeepEP dispatch with the cached handle
        (out,) = with_backward([out.detach()], (per_row,), lambda grads, needs: [backend.dispatch_again(grads[0], handle)])
        return out, done


class _PendingDispatch:
    """A started dispatch: DeepEP's kernels queued on its stream (`d.done`, their end).
    `wait()` makes the current stream wait for them and lays the rows out expert-major."""

    def __init__(self, dispatcher: DeepEPDispatcher, recv_x: torch.Tensor, recv_probs: torch.Tensor, d: Dispatched):
        self.dispatcher, self.recv_x, self.recv_probs, self.d = dispatcher, recv_x, recv_probs, d

    def send(self) -> None:
        pass  # DeepEP's kernels are queued by start_dispatch

    def wait(self) -> ExpertBatch:
        p, d = self.dispatcher, self.d
        _wait_for_deepep(d.done)
        if p.buffers == "worst_case":  # every received row may carry min(K, E_local) slots of this rank
            num_slots = self.recv_x.shape[0] * min(d.experts.shape[1], p.local_experts)
        else:
            num_slots = sum(d.tokens_per_expert)
        batch, local_index = expert_major(self.recv_x, d.experts, self.recv_probs, p.local_experts, p.align,
                                          p.kernels, num_slots=num_slots)
        batch.ctx = _Plan(local_index, d.handle)
        return batch


class _PendingCombine:
    """A started combine: the sums over ranks on their way. `wait()`: usable on the current stream."""

    def __init__(self, out: torch.Tensor, done):
        self.out, self.done = out, done

    def send(self) -> None:
        pass

    def wait(self) -> torch.Tensor:
        _wait_for_deepep(self.done)
        return self.out


@torch.compiler.disable
def _wait_for_deepep(done) -> None:
    """The current stream waits for DeepEP's kernels (done: their event; None: a replay, nothing to wait for)."""
    if done is not None:
        done.current_stream_wait()
