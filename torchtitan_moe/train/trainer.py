"""Train: `python -m torchtitan_moe.train --job.config_file FILE [--section.key value ...]`.

Runs under torchrun or as one process. torchtitan's Trainer does the work; `MoETrainer`
adds what MoE training needs: the aux-loss weight per micro-batch, the router-init checks
before step 1, the per-rank numbers of the training-health monitors, and MoE statistics on
the step line; its step is torchtitan's without the host syncs (train/step.py). On a machine
without CUDA it trains on the CPU over gloo.

Nothing lost, nothing silent (docs/failures.md): the run holds its dump folder's lock (train/run_folder.py),
saves each step with its checksums and never from NaN weights (train/checksums.py, train/divergence.py),
stops on a non-finite loss or gradient norm as [training] on_nonfinite says, and a hang watchdog turns a
stuck step into one line (train/watchdog.py).
"""

from __future__ import annotations

import netrc
import os
import socket
import sys

import torch

from torchtitan_moe.train.machine import check_machine, configure_allocator
from torchtitan_moe.train.checkpoint import CheckpointError, check_checkpoint_to_load, record_model_args, saving
from torchtitan_moe.train.checksums import ChecksummedWriter
from torchtitan_moe.train.divergence import NonFiniteError, NonFiniteWatch, check_before_save
from torchtitan_moe.train.divergence import EXIT_STATUS as DIVERGED
from torchtitan_moe.train.run_folder import RunFolderLock
from torchtitan_moe.train.watchdog import HangWatchdog
from torchtitan_moe.components.data.check import describe_data
from torchtitan_moe.components.checks import run_router_init_checks
from torchtitan_moe.components.checks.monitors import gather_rank_stats, local_grad_norm
from torchtitan_moe.config.sections import ConfigError
from torchtitan_moe.train.job_config import load_job_config
from torchtitan_moe.components.data import stop_workers
from torchtitan_moe.models import qwen3_moe
from torchtitan_moe.models.baseline import write_init_fingerprint
from torchtitan_moe.dispatch.deepep_backend import release_buffers
from torchtitan_moe.moe.balance import set_aux_loss_scale
from torchtitan_moe.components.optimizer import attach_working_copies, clip_in_optimizer, keep_expert_gradients
from torchtitan_moe.train.step import flush_log, train_step
from torchtitan_moe.compat.torchtitan import (
    DataloaderExhaustedError,
    Trainer,
    check_torchtitan_version,
    enable_cpu_training,
    init_logger,
    logger,
    replace_clip_grad_norm,
    route_checkpoint_saves,
)


class RouterInitError(RuntimeError):
    """The router-init checks failed (`[checks] router_init = "error"`); the findings are logged."""


def wandb_offline_without_key(job_config) -> None:
    """W&B without an API key would stop to ask for one: log offline instead (`wandb sync`
    uploads later). Must run before torchtitan builds its loggers, in Trainer.__init__."""
    if not job_config.metrics.enable_wandb or "WANDB_MODE" in os.environ or os.environ.get("WANDB_API_KEY"):
        return
    try:  # `wandb login` keeps the key in ~/.netrc
        if netrc.netrc().authenticators("api.wandb.ai"):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    os.environ["WANDB_MODE"] = "offline"
    logger.info("W&B: no API key found, logging offline (WANDB_MODE=offline)")


