"""All-gather dispatcher (EP = 2 on one node): every token to every rank, on the copy engines.

At EP = 2 with top-8 of 128 experts a token has an expert on the other rank 99.6% of the time
(1 - (1/2)^8), so the dispatch is an all-gather of the tokens and the combine a reduce-scatter of
each rank's partial sums, with sizes known without asking: no counts, no layout, no host sync.
dispatch/peer_memory.py moves them with plain device copies into the other rank's symmetric
memory, on the GPU's copy engines: no SM is held while the experts' persistent grouped GEMMs run.

    send_tokens     x [T, D] ─all_gather─► [P T, D]: started before the router, which runs beside the copies
    start_dispatch  experts [T, K], probs [T, K] ─all_gather─► [P T, K], [P T, K]
                    ─this rank's slots (ids - r E/P, -1 elsewhere)─► expert_major ─► ExpertBatch
    start_combine   y [N, D] ─combine─► the other rank's tokens [T, D] ─pushed─► ... beside: ─combine─►
                    our tokens [T, D]; every rank's sums for our tokens added in rank order ─► [T, D]

Rank r's partial sum of a token is its experts' outputs summed in fp32 and rounded to bf16 (ops.combine),
the two ranks' partials summed in fp32 in rank order and rounded once: DeepEP's combine sums the same
bf16 partials in that order. Backward: the all-gather's adjoint is the reduce-scatter of the rows' and
probabilities' gradients, and the reduce-scatter's the all-gather of the output's gradient.

Every rank must have the same T (training's local batch x seq_len). The expert-major rows are laid out
for P T min(K, E/P) slots, as DeepEP's and all_to_all's worst-case buffers do. At EP = P > 2 every
token would still go to every rank, where DeepEP sends it only to the ranks that hold its experts:
this dispatcher takes EP = 2 only (dispatch/registry.py, which builds it).

On CPU (gloo) the same two calls run on torch.distributed's all_gather (CollectiveTransport).
Under activation checkpointing the recompute replays the kept results (copies: the all-gather's
results live in the transport's inbox only until its next call), or gathers again ([dispatch]
recompute = "exchange": nothing kept; no host sync either way).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchtitan_moe import ops
from torchtitan_moe.dispatch.backward import with_backward
from torchtitan_moe.dispatch.peer_memory import CollectiveTransport, PeerMemoryTransport
from torchtitan_moe.dispatch.replay import ReplaysExchanges
from torchtitan_moe.dispatch.seam import Done, ExpertBatch, Routing, expert_major


def build_transport(group: dist.ProcessGroup, device: torch.device):
    """Copy engines on CUDA, torch.distributed's all_gather on CPU."""
    if device.type != "cuda":
        return CollectiveTransport(group)
    return PeerMemoryTransport(group)  # raises PeerMemoryUnavailable


