"""The chunked schedule ([dispatch] overlap = "chunks"): one chunk's exchange under the other's experts.

    tokens [T, D], routing (router run once over all T) ─split by token rows─► chunk 0: [T0, D], T0 = ceil(T/2)
                                                                               chunk 1: [T - T0, D]
    h0 = start_dispatch(chunk 0); h0.send()      # exact buffers: split sizes read, exchange queued
    h1 = start_dispatch(chunk 1); h1.send()      # dispatch 1 in flight ...
    b0 = h0.wait(); y0 = experts(b0)             # ... under chunk 0's experts
    c0 = start_combine(y0, b0)                   # combine 0 in flight ...
    b1 = h1.wait(); y1 = experts(b1)             # ... under chunk 1's experts
    c1 = start_combine(y1, b1)
    out [T, D] = cat(c0.wait(), c1.wait())

The overlap exists only where an exchange runs beside the compute: on CUDA (all_to_all on its
communication stream, DeepEP on its own); on CPU/gloo every exchange finishes where it is called
and the schedule is the plain one twice. Opt-in: on 2 H200s at 30B-A3B shapes it loses (0.92x with
DeepEP, 0.87x all_to_all; 0.935x with DeepEP with the experts' working
copies). Each variant with overlap against the same without:

    python -m torchtitan_moe.tools.bench_train configs/qwen3_30b_a3b_8l.toml --models all_to_all,deepep \
        --routers learned --modes eager,compiled --vary dispatch.overlap=none,chunks -- --parallelism.expert_parallel_degree 2

Same results as one chunk: the router, its losses and the layer's statistics see all T tokens
(the caller counts them before calling here); each token's rows, expert outputs and sums are
the ones it gets unchunked. What changes is summation order only where sums run over tokens:
the experts' weight gradients are two GEMMs' sums added (fp32 order; in bf16 each is rounded to bf16
first), and a GEMM's rows may round differently with another row count (tests/test_overlap.py).

Costs besides the exchanges: under FSDP2 the experts' weights are prepared once per chunk where it
unshards them per call (it reshards after forward); experts outside FSDP2 read one working copy in both.

Backward: autograd runs each exchange's backward on the stream its forward ran on (all_to_all:
the communication stream, the engine making the consumer wait on an event) and runs ready nodes
latest-created first, so one chunk's reverse exchange is queued while the other chunk's expert
backward is (docs/dispatchers.md, overlap). DeepEP's backward calls finish on the current stream:
no overlap there.

Replay (activation checkpointing): the calls come in one fixed order, each chunk's send() right
after its start, which is also the order the dispatchers keep their exchanges in (dispatch/replay.py);
`chunk=` tells them that chunk 1's dispatch belongs to the same forward as chunk 0's.
"""

from __future__ import annotations

import dataclasses

import torch

from torchtitan_moe.moe.router import count_tokens
from torchtitan_moe.dispatch.seam import Routing

CHUNKS = 2


def chunk_bounds(num_tokens: int) -> list[tuple[int, int]]:
    """[(0, T0), (T0, T)], T0 = ceil(T / 2). Equal T on every rank gives equal chunks on every rank
    (worst-case buffers need that: their splits are the chunk's T on every rank)."""
    if num_tokens < CHUNKS:
        raise ValueError(f"[dispatch] overlap = 'chunks' splits a layer's tokens in {CHUNKS}: got {num_tokens} tokens")
    first = -(-num_tokens // CHUNKS)
    return [(0, first), (first, num_tokens)]


def split_routing(routing: Routing, bounds: list[tuple[int, int]]) -> list[Routing]:
    """One Routing per chunk of token rows: probs, experts, scores sliced, tokens_per_expert counted
    for the chunk. The losses stay with the whole layer's Routing (None here): attached once."""
    num_experts = routing.tokens_per_expert.shape[0]
    chunks = []
    for start, end in bounds:
        experts = routing.experts[start:end]
        chunks.append(dataclasses.replace(
            routing, probs=routing.probs[start:end], experts=experts, scores=routing.scores[start:end],
            tokens_per_expert=count_tokens(experts, num_experts), aux_loss=None, balance_loss=None, z_loss=None))
    return chunks


def chunked_forward(dispatcher, experts, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
    """tokens [T, D] (in the rows' travel dtype), routing of all T -> out [T, D], as
    dispatcher.start_combine(experts(dispatcher.start_dispatch(tokens, routing).wait()), ...).wait()."""
    bounds = chunk_bounds(tokens.shape[0])
    routings = split_routing(routing, bounds)
    pending = []
    for chunk, ((start, end), part) in enumerate(zip(bounds, routings)):
        handle = dispatcher.start_dispatch(tokens[start:end], part, chunk=chunk)
        handle.send()  # before the other chunk's experts are queued, so it runs under them
        pending.append(handle)
    combines = []
    for handle in pending:
        batch = handle.wait()
        combines.append(dispatcher.start_combine(experts(batch), batch))
    return torch.cat([c.wait() for c in combines])
