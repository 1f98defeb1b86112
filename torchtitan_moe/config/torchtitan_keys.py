"""One-line checks of torchtitan's own keys, for values its Trainer would crash on or ignore.

torchtitan 0.2.2 takes `optimizer.lr = -1` to a traceback in torch's AdamW, `training.steps = -5`
to an assertion in its LR scheduler, `checkpoint.interval = 0` to a ZeroDivisionError after
step 1, and `training.steps = 0` to a run that trains nothing and says "Training completed".
`check_torchtitan_keys` stops each before launch, in one line that names the key and what is
allowed, like our own sections' checks (config/sections.py). Like config/sections.py, it imports nothing from
torchtitan: it reads the parsed config.
"""

import math
import os
from typing import Any

from torchtitan_moe.config.sections import ConfigError, _need


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def check_torchtitan_keys(cfg: Any, world_size: int | None = None) -> None:
    """[optimizer], [lr_scheduler], [training], [checkpoint] and [metrics] values that cannot train."""
    opt, sched, train, ck = cfg.optimizer, cfg.lr_scheduler, cfg.training, cfg.checkpoint
    # lr = 0 is allowed: a run that must not move the weights (tests of resume and loading use it).
    _need(_finite(opt.lr) and opt.lr >= 0, f"[optimizer] lr = {opt.lr}: must be a number >= 0")
    for key in ("beta1", "beta2"):
        beta = getattr(opt, key)
        _need(_finite(beta) and 0 <= beta < 1, f"[optimizer] {key} = {beta}: must be in [0, 1)")
    _need(_finite(opt.eps) and opt.eps > 0, f"[optimizer] eps = {opt.eps}: must be > 0")
    _need(_finite(opt.weight_decay) and opt.weight_decay >= 0,
          f"[optimizer] weight_decay = {opt.weight_decay}: must be >= 0")
    if opt.moments_dtype != "float32":
        _need(opt.name == "AdamW", f"[optimizer] moments_dtype = {opt.moments_dtype!r} is for name = 'AdamW' "
              f"(got {opt.name!r}); use moments_dtype = 'float32'")
        _need(not opt.early_step_in_backward, f"[optimizer] moments_dtype = {opt.moments_dtype!r} with "
              "early_step_in_backward = true: not supported; use moments_dtype = 'float32'")
        _need(opt.update != "torch", f"[optimizer] update = 'torch' with moments_dtype = {opt.moments_dtype!r}: "
              "torch's AdamW keeps fp32 moments; use update = 'triton' (or 'auto')")
    if opt.update == "triton":
        _need(opt.name == "AdamW", f"[optimizer] update = 'triton' is for name = 'AdamW' (got {opt.name!r}); "
              "use update = 'auto'")
        _need(not opt.early_step_in_backward, "[optimizer] update = 'triton' with early_step_in_backward = true: "
              "not supported; use update = 'auto'")

    _need(train.steps >= 1, f"[training] steps = {train.steps}: must be >= 1 (the number of optimizer steps to train)")
    _need(sched.warmup_steps >= 0, f"[lr_scheduler] warmup_steps = {sched.warmup_steps}: must be >= 0")
    _need(sched.total_steps is None or sched.total_steps >= 1,
          f"[lr_scheduler] total_steps = {sched.total_steps}: must be >= 1, or unset (then training.steps)")
    _need(sched.decay_ratio is None or (_finite(sched.decay_ratio) and 0 <= sched.decay_ratio <= 1),
          f"[lr_scheduler] decay_ratio = {sched.decay_ratio}: must be in [0, 1], or unset (decay right after warmup)")
    _need(_finite(sched.min_lr_factor) and 0 <= sched.min_lr_factor <= 1,
          f"[lr_scheduler] min_lr_factor = {sched.min_lr_factor}: must be in [0, 1]")

    _need(_finite(train.max_norm) and train.max_norm > 0,
          f"[training] max_norm = {train.max_norm}: must be > 0 (the gradient-clipping norm)")
    global_batch = train.global_batch_size
    _need(global_batch == -1 or global_batch >= 1,
          f"[training] global_batch_size = {global_batch}: must be -1 (local_batch_size x data-parallel ranks) or >= 1")
    if global_batch >= 1 and world_size is not None and train.local_batch_size >= 1:
        per_step = train.local_batch_size * world_size  # FSDP and EP only: every process is a data-parallel rank
        _need(global_batch % per_step == 0,
              f"[training] global_batch_size = {global_batch}: must be a multiple of local_batch_size x processes "
              f"({train.local_batch_size} x {world_size} = {per_step}); the quotient is the gradient accumulation")
    if opt.expert_grad_dtype == "bfloat16":  # the rest (experts outside FSDP2, our AdamW): at start-up
        for conflict in expert_gradient_conflicts(cfg, world_size):
            _need(False, f"[optimizer] expert_grad_dtype = 'bfloat16' {conflict}; or use expert_grad_dtype = 'float32'")
    _need(cfg.metrics.log_freq >= 1, f"[metrics] log_freq = {cfg.metrics.log_freq}: must be >= 1")

    if ck.enable:
        _need(ck.interval >= 1, f"[checkpoint] interval = {ck.interval}: must be >= 1 (steps between saves)")
        _need(ck.keep_latest_k == 0 or ck.keep_latest_k >= 2,
              f"[checkpoint] keep_latest_k = {ck.keep_latest_k}: must be 0 (keep all) or >= 2")
        _need(ck.load_step >= -1, f"[checkpoint] load_step = {ck.load_step}: must be -1 (the newest) or a saved step")


