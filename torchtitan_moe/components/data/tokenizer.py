"""Tokenizers that need no download: bytes, or a local tokenizers `tokenizer.json`."""

from __future__ import annotations

import os

from torchtitan_moe.compat.torchtitan import BaseTokenizer

_EOS_NAMES = ("<|endoftext|>", "<|im_end|>", "</s>", "<eos>", "[EOS]")


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes are tokens 0..255; 256 is BOS and 257 EOS."""

    def __init__(self):
        super().__init__()
        self.bos_id, self.eos_id = 256, 257

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return 258


class FileTokenizer(BaseTokenizer):
    """A `tokenizer.json` (Hugging Face tokenizers format), e.g. from scripts/build_tokenizer.py."""

    def __init__(self, path: str):
        super().__init__()
        from tokenizers import Tokenizer

        if not os.path.isfile(path):
            raise FileNotFoundError(f"[data] tokenizer = {path!r}: no such file")
        self.tokenizer = Tokenizer.from_file(path)
        vocab = self.tokenizer.get_vocab()
        eos = next((vocab[name] for name in _EOS_NAMES if name in vocab), None)
        if eos is None:
            raise ValueError(f"[data] tokenizer = {path!r}: needs an end-of-text token, one of {', '.join(_EOS_NAMES)}")
        self.eos_id = eos

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def get_vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


def build_tokenizer(job_config) -> BaseTokenizer | None:
    """The [data] tokenizer for text data; the synthetic stream needs none."""
    if job_config.training.dataset == "synthetic":
        return None
    name = job_config.data.tokenizer
    return ByteTokenizer() if name == "bytes" else FileTokenizer(name)


def train_bpe(files: list[str], vocab_size: int, out_path: str) -> FileTokenizer:
    """Train a byte-level BPE tokenizer on local text files and save it as `out_path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train(files, trainer)
    tokenizer.save(out_path)
    return FileTokenizer(out_path)