class MoETrainer(Trainer):
    def __init__(self, job_config):
        wandb_offline_without_key(job_config)
        route_checkpoint_saves(ChecksummedWriter)  # every step saved with its checksums (train/checksums.py)
        # One run writes a dump folder at a time: global rank 0 holds its lock until close().
        self.run_lock = RunFolderLock(job_config.job.dump_folder)
        self.watchdog: HangWatchdog | None = None
        if int(os.environ.get("RANK", "0")) == 0:
            self.run_lock.acquire()
        try:
            self._build(job_config)
        except BaseException:
            self.run_lock.release()
            raise

    def _build(self, job_config) -> None:
        super().__init__(job_config)
        # Each micro-batch's aux loss counts 1 / (micro-batches x data-parallel ranks) so the
        # summed gradients are those of the mean over the global batch, like the main loss.
        dims = self.parallel_dims
        batch_degree = dims.get_mesh("batch").size() if dims.dp_enabled else 1
        set_aux_loss_scale(self.model_parts, 1.0 / (self.gradient_accumulation_steps * batch_degree))
        self._local_losses: list[torch.Tensor] = []
        self.pending_log = None  # a logging step's values, read once the next step is queued (train/step.py)
        self.log_mark = None  # where the last logged step ended (train_step.mark): the next line's time starts
        self.ours = job_config.model.name == qwen3_moe.NAME  # not the torchtitan_qwen3_moe baseline
        if job_config.checkpoint.enable and self.ours:
            record_model_args(self.checkpointer, self.model_args, self.checkpointer.export_dtype)
        # Both models: a comparison of the two clips the same way.
        replace_clip_grad_norm(lambda torchtitan_clip: clip_in_optimizer(self.optimizers, torchtitan_clip))
        attach_working_copies(self.optimizers, self.model_parts)
        if self.ours:  # torchtitan's baseline has no working copies
            keep_expert_gradients(job_config.optimizer.expert_grad_dtype, self.optimizers, self.model_parts,
                                  self.gradient_accumulation_steps, self.parallel_dims.pp_enabled)
        self.nonfinite = NonFiniteWatch(job_config.training.on_nonfinite, self.device,
                                        job_config.training.max_skipped_steps)
        self.first_step: int | None = None  # the step this run starts from (0, or the one it resumes)
        self.guard_saves()
        logger.info(f"data: {describe_data(job_config)}")

    def guard_saves(self) -> None:
        """Each save: refused from NaN weights or state and after a diverged step (train/divergence.py), a
        failure while writing (a full disk) turned into one line, progress told to the hang watchdog."""
        save, checkpointer = self.checkpointer.save, self.checkpointer

        def guarded(curr_step: int, last_step: bool = False) -> None:
            if not checkpointer._should_save(curr_step, last_step):  # torchtitan's own test, inside its save
                return save(curr_step, last_step)
            check_before_save(self, curr_step)
            self.beat(f"saving step {curr_step}")
            with saving(checkpointer.folder, curr_step):
                save(curr_step, last_step)
            self.beat(f"step {curr_step} saved")

        checkpointer.save = guarded

    def beat(self, doing: str) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(doing)

    def hang_timeout(self) -> float:
        """[checks] hang_timeout, or 90% of the collectives' current timeout: [comm] init_timeout_seconds until
        torchtitan shortens it to train_timeout_seconds, after step 1 of a run that starts at step 0."""
        setting = self.job_config.checks.hang_timeout
        if setting >= 0:
            return setting
        comm = self.job_config.comm
        shortened = self.first_step == 0 and self.step >= 2
        return 0.9 * (comm.train_timeout_seconds if shortened else comm.init_timeout_seconds)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        stop_workers(getattr(self, "dataloader", None))
        try:
            super().close()
        finally:
            replace_clip_grad_norm(lambda torchtitan_clip: torchtitan_clip)  # no later trainer steps these optimizers
            self.run_lock.release()

    def train(self) -> None:
        # Refuse, in one line, a checkpoint that cannot resume or start this run, before
        # torchtitan's load fails deep inside DCP (or loads what would train wrong).
        distributed = torch.distributed.is_initialized()
        if self.ours:  # the baseline's checkpoints are torchtitan's own business
            check_checkpoint_to_load(self.job_config, self.model_args, self.dataloader.dp_world_size,
                                     split_over_ranks=distributed)
        rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if distributed else (0, 1)
        self.watchdog = HangWatchdog(self.job_config.job.dump_folder, rank, world, self.hang_timeout).start()
        super().train()

    def batch_generator(self, data_iterable):
        # torchtitan's train() calls this once, right after it loads the checkpoint and right
        # before step 1: the only point where the weights training starts from are in place
        # without copying train(). The checks must see them (a zero-init run fails, a resumed
        # healthy run passes), so they run here.
        self.first_step = self.step
        if self.job_config.checks.init_fingerprint and self.step == 0:
            write_init_fingerprint(self.model_parts[0], self.job_config.job.dump_folder)
        self.check_router_init()
        return super().batch_generator(data_iterable)

    def check_router_init(self) -> None:
        mode = self.job_config.checks.router_init
        if mode == "off":
            return
        # At step 0 the gate is its init, so its std is compared with [router] init_std;
        # a resumed run's gate has trained away from it and gets the other checks only.
        with self.maybe_enable_amp:
            findings = run_router_init_checks(self.model_parts, self.job_config, self.parallel_dims,
                                              self.device, fresh=self.step == 0)
        if not findings:
            logger.info("router-init checks passed")
            return
        # Findings come from global statistics: every rank has the same list; rank 0 logs it.
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            for finding in findings:
                logger.warning(f"router-init: {finding}")
        summary = f"router-init checks failed: {len(findings)} findings (see above)"
        if mode == "error":
            raise RouterInitError(f'{summary}; set [checks] router_init = "warn" to train anyway')
        logger.warning(f'{summary}; training anyway ([checks] router_init = "warn")')

    def post_dataloading_process(self, input_dict, labels):
        inputs, labels, extra_inputs, extra_kwargs = super().post_dataloading_process(input_dict, labels)
        if self.ours:
            # Our model's output layer returns the summed loss given the labels (one pass over
            # bf16 logits, models/qwen3_moe/model.py:OutputLayer); the loss function passes it on.
            extra_kwargs["labels"] = labels
        return inputs, labels, extra_inputs, extra_kwargs

    def train_step(self, data_iterator) -> None:
        # Monitor steps also check that the experts' working copies the optimizer wrote are the new weights'
        # casts: with the step's log (components/metrics.py: step_state).
        self._local_losses = []
        self.beat(f"step {self.step}")
        if self.parallel_dims.pp_enabled:
            super().train_step(data_iterator)
            return
        try:  # torchtitan's step without its host syncs (train/step.py)
            train_step(self, data_iterator)
        except DataloaderExhaustedError:
            flush_log(self)  # the last logged step's line, before torchtitan ends the run
            raise

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens) -> torch.Tensor:
        loss = super().forward_backward_step(input_dict=input_dict, labels=labels,
                                             global_valid_tokens=global_valid_tokens)
        self._local_losses.append(loss.detach())
        # After the step's last backward and before clipping (which spreads one rank's NaN to
        # every rank's gradients), record each rank's loss share and gradient norm on monitor
        # steps: one small all-gather per monitor interval.
        last = len(self._local_losses) == self.gradient_accumulation_steps
        if last and self.metrics_processor.monitor.is_monitor_step(self.step):
            local_loss = torch.stack(self._local_losses).sum()
            self.metrics_processor.rank_stats = gather_rank_stats(local_loss, local_grad_norm(self.model_parts))
        return loss


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


