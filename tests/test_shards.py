"""Token shards: the on-disk format, `prepare` (text/JSONL/Parquet, parallel, resumable, one tokenizer per
folder), and the shard loader (windows of the stream, positions per document, weighted sources, disjoint
ranks, workers, exact resume at the same and at another number of data-parallel ranks). In-process, seconds."""

import json
import os
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from torchtitan_moe.components.data import build_dataloader
from torchtitan_moe.components.data.order import Mixture, permute
from torchtitan_moe.components.data.packed import ShardDataloader, open_sources
from torchtitan_moe.components.data.prepare import main as prepare_main
from torchtitan_moe.components.data.prepare import prepare
from torchtitan_moe.components.data.shards import DataError, open_shard, read_header, token_dtype, write_shard
from torchtitan_moe.components.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def write_jsonl(path, texts):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return str(path)


def corpus(n: int, seed: int = 0, prefix: str = "") -> list[str]:
    """n documents of 3..60 random words, of uneven lengths: no two windows of 16 bytes alike."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return [f"{prefix}doc {i}: " + " ".join("".join(rng.choice(letters, rng.integers(1, 8)))
                                            for _ in range(rng.integers(3, 60))) for i in range(n)]


def make_source(tmp_path, name: str, texts: list[str], **kwargs) -> str:
    inputs = tmp_path / f"{name}_in"
    inputs.mkdir()
    write_jsonl(inputs / "docs.jsonl", texts)
    out = str(tmp_path / name)
    prepare([str(inputs)], out, show_progress=False, **kwargs)
    return out


def job(path=None, sources=(), seq_len=16, batch=2, attention="causal", seed=0, workers=0, tokenizer="bytes"):
    return SimpleNamespace(
        training=SimpleNamespace(dataset="shards", dataset_path=path, seq_len=seq_len, local_batch_size=batch),
        data=SimpleNamespace(sources=list(sources), tokenizer=tokenizer, shuffle_seed=seed, attention=attention,
                             workers=workers))


def batches(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def stream(shards: list[str]) -> np.ndarray:
    return np.concatenate([np.asarray(open_shard(p).tokens) for p in shards]).astype(np.int64)


# -- the format and prepare ------------------------------------------------------------------------


def test_a_shard_is_its_documented_layout(tmp_path):
    docs = [np.array([5, 6, 257]), np.array([257]), np.array([1, 2, 3, 4, 257])]
    ident = {"name": "bytes", "sha256": None, "vocab_size": 258, "eos_id": 257}
    path = str(tmp_path / "s.bin")
    write_shard(path, docs, ident, [{"kind": "test"}])
    raw = open(path, "rb").read()
    length = int.from_bytes(raw[8:16], "little")
    assert raw[:8] == b"TTMSHARD" and (16 + length) % 64 == 0
    header = json.loads(raw[16:16 + length])
    assert header | {"inputs": None} == {"format": "torchtitan-moe-shard", "version": 1, "dtype": "uint16",
                                         "num_tokens": 9, "num_documents": 3, "max_token_id": 257,
                                         "tokenizer": ident, "inputs": None}
    tokens = np.frombuffer(raw[16 + length:16 + length + 18], dtype="<u2")
    index = np.frombuffer(raw[-32:], dtype="<i8")
    assert tokens.tolist() == [5, 6, 257, 257, 1, 2, 3, 4, 257] and index.tolist() == [0, 3, 4, 9]
    assert len(raw) == 16 + length + 24 + 32  # 18 bytes of tokens padded to 24, then the index
    shard = open_shard(path)
    assert shard.tokens.tolist() == tokens.tolist() and shard.doc_index.tolist() == [0, 3, 4, 9]
    # Past 65,536 tokens the ids take 4 bytes.
    assert token_dtype(65536) == np.uint16 and token_dtype(151936) == np.uint32
    big = str(tmp_path / "big.bin")
    write_shard(big, [np.array([151000, 151645])], ident | {"vocab_size": 151936}, [])
    assert read_header(big)[0]["dtype"] == "uint32" and open_shard(big).tokens.tolist() == [151000, 151645]


def test_prepare_tokenizes_text_markdown_jsonl_and_parquet_with_eos(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    inputs = tmp_path / "in"
    (inputs / "sub").mkdir(parents=True)
    (inputs / "a.txt").write_text("plain text, one document")
    (inputs / "sub" / "b.md").write_text("# markdown\n\nalso one document")
    write_jsonl(inputs / "c.jsonl", ["first line", "", "third ünïcode"])  # the empty document is skipped
    pq.write_table(pa.table({"text": ["row one", "row two"], "id": [1, 2]}), inputs / "d.parquet", row_group_size=1)
    (inputs / "notes.csv").write_text("not read")
    manifest = prepare([str(inputs)], str(tmp_path / "out"), show_progress=False)
    expected = ["plain text, one document", "first line", "third ünïcode", "row one", "row two",
                "# markdown\n\nalso one document"]  # sorted by path: a.txt, c.jsonl, d.parquet, sub/b.md
    tokens = stream([str(tmp_path / "out" / s) for s in manifest["shards"]])
    assert tokens.tolist() == [t for text in expected for t in TOK.encode(text, add_eos=True)]
    assert manifest["complete"] and manifest["num_documents"] == 6 and manifest["num_tokens"] == len(tokens)


def test_prepare_splits_jsonl_at_line_boundaries_and_workers_make_the_same_shards(tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_jsonl(inputs / "docs.jsonl", corpus(200))
    one, split, again = (str(tmp_path / name) for name in ("one", "split", "again"))
    prepare([str(inputs)], one, show_progress=False)
    # Units of 1 KB: a byte range that starts mid-line leaves that line to the unit before.
    prepare([str(inputs)], split, unit_bytes=1024, workers=2, show_progress=False)
    names = sorted(n for n in os.listdir(split) if n.endswith(".bin"))
    assert len(names) > 5
    assert stream([os.path.join(split, n) for n in names]).tolist() == stream([os.path.join(one, "shard-00000.bin")]).tolist()
    prepare([str(inputs)], again, unit_bytes=1024, workers=1, show_progress=False)
    for n in names:
        assert open(os.path.join(split, n), "rb").read() == open(os.path.join(again, n), "rb").read()


def test_prepare_resumes_making_only_the_missing_shards(tmp_path, capsys):
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_jsonl(inputs / "docs.jsonl", corpus(200))
    out = tmp_path / "out"
    args = [str(inputs), "--out", str(out), "--unit-mb", "0.001", "--workers", "1", "--quiet"]
    assert prepare_main(args) == 0
    shards = sorted(out.glob("*.bin"))
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in shards}
    # A killed run: one shard never renamed into place, its temporary file left, the manifest not complete.
    shards[2].unlink()
    (out / "shard-00002.bin.tmp123").write_bytes(b"partial")
    manifest = json.loads((out / "prepare.json").read_text())
    (out / "prepare.json").write_text(json.dumps(manifest | {"complete": False}))
    assert prepare_main(args) == 0
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(out.glob("*.bin"))}
    assert sorted(after) == sorted(before) and not list(out.glob("*.tmp*"))
    assert all(after[n] == before[n] for n in before if n != shards[2].name)  # untouched
    assert after[shards[2].name][0] == before[shards[2].name][0]  # made again, the same bytes
    assert json.loads((out / "prepare.json").read_text())["complete"]
    assert "tokens" in capsys.readouterr().out


def test_prepare_refuses_a_folder_of_another_tokenizer_or_other_inputs(tmp_path, capsys):
    from torchtitan_moe.components.data.tokenizer import train_bpe

    inputs = tmp_path / "in"
    inputs.mkdir()
    write_jsonl(inputs / "docs.jsonl", corpus(50))
    out = str(tmp_path / "out")
    assert prepare_main([str(inputs), "--out", out, "--quiet"]) == 0
    tok = tmp_path / "tokenizer.json"
    train_bpe([str(inputs / "docs.jsonl")], 300, str(tok))
    assert prepare_main([str(inputs), "--out", out, "--tokenizer", str(tok), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{out}: holds shards of tokenizer bytes, not tokenizer.json" in err
    (inputs / "more.txt").write_text("another document")
    assert prepare_main([str(inputs), "--out", out, "--quiet"]) == 2
    assert "was prepared from other inputs" in capsys.readouterr().err
    # A BPE tokenizer's shards hold its ids, and its identity is the file's sha256.
    bpe = make_source(tmp_path, "bpe", corpus(50), tokenizer=str(tok))
    header = read_header(os.path.join(bpe, "shard-00000.bin"))[0]
    assert header["tokenizer"]["sha256"] and header["tokenizer"]["vocab_size"] <= 300


# -- the order -------------------------------------------------------------------------------------


def test_permute_is_a_bijection_that_depends_on_its_key():
    for n in (1, 2, 3, 5, 64, 1000, 4097):
        for key in (0, 1, 99):
            assert sorted(permute(i, n, key) for i in range(n)) == list(range(n))
    a, b = [permute(i, 1000, 1) for i in range(1000)], [permute(i, 1000, 2) for i in range(1000)]
    assert a != b and a != list(range(1000))


def test_the_mixture_holds_each_weight_in_every_stretch_of_the_stream():
    mixture = Mixture([5.0, 3.0, 2.0], seed=1)
    sources, indices, end = mixture.take(mixture.start(), 20000)
    for lo in range(0, 20000, 1000):  # every 1,000 consecutive samples: each source's share to within 5
        counts = np.bincount(sources[lo:lo + 1000], minlength=3)
        assert np.abs(counts - [500, 300, 200]).max() <= 5, (lo, counts)
    for s in range(3):  # the j-th pick of a source is numbered j
        assert indices[sources == s].tolist() == list(range(int((sources == s).sum())))
    # Taken in pieces, the stream is the same.
    at, pieces = mixture.start(), []
    for n in (7, 1000, 18993):
        src, _, at = mixture.take(at, n)
        pieces.append(src)
    assert np.array_equal(np.concatenate(pieces), sources) and at == end
    other, _, _ = Mixture([5.0, 3.0, 2.0], seed=2).take(mixture.start(), 20000)
    assert not np.array_equal(other, sources)


# -- the loader ------------------------------------------------------------------------------------


def test_samples_are_windows_of_the_stream_with_positions_restarting_at_each_document(tmp_path):
    # The first token's position is 0 even inside a document: every position is below seq_len (RoPE's table).
    src = make_source(tmp_path, "src", corpus(60))
    shards = sorted(os.path.join(src, n) for n in os.listdir(src) if n.endswith(".bin"))
    flat = stream(shards)
    index = open_shard(shards[0]).doc_index
    (source,) = open_sources(job(src, seq_len=16), vocab_size=2048)
    assert source.num_windows == (len(flat) - 1) // 16
    for w in range(source.num_windows):
        tokens, positions = source.window(w, 2048)
        assert tokens.tolist() == flat[w * 16:w * 16 + 17].tolist()
        at = np.arange(w * 16, w * 16 + 17)  # counted from the document's start, or from the window's
        starts = np.maximum(index[np.searchsorted(index, at, side="right") - 1], w * 16)
        assert positions.tolist() == (at - starts).tolist()
    loader = build_dataloader(1, 0, TOK, job(src, attention="document"), vocab_size=2048)
    (inputs, labels), = batches(loader, 1)
    assert torch.equal(inputs["input"][:, 1:], labels[:, :-1]) and inputs["positions"].shape == (2, 16)
    assert "positions" not in batches(build_dataloader(1, 0, TOK, job(src), vocab_size=2048), 1)[0][0]


def test_a_window_across_shards_reads_both_and_restarts_positions_at_the_second(tmp_path):
    src = make_source(tmp_path, "src", corpus(100), unit_bytes=512)
    shards = sorted(os.path.join(src, n) for n in os.listdir(src) if n.endswith(".bin"))
    flat = stream(shards)
    (source,) = open_sources(job(src, seq_len=16), vocab_size=2048)
    boundary = int(source.starts[1])
    w = boundary // 16  # the window holding the first shard's end
    tokens, positions = source.window(w, 2048)
    assert tokens.tolist() == flat[w * 16:w * 16 + 17].tolist() and boundary % 16 != 0
    assert positions[boundary - w * 16] == 0 and positions[boundary - w * 16 - 1] > 0


def test_ranks_read_disjoint_shares_that_cover_every_window_once_per_epoch(tmp_path):
    src = make_source(tmp_path, "src", corpus(120))
    (source,) = open_sources(job(src, seq_len=16), vocab_size=2048)
    n = source.num_windows
    seen = []
    for rank in range(3):
        loader = build_dataloader(3, rank, TOK, job(src, seq_len=16, batch=1), vocab_size=2048)
        rows = [b[0]["input"][0] for b in batches(loader, n // 3)]
        seen.append({tuple(r.tolist()) for r in rows})
        assert len(seen[-1]) == n // 3
    assert all(seen[a].isdisjoint(seen[b]) for a in range(3) for b in range(a + 1, 3))
    windows = {tuple(source.window(w, 2048)[0][:-1].tolist()) for w in range(n)}
    assert set().union(*seen) <= windows and len(set().union(*seen)) == 3 * (n // 3)


def test_each_epoch_and_each_seed_shuffles_the_windows_anew(tmp_path):
    src = make_source(tmp_path, "src", corpus(40))
    dataset = build_dataloader(1, 0, TOK, job(src), vocab_size=2048).dataset
    n = dataset.sources[0].num_windows
    epochs = [[dataset.window_of(0, e * n + j) for j in range(n)] for e in range(3)]
    assert all(sorted(order) == list(range(n)) for order in epochs)  # each epoch reads every window once
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    other_seed = build_dataloader(1, 0, TOK, job(src, seed=1), vocab_size=2048).dataset
    assert [other_seed.window_of(0, j) for j in range(n)] != epochs[0]


def test_weighted_sources_are_mixed_by_weight(tmp_path):
    a = make_source(tmp_path, "a", corpus(80, prefix="A"))
    b = make_source(tmp_path, "b", corpus(80, seed=1, prefix="B"))
    sources = [{"path": a, "weight": 3.0}, {"path": b, "weight": 1.0}]
    loader = build_dataloader(1, 0, TOK, job(sources=sources, seq_len=16, batch=4), vocab_size=2048)
    opened = open_sources(job(sources=sources, seq_len=16), vocab_size=2048)
    windows = [{tuple(s.window(w, 2048)[0][:-1].tolist()) for w in range(s.num_windows)} for s in opened]
    rows = [tuple(r.tolist()) for x, _ in batches(loader, 100) for r in x["input"]]
    from_a = sum(r in windows[0] for r in rows)
    assert all(r in windows[0] or r in windows[1] for r in rows) and abs(from_a - 300) <= 3


def test_dataloader_workers_make_the_same_batches(tmp_path):
    src = make_source(tmp_path, "src", corpus(60))
    expected = batches(build_dataloader(2, 1, TOK, job(src, attention="document"), vocab_size=2048), 6)
    got = batches(build_dataloader(2, 1, TOK, job(src, attention="document", workers=2), vocab_size=2048), 6)
    for (a, la), (b, lb) in zip(expected, got, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a) and torch.equal(la, lb)


def global_batches(src, dp: int, batch: int, n: int, state=None):
    """n steps of `dp` ranks at local batch `batch`: each step's rows of all ranks, as a sorted list."""
    loaders = [build_dataloader(dp, r, TOK, job(src, batch=batch), vocab_size=2048) for r in range(dp)]
    for loader in loaders:
        loader.load_state_dict(state or {})
    steps = zip(*(batches(loader, n) for loader in loaders))
    return [sorted(tuple(row.tolist()) for x, _ in step for row in x["input"]) for step in steps], loaders


