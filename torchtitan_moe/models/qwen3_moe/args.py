"""Qwen3-MoE model arguments and flavors."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from torchtitan_moe.components.flops import flops_per_token
from torchtitan_moe.config.sections import moe_args
from torchtitan_moe.moe.layer import MoE
from torchtitan_moe.moe.options import MoEArgs
from torchtitan_moe.compat.torchtitan import BaseModelArgs


@dataclass
class Qwen3MoEArgs(BaseModelArgs):
    dim: int = 2048
    n_layers: int = 48
    n_heads: int = 32
    n_kv_heads: int = 4
    head_dim: int = 128
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    qk_norm: bool = True
    max_seq_len: int = 4096
    attn_type: str = "sdpa"  # the torchtitan attention we reuse reads these two: "flex" and
    attn_mask_type: str = "causal"  # "block_causal" for [data] attention = "document"
    enable_weight_tying: bool = False
    moe: MoEArgs = field(default_factory=MoEArgs)
    init_seed: int | None = None  # [debug] seed: the init draws from it alone (None: the RNG as it is)

    def update_from_config(self, job_config, **kwargs) -> None:
        """Apply [moe], [router], [kernels], the precision and the sequence length from the job config."""
        self.max_seq_len = job_config.training.seq_len
        document = job_config.data.attention == "document"
        self.attn_type, self.attn_mask_type = ("flex", "block_causal") if document else ("sdpa", "causal")
        self.init_seed = job_config.debug.seed
        self.moe = moe_args(job_config, self.moe)

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Total parameters and training FLOPs per token in torchtitan's count (components/flops.py: 6 x active
        non-embedding params + attention scores and values, 12 x layers x heads x head_dim x seq_len)."""
        total = sum(p.numel() for p in model.parameters())
        embedding = sum(p.numel() for p in model.tok_embeddings.parameters())
        experts = sum(p.numel() for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters())
        active_experts = experts * self.moe.top_k // self.moe.num_experts
        active = total - embedding - experts + active_experts
        return total, flops_per_token(active, self.n_layers, self.n_heads, self.head_dim, seq_len)


FLAVORS: dict[str, Qwen3MoEArgs] = {
    # Trains on a CPU in seconds; the synthetic stream's loss falls within a few dozen steps.
    "debug": Qwen3MoEArgs(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=2048,
        max_seq_len=512, rope_theta=1e4,
        moe=MoEArgs(num_experts=8, top_k=2, inter_dim=128),
    ),
    # Qwen3-30B-A3B.
    "30b-a3b": Qwen3MoEArgs(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, vocab_size=151936,
        rope_theta=1e6, moe=MoEArgs(num_experts=128, top_k=8, inter_dim=768),
    ),
    # Qwen3-30B-A3B at 8 layers (5.6B parameters): single-node benchmarks.
    "30b-a3b-8l": Qwen3MoEArgs(
        dim=2048, n_layers=8, n_heads=32, n_kv_heads=4, head_dim=128, vocab_size=151936,
        rope_theta=1e6, moe=MoEArgs(num_experts=128, top_k=8, inter_dim=768),
    ),
    # Qwen3-235B-A22B (its Hugging Face config: 94 layers, hidden 4096, 64 q / 4 kv heads of 128,
    # 128 experts top-8, moe_intermediate 1536): 235B parameters, for the planner (torchtitan_moe.tools.plan).
    "235b-a22b": Qwen3MoEArgs(
        dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128, vocab_size=151936,
        rope_theta=1e6, moe=MoEArgs(num_experts=128, top_k=8, inter_dim=1536),
    ),
}