def check_tokenizer_file(path: str) -> None:
    """A `[data] tokenizer` path must hold a tokenizer.json that the tokenizers library reads."""
    from tokenizers import Tokenizer

    if not os.path.isfile(path):
        raise ConfigError(f"[data] tokenizer = {path!r}: expected 'bytes' or the path of a tokenizer.json")
    try:
        Tokenizer.from_file(path)
    except Exception as e:  # the library raises a bare Exception with a parser message
        raise ConfigError(f"[data] tokenizer = {path!r}: not a tokenizers tokenizer.json ({e}); build one with "
                          "scripts/build_tokenizer.py, or use 'bytes'") from None


def expert_gradient_conflicts(cfg: Any, world_size: int | None = None) -> list[str]:
    """The keys that keep the experts' gradients off their bf16 working copies ([optimizer] expert_grad_dtype),
    each completing "expert_grad_dtype = 'bfloat16' ...": what the config alone tells (the rest, experts outside
    FSDP2 and our AdamW built, at start-up: optimizer.keep_expert_gradients). The planner reads 'auto' by it."""
    opt, train = cfg.optimizer, cfg.training
    conflicts = []
    if not (opt.name == "AdamW" and opt.update != "torch" and not opt.early_step_in_backward):
        conflicts.append("is read by our AdamW: needs name = 'AdamW', update = 'triton' or 'auto' and "
                         "early_step_in_backward = false")
    if train.mixed_precision_param != "bfloat16":
        conflicts.append("keeps the experts' gradients on their bf16 working copies: needs [training] "
                         f"mixed_precision_param = 'bfloat16' (got {train.mixed_precision_param!r})")
    if cfg.parallelism.pipeline_parallel_degree != 1:
        conflicts.append("is read by our gradient clipping, which pipeline parallelism replaces with torchtitan's")
    global_batch, per_step = train.global_batch_size, train.local_batch_size * (world_size or 0)
    if global_batch >= 1 and per_step >= 1 and global_batch != per_step:
        conflicts.append(f"keeps one backward's gradients: global_batch_size = {global_batch} accumulates "
                         f"{global_batch // per_step} micro-batches a step")
    return conflicts