class AllGatherDispatcher(ReplaysExchanges):
    """Experts [r E/P, (r+1) E/P) on EP rank r, as the other dispatchers. `transport`: a
    PeerMemoryTransport (CUDA) or CollectiveTransport, shared by the layers."""

    def __init__(self, num_experts: int, transport, align: int = 1, kernels: str = "torch"):
        super().__init__()
        self.transport = transport
        self.ep_size, self.rank = transport.size, transport.rank
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts = {num_experts} is not divisible by the EP degree {self.ep_size}")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.ep_size
        self.align = align
        self.kernels = kernels
        self.checked_tokens = 0  # the tokens per rank every rank was found to have
        self._sent = None  # (x, its started all-gather) from send_tokens, for start_dispatch

    @torch.compiler.disable
    def send_tokens(self, x: torch.Tensor) -> None:
        """Start x's all-gather now, before the router: its copies (64 MiB a layer at 30B-A3B shapes, local
        batch 4) run beside the router's kernels instead of after them. A recompute replays instead."""
        self._sent = None if self._replaying() else (x, self._start_gather(x))

    def start_dispatch(self, x: torch.Tensor, routing: Routing, chunk: int = 0) -> Done[ExpertBatch]:
        if chunk:
            raise ValueError("all_gather dispatcher: one dispatch per forward (its exchanges finish where they "
                             "start: no chunked overlap)")
        gathered_x, experts, probs = self._gather(x, routing)
        # This rank's slots: local expert ids, -1 and probability 0 for the other rank's.
        local = experts - self.rank * self.local_experts
        mine = (local >= 0) & (local < self.local_experts)
        local = torch.where(mine, local, -1)
        probs = torch.where(mine, probs, 0.0)
        num_slots = gathered_x.shape[0] * min(experts.shape[1], self.local_experts)
        # Read now: the inbox holds the gathered rows only until the transport's next call.
        batch, index = expert_major(gathered_x, local, probs, self.local_experts, self.align, self.kernels,
                                    num_slots=num_slots)
        batch.ctx = index
        return Done(batch)

    def start_combine(self, y: torch.Tensor, batch: ExpertBatch) -> Done[torch.Tensor]:
        return Done(self._combine(y, batch.ctx))

    # -- the exchanges: outside torch.compile (the transport queues copies and stream waits) ----

    @torch.compiler.disable
    def _gather(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._replaying():
            gathered_x, experts, probs = self._replayed()
        else:
            self._first_exchange()
            sent, self._sent = self._sent, None
            if sent is None:  # called without send_tokens
                sent = (x, self._start_gather(x))
            elif sent[0] is not x:
                raise RuntimeError("all_gather dispatcher: start_dispatch got other tokens than send_tokens sent")
            with torch.no_grad():  # started before the tokens' views are waited for: see PeerMemoryTransport
                routed = self.transport.start_all_gather([routing.experts, routing.probs.detach().float()])
                (gathered_x,), (experts, probs) = sent[1].wait(), routed.wait()
            if self._keeping():  # the inbox is reused: keep copies
                self._keep((gathered_x.clone(), experts.clone(), probs.clone()))
        transport, kept = self.transport, self._kept

        def back(grads, needs):
            # The all-gather's adjoint: the reduce-scatter of the rows' and probabilities' gradients. By this
            # backward the layer's recompute (if any) is over: what it left of the kept results is dropped (a
            # recompute stops once it has the tensors backward needs, before the combine's exchange).
            kept.clear()
            return transport.reduce_scatter(grads)

        gathered_x, probs = with_backward([gathered_x, probs], (x, routing.probs), back)
        return gathered_x, experts, probs

    def _start_gather(self, x: torch.Tensor):
        if x.shape[0] != self.checked_tokens:
            self._check_equal_tokens(x.shape[0])
        with torch.no_grad():
            return self.transport.start_all_gather([x.detach()])

    def _check_equal_tokens(self, tokens: int) -> None:
        """Every rank must send as many tokens as the others (the parts have one size): asked once per size
        (a host collective), one error on every rank where they differ."""
        everyone: list = [None] * self.ep_size
        dist.all_gather_object(everyone, tokens, group=self.transport.group)
        if len(set(everyone)) > 1:
            raise ValueError(f"all_gather dispatcher: the EP ranks have {everyone} tokens in this layer; every rank "
                             "must have as many (local batch x sequence length); the all_to_all and deepep "
                             "dispatchers take uneven batches")
        self.checked_tokens = tokens

    @torch.compiler.disable
    def _combine(self, y: torch.Tensor, index: ops.RoutingIndex) -> torch.Tensor:
        if self._replaying():
            out = self._replayed()
        else:
            with torch.no_grad():
                out = self._sum_over_ranks(y.detach(), index)
            self._keep(out)

        def back(grads, needs):
            # The reduce-scatter's adjoint: the all-gather of the gradient, then combine's backward (a gather of
            # its rows), queued before the transport's next call reuses the inbox.
            (gathered,) = self.transport.all_gather(grads)
            return [ops.gather_rows(gathered, index, backend=self.kernels)]

        (out,) = with_backward([out], (y,), back)
        return out

    def _sum_over_ranks(self, y: torch.Tensor, index: ops.RoutingIndex) -> torch.Tensor:
        """This rank's experts' outputs summed per token (ops.combine), the other ranks' tokens first: their
        sums travel while ours are computed; then every rank's sums for our tokens, added in rank order."""
        tokens = index.inv.shape[0] // self.ep_size

        def per_token(rank: int) -> torch.Tensor:  # [T, D]: rank's tokens, this rank's experts summed
            return ops.combine_tokens(y, index, rank * tokens, (rank + 1) * tokens, backend=self.kernels)

        pending = self.transport.start_reduce_scatter({q: [per_token(q)] for q in range(self.ep_size) if q != self.rank})
        return pending.finish([per_token(self.rank)])[0]
