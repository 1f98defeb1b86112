"""Data: a learnable synthetic stream, local text/JSONL files tokenized on the fly, or pretokenized
token shards of weighted sources (`prepare` makes them; packed.py reads them)."""

from __future__ import annotations

from torchtitan_moe.components.data.packed import build_shard_dataloader, open_sources
from torchtitan_moe.components.data.synthetic import SyntheticMarkovDataset
from torchtitan_moe.components.data.text import LocalTextDataset
from torchtitan_moe.components.data.tokenizer import build_tokenizer
from torchtitan_moe.compat.torchtitan import ParallelAwareDataloader

__all__ = ["build_dataloader", "build_tokenizer", "check_data", "stop_workers"]


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, vocab_size: int):
    """torchtitan's dataloader builder: one stream per data-parallel rank, checkpointable."""
    training = job_config.training
    if training.dataset == "shards":
        return build_shard_dataloader(dp_world_size, dp_rank, job_config, vocab_size)
    if training.dataset == "synthetic":
        dataset = SyntheticMarkovDataset(
            vocab_size, training.seq_len, dp_rank,
            successors=job_config.data.synthetic_successors, seed=job_config.data.synthetic_seed,
        )
    elif training.dataset == "text":
        if tokenizer.get_vocab_size() > vocab_size:
            raise ValueError(
                f"[data] tokenizer has {tokenizer.get_vocab_size()} tokens but the model's vocab_size is {vocab_size}"
            )
        dataset = LocalTextDataset(training.dataset_path, tokenizer, training.seq_len, dp_rank, dp_world_size)
    else:
        raise ValueError(f"[training] dataset = {training.dataset!r}: expected 'synthetic' or 'text', or 'shards'")
    workers = job_config.data.workers  # a worker keeps two batches ready (persistent: forked once)
    return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=training.local_batch_size,
                                   num_workers=workers, persistent_workers=workers > 0, prefetch_factor=2 if workers else None)


def check_data(job_config, vocab_size: int) -> None:
    """The data's own checks, before anything is launched or written: every shard of every source
    (DataError, one line naming the file). Other datasets are checked as they are read."""
    if job_config.training.dataset == "shards":
        open_sources(job_config, vocab_size)


def stop_workers(dataloader) -> None:
    """Stop a DataLoader's persistent worker processes now, and wait for them (a trainer's close()).

    Left to the garbage collector, the loader's iterator sits in a reference cycle with the trainer, and
    the collector runs its queues' finalizers (which end their feeder threads) before the iterator's own:
    the stop signal it then queues never reaches the worker, whose join waits out torch's 5 s timeout
    before killing it. Each run of a multi-run launch (train_runs, the tests' harness) paid those 5 s.
    A process that exits skips all this (torch's workers are daemons)."""
    iterator = getattr(dataloader, "_iterator", None)  # torch keeps it only for persistent workers
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
