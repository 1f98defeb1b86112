"""The MoE layer's and its router's settings, each declared here once.

    MoEArgs                what one MoE layer is built from (the model flavor's, updated by the run's config)
      MoEOptions           its own keys: experts, top_k, the experts' width, padding      [moe] in the TOML
      kernels, param_dtype from [kernels] backend and [training] mixed_precision_param
      router: RouterOptions the router's keys, handed to the router whole                 [router] in the TOML

The TOML sections are these classes (config/sections.py subclasses them only where a run's default differs
from a bare layer's: a key the model flavor fills in when unset, and Qwen3's balancing recipe), so a key's
type and meaning are written once, here; and so are its checks: `moe_problem` and `router_problem` word
each problem once, the layer and the router refuse what they return, and the config check words the keys
in its own terms through `name` ("[router] n_groups = 3: must divide [moe] num_experts (8)").

No `from __future__ import annotations`: the config reads these fields' real types.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

from torchtitan_moe.moe.padding import ALIGNMENTS, PaddingPolicy
from torchtitan_moe.moe.router_losses import BALANCE_LOSSES, BalanceLoss


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


def _as_is(key: str) -> str:
    return key


def router_problem(options: RouterOptions, num_experts: int, top_k: int,
                   name: Callable[[str], str] = _as_is) -> str | None:
    """What is wrong with routing `num_experts` experts, `top_k` a token, with `options`, in one line; None if
    nothing. `name(key)` words a key (of RouterOptions, or num_experts / top_k): the key itself by default."""
    o = options
    if num_experts < 1:
        return f"{name('num_experts')} = {num_experts}: must be >= 1"
    if not 1 <= top_k <= num_experts:
        return f"{name('top_k')} = {top_k}: must be in 1..num_experts ({num_experts})"
    if o.score_func not in ("softmax", "sigmoid"):
        return f"{name('score_func')} = {o.score_func!r}: expected 'softmax' or 'sigmoid'"
    if o.gate_precision not in ("float32", "param"):
        return f"{name('gate_precision')} = {o.gate_precision!r}: expected 'float32' or 'param'"
    if o.init_std < 0:
        return f"{name('init_std')} = {o.init_std}: must be >= 0"
    if o.route_scale <= 0:
        return f"{name('route_scale')} = {o.route_scale}: must be > 0"
    if o.bias_update_rate < 0:
        return f"{name('bias_update_rate')} = {o.bias_update_rate}: must be >= 0 (0: off)"
    if o.balance_loss not in BALANCE_LOSSES:
        return f"{name('balance_loss')} = {o.balance_loss!r}: expected one of {', '.join(BALANCE_LOSSES)}"
    if o.balance_loss_coeff < 0:
        return f"{name('balance_loss_coeff')} = {o.balance_loss_coeff}: must be >= 0"
    if o.balance_loss != "none" and o.balance_loss_coeff == 0:
        return (f"{name('balance_loss')} = {o.balance_loss!r} needs balance_loss_coeff > 0 (e.g. 1e-3); "
                "'none' turns it off")
    if o.balance_loss == "none" and o.balance_loss_coeff > 0:
        return (f"{name('balance_loss_coeff')} = {o.balance_loss_coeff} has no loss to weigh: set balance_loss "
                "(e.g. 'global_batch') or 0")
    if o.z_loss_coeff < 0:
        return f"{name('z_loss_coeff')} = {o.z_loss_coeff}: must be >= 0 (0: off)"
    return _groups_problem(o, num_experts, top_k, name)


def _groups_problem(o: RouterOptions, num_experts: int, top_k: int, name: Callable[[str], str]) -> str | None:
    """Group-limited routing: the experts split evenly into n_groups, each token's top_k within topk_groups."""
    groups, topk_groups = o.n_groups, o.topk_groups
    if groups < 1:
        return f"{name('n_groups')} = {groups}: must be >= 1 (1: no groups)"
    if num_experts % groups:
        return f"{name('n_groups')} = {groups}: must divide {name('num_experts')} ({num_experts})"
    if not 1 <= topk_groups <= groups:
        return f"{name('topk_groups')} = {topk_groups}: must be in 1..n_groups ({groups})"
    if groups == 1:
        return None
    per_group = num_experts // groups
    if top_k > topk_groups * per_group:
        return f"{name('top_k')} = {top_k}: more than topk_groups x experts per group ({topk_groups} x {per_group})"
    if topk_groups > top_k:
        return f"{name('topk_groups')} = {topk_groups}: more than top_k ({top_k}) groups cannot all be used"
    if o.force_balance:
        return f"{name('force_balance')} sends tokens round-robin over all experts: it needs n_groups = 1"
    return None


def moe_problem(args: MoEArgs, name: Callable[[str], str] = _as_is) -> str | None:
    """What is wrong with `args` for one MoE layer, in one line (its router's settings included); None if
    nothing. `name(key)` words a key (of MoEOptions or RouterOptions): the key itself by default."""
    if args.inter_dim < 1:
        return f"{name('inter_dim')} = {args.inter_dim}: must be >= 1"
    if args.padding not in get_args(PaddingPolicy):
        return f"{name('padding')} = {args.padding!r}: expected 'none', 'auto' or 'always'"
    if args.align not in ALIGNMENTS:
        return f"{name('align')} = {args.align}: must be one of 8, 16, 32"
    return router_problem(args.router, args.num_experts, args.top_k, name)