def test_resume_is_exact_at_the_same_and_at_another_number_of_ranks(tmp_path):
    import torch.distributed.checkpoint as dcp

    src = make_source(tmp_path, "src", corpus(40))  # a small source: the stream crosses epochs
    uninterrupted, _ = global_batches(src, dp=2, batch=2, n=30)
    first, loaders = global_batches(src, dp=2, batch=2, n=12)
    assert first == uninterrupted[:12]
    states = [loader.state_dict() for loader in loaders]
    assert states[0] == states[1] and list(states[0]) == ["position"]  # one global position, no rank keys
    with warnings.catch_warnings():  # DCP without a process group says it assumes one process
        warnings.simplefilter("ignore")
        dcp.save({"dataloader": loaders[0]}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
        fresh = build_dataloader(2, 0, TOK, job(src, batch=2), vocab_size=2048)
        dcp.load({"dataloader": fresh}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    saved = fresh.state_dict()
    assert saved == states[0]
    for dp, batch in ((2, 2), (1, 4), (4, 1)):  # the same global batch of 4 samples a step
        resumed, _ = global_batches(src, dp=dp, batch=batch, n=18, state=saved)
        assert resumed == uninterrupted[12:], (dp, batch)


def test_resume_with_other_data_is_refused_in_one_line(tmp_path):
    src = make_source(tmp_path, "src", corpus(40))
    loader = build_dataloader(1, 0, TOK, job(src), vocab_size=2048)
    batches(loader, 3)
    state = loader.state_dict()
    for other in (job(src, seq_len=8), job(src, seed=1)):
        with pytest.raises(DataError, match="the checkpoint's data position is for other data") as e:
            build_dataloader(1, 0, TOK, other, vocab_size=2048).load_state_dict(state)
        assert "\n" not in str(e.value) and "--checkpoint.exclude_from_loading dataloader" in str(e.value)
    assert isinstance(loader, ShardDataloader)
