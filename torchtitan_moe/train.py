"""Train: `python -m torchtitan_moe.train --job.config_file FILE [--section.key value ...]`.

Runs under torchrun or as one process. torchtitan's Trainer does the work; `MoETrainer`
adds what MoE training needs: the aux-loss weight per micro-batch and MoE statistics on
the step line. On a machine without CUDA it trains on the CPU over gloo.
"""

from __future__ import annotations

import os
import socket
import sys

import torch

from torchtitan_moe.config import ConfigError
from torchtitan_moe.config_loader import load_job_config
from torchtitan_moe.moe.layer import MoE
from torchtitan_moe.torchtitan_compat import Trainer, check_torchtitan_version, enable_cpu_training, init_logger, logger


class MoETrainer(Trainer):
    def __init__(self, job_config):
        super().__init__(job_config)
        # Each micro-batch's aux loss counts 1 / (micro-batches x data-parallel ranks) so the
        # summed gradients are those of the mean over the global batch, like the main loss.
        dims = self.parallel_dims
        batch_degree = dims.get_mesh("batch").size() if dims.dp_enabled else 1
        MoE.aux_loss_scale = 1.0 / (self.gradient_accumulation_steps * batch_degree)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env() -> None:
    """Let `python -m torchtitan_moe.train` run without torchrun, as rank 0 of 1."""
    if "RANK" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def prepare(argv: list[str] | None = None):
    """Environment, torchtitan registration and the checked job config."""
    from torchtitan_moe.models.qwen3_moe import register

    check_torchtitan_version()
    single_process_env()
    enable_cpu_training()
    register()
    return load_job_config(argv)


def run(config) -> None:
    trainer = None
    try:
        trainer = MoETrainer(config)
        if config.checkpoint.create_seed_checkpoint:
            if int(os.environ["WORLD_SIZE"]) != 1:
                raise ConfigError("[checkpoint] create_seed_checkpoint needs one process (no sharding)")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    init_logger()
    try:
        config = prepare(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
