"""Qwen3-MoE: torchtitan's Qwen3 attention (qk-norm, GQA, RoPE) with our MoE layer.

    tokens [B, S] ─► tok_embeddings ─► n_layers x TransformerBlock ─► norm ─► output [B, S, V]
                                                                   or, given labels, the summed loss []
    TransformerBlock: h = x + attention(attention_norm(x));  out = h + moe(ffn_norm(h))
                      (`attend` is everything before the MoE)

Attention is causal SDPA, or with [data] attention = "document" block-causal within each document
(attention.py: torchtitan's flex path on a GPU, a dense mask on the CPU), the positions restarting RoPE.

Module names follow torchtitan's (tok_embeddings, layers, norm, output, moe_enabled) so
its activation checkpointing, checkpointing and metrics work unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from torchtitan_moe import ops
from torchtitan_moe.models.qwen3_moe.args import Qwen3MoEArgs
from torchtitan_moe.models.qwen3_moe.attention import DocumentAttention, document_block_mask
from torchtitan_moe.models.sharded_init import full_tensors
from torchtitan_moe.moe.experts import autocast_dtype
from torchtitan_moe.moe.layer import MoE, resolve_kernels
from torchtitan_moe.parallel.embedding import embed_sharded_rows
from torchtitan_moe.compat.torchtitan import Attention, ModelProtocol, precompute_rope_cache, trunc_normal_


class TransformerBlock(nn.Module):
    moe_enabled = True  # read by torchtitan's activation checkpointing and metrics

    def __init__(self, layer_id: int, args: Qwen3MoEArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        if args.attn_type == "flex":  # document masking: flex on a GPU, a dense mask on the CPU
            self.attention.inner_attention = DocumentAttention()
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe = MoE(args.moe, args.dim)
        # Output projections shrink with depth so the residual stream's variance stays bounded.
        self.out_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, attention_masks=None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        if attention_masks is None and self.attention.attn_type == "flex":  # a block called alone: one document a row
            attention_masks = document_block_mask(torch.arange(x.shape[1], device=x.device).expand(x.shape[:2]))
        h, moe_input = self.attend(x, rope_cache, attention_masks, positions)
        return h + self.moe(moe_input)

    def attend(self, x: torch.Tensor, rope_cache: torch.Tensor, attention_masks=None,
               positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block up to its MoE: h = x + attention(norm(x)), and the MoE's input norm(h).
        One region for torch.compile (parallelize.apply_compile)."""
        h = x + self.attention(self.attention_norm(x), rope_cache, attention_masks, positions)
        return h, self.ffn_norm(h)

    def init_weights(self, buffer_device: torch.device | None) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_init_std)
        self.moe.init_weights(self.out_init_std, buffer_device)


class TokenEmbedding(nn.Embedding):
    """tokens [*S] int64 -> [*S, D]. Where parallelize shards its rows over the FSDP ranks
    ([parallelism] embedding = "rows"), each rank looks up the rows it holds for every rank's tokens
    (parallel/embedding.py); else FSDP2 gathers the weight around a plain lookup."""

    compute_dtype: torch.dtype | None = None  # set by shard_embedding_rows

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is not None:
            return embed_sharded_rows(tokens, self.weight, self.compute_dtype)
        return super().forward(tokens)


class OutputLayer(nn.Linear):
    """The output projection [D] -> [V]. Given labels it returns the summed cross-entropy []
    (torchtitan's loss, reduction "sum") instead of the logits: with Triton kernels the loss and
    its gradients come from one pass over bf16 logits (ops.linear_cross_entropy), never the 5 GB
    of fp32 log-probabilities torchtitan's loss keeps at 8192 tokens. It runs inside this
    module's forward, so FSDP2's hooks gather and reduce the weight as for a plain Linear."""

    def __init__(self, dim: int, vocab_size: int, kernels: str):
        super().__init__(dim, vocab_size, bias=False)
        self.kernels = kernels

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(h)
        # Autocast does not reach into custom ops: cast as it would for a Linear.
        dtype = autocast_dtype(h.device) or self.weight.dtype
        return ops.linear_cross_entropy(h.flatten(0, -2).to(dtype), self.weight.to(dtype), labels.flatten(),
                                        backend=resolve_kernels(self.kernels, h.device))


@contextmanager
def seeded(seed: int | None, device: torch.device):
    """The RNG seeded with `seed` inside, restored after (None: left as it is)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


class Qwen3MoEModel(ModelProtocol):
    def __init__(self, args: Qwen3MoEArgs):
        super().__init__(args)
        self.model_args = args
        self.tok_embeddings = TokenEmbedding(args.vocab_size, args.dim)
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = OutputLayer(args.dim, args.vocab_size, args.moe.kernels)
        if args.enable_weight_tying:
            self.output.weight = self.tok_embeddings.weight

    def _rope_cache(self) -> torch.Tensor:
        args = self.model_args
        return precompute_rope_cache(args.head_dim, args.max_seq_len, args.rope_theta)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        buffer_device = buffer_device or self.rope_cache.device
        with torch.device(buffer_device):
            self.rope_cache = self._rope_cache()
        # From [debug] seed alone, whatever drew from the RNG before: any run of this model, or
        # torchtitan's model copying this init (models/baseline.py), starts from the same weights.
        with seeded(self.model_args.init_seed, self.tok_embeddings.weight.device):
            self._init_weights(buffer_device)

    def _init_weights(self, buffer_device: torch.device) -> None:
        # Sharded parameters are initialized as full tensors, one part at a time: the init is
        # a single process's from the same seed, whatever the mesh (models/sharded_init.py).
        with full_tensors(self.tok_embeddings):
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            with full_tensors(layer):
                layer.init_weights(buffer_device)
        self.norm.reset_parameters()
        if self.model_args.enable_weight_tying:
            self.output.weight = self.tok_embeddings.weight
        std = self.model_args.dim**-0.5
        with full_tensors(self.output):
            trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def get_attention_masks(self, input_batch: torch.Tensor, tokenizer=None, extra_inputs=None):
        """torchtitan's hook, called by its trainer for each micro-batch when attn_type is "flex"
        (document masking): the BlockMask of the batch's documents, from its positions [B, S]."""
        positions = (extra_inputs or {}).get("positions")
        if positions is None:  # no document boundaries given: each sequence is one document
            positions = torch.arange(input_batch.shape[1], device=input_batch.device).expand_as(input_batch)
        return document_block_mask(positions)

    def forward(self, tokens: torch.Tensor, attention_masks=None, positions: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, S] int64 -> logits [B, S, V]; with labels [B, S], the summed loss [] fp32
        (the trainer passes them: see loss_of_output). positions [B, S]: each token's place in its
        document (RoPE's, and with document masking the documents); None: 0..S-1."""
        if self.model_args.attn_type == "flex" and attention_masks is None:
            attention_masks = self.get_attention_masks(tokens, extra_inputs={"positions": positions})
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, attention_masks, positions)
        return self.output(self.norm(h), labels)
