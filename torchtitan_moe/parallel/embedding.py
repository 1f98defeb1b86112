"""The token embedding sharded by vocabulary rows over the FSDP ranks, exchanged as activations.

Under FSDP2 the embedding ([V, D]: 311M weights for Qwen3's 151,936-token vocabulary at D = 2048) is
the first module of the forward and the last of the backward: its all-gather (622 MB in bf16) starts
the step with nothing to hide it under, and its gradient's reduce-scatter (1.2 GB in fp32) ends the
backward the same way. Here each rank keeps the same shard FSDP2 would (a DTensor, Shard(0) on the
same mesh: checkpoints, the sharded init, clipping and the optimizer see the same parameter), and the
tokens travel instead of the weights. With W ranks of N tokens each:

    forward   all-gather the token ids [W*N]; look up the rows this rank holds, zeros for the others,
              in the compute dtype [W*N, D]; reduce-scatter them: each rank gets its own tokens' rows
              [N, D] (each a sum of one nonzero term: exact, the values FSDP2's lookup gives)
    backward  all-gather the output gradients [W*N, D]; add each token's gradient, in fp32, into
              the rows this rank holds [V/W, D] (no reduce-scatter of the weight's gradient)

At 16,384 tokens a rank and D = 2048: 64 MB a rank each way instead of 311 MB gathered and 622 MB
reduce-scattered. Every rank of the mesh must call it with the same number of tokens (torchtitan's
batches are [local_batch_size, seq_len] on every rank).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from torchtitan_moe.compat.collectives import all_gather, reduce_scatter_sum


def shard_embedding_rows(embedding: nn.Embedding, mesh: DeviceMesh, compute_dtype: torch.dtype) -> None:
    """Make `embedding.weight` this rank's rows (torch.chunk's split, as FSDP2's Shard(0)) of a 1-D `mesh`;
    its forward then looks up through embed_sharded_rows in `compute_dtype` (FSDP2's param_dtype)."""
    if mesh.ndim != 1:
        raise ValueError(f"shard_embedding_rows: a 1-D mesh, got {mesh.ndim}-D {mesh.mesh_dim_names}")
    weight = embedding.weight
    if isinstance(weight, DTensor):
        raise ValueError("shard_embedding_rows: the embedding's weight is already a DTensor (sharded twice?)")
    chunks = weight.detach().chunk(mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    local = chunks[rank].clone() if rank < len(chunks) else weight.new_empty(0, weight.shape[1])
    sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=weight.shape, stride=weight.stride())
    embedding.weight = nn.Parameter(sharded, requires_grad=weight.requires_grad)
    embedding.compute_dtype = compute_dtype


def embed_sharded_rows(tokens: torch.Tensor, weight: DTensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """tokens [*S] int64, weight a DTensor [V, D] sharded Shard(0) on a 1-D mesh -> [*S, D] compute_dtype."""
    mesh = weight.device_mesh
    local = weight.to_local()  # autograd hands its gradient back as the DTensor's, Shard(0)
    rows_per_rank = -(-weight.shape[0] // mesh.size())
    start = min(mesh.get_local_rank() * rows_per_rank, weight.shape[0])
    out = _ShardedRows.apply(local, tokens.reshape(-1), start, mesh, compute_dtype)
    return out.view(*tokens.shape, weight.shape[1])


class _ShardedRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, ids: torch.Tensor, start: int, mesh: DeviceMesh,
                compute_dtype: torch.dtype) -> torch.Tensor:
        all_ids = all_gather(ids, mesh)
        held_rows = local.shape[0]
        index = all_ids - start
        held = (index >= 0) & (index < held_rows)
        # Read only the looked-up rows (fp32) and cast those: not the whole shard, as FSDP2's cast does.
        rows = nn.functional.embedding(index.clamp(0, max(held_rows - 1, 0)), local.detach()).to(compute_dtype) \
            if held_rows else local.new_zeros(index.numel(), local.shape[1], dtype=compute_dtype)
        rows.masked_fill_(~held[:, None], 0)  # [W*N, D]: zeros where another rank holds the row
        out = reduce_scatter_sum(rows, mesh)
        ctx.save_for_backward(torch.where(held, index, held_rows))  # one row past this rank's: the others'
        ctx.mesh, ctx.held_rows, ctx.local_dtype = mesh, held_rows, local.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        all_grad = all_gather(grad.contiguous(), ctx.mesh)
        # Each held row's gradient summed in fp32 over every rank's tokens; the padding row (the other
        # ranks' rows) is skipped. embedding_dense_backward sums in a fixed order (it sorts the ids).
        grad_local = torch.ops.aten.embedding_dense_backward(all_grad.float(), index, ctx.held_rows + 1,
                                                             ctx.held_rows, False)
        return grad_local[: ctx.held_rows].to(ctx.local_dtype), None, None, None, None
