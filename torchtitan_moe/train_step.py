"""The training step, as torchtitan 0.2.2's `Trainer.train_step` computes it, without its host syncs.

torchtitan's step starts by draining the GPU: it moves the step's token count and each
micro-batch to the device with blocking copies and reads the all-reduced count back with
`.item()`, four waits for the GPU to finish the step before. The host then launches the forward
on an idle GPU, only a little ahead of it for the whole forward: any stall of one rank's host
(a slow hook, the interpreter) idles its GPU and leaves the other rank's collectives spinning
beside its GEMMs (2 H200s, EP = 2: the grouped GEMMs ran 1.8x longer beside a waiting
all-gather; worklogs/2026-11-26-session4-h200x2.md). Here the batches go from pinned memory
with non-blocking copies and the count stays on the device, so the host queues step N + 1
while the GPU finishes step N; only a logging step reads values back.

The same arithmetic: the loss of each micro-batch is its summed loss / the global count of
valid tokens (a device tensor here; in torchtitan's data-parallel branch a Python number, which
CUDA's division turns into a multiplication by its reciprocal: the same for power-of-two counts,
within one ulp otherwise), clipping, the optimizer and the scheduler as torchtitan calls them,
and its logging. Pipeline parallelism keeps torchtitan's step (the caller's choice).
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import all_reduce

from torchtitan_moe.torchtitan_compat import IGNORE_INDEX, dist_utils


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without the host waiting: through pinned memory, whose buffer
    the caching host allocator keeps until the copy is done."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def train_step(trainer, data_iterator) -> None:
    """One optimizer step of `trainer` (a torchtitan Trainer without pipeline parallelism)."""
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
    trainer.optimizers.step()
    trainer.lr_schedulers.step()
    loss = torch.sum(torch.stack(losses))
    if trainer.metrics_processor.should_log(trainer.step):
        log(trainer, loss, grad_norm, lr, local_valid_tokens, global_valid_tokens)


def log(trainer, loss, grad_norm, lr, local_valid_tokens, global_valid_tokens) -> None:
    """torchtitan's step-end logging: the global mean loss, the largest rank's mean loss, tokens seen."""
    dims = trainer.parallel_dims
    if dims.dp_cp_enabled:
        loss_mesh = dims.get_optional_mesh("loss")
        # loss = this rank's summed loss / the global count: summed over ranks, the global mean;
        # times global / local count, this rank's own mean.
        local_avg_loss = loss * global_valid_tokens / local_valid_tokens
        global_avg_loss = dist_utils.dist_sum(loss, loss_mesh)
        global_max_loss = dist_utils.dist_max(local_avg_loss, loss_mesh)
        ntokens_seen = dist_utils.dist_sum(torch.tensor(trainer.ntokens_seen, dtype=torch.int64, device=trainer.device),
                                           loss_mesh)
    else:
        global_avg_loss = global_max_loss = loss.item()
        ntokens_seen = trainer.ntokens_seen
    trainer.metrics_processor.log(trainer.step, global_avg_loss, global_max_loss, grad_norm.item(),
                                  extra_metrics={"n_tokens_seen": ntokens_seen, "lr": lr})
