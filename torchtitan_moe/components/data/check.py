"""The data a run will read: said in one line at its start, and its text files checked before launch
(tools/check_config) with the same reader the ranks use, so a bad file is one line naming it (and its line)
before any worker starts."""

from __future__ import annotations

import os

from torchtitan_moe.components.data.shards import DataError  # noqa: F401 (text.py raises it from here too)


def describe_data(job_config) -> str:
    """Which data the run reads, in words (the trainer logs it once at start)."""
    training, data = job_config.training, job_config.data
    if training.dataset == "synthetic":
        return (f"synthetic Markov stream (no files): seed {data.synthetic_seed}, {data.synthetic_successors} likely "
                "successors a token")
    if training.dataset == "text":
        from torchtitan_moe.components.data.text import list_files

        files = list_files(training.dataset_path)
        size = sum(os.path.getsize(f) for f in files)
        return (f"text from {training.dataset_path}: {len(files)} .txt/.jsonl file{'s' * (len(files) != 1)}, "
                f"{size / 2**20:,.1f} MiB, tokenizer {data.tokenizer}")
    if training.dataset == "shards":
        from torchtitan_moe.components.data.packed import source_specs

        sources = source_specs(data, training.dataset_path)
        return "token shards from " + ", ".join(f"{s.path} (weight {s.weight:g})" for s in sources)
    return f"{training.dataset} from {training.dataset_path}"


def check_text_data(job_config, vocab_size: int, dp_ranks: int | None) -> None:
    """Read the run's text data as its ranks will (every file, every record) and its tokenizer's size, before
    launch (token shards are checked by the data's own `check_data`, as the config loads). `dp_ranks`: the run's
    data-parallel ranks, when known (each needs a document)."""
    if job_config.training.dataset != "text":
        return
    from torchtitan_moe.components.data.text import iter_documents, list_files
    from torchtitan_moe.components.data.tokenizer import build_tokenizer

    path = job_config.training.dataset_path
    documents = sum(1 for _ in iter_documents(list_files(path)))
    if dp_ranks is not None and documents < dp_ranks:
        raise DataError(f"[training] dataset_path = {path!r}: {documents} documents for {dp_ranks} data-parallel "
                        "ranks (each reads its own documents)")
    tokens = build_tokenizer(job_config).get_vocab_size()
    if tokens > vocab_size:
        raise DataError(f"[data] tokenizer = {job_config.data.tokenizer!r} has {tokens} tokens but the model's "
                        f"vocab_size is {vocab_size}")
