"""Training FLOPs per token, in the two counts MFU is quoted in.

    torchtitan's  F     = 6 N + 12 L H d_h S
    causal        F_c   = 6 N +  6 L H d_h S      (= F - 6 L H d_h S)

N: the active parameters a token meets, without the input embedding (a lookup): every other parameter but
the experts, which count K / E of theirs (top-K of E): the attention projections, the norms, the router
gate, the output layer. 6 N: 2 FLOPs per multiply-add, forward + backward's two GEMMs (x 3). Attention:
per layer and head, QK^T and AV are 2 x 2 d_h S FLOPs a token forward, x 3 for training: 12 L H d_h S,
torchtitan's count (models/utils.py get_moe_model_nparams_and_flops: 6 x L x H x (2 d_h) x S), which
counts the whole S x S score matrix. A causal mask leaves half of it, which is what the flash kernels
compute and what the causal count counts, as Megatron-style counts do (NeMo's qwen3_flops: the attention
term times 0.5 for causal self-attention; its transformer_flops, Megatron-LM's formula: S / 2).

Qwen3-30B-A3B (30b-a3b: L = 48, H = 32, d_h = 128, D = 2048, E = 128, K = 8, V = 151,936) at S = 4096:
    N                 = 3,041,867,776            (30,532,122,624 parameters in all)
    6 N               = 18,251,206,656
    12 L H d_h S      =  9,663,676,416
    torchtitan's F    = 27,914,883,072 FLOPs a token (27.9 GFLOP)
    causal F_c        = 23,083,044,864 FLOPs a token (23.1 GFLOP): 0.827 of F, so an MFU of 21.8% in
                        torchtitan's count is 18.0% in the causal one
NeMo's qwen3_flops gives 23,006,281,728 for the same model: 0.33% below F_c, since it leaves out the router
gate (6 x 48 x 128 x 2048 = 75.5M) and the norms (1.3M). tests/test_flops.py checks these numbers.
"""

from __future__ import annotations


def attention_flops_per_token(n_layers: int, n_heads: int, head_dim: int, seq_len: int, causal: bool = False) -> int:
    """Training FLOPs of attention's scores and values per token: 12 L H d_h S, or half of it under the causal count."""
    full = 12 * n_layers * n_heads * head_dim * seq_len
    return full // 2 if causal else full


def flops_per_token(active_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int,
                    causal: bool = False) -> int:
    """6 N + attention: torchtitan's count, or the causal count (attention halved)."""
    return 6 * active_params + attention_flops_per_token(n_layers, n_heads, head_dim, seq_len, causal)


def causal_flops_per_token(torchtitan_flops: int, model_args, seq_len: int) -> int:
    """A model's torchtitan count (its args' get_nparams_and_flops) -> its causal count. `model_args`: ours or
    torchtitan's Qwen3 args (n_layers, n_heads, head_dim)."""
    half = attention_flops_per_token(model_args.n_layers, model_args.n_heads, model_args.head_dim, seq_len) // 2
    return torchtitan_flops - half
