"""Local text data: .txt files (one document each) or .jsonl files (one {"text": ...} per line).

Documents are dealt round-robin to data-parallel ranks, tokenized with EOS appended,
packed into one stream and cut into windows of seq_len + 1 tokens. The stream repeats
(epochs) and its position is checkpointable: (epoch, next document, leftover tokens).
"""

from __future__ import annotations

import json
import os

import torch
from torch.utils.data import IterableDataset

from torchtitan_moe.compat.torchtitan import BaseTokenizer


def list_files(path: str) -> list[str]:
    """A file, or the .txt/.jsonl files under a folder (sorted, so every rank agrees)."""
    if os.path.isfile(path):
        return [path]
    found = sorted(
        os.path.join(root, name)
        for root, _, names in os.walk(path)
        for name in names
        if name.endswith((".txt", ".jsonl"))
    )
    if not found:
        raise FileNotFoundError(f"[training] dataset_path = {path!r}: no .txt or .jsonl files")
    return found


def read_documents(files: list[str]) -> list[str]:
    docs = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".jsonl"):
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        record = json.loads(line)
                        if "text" not in record:
                            raise ValueError(f"{path}:{lineno}: a JSONL record needs a 'text' field")
                        docs.append(record["text"])
            else:
                docs.append(f.read())
    return docs


class LocalTextDataset(IterableDataset):
    """Yields ({"input": tokens[:-1]}, labels = tokens[1:]), each [seq_len] int64."""

    def __init__(self, path: str, tokenizer: BaseTokenizer, seq_len: int, dp_rank: int, dp_world_size: int):
        docs = read_documents(list_files(path))
        self.docs = docs[dp_rank::dp_world_size]
        if not self.docs:
            raise ValueError(
                f"[training] dataset_path = {path!r}: {len(docs)} documents for {dp_world_size} data-parallel ranks"
            )
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.epoch, self.doc_idx, self.buffer = 0, 0, []

    def __iter__(self):
        window = self.seq_len + 1
        while True:
            while len(self.buffer) < window:
                self.buffer.extend(self.tokenizer.encode(self.docs[self.doc_idx], add_eos=True))
                self.doc_idx += 1
                if self.doc_idx == len(self.docs):
                    self.epoch, self.doc_idx = self.epoch + 1, 0
            tokens = torch.tensor(self.buffer[:window], dtype=torch.int64)
            self.buffer = self.buffer[window - 1 :]  # windows overlap by one: labels continue
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "doc_idx": self.doc_idx, "buffer": list(self.buffer)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.doc_idx, self.buffer = state["epoch"], state["doc_idx"], list(state["buffer"])
