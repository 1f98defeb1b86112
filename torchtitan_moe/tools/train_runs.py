"""Several training runs in ONE launch: process start-up, imports and the process group are paid once.

    torchrun --standalone --nproc_per_node=N -m torchtitan_moe.tools.train_runs RUNS.json

RUNS.json is a list of runs, trained in order on every rank:
    {"argv": [arg, ...], "log": path}   `python -m torchtitan_moe.train ARGV`; rank 0's output goes to `log`

Each run is torchtitan's Trainer (our MoETrainer) built from scratch; only the process group is
shared. Between runs, compiled graphs are dropped and torch's deterministic-algorithms switch is put
back, so a run sees the process as a fresh launch would. A run that fails stops the launch (exit 1).
`python -m torchtitan_moe.tools.parity --one-launch` trains its settings this way; the tests' multi-run
harness (tests/resume_harness.py) uses `shared_group`, `train` and `output_to`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_moe.compat.torchtitan import exit_process, init_logger
from torchtitan_moe.train.trainer import MoETrainer, prepare


@contextlib.contextmanager
def shared_group(argv: list[str]):
    """The gloo/NCCL default group every run's Trainer reuses; `argv` is a run's, for the one-time
    set-up (the CPU shim, the TrainSpec registration)."""
    init_logger()
    prepare(argv)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # Named, as torchtitan names it: FSDP2 picks its gradient reduction by the group's backend.
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    # torchtitan's train() ends with a 2 s sleep on rank 0 "for other ranks"; the barrier after each run does that.
    sleep = time.sleep
    time.sleep = lambda seconds: None if seconds == 2 else sleep(seconds)
    # What is alive now (the imported modules: torch, torchtitan, ...) lives as long as the process: kept
    # out of the collections after each run, which then walk only what the runs made (0.3 s a run less).
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        time.sleep = sleep
        dist.destroy_process_group()


def train(argv: list[str], adapt=None) -> None:
    """One run from scratch; `adapt(trainer)`, if given, changes the trainer before it trains."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    trainer = MoETrainer(prepare(argv))
    try:
        if adapt is not None:
            adapt(trainer)
        trainer.train()
    finally:
        trainer.close()
        del trainer
        gc.collect()
        torch._dynamo.reset()  # no compiled graph (nor its guards) carried into the next run
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)  # as before the run


@contextlib.contextmanager
def output_to(path: str | None, err_path: str | None = None):
    """This process's stdout and stderr (file descriptors 1 and 2) appended to `path` (stderr to
    `err_path` if given)."""
    if path is None:
        yield
        return
    sys.stdout.flush(), sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    for fd, target in ((1, path), (2, err_path or path)):
        f = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    try:
        yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)


def main(runs_path: str) -> int:
    runs = json.loads(Path(runs_path).read_text())
    with shared_group(runs[0]["argv"]):
        rank = dist.get_rank()
        for i, run in enumerate(runs):
            print(f"train_runs: run {i + 1} of {len(runs)}: {run['log']}", flush=True)
            with output_to(run["log"] if rank == 0 else None):
                print(" ".join(["train_runs:", *run["argv"]]), flush=True)
                try:
                    train(run["argv"])
                except BaseException:
                    import traceback

                    traceback.print_exc()  # into the run's log; the launch stops (torchrun ends the peers)
                    sys.stdout.flush(), sys.stderr.flush()
                    return 1
            dist.barrier()
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1]))