def colour_wanted() -> bool:
    """Colour codes only on a terminal. A launcher whose own output is not one says so with
    NO_COLOR (scripts/train.sh does); its workers' output is always a pipe."""
    if os.environ.get("NO_COLOR"):
        return False
    return "TORCHELASTIC_RUN_ID" in os.environ or sys.stdout.isatty()


def prepare(argv: list[str] | None = None):
    """Environment, torchtitan registration and the checked job config."""
    from torchtitan_moe.models import baseline

    check_torchtitan_version()
    single_process_env()
    enable_cpu_training()
    qwen3_moe.register()
    baseline.register()
    config = load_job_config(argv)
    check_machine(config, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    configure_allocator(config)
    if not colour_wanted():
        config.metrics.disable_color_printing = True
    if config.model.name == baseline.NAME and not torch.cuda.is_available():
        raise ConfigError(f"[model] name = {baseline.NAME!r} needs a CUDA GPU: torchtitan 0.2.2's MoE counts "
                          "tokens with torch.histc, which has no CPU kernel for int64")
    return config


def run(config) -> None:
    trainer = None
    try:
        trainer = MoETrainer(config)
        if config.checkpoint.create_seed_checkpoint:
            if int(os.environ["WORLD_SIZE"]) != 1:
                raise ConfigError("[checkpoint] create_seed_checkpoint needs one process (no sharding)")
            trainer.checkpointer.last_save_model_only = True  # a seed is weights only (step 0)
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except BaseException:
        if trainer is not None:
            trainer.close()
        raise  # no barrier here: a failed peer would never reach it
    trainer.close()
    if torch.distributed.is_initialized():
        # Every rank leaves together: a gloo rank that tears its group down while a peer is
        # still inside it can abort ("terminate called without an active exception").
        torch.distributed.barrier()
        release_buffers()  # DeepEP's, if any: freed collectively while every rank is here
        torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Train; a stop the run can explain is one line and an exit status (docs/failures.md): 2 a refusal
    (config, data, checkpoint, a busy run folder), 1 the router-init checks, 3 a diverged run; a hang
    exits with 4 from its watchdog. Every rank prints its line: under torchrun the launcher shows rank 0's."""
    init_logger()
    try:
        config = prepare(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        run(config)
    except CheckpointError as e:  # before ConfigError, which it subclasses
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:  # found while building (a dispatcher this node cannot run, the data, the run folder)
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except RouterInitError as e:
        print(e, file=sys.stderr)
        return 1
    except NonFiniteError as e:
        print(f"stopped: {e}", file=sys.stderr)
        return DIVERGED
    return 0

