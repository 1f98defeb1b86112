"""The training step, as torchtitan 0.2.2's `Trainer.train_step` computes it, without its host syncs.

torchtitan's step starts by draining the GPU: it moves the step's token count and each
micro-batch to the device with blocking copies and reads the all-reduced count back with
`.item()`, four waits for the GPU to finish the step before. The host then launches the forward
on an idle GPU, only a little ahead of it for the whole forward: any stall of one rank's host
(a slow hook, the interpreter) idles its GPU and leaves the other rank's collectives spinning
beside its GEMMs (2 H200s, EP = 2: the grouped GEMMs ran 1.8x longer beside a waiting
all-gather). Here the batches go from pinned memory
with non-blocking copies and the count stays on the device, so the host queues step N + 1
while the GPU finishes step N.

A logging step reads values back too (the loss, the gradient norm, the MoE statistics), which
drained the GPU once per log: the next step started on an idle GPU, its forward launched from a
host with no lead (2 H200s, local batch 4, logging every 10 steps: 110-200 ms lost every 10
steps; 78,575 tokens/s/GPU here against 69,720-71,261 in the same position before).
Here a logging step launches what it reads (the reductions, copies to pinned
memory behind one event) and its line is written once the next step is queued (PendingLog): the
read waits for the logged step alone while the GPU works on the next. The line and the run's
monitors come one step later (the last step's at once). A line's throughput counts the steps since
the last logged one, timed from that step's end to this one's as the device ran them (`mark`: CUDA
timing events on a GPU, whose host runs ahead; the host's clock on a CPU), not when the lines are
written: the last step's line comes right after the one before it, and a first line written after
step 2 would have timed step 2 as well.

The same arithmetic: the loss of each micro-batch is its summed loss / the global count of
valid tokens (a device tensor here; in torchtitan's data-parallel branch a Python number, which
CUDA's division turns into a multiplication by its reciprocal: the same for power-of-two counts,
within one ulp otherwise), clipping, the optimizer and the scheduler as torchtitan calls them,
and its logging. Pipeline parallelism keeps torchtitan's step (the caller's choice). A step whose loss
or gradient norm is not finite is stopped, skipped or let through as [training] on_nonfinite says
(train/divergence.py): the verdict travels with the logged values, read back with them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.distributed._functional_collectives import all_reduce

from torchtitan_moe.components.metrics import StepState
from torchtitan_moe.compat.torchtitan import IGNORE_INDEX, dist_utils


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without the host waiting: through pinned memory, whose buffer
    the caching host allocator keeps until the copy is done."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def train_step(trainer, data_iterator) -> None:
    """One optimizer step of `trainer` (a torchtitan Trainer without pipeline parallelism)."""
    if trainer.log_mark is None:  # the run's first step: its line is timed from here
        trainer.log_mark = mark(trainer.device)
    trainer.optimizers.zero_grad()
    lr = trainer.lr_schedulers.schedulers[0].get_last_lr()[0]
    dims, device = trainer.parallel_dims, trainer.device

    microbatches = [next(data_iterator) for _ in range(trainer.gradient_accumulation_steps)]
    local_valid_tokens = to_device(torch.stack([(labels != IGNORE_INDEX).sum() for _, labels in microbatches]).sum(),
                                   device)
    if dims.dp_enabled:
        global_valid_tokens = all_reduce(local_valid_tokens, "sum", dims.get_mesh("batch")).float()
    else:
        global_valid_tokens = local_valid_tokens.float()

    losses = []
    for input_dict, labels in microbatches:
        input_dict = {k: to_device(v, device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
        loss = trainer.forward_backward_step(input_dict=input_dict, labels=to_device(labels, device),
                                             global_valid_tokens=global_valid_tokens)
        losses.append(loss.detach())

    grad_norm = dist_utils.clip_grad_norm_(
        [p for m in trainer.model_parts for p in m.parameters()],
        trainer.job_config.training.max_norm,
        foreach=True,
        pp_mesh=dims.get_optional_mesh("pp"),
        ep_enabled=dims.ep_enabled,
    )
    trainer.checkpointer.maybe_wait_for_staging()
    loss = torch.sum(torch.stack(losses))
    if trainer.nonfinite.allows_update(trainer.step, loss, grad_norm):  # [training] on_nonfinite (train/divergence.py)
        trainer.optimizers.step()
        trainer.lr_schedulers.step()
    previous, trainer.pending_log = trainer.pending_log, None
    if trainer.metrics_processor.should_log(trainer.step):
        trainer.pending_log = start_log(trainer, loss, grad_norm, lr, local_valid_tokens, global_valid_tokens)
    if previous is not None:  # this step is queued: reading the last one's values keeps the GPU busy
        finish_log(trainer, previous)
    if trainer.step >= trainer.job_config.training.steps:
        flush_log(trainer)


Mark = torch.cuda.Event | float


def mark(device: torch.device) -> Mark:
    """Now, in the order `device` runs its work: a CUDA timing event recorded on the current stream, or on a
    CPU (whose work is done when its call returns) the host's clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds_between(start: Mark, end: Mark) -> float:
    """Seconds from mark `start` to mark `end` (on a GPU once the device has reached `end`: it waits)."""
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


