"""A run that diverges stops, or skips the step, instead of training on (and saving) NaN.

`[training] on_nonfinite` says what a step whose loss or gradient norm is NaN or inf does:

    "stop"       (default) the run stops with one line: the first such step, which value, the last good
                 checkpoint; exit status 3, nothing saved from that step on
    "skip_step"  the step's update is skipped (weights, optimizer state, lr schedule untouched) with a
                 warning; one host sync and one all-reduce of a flag per step; the run stops as "stop"
                 does after [training] max_skipped_steps skipped in a row
    "warn"       the run trains on (the step line and the monitors show the NaN)

"stop" costs no host sync: each step folds its verdict into one int64 on the device (`first`: step x 4 +
what was not finite, the smallest such step so far), which travels with the logged step's values (read
back a step later, train/step.py) and is read before each save, so the run stops at the next logged step
or save after the first bad step, whichever comes first. Whatever the setting, a save is refused when the
weights or the optimizer state hold a NaN or inf (`check_before_save`): a checkpoint is never NaN.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan_moe.compat.torchtitan import logger

NONE = 2**62  # `first` while every step was finite
WHAT = {1: "the loss", 2: "the gradient norm", 3: "the loss and the gradient norm"}
EXIT_STATUS = 3  # python -m torchtitan_moe.train's exit status for a run stopped here


class NonFiniteError(RuntimeError):
    """The run diverged (one line: the step, which value, the last good checkpoint, what to do)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class NonFiniteWatch:
    """What a trainer does with a non-finite loss or gradient norm ([training] on_nonfinite)."""

    def __init__(self, mode: str, device: torch.device, max_skipped: int = 10):
        self.mode, self.device, self.max_skipped = mode, device, max_skipped
        self.skipped = 0  # "skip_step": steps skipped in a row
        self.first = torch.full((), NONE, dtype=torch.int64, device=device)
        self.counter: torch.Tensor | None = None  # the step, counted on the device (no copy per step)

    def allows_update(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """After the step's backward and clipping: False when its update must be skipped ("skip_step")."""
        code = (~torch.isfinite(loss.detach())).long() + 2 * (~torch.isfinite(_local(grad_norm).detach())).long()
        if self.mode == "stop":
            if self.counter is None:
                self.counter = torch.tensor(step, dtype=torch.int64, device=self.device)
            else:
                self.counter.add_(1)
            torch.minimum(self.first, torch.where(code > 0, self.counter * 4 + code, NONE), out=self.first)
            return True
        if self.mode == "skip_step":
            if dist.is_initialized():  # a rank's own loss may be the only bad value: every rank skips or none
                dist.all_reduce(code, op=dist.ReduceOp.MAX)
            if not int(code):
                self.skipped = 0
                return True
            self.skipped += 1
            if self.skipped >= self.max_skipped:
                raise NonFiniteError(f"step {step}: {WHAT[int(code)]} is not finite, {self.skipped} steps in a row "
                                     "skipped: training diverged; the weights are those of before the first of them; "
                                     f"stopped by [training] max_skipped_steps = {self.max_skipped}; lower [optimizer] "
                                     "lr or raise [lr_scheduler] warmup_steps")
            logger.warning(f"step {step}: {WHAT[int(code)]} is not finite: its update is skipped (weights, optimizer "
                           f"state and learning rate as before it; {self.skipped} in a row of at most "
                           f"{self.max_skipped}; [training] on_nonfinite = 'skip_step')")
            return False
        return True

    def check(self, first: int, checkpoint_folder: str | None) -> None:
        """Stop ("stop") if `first` (a read-back value of `self.first`, reduced over the ranks) names a step."""
        if self.mode != "stop" or first >= NONE:
            return
        step, what = divmod(first, 4)
        raise NonFiniteError(f"step {step}: {WHAT[what]} is not finite: training diverged; nothing was saved from "
                             f"step {step} on; {last_good(checkpoint_folder, step)}; lower [optimizer] lr or raise "
                             "[lr_scheduler] warmup_steps, or set [training] on_nonfinite = 'skip_step' to skip such "
                             "steps")


def last_good(checkpoint_folder: str | None, before: int) -> str:
    """Where to go on from: the newest complete step saved before step `before`."""
    from torchtitan_moe.train.checkpoint import is_complete, step_folders

    if checkpoint_folder is None:
        return "checkpointing is off ([checkpoint] enable), so the run starts over"
    saved = [s for s, path in step_folders(checkpoint_folder).items() if s < before and is_complete(path)]
    if not saved:
        return f"no checkpoint was saved before it in {checkpoint_folder}"
    return f"the last good checkpoint is step {max(saved)} ({os.path.join(checkpoint_folder, f'step-{max(saved)}')})"


def nonfinite_tensor(model_parts, optimizers) -> str | None:
    """The name of a weight or optimizer state tensor of this rank holding a NaN or inf, or None.
    One max-abs reduction per tensor (torch._foreach_norm, NaN propagating) and one read back."""
    named = [(name, _local(p)) for part in model_parts for name, p in part.named_parameters()]
    names = {id(p): name for part in model_parts for name, p in part.named_parameters()}
    for optimizer in getattr(optimizers, "optimizers", [optimizers]):
        for p, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    named.append((f"optimizer state {key} of {names.get(id(p), 'a parameter')}", _local(value)))
    named = [(name, t) for name, t in named if t.numel() and t.is_floating_point()]
    if not named:
        return None
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(named):
        by_device.setdefault(t.device, []).append(i)
    found = torch.zeros(len(named), dtype=torch.bool)
    for indices in by_device.values():
        norms = torch._foreach_norm([named[i][1] for i in indices], float("inf"))
        found[indices] = ~torch.isfinite(torch.stack([n.float() for n in norms])).cpu()
    bad = torch.nonzero(found).flatten().tolist()
    return named[bad[0]][0] if bad else None


def check_before_save(trainer, step: int) -> None:
    """Refuse (NonFiniteError, on every rank) to save `step` from non-finite weights or optimizer state, or,
    under "stop", after a non-finite step not yet read back. One all-reduce."""
    watch = trainer.nonfinite
    bad_tensor = nonfinite_tensor(trainer.model_parts, trainer.optimizers)
    flags = torch.stack([watch.first, torch.tensor(-1 if bad_tensor else 0, dtype=torch.int64, device=watch.device)])
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    first, any_bad = (int(x) for x in flags.cpu())
    folder = trainer.checkpointer.folder if trainer.checkpointer.enable else None
    watch.check(first, folder)
    if any_bad:
        where = f"{bad_tensor} on this rank" if bad_tensor else "another rank's weights or optimizer state"
        raise NonFiniteError(f"step {step}: not saved: {where} holds a NaN or inf; {last_good(folder, step + 1)}")
