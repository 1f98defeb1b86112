"""The shard loader: memory-mapped token shards of weighted sources, packed into seq_len samples.

A source is a folder of shards (`prepare`'s output) read as one stream of tokens, its documents back to
back in shard order. Sample window w of a source is the stream's tokens [w·S, w·S + S + 1) (S = seq_len):
input tokens [:-1], labels [1:], so every token is predicted once per epoch. The global stream of samples
(components/data/order.py) is dealt round-robin: data-parallel rank r of R takes global samples r, r + R,
r + 2R, ... Batch b of a rank is its samples [b·B, (b + 1)·B): with W DataLoader workers, worker w makes
batches w, w + W, ... (the DataLoader takes them in turn), so the stream is the same with any W.

With [data] attention = "document", each sample also carries `positions` [S]: each token's place in its
document, counted from the sample's first token for the document the sample starts inside (Megatron's
reset_position_ids: every position < S, within RoPE's table); 0 marks where the model's mask starts a new
document and RoPE restarts (RoPE's scores depend on distances only: the restart changes rounding alone).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan_moe.components.data.order import Mixture, Position, mix, permute
from torchtitan_moe.components.data.shards import (
    MANIFEST,
    DataError,
    Shard,
    describe_tokenizer,
    list_shards,
    open_shard,
    read_header,
    same_tokenizer,
    tokenizer_identity,
)
from torchtitan_moe.compat.torchtitan import ParallelAwareDataloader


@dataclass
class SourceSpec:
    path: str
    weight: float


def source_specs(data, dataset_path: str | None) -> list[SourceSpec]:
    """[data] sources, or [training] dataset_path as the one source (weight 1)."""
    if data.sources:
        return [SourceSpec(s["path"], float(s.get("weight", 1.0))) for s in data.sources]
    return [SourceSpec(dataset_path or "", 1.0)]


class Source:
    """One source's shards as one stream of tokens: windows of seq_len + 1 tokens."""

    def __init__(self, shards: list[Shard], seq_len: int):
        self.shards = [s for s in shards if s.num_tokens > 0]
        self.starts = np.cumsum([0] + [s.num_tokens for s in self.shards])  # [shards + 1]
        self.num_tokens = int(self.starts[-1])
        self.seq_len = seq_len
        self.num_windows = max(0, (self.num_tokens - 1) // seq_len)

    def window(self, w: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Window w: tokens [S + 1] int64 and each token's position in its document [S + 1] (see above)."""
        start, length = w * self.seq_len, self.seq_len + 1
        tokens, doc_starts = [], [np.array([0])]  # the window's first token counts from 0
        at, i = start, int(np.searchsorted(self.starts, start, side="right")) - 1
        while at < start + length:
            shard = self.shards[i]
            lo, hi = at - self.starts[i], min(start + length, self.starts[i + 1]) - self.starts[i]
            piece = np.asarray(shard.tokens[lo:hi])
            if piece.size and piece.max() >= vocab_size:  # a header that lied: stop before training on it
                raise DataError(f"{shard.path}: token id {int(piece.max())} >= the model's vocab_size {vocab_size}")
            tokens.append(piece)
            index = shard.doc_index
            d = int(np.searchsorted(index, lo, side="right")) - 1  # the document holding token lo
            inside = np.asarray(index[d + 1 : np.searchsorted(index, hi, side="left")])  # starts in (lo, hi)
            doc_starts += [np.array([at - start]), inside - lo + (at - start)]  # a shard's first token begins a document
            at += hi - lo
            i += 1
        tokens = np.concatenate(tokens).astype(np.int64)
        anchors = np.unique(np.concatenate(doc_starts))  # where each token's document starts (sorted)
        idx = np.arange(length)
        positions = idx - anchors[np.searchsorted(anchors, idx, side="right") - 1]
        return tokens, positions


def open_sources(job_config, vocab_size: int) -> list[Source]:
    """Every source's shards, checked (DataError naming the file): before anything trains or is written."""
    specs = source_specs(job_config.data, job_config.training.dataset_path)
    expected = tokenizer_identity(job_config.data.tokenizer)
    seq_len = job_config.training.seq_len
    sources = []
    for i, spec in enumerate(specs):
        name = f"[data] sources[{i}] path = {spec.path!r}" if job_config.data.sources else \
            f"[training] dataset_path = {spec.path!r}"
        if not spec.path or not os.path.exists(spec.path):
            raise DataError(f"{name}: no such file or folder")
        if not spec.weight > 0:
            raise DataError(f"{name}: weight = {spec.weight}: must be > 0")
        check_prepared(spec.path, name)
        paths = list_shards(spec.path)
        if not paths:
            raise DataError(f"{name}: no shards (*.bin) in it; make them with "
                            "`python -m torchtitan_moe.components.data.prepare FILES --out FOLDER`")
        shards = []
        for path in paths:
            header, _ = read_header(path)
            if not same_tokenizer(header["tokenizer"], expected):
                raise DataError(f"{path}: made with tokenizer {describe_tokenizer(header['tokenizer'])}, but [data] "
                                f"tokenizer is {describe_tokenizer(expected)}")
            if header["max_token_id"] >= vocab_size:
                raise DataError(f"{path}: token ids up to {header['max_token_id']}, but the model's vocab_size is "
                                f"{vocab_size}")
            shards.append(open_shard(path))
        source = Source(shards, seq_len)
        if source.num_windows == 0:
            raise DataError(f"{name}: {source.num_tokens} tokens, fewer than one sample of seq_len + 1 = "
                            f"{seq_len + 1}: an empty source")
        sources.append(source)
    return sources


def check_prepared(path: str, name: str) -> None:
    """A folder `prepare` has not finished (its manifest says so) is refused: some shards are missing."""
    manifest = os.path.join(path, MANIFEST)
    if os.path.isdir(path) and os.path.isfile(manifest):
        with open(manifest) as f:
            plan = json.load(f)
        if not plan.get("complete"):
            made = sum(os.path.isfile(os.path.join(path, s)) for s in plan["shards"])
            raise DataError(f"{name}: prepare did not finish ({made} of {len(plan['shards'])} shards): run the same "
                            "prepare command again to make the rest")


class ShardDataset(IterableDataset):
    """Yields ({"input": tokens[:-1]} [+ "positions"], labels = tokens[1:]), each [seq_len] int64."""

    def __init__(self, sources: list[Source], weights: list[float], seq_len: int, dp_rank: int, dp_world_size: int,
                 batch_size: int, seed: int, vocab_size: int, positions: bool):
        self.sources, self.seq_len, self.vocab_size = sources, seq_len, vocab_size
        self.dp_rank, self.dp_world_size, self.batch_size = dp_rank, dp_world_size, batch_size
        self.seed, self.positions = seed, positions
        self.mixture = Mixture(weights, seed)
        self.start = self.mixture.start()
        self.layout = json.dumps({"seq_len": seq_len, "seed": seed, "sources": [
            {"weight": w, "tokens": s.num_tokens, "shards": [os.path.basename(x.path) for x in s.shards]}
            for s, w in zip(sources, weights)]})

    def window_of(self, source: int, j: int) -> int:
        """The window of `source` that its j-th sample reads: epoch j // N, shuffled anew each epoch."""
        n = self.sources[source].num_windows
        epoch, k = divmod(j, n)
        return permute(k, n, mix(self.seed, source, epoch))

    def sample(self, source: int, j: int):
        tokens, positions = self.sources[source].window(self.window_of(source, j), self.vocab_size)
        inputs = {"input": torch.from_numpy(tokens[:-1])}
        if self.positions:
            inputs["positions"] = torch.from_numpy(positions[:-1])
        return inputs, torch.from_numpy(tokens[1:])

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        chunk = self.batch_size * self.dp_world_size  # one batch of every rank
        at, batch = self.start, 0
        while True:
            sources, indices, at = self.mixture.take(at, chunk)
            if batch % workers == worker:
                for k in range(self.dp_rank, chunk, self.dp_world_size):
                    yield self.sample(int(sources[k]), int(indices[k]))
            batch += 1


class ShardDataloader(ParallelAwareDataloader):
    """torchtitan's dataloader over a ShardDataset, checkpointing the global position: one entry, the same
    on every data-parallel rank, so that a run resumes at another number of ranks (the ranks deal the
    same global stream from there)."""

    def __init__(self, dataset: ShardDataset, **kwargs):
        super().__init__(dataset, **kwargs)
        self.position = dataset.start

    def __iter__(self):
        for batch in super().__iter__():
            # Every rank has now taken one more batch: the global stream moved by B x ranks samples.
            _, _, self.position = self.dataset.mixture.take(self.position, self.batch_size * self.dp_world_size)
            yield batch

    def state_dict(self) -> dict:
        return {"position": json.dumps({"samples": self.position.samples, "counts": list(self.position.counts),
                                        "layout": json.loads(self.dataset.layout)})}

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        saved = json.loads(state_dict["position"])
        if saved["layout"] != json.loads(self.dataset.layout):
            raise DataError("the checkpoint's data position is for other data (its seq_len, [data] sources, weights, "
                            "shards or shuffle_seed differ from this run's): resume with the same data, or add "
                            "--checkpoint.exclude_from_loading dataloader to start this data from its beginning")
        self.position = self.dataset.start = Position(saved["samples"], tuple(saved["counts"]))


def build_shard_dataloader(dp_world_size: int, dp_rank: int, job_config, vocab_size: int) -> ShardDataloader:
    training, data = job_config.training, job_config.data
    sources = open_sources(job_config, vocab_size)
    weights = [s.weight for s in source_specs(data, training.dataset_path)]
    dataset = ShardDataset(sources, weights, training.seq_len, dp_rank, dp_world_size, training.local_batch_size,
                           data.shuffle_seed, vocab_size, positions=data.attention == "document")
    workers = data.workers
    return ShardDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                           batch_size=training.local_batch_size, num_workers=workers,
                           persistent_workers=workers > 0, prefetch_factor=2 if workers else None)
