"""Token shards on disk: the format `prepare` writes and the shard loader memory-maps (docs/data.md).

One file per shard, little-endian throughout:

    [0, 8)            magic b"TTMSHARD"
    [8, 16)           H: the header's length in bytes, uint64
    [16, 16 + H)      header: UTF-8 JSON, padded with spaces so that 16 + H is a multiple of 64
    [16 + H, I)       tokens [num_tokens], uint16 (vocabularies up to 65,536 tokens) or uint32: the
                      documents back to back, each ending with the tokenizer's EOS; zero-padded to 8 bytes
    [I, I + 8(D + 1)) document index [D + 1] int64: document d is tokens[index[d]:index[d + 1]],
                      index[0] = 0 and index[D] = num_tokens; the file ends here

The header: {"format": "torchtitan-moe-shard", "version": 1, "dtype", "num_tokens", "num_documents",
"max_token_id", "tokenizer": {"name", "sha256", "vocab_size", "eos_id"}, "inputs": [what it was made from]}.
Two tokenizers are the same when their sha256 (of the tokenizer.json's bytes) and sizes are: "bytes" has none.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

from torchtitan_moe.config.sections import ConfigError

MAGIC = b"TTMSHARD"
FORMAT = "torchtitan-moe-shard"
VERSION = 1
SUFFIX = ".bin"
MANIFEST = "prepare.json"  # prepare's plan of a source folder: which shards it will hold, and whether all are made
_ALIGN = 64


class DataError(ConfigError):
    """Data that cannot train, worded as one line naming the file (a config error: stops before step 1)."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits, else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def tokenizer_identity(name: str) -> dict:
    """What a shard records of its tokenizer: `name` is 'bytes' or the path of a tokenizer.json."""
    from torchtitan_moe.components.data.tokenizer import ByteTokenizer, FileTokenizer

    if name == "bytes":
        tok = ByteTokenizer()
        return {"name": "bytes", "sha256": None, "vocab_size": tok.get_vocab_size(), "eos_id": tok.eos_id}
    try:
        tok = FileTokenizer(name)
    except (OSError, ValueError) as e:
        raise DataError(str(e)) from None
    with open(name, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"name": os.path.basename(name), "sha256": digest, "vocab_size": tok.get_vocab_size(), "eos_id": tok.eos_id}


def same_tokenizer(a: dict, b: dict) -> bool:
    """The same token ids for the same text: the same file's bytes (or both 'bytes')."""
    same = all(a.get(k) == b.get(k) for k in ("sha256", "vocab_size", "eos_id"))
    return same and (a["sha256"] is not None or a.get("name") == b.get("name"))


def describe_tokenizer(t: dict) -> str:
    return "bytes" if t["sha256"] is None else f"{t['name']} (sha256 {t['sha256'][:12]}, {t['vocab_size']} tokens)"


def write_shard(path: str, documents: list[np.ndarray], tokenizer: dict, inputs: list[dict]) -> dict:
    """Write `documents` (token arrays, each ending with EOS) as one shard, atomically (a temporary
    file renamed into place: a shard that exists is complete). Returns its header."""
    dtype = token_dtype(tokenizer["vocab_size"])
    lengths = np.fromiter((len(d) for d in documents), dtype=np.int64, count=len(documents))
    index = np.zeros(len(documents) + 1, dtype="<i8")
    np.cumsum(lengths, out=index[1:])
    tokens = np.concatenate(documents).astype(dtype) if documents else np.zeros(0, dtype)
    header = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "num_tokens": int(index[-1]),
              "num_documents": len(documents), "max_token_id": int(tokens.max()) if len(tokens) else -1,
              "tokenizer": tokenizer, "inputs": inputs}
    text = json.dumps(header).encode()
    text += b" " * (-(16 + len(text)) % _ALIGN)
    body = tokens.tobytes()
    body += b"\0" * (-len(body) % 8)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(MAGIC + len(text).to_bytes(8, "little") + text + body + index.tobytes())
    os.replace(tmp, path)
    return header


@dataclass
class Shard:
    """One shard, memory-mapped: tokens [num_tokens] and its document index [num_documents + 1]."""

    path: str
    header: dict
    tokens: np.ndarray
    doc_index: np.ndarray

    @property
    def num_tokens(self) -> int:
        return self.header["num_tokens"]


def read_header(path: str) -> tuple[dict, int]:
    """The header of the shard at `path` and where its tokens start; DataError (one line) if it is
    not a shard of this format, or is shorter than its header says."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(16)
            if len(head) < 16 or head[:8] != MAGIC:
                raise DataError(f"{path}: not a token shard (no {MAGIC.decode()} magic); make shards with "
                                "`python -m torchtitan_moe.components.data.prepare`")
            length = int.from_bytes(head[8:], "little")
            text = f.read(length)
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror})") from None
    if len(text) < length:
        raise DataError(f"{path}: truncated: {size} bytes, shorter than its own header ({16 + length} bytes); "
                        "prepare it again")
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise DataError(f"{path}: its header is not JSON: corrupt; prepare it again") from None
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise DataError(f"{path}: format {header.get('format')!r} version {header.get('version')!r}; this "
                        f"loader reads {FORMAT!r} version {VERSION}")
    start = 16 + length
    dtype = np.dtype(header["dtype"])
    index_at = start + header["num_tokens"] * dtype.itemsize
    index_at += -index_at % 8
    expected = index_at + 8 * (header["num_documents"] + 1)
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise DataError(f"{path}: {what}: {size} bytes where its header needs {expected} "
                        f"({header['num_tokens']} tokens, {header['num_documents']} documents); prepare it again")
    return header, start


def open_shard(path: str) -> Shard:
    """Memory-map a shard (the pages are read as samples touch them)."""
    header, start = read_header(path)
    dtype = np.dtype(header["dtype"]).newbyteorder("<")
    n, docs = header["num_tokens"], header["num_documents"]
    index_at = start + n * dtype.itemsize
    index_at += -index_at % 8
    # Plain ndarray views of the maps (slicing a np.memmap costs a subclass finalizer per slice).
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=start, shape=(n,)).view(np.ndarray) if n else np.zeros(0, dtype)
    doc_index = np.memmap(path, dtype="<i8", mode="r", offset=index_at, shape=(docs + 1,)).view(np.ndarray)
    if doc_index[0] != 0 or doc_index[-1] != n:
        raise DataError(f"{path}: its document index runs from {doc_index[0]} to {doc_index[-1]}, not 0 to {n}: "
                        "corrupt; prepare it again")
    return Shard(path, header, tokens, doc_index)


def list_shards(path: str) -> list[str]:
    """A shard file, or the shards in a folder (sorted by name: their order in the source's stream)."""
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(SUFFIX))
