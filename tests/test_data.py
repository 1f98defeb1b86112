"""Data with no download: the synthetic stream and local text, per rank and checkpointable."""

import json
import math

import pytest
import torch

from torchtitan_moe.components.data.synthetic import SyntheticMarkovDataset, chain_entropy, markov_chain
from torchtitan_moe.components.data.text import LocalTextDataset
from torchtitan_moe.components.data.tokenizer import ByteTokenizer


def take(dataset, n):
    it = iter(dataset)
    return [next(it) for _ in range(n)]


def test_synthetic_stream_is_deterministic_distinct_per_rank_and_shifted():
    rank0 = take(SyntheticMarkovDataset(512, 32, dp_rank=0), 3)
    again = take(SyntheticMarkovDataset(512, 32, dp_rank=0), 3)
    rank1 = take(SyntheticMarkovDataset(512, 32, dp_rank=1), 3)
    for (a, la), (b, lb), (c, _) in zip(rank0, again, rank1):
        assert torch.equal(a["input"], b["input"]) and torch.equal(la, lb)
        assert not torch.equal(a["input"], c["input"])
        assert a["input"].shape == la.shape == (32,)
        assert torch.equal(a["input"][1:], la[:-1])  # labels are the next tokens


def test_synthetic_stream_follows_its_chain_and_is_learnable():
    next_tokens, _ = markov_chain(512, 4, seed=1234)
    (inputs, labels), = take(SyntheticMarkovDataset(512, 64, dp_rank=0, successors=4, seed=1234), 1)
    for a, b in zip(inputs["input"].tolist(), labels.tolist()):
        assert b in next_tokens[a].tolist()
    assert chain_entropy(4) < 0.2 * math.log(2048)  # far below uniform: a model can learn it


def test_synthetic_state_resumes_the_same_samples():
    dataset = SyntheticMarkovDataset(256, 16, dp_rank=1)
    take(dataset, 5)
    state = dataset.state_dict()
    expected = take(dataset, 2)
    resumed = SyntheticMarkovDataset(256, 16, dp_rank=1)
    resumed.load_state_dict(state)
    for (a, la), (b, lb) in zip(expected, take(resumed, 2)):
        assert torch.equal(a["input"], b["input"]) and torch.equal(la, lb)


def write_corpus(tmp_path):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 3)
    with open(tmp_path / "b.jsonl", "w") as f:
        for i in range(5):
            f.write(json.dumps({"text": f"document number {i} says hello"}) + "\n")
    return str(tmp_path)


def test_text_data_is_sharded_by_rank_and_resumable(tmp_path):
    path = write_corpus(tmp_path)
    tok = ByteTokenizer()
    rank0 = LocalTextDataset(path, tok, seq_len=16, dp_rank=0, dp_world_size=2)
    rank1 = LocalTextDataset(path, tok, seq_len=16, dp_rank=1, dp_world_size=2)
    assert set(rank0.docs).isdisjoint(rank1.docs) and len(rank0.docs) + len(rank1.docs) == 6

    samples = take(rank0, 3)
    assert tok.decode(samples[0][0]["input"].tolist()) == "the quick brown "
    for inputs, labels in samples:
        assert torch.equal(inputs["input"][1:], labels[:-1])

    state = rank0.state_dict()
    expected = take(rank0, 20)  # crosses an epoch boundary
    resumed = LocalTextDataset(path, tok, seq_len=16, dp_rank=0, dp_world_size=2)
    resumed.load_state_dict(state)
    for (a, la), (b, lb) in zip(expected, take(resumed, 20)):
        assert torch.equal(a["input"], b["input"]) and torch.equal(la, lb)
    assert rank0.epoch >= 1


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and tok.get_vocab_size() == 258
    assert tok.decode(ids) == "héllo"


def test_file_tokenizer_built_from_local_text(tmp_path):
    from torchtitan_moe.components.data.tokenizer import train_bpe

    write_corpus(tmp_path)
    tok = train_bpe([str(tmp_path / "a.txt")], vocab_size=300, out_path=str(tmp_path / "tokenizer.json"))
    ids = tok.encode("the lazy dog", add_eos=True)
    assert ids[-1] == tok.eos_id and tok.get_vocab_size() <= 300
    assert len(ids) < len("the lazy dog")  # merges learned from the corpus
    assert tok.decode(ids[:-1]) == "the lazy dog"


@pytest.mark.parametrize("dataset, dp", [("synthetic", (0, 1)), ("synthetic", (1, 2)), ("text", (1, 2))])
def test_dataloader_with_workers_gives_and_resumes_the_batches_made_in_process(tmp_path, dataset, dp):
    # [data] workers: batches made by a worker process are the ones made in the training process, and a
    # loader's state taken mid-stream (the worker two batches ahead) resumes at the next batch it hands out.
    from types import SimpleNamespace

    from torchtitan_moe.components.data import build_dataloader

    path = write_corpus(tmp_path) if dataset == "text" else None
    rank, world = dp

    def loader(workers):
        job = SimpleNamespace(training=SimpleNamespace(dataset=dataset, dataset_path=path, seq_len=16, local_batch_size=2),
                              data=SimpleNamespace(synthetic_successors=4, synthetic_seed=7, workers=workers))
        return build_dataloader(world, rank, ByteTokenizer(), job, vocab_size=512)

    def batches(dl, n):
        it = iter(dl)
        return [next(it) for _ in range(n)]

    expected = batches(loader(0), 5)
    in_worker = loader(1)
    got = batches(in_worker, 3)
    state = in_worker.state_dict()
    resumed = loader(1)
    resumed.load_state_dict(state)
    got += batches(resumed, 2)
    for (a, la), (b, lb) in zip(expected, got, strict=True):
        assert torch.equal(a["input"], b["input"]) and torch.equal(la, lb)
