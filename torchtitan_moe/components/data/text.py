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

from torchtitan_moe.components.data.check import DataError
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
        raise DataError(f"[training] dataset_path = {path!r}: no .txt or .jsonl files")
    return found


def _decode(raw: bytes, path: str, lineno: int | None = None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = lineno or raw.count(b"\n", 0, e.start) + 1
        where = f"{path}:{lineno}"
        raise DataError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x}); text data must be UTF-8") from None


def iter_documents(files: list[str]):
    """Each document of `files`, in order: a .txt file whole, a .jsonl file's records' 'text'."""
    for path in files:
        with open(path, "rb") as f:
            if not path.endswith(".jsonl"):
                yield _decode(f.read(), path)
                continue
            for lineno, raw in enumerate(f, 1):
                line = _decode(raw, path, lineno)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not a JSON record ({e.msg}, column {e.colno})") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise DataError(f"{path}:{lineno}: a JSONL record needs a 'text' field holding a string")
                yield record["text"]


def read_documents(files: list[str]) -> list[str]:
    return list(iter_documents(files))


class LocalTextDataset(IterableDataset):
    """Yields ({"input": tokens[:-1]}, labels = tokens[1:]), each [seq_len] int64."""

    def __init__(self, path: str, tokenizer: BaseTokenizer, seq_len: int, dp_rank: int, dp_world_size: int):
        docs = read_documents(list_files(path))
        self.docs = docs[dp_rank::dp_world_size]
        if not self.docs:
            raise DataError(
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
