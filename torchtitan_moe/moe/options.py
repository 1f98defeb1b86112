"""The MoE layer's and its router's settings, each declared here once.

    MoEArgs                what one MoE layer is built from (the model flavor's, updated by the run's config)
      MoEOptions           its own keys: experts, top_k, the experts' width, padding      [moe] in the TOML
      kernels, param_dtype from [kernels] backend and [training] mixed_precision_param
      router: RouterOptions the router's keys, handed to the router whole                 [router] in the TOML

The TOML sections are these classes (config/sections.py subclasses them only where a run's default differs
from a bare layer's: a key the model flavor fills in when unset, and Qwen3's balancing recipe), so a key's
type and meaning are written once, here.

No `from __future__ import annotations`: the config reads these fields' real types.
"""

from dataclasses import dataclass, field
from typing import Literal

from torchtitan_moe.moe.padding import PaddingPolicy
from torchtitan_moe.moe.router_losses import BalanceLoss


@dataclass
class RouterOptions:
    """The router's settings ([router]); the defaults are a bare layer's: no balance loss, an expert bias
    that moves where the balancing hook runs (moe/balance.py)."""

    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """Score function over the gate logits."""

    route_norm: bool = True
    """Renormalize the top-k probabilities to sum to 1."""

    route_scale: float = 1.0
    """Multiplier on the top-k probabilities."""

    init_std: float = 0.02
    """Std of the gate's truncated-normal init. 0 reproduces a zero-initialized gate."""

    bias_update_rate: float = 1e-3
    """Aux-loss-free balancing: step of the expert-bias update per optimizer step (0: off; moe/balance.py)."""

    balance_loss: BalanceLoss = "none"
    """Load-balance loss sum_e f_e P_e (1 when balanced), f and P counted per 'sequence' (DeepSeek-V3),
    per 'micro_batch' (Switch, GShard) or f over the 'global_batch' (Qwen3: all data-parallel ranks and
    the step's micro-batches so far, one all-reduce of E counts per layer)."""

    balance_loss_coeff: float = 0.0
    """Each MoE layer adds coeff x its balance loss (Megatron-LM, DeepSeek-V3); > 0 exactly when
    balance_loss is not 'none'."""

    z_loss_coeff: float = 0.0
    """Weight of the router z-loss, mean of logsumexp(logits)^2 (ST-MoE, OLMoE: 1e-3; 0: off)."""

    n_groups: int = 1
    """Group-limited routing (DeepSeek-V3): the experts split into this many groups (1: off)."""

    topk_groups: int = 1
    """Groups a token may use, ranked by the sum of their best top_k // topk_groups choice scores."""

    force_balance: bool = False
    """Ignore the scores and send tokens round-robin over experts (benchmarks only)."""

    gate_precision: Literal["float32", "param"] = "float32"
    """The gate's matrix product: 'float32' from fp32 weights (its own FSDP2 group), or 'param':
    in [training] mixed_precision_param, as torchtitan's Qwen3 does (scores in fp32 either way)."""


@dataclass
class MoEOptions:
    """The MoE layer's own settings ([moe])."""

    num_experts: int = 8
    """Routed experts per MoE layer."""

    top_k: int = 2
    """Experts each token is sent to."""

    inter_dim: int = 256
    """Hidden size of each expert."""

    padding: PaddingPolicy = "auto"
    """Pad each expert's rows for torch._grouped_mm: 'auto' pads only where the GPU needs it
    (compute capability 10.x gives empty groups wrong weight gradients), 'always', 'none'."""

    align: int = 8
    """Row alignment of each expert's group when padding (8, 16 or 32)."""


@dataclass
class MoEArgs(MoEOptions):
    """Everything one MoE layer is built from: its own settings, the ops' backend, and its router's."""

    kernels: Literal["auto", "torch", "triton"] = "auto"
    """The hot-path ops' backend ([kernels] backend): 'auto' is triton on CUDA, torch elsewhere."""

    param_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """The parameters' dtype in the matrix products ([training] mixed_precision_param): the gate's
    where router.gate_precision = 'param'."""

    router: RouterOptions = field(default_factory=RouterOptions)
    """The router's settings, handed to it whole."""
