"""Pretokenize text into token shards (components/data/shards.py; docs/data.md).

    python -m torchtitan_moe.components.data.prepare INPUT [INPUT ...] --out DIR
        [--tokenizer bytes|tokenizer.json] [--text-field text] [--workers N] [--unit-mb 64]
    (installed: torchtitan-moe-prepare ...)

INPUT: files or folders of .txt / .md (one document each), .jsonl (one {"text": ...} per line) and
.parquet (a "text" column; read with pyarrow). The inputs are cut into units of about --unit-mb of
text (runs of small files, byte ranges of a JSONL file at line boundaries, row groups of a Parquet
file); each unit becomes one shard, tokenized by a pool of --workers processes. DIR/prepare.json records
the plan first: the same command run again makes only the shards that are missing (each shard is
written to a temporary file and renamed, so one that exists is complete). A DIR prepared with another
tokenizer or from other inputs is refused: one folder is one source of one tokenizer.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys

import numpy as np

from torchtitan_moe.components.data.shards import (
    FORMAT,
    MANIFEST,
    SUFFIX,
    VERSION,
    DataError,
    describe_tokenizer,
    read_header,
    same_tokenizer,
    tokenizer_identity,
    write_shard,
)

TEXT_SUFFIXES = (".txt", ".md")
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")
ENCODE_BATCH = 256  # documents per call of the tokenizer (a Rust tokenizer encodes a batch on its threads)


def list_inputs(paths: list[str]) -> list[str]:
    """The input files: each path a file, or a folder walked for the known suffixes (sorted)."""
    found = []
    for path in paths:
        if os.path.isfile(path):
            if not path.endswith(SUFFIXES):
                raise DataError(f"{path}: not an input prepare reads (one of {', '.join(SUFFIXES)})")
            found.append(os.path.abspath(path))
        elif os.path.isdir(path):
            found += sorted(os.path.abspath(os.path.join(root, name)) for root, _, names in os.walk(path)
                            for name in names if name.endswith(SUFFIXES))
        else:
            raise DataError(f"{path}: no such file or folder")
    if not found:
        raise DataError(f"{' '.join(paths)}: no {', '.join(SUFFIXES)} files")
    return found


def plan_units(files: list[str], unit_bytes: int) -> list[dict]:
    """Cut the inputs into units of about unit_bytes of text, in order: one shard each."""
    units, texts, size = [], [], 0
    for path in files:
        if path.endswith(TEXT_SUFFIXES):
            texts.append(path)
            size += os.path.getsize(path)
            if size >= unit_bytes:
                units.append({"kind": "text", "files": texts})
                texts, size = [], 0
            continue
        if texts:
            units.append({"kind": "text", "files": texts})
            texts, size = [], 0
        if path.endswith(".jsonl"):
            total = os.path.getsize(path)
            for start in range(0, max(total, 1), unit_bytes):
                units.append({"kind": "jsonl", "path": path, "start": start, "end": min(start + unit_bytes, total)})
        else:
            units += [{"kind": "parquet", "path": path, "row_groups": groups} for groups in _row_group_runs(path, unit_bytes)]
    if texts:
        units.append({"kind": "text", "files": texts})
    return units


def _parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("Parquet inputs need pyarrow: pip install pyarrow") from None
    return pq


def _row_group_runs(path: str, unit_bytes: int) -> list[list[int]]:
    meta = _parquet().ParquetFile(path).metadata
    runs, run, size = [], [], 0
    for i in range(meta.num_row_groups):
        run.append(i)
        size += meta.row_group(i).total_byte_size
        if size >= unit_bytes:
            runs.append(run)
            run, size = [], 0
    return runs + [run] if run or not runs else runs


def read_unit(unit: dict, text_field: str):
    """The documents (strings) of one unit, in order."""
    if unit["kind"] == "text":
        for path in unit["files"]:
            with open(path, encoding="utf-8") as f:
                yield f.read()
    elif unit["kind"] == "jsonl":
        path, start, end = unit["path"], unit["start"], unit["end"]
        with open(path, "rb") as f:
            if start > 0:  # the line that starts before `start` is the previous unit's
                f.seek(start - 1)
                f.readline()
            while f.tell() < end:
                at = f.tell()
                line = f.readline()
                if not line:
                    break
                if line.strip():
                    yield _text_of(line, path, at, text_field)
    else:
        table = _parquet().ParquetFile(unit["path"]).read_row_groups(unit["row_groups"], columns=[text_field])
        yield from table.column(text_field).to_pylist()


def _text_of(line: bytes, path: str, at: int, field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: the line at byte {at} is not JSON ({e.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        raise DataError(f"{path}: the record at byte {at} has no string {field!r} field (--text-field)")
    return record[field]


_TOKENIZERS: dict = {}


def _tokenizer(name: str):
    if name not in _TOKENIZERS:  # once per worker process
        from torchtitan_moe.components.data.tokenizer import ByteTokenizer, FileTokenizer

        _TOKENIZERS[name] = ByteTokenizer() if name == "bytes" else FileTokenizer(name)
    return _TOKENIZERS[name]


def encode(texts: list[str], tokenizer_name: str) -> list[np.ndarray]:
    """Token ids of each text with EOS appended, int64 [len + 1] each."""
    tok = _tokenizer(tokenizer_name)
    if tokenizer_name == "bytes":
        ids = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    else:
        ids = [np.asarray(e.ids) for e in tok.tokenizer.encode_batch(texts, add_special_tokens=False)]
    return [np.append(i.astype(np.int64), tok.eos_id) for i in ids]


def make_shard(job: tuple) -> tuple[str, int, int]:
    """One unit -> one shard (a pool worker's task): (shard path, tokens, documents)."""
    path, unit, tokenizer_name, identity, text_field = job
    documents, batch = [], []
    for text in read_unit(unit, text_field):
        if text and text.strip():  # an empty document has nothing to learn from
            batch.append(text)
        if len(batch) == ENCODE_BATCH:
            documents += encode(batch, tokenizer_name)
            batch = []
    documents += encode(batch, tokenizer_name) if batch else []
    header = write_shard(path, documents, identity, [unit])
    return path, header["num_tokens"], header["num_documents"]


def shard_name(i: int) -> str:
    return f"shard-{i:05d}{SUFFIX}"


def check_out_folder(out: str, manifest: dict) -> None:
    """Refuse a folder that holds shards of another tokenizer or of other inputs."""
    path = os.path.join(out, MANIFEST)
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
        if not same_tokenizer(old["tokenizer"], manifest["tokenizer"]):
            raise DataError(f"{out}: holds shards of tokenizer {describe_tokenizer(old['tokenizer'])}, not "
                            f"{describe_tokenizer(manifest['tokenizer'])}: one folder is one tokenizer's source; "
                            "use another --out")
        keys = ("inputs", "text_field", "units")
        if any(old.get(k) != manifest[k] for k in keys):
            raise DataError(f"{out}: was prepared from other inputs or settings ({path}); use another --out "
                            "(each folder is one source: list several in [data] sources)")
        return
    if os.path.isdir(out) and any(name.endswith(SUFFIX) for name in os.listdir(out)):
        raise DataError(f"{out}: holds shards without a {MANIFEST}; use another --out")


def done_shards(out: str, count: int) -> set[int]:
    """The shards already written in full (a rename put each in place whole)."""
    done = set()
    for i in range(count):
        path = os.path.join(out, shard_name(i))
        if os.path.isfile(path):
            read_header(path)  # a shard of another format or size stops here
            done.add(i)
    return done


def progress(total: int, initial: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, unit="shard", desc="prepare", file=sys.stderr, dynamic_ncols=True)


def prepare(inputs: list[str], out: str, tokenizer: str = "bytes", text_field: str = "text", workers: int = 1,
            unit_bytes: int = 64 << 20, show_progress: bool = True) -> dict:
    """Tokenize `inputs` into shards in `out`; returns the finished manifest."""
    files = list_inputs(inputs)
    identity = tokenizer_identity(tokenizer)
    units = plan_units(files, unit_bytes)
    manifest = {"format": f"{FORMAT}-prepare", "version": VERSION, "tokenizer": identity, "text_field": text_field,
                "inputs": [{"path": p, "bytes": os.path.getsize(p)} for p in files], "units": units,
                "shards": [shard_name(i) for i in range(len(units))], "complete": False}
    check_out_folder(out, manifest)
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):  # a killed run's unfinished shards
        if ".tmp" in name:
            os.remove(os.path.join(out, name))
    _write_json(os.path.join(out, MANIFEST), manifest)
    done = done_shards(out, len(units))
    jobs = [(os.path.join(out, shard_name(i)), unit, tokenizer, identity, text_field)
            for i, unit in enumerate(units) if i not in done]
    bar = progress(len(units), len(done)) if show_progress else None
    workers = max(1, min(workers, len(jobs)))
    if workers == 1:
        results = map(make_shard, jobs)
    else:
        pool = multiprocessing.get_context("fork").Pool(workers)
        results = pool.imap_unordered(make_shard, jobs)
    for path, tokens, docs in results:
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"{os.path.basename(path)}: {tokens:,} tokens, {docs:,} documents")
    if workers > 1:
        pool.close()
        pool.join()
    if bar is not None:
        bar.close()
    headers = [read_header(os.path.join(out, name))[0] for name in manifest["shards"]]
    manifest.update(complete=True, num_tokens=sum(h["num_tokens"] for h in headers),
                    num_documents=sum(h["num_documents"] for h in headers))
    _write_json(os.path.join(out, MANIFEST), manifest)
    return manifest


def _write_json(path: str, value: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtitan_moe.components.data.prepare",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="files or folders of .txt, .md, .jsonl, .parquet")
    parser.add_argument("--out", required=True, help="the source's folder of shards")
    parser.add_argument("--tokenizer", default="bytes", help="'bytes' or the path of a tokenizer.json")
    parser.add_argument("--text-field", default="text", help="the JSONL field / Parquet column of the text")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes")
    parser.add_argument("--unit-mb", type=float, default=64, help="text per shard, about (MB)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.unit_mb <= 0:
        print("prepare: --workers must be >= 1 and --unit-mb > 0", file=sys.stderr)
        return 2
    try:
        manifest = prepare(args.inputs, args.out, args.tokenizer, args.text_field, args.workers,
                           int(args.unit_mb * (1 << 20)), show_progress=not args.quiet)
    except DataError as e:
        print(f"prepare: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {len(manifest['shards'])} shards, {manifest['num_tokens']:,} tokens, "
          f"{manifest['num_documents']:,} documents ({describe_tokenizer(manifest['tokenizer'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
