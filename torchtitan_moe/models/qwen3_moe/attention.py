"""Document masking ([data] attention = "document"): each token attends to the tokens before it in its own
document only (block-causal), from each token's position in its document.

    positions [B, S] (0 where a document starts) ─► documents [B, S] = cumsum(positions == 0)
    mask(b, q, kv) = kv <= q  and  documents[b, q] == documents[b, kv]

The mask is a flex-attention BlockMask and torchtitan's Attention runs with attn_type "flex", its inner
attention replaced by `DocumentAttention`: on a GPU a compiled flex_attention over a BlockMask made by
torchtitan's compiled create_block_mask (blocks outside every document are skipped, not computed); flex has
no CPU backward, so on the CPU the same mask_mod is evaluated densely [B, 1, S, S] for SDPA. The positions
also restart RoPE at each document, so a packed document computes what it would alone.

`KeptAttention` is the causal path's inner attention where a recompute takes the attention's outputs from its
first forward ([activation_checkpoint] offload_attention).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, and_masks, flex_attention

from torchtitan_moe.compat.torchtitan import create_attention_mask, get_causal_mask_mod
from torchtitan_moe.moe.experts import autocast_dtype
from torchtitan_moe.ops.attention import causal_attention


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """positions [B, S] -> documents [B, S] int64: a new id wherever a position is 0."""
    return torch.cumsum(positions == 0, dim=1)


def document_mask_mod(documents: torch.Tensor):
    """flex-attention's mask_mod(b, h, q, kv) -> bool of the block-causal mask over `documents` [B, S]."""

    def same_document(b, h, q_idx, kv_idx):
        return documents[b, q_idx] == documents[b, kv_idx]

    return and_masks(get_causal_mask_mod(), same_document)


def document_block_mask(positions: torch.Tensor) -> BlockMask:
    """The BlockMask of a batch's documents. On the CPU, one block over the whole sequence: a valid
    BlockMask (every block partial) that carries the mask_mod to DocumentAttention's dense path."""
    batch, seq_len = positions.shape
    mask_mod = document_mask_mod(document_ids(positions))
    if positions.is_cuda:
        return create_attention_mask(mask_mod, batch, None, seq_len, seq_len)
    ones = torch.ones(batch, 1, 1, dtype=torch.int32)
    return BlockMask.from_kv_blocks(ones, torch.zeros(batch, 1, 1, 1, dtype=torch.int32), BLOCK_SIZE=seq_len,
                                    mask_mod=mask_mod, seq_lengths=(seq_len, seq_len))


def dense_mask(block_mask: BlockMask, batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """block_mask's mask_mod at every (b, q, kv): [B, 1, S, S] bool (True: attend)."""
    index = torch.arange(seq_len, device=device)
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    return block_mask.mask_mod(b, torch.zeros_like(b), index.view(1, 1, -1, 1), index.view(1, 1, 1, -1))


@functools.cache
def compiled_flex_attention():
    """flex_attention compiled once, with inductor's default kernel configs. Not torchtitan's compiled one
    (FlexAttentionWrapper): it autotunes (max_autotune), and on torch 2.11 inductor then finds no valid
    kernel choice for flex (NoValidChoicesError, on an H200, bf16 and fp32 alike)."""
    return torch.compile(flex_attention, dynamic=False)


class DocumentAttention(nn.Module):
    """torchtitan's inner attention for attn_type "flex" (FlexAttentionWrapper's call), q [B, H, S, D],
    k and v [B, H_kv, S, D] -> [B, H, S, D]: flex on a GPU, SDPA with the dense mask elsewhere."""

    def forward(self, q, k, v, *, block_mask: BlockMask, scale: float | None = None, enable_gqa: bool = False):
        if q.is_cuda:
            return compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
        mask = dense_mask(block_mask, q.shape[0], q.shape[2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


class KeptAttention(nn.Module):
    """torchtitan's inner attention for attn_type "sdpa" (its SDPA wrapper's call), q [B, H, S, D], k and v
    [B, H_kv, S, D] -> [B, H, S, D], through ops.causal_attention with a keeper: under full recompute the
    recompute takes the first forward's outputs instead of computing them ([activation_checkpoint]
    offload_attention; parallel/offload.py keeps them)."""

    def __init__(self, keeper: int):
        super().__init__()
        self.keeper = keeper

    def forward(self, q, k, v, *, scale: float | None = None, enable_gqa: bool = False, is_causal: bool = True):
        dtype = autocast_dtype(q.device)  # autocast does not reach into custom ops: cast as it would for SDPA
        if dtype is not None:
            q, k, v = (t.to(dtype) for t in (q, k, v))
        return causal_attention(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale, self.keeper)
