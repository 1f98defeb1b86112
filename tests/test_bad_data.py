"""Bad data stops a run before step 1 in one line that names the file, and nothing is written: a truncated
shard, a header from another tokenizer, token ids past the model's vocabulary, a weight <= 0, an empty
source, a path that does not exist (and a folder prepare did not finish, a file that is no shard). Each
through the trainer's entry point and the launcher's check (in-process, before any process group), and
the shard loader itself where a shard changes after the check."""

import os
import shutil

import numpy as np
import pytest

from torchtitan_moe.components.data import build_dataloader
from torchtitan_moe.components.data.prepare import prepare
from torchtitan_moe.components.data.shards import DataError, write_shard
from torchtitan_moe.components.data.tokenizer import ByteTokenizer
from torchtitan_moe.tools import check_config
from torchtitan_moe.train import trainer
from torchtitan_moe.train.job_config import load_job_config

from test_config import DEBUG
from torchtitan_moe.train.job_config import read_toml
from test_shards import corpus, write_jsonl

BYTES = {"name": "bytes", "sha256": None, "vocab_size": 258, "eos_id": 257}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("good")
    write_jsonl(d / "docs.jsonl", corpus(40))
    prepare([str(d / "docs.jsonl")], str(d / "src"), unit_bytes=1024, show_progress=False)
    return str(d / "src")


def copy_of(good: str, tmp_path) -> str:
    return str(shutil.copytree(good, tmp_path / "src"))


def shard(folder, i=0) -> str:
    return os.path.join(folder, f"shard-{i:05d}.bin")


def truncated(good, tmp_path):
    src = copy_of(good, tmp_path)
    with open(shard(src, 1), "r+b") as f:
        f.truncate(os.path.getsize(shard(src, 1)) - 10)
    return {"sources": [{"path": src}]}, [shard(src, 1), "truncated"]


def other_tokenizer(good, tmp_path):
    src = copy_of(good, tmp_path)
    other = {"name": "tokenizer.json", "sha256": "ab" * 32, "vocab_size": 300, "eos_id": 299}
    write_shard(shard(src, 2), [np.array([5, 6, 299])], other, [])
    return {"sources": [{"path": src}]}, [shard(src, 2), "made with tokenizer tokenizer.json (sha256 abababababab, 300 "
                                          "tokens), but [data] tokenizer is bytes"]


def ids_past_vocab(good, tmp_path):
    src = copy_of(good, tmp_path)
    write_shard(shard(src, 0), [np.array([5, 2048, 257])], BYTES, [])  # the first id past the debug model's
    return {"sources": [{"path": src}]}, [shard(src, 0), "token ids up to 2048, but the model's vocab_size is 2048"]


def weight_zero(good, tmp_path):
    return {"sources": [{"path": good}, {"path": good, "weight": 0}]}, [good, "sources[1] weight = 0", "must be a number > 0"]


def weight_negative(good, tmp_path):
    return {"sources": [{"path": good, "weight": -1.5}]}, [good, "sources[0] weight = -1.5", "must be a number > 0"]