class HostCopies:
    """Tensors copied to the host behind the work queued so far, without the host waiting: on a GPU
    into pinned memory behind one event, which `read` waits for (that work, not what was queued since)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.host, self.ready = {}, None
        for name, t in tensors.items():
            if t.device.type == "cuda":
                self.host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                self.ready = self.ready or torch.cuda.Event()
            else:
                self.host[name] = t
        if self.ready is not None:
            self.ready.record()

    def read(self) -> dict[str, torch.Tensor]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host


@dataclass
class PendingLog:
    """A logging step's values, launched at the end of its step and read once the next step is queued."""
    step: int
    lr: float
    ntokens_seen: int  # where no reduction over ranks counts it (else values["ntokens_seen"])
    ntokens: int  # this rank's tokens since the last logged step, the line's throughput
    values: HostCopies  # loss, max_loss, grad_norm, nonfinite (+ ntokens_seen) and the metrics' StepState tensors
    stale_names: list[str]
    end: Mark  # the step's end, its log's reductions and copies included


def start_log(trainer, loss, grad_norm, lr, local_valid_tokens, global_valid_tokens) -> PendingLog:
    """torchtitan's step-end logging, launched: the global mean loss, the largest rank's mean loss and the
    tokens seen (reduced over the loss mesh), the gradient norm and the metrics' StepState, each on its way
    to the host behind one event; nothing waits here."""
    dims = trainer.parallel_dims
    values = {"loss": loss, "max_loss": loss, "grad_norm": grad_norm, "nonfinite": trainer.nonfinite.first.clone()}
    loss_mesh = dims.get_optional_mesh("loss") if dims.dp_cp_enabled else None
    if loss_mesh is not None:
        values["nonfinite"] = all_reduce(trainer.nonfinite.first, "min", loss_mesh)  # the earliest on any rank
        # loss = this rank's summed loss / the global count: summed over ranks, the global mean;
        # times global / local count, this rank's own mean.
        values["loss"] = all_reduce(loss, "sum", loss_mesh)
        values["max_loss"] = all_reduce(loss * global_valid_tokens / local_valid_tokens, "max", loss_mesh)
        seen = to_device(torch.tensor(trainer.ntokens_seen, dtype=torch.int64), trainer.device)
        values["ntokens_seen"] = all_reduce(seen, "sum", loss_mesh)
    metrics = trainer.metrics_processor
    state = metrics.step_state(trainer.step)
    values.update({f"state/{name}": t for name, t in state.tensors.items()})
    ntokens, metrics.ntokens_since_last_log = metrics.ntokens_since_last_log, 0
    copies = HostCopies(values)
    return PendingLog(trainer.step, lr, trainer.ntokens_seen, ntokens, copies, state.stale_names, mark(trainer.device))


def finish_log(trainer, pending: PendingLog) -> None:
    """The step line and record of a started log (waits for its step alone)."""
    values = pending.values.read()
    state = StepState({name.removeprefix("state/"): t for name, t in values.items() if name.startswith("state/")},
                      pending.stale_names)
    ntokens_seen = int(values["ntokens_seen"]) if "ntokens_seen" in values else pending.ntokens_seen
    elapsed, trainer.log_mark = seconds_between(trainer.log_mark, pending.end), pending.end
    trainer.metrics_processor.log(pending.step, float(values["loss"]), float(values["max_loss"]),
                                  float(values["grad_norm"]), extra_metrics={"n_tokens_seen": ntokens_seen,
                                                                             "lr": pending.lr},
                                  state=state, ntokens=pending.ntokens, elapsed=elapsed)
    checkpointer = trainer.checkpointer
    trainer.nonfinite.check(int(values["nonfinite"]), checkpointer.folder if checkpointer.enable else None)


def flush_log(trainer) -> None:
    """The started log, if any, finished now: the run's last step, or a run stopped between steps."""
    pending, trainer.pending_log = trainer.pending_log, None
    if pending is not None:
        finish_log(trainer, pending)