def no_shards(good, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    return {"sources": [{"path": good}, {"path": str(empty)}]}, [str(empty), "no shards (*.bin) in it"]


def too_few_tokens(good, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    write_shard(shard(small), [np.array([5, 6, 257])], BYTES, [])
    return {"sources": [{"path": str(small)}]}, [str(small), "3 tokens, fewer than one sample of seq_len + 1 = 129"]


def missing_path(good, tmp_path):
    gone = str(tmp_path / "gone")
    return {"sources": [{"path": good, "weight": 2}, {"path": gone}]}, [gone, "sources[1] path", "no such file or folder"]


def missing_dataset_path(good, tmp_path):
    gone = str(tmp_path / "gone")
    return {"dataset_path": gone}, [gone, "[training] dataset_path", "no such file or folder"]


def unfinished(good, tmp_path):
    src = copy_of(good, tmp_path)
    os.remove(shard(src, 1))
    manifest = os.path.join(src, "prepare.json")
    text = open(manifest).read().replace('"complete": true', '"complete": false')
    open(manifest, "w").write(text)
    return {"sources": [{"path": src}]}, [src, "prepare did not finish (", "shards): run the same prepare command again"]


def not_a_shard(good, tmp_path):
    src = copy_of(good, tmp_path)
    open(shard(src, 1), "wb").write(b"PK\x03\x04 a zip file")
    return {"sources": [{"path": src}]}, [shard(src, 1), "not a token shard"]


CASES = [truncated, other_tokenizer, ids_past_vocab, weight_zero, weight_negative, no_shards, too_few_tokens,
         missing_path, missing_dataset_path, unfinished, not_a_shard]


def toml(value) -> str:
    """A TOML value, inline tables included ([data] sources is a list of them)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def debug_with(tmp_path, **changes) -> str:
    """configs/debug.toml with `section__key=value` changes."""
    values = read_toml(str(DEBUG))
    for name, value in changes.items():
        section, key = name.split("__")
        values.setdefault(section, {})[key] = value
    lines = [line for section, table in values.items()
             for line in (f"[{section}]", *(f"{k} = {toml(v)}" for k, v in table.items()))]
    path = tmp_path / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def config_of(tmp_path, data: dict) -> str:
    changes = {"training__dataset": "shards", "job__dump_folder": str(tmp_path / "dump")}
    if "sources" in data:
        changes["data__sources"] = data["sources"]
    else:
        changes["training__dataset_path"] = data["dataset_path"]
    return debug_with(tmp_path, **changes)


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_data_is_one_line_naming_the_file_before_anything_is_written(good, tmp_path, case, capsys, monkeypatch):
    data, expected = case(good, tmp_path)
    config = config_of(tmp_path, data)
    # The trainer's entry point: one process, as `python -m torchtitan_moe.train` without torchrun.
    for var, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        monkeypatch.setenv(var, value)
    for main in (trainer.main, check_config.main):
        assert main(["--job.config_file", config] if main is trainer.main else [config]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("config error: "), err
        assert all(part in err for part in expected), (expected, err)
    assert not (tmp_path / "dump").exists()


def test_attention_document_needs_shards_and_sources_need_the_shards_dataset(tmp_path, good, capsys):
    for changes, expected in (
        ({"data__attention": "document"}, "[data] attention = 'document' needs documents: [training] dataset = 'shards'"),
        ({"data__sources": [{"path": good}]}, "[data] sources are read by [training] dataset = 'shards'"),
        ({"training__dataset": "shards", "data__sources": [{"path": good, "wieght": 2}]}, "sources[0] = "),
    ):
        assert check_config.main([debug_with(tmp_path, **changes)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and expected in err, err


def test_the_loader_refuses_a_shard_changed_after_the_check(good, tmp_path):
    # Training builds its loader after the check: a shard damaged in between stops it there, and a header
    # that understates its ids stops the first sample that holds one.
    src = copy_of(good, tmp_path)
    job = load_job_config(["--job.config_file", config_of(tmp_path, {"sources": [{"path": src}]}),
                           "--data.workers", "0"])
    os.truncate(shard(src, 1), 100)
    with pytest.raises(DataError, match=f"{shard(src, 1)}: truncated"):
        build_dataloader(1, 0, ByteTokenizer(), job, vocab_size=2048)
    shutil.rmtree(src)
    src = copy_of(good, tmp_path)
    write_shard(shard(src, 1), [np.array([5, 300, 257] * 2000)], BYTES, [])  # ids < 258, as its header says
    raw = bytearray(open(shard(src, 1), "rb").read())
    start = len(raw) - 8 * 2 - 2 * 6000  # the tokens: 6,000 uint16 before the 2-entry index
    raw[start + 2:start + 4] = (4000).to_bytes(2, "little")
    open(shard(src, 1), "wb").write(bytes(raw))
    loader = build_dataloader(1, 0, ByteTokenizer(), job, vocab_size=2048)
    with pytest.raises(DataError, match=f"{shard(src, 1)}: token id 4000 >= the model's vocab_size 2048"):
        for _ in loader:
            pass
