"""Checksums of a checkpoint's files: written with each save, verified before a run loads it.

    save:  every rank writes its .distcp files (DCP), then hashes them (xxh3_64 per 64 MiB chunk,
           chunks in threads) -> the coordinator writes checksums.json, then DCP's .metadata
    load:  sizes against checksums.json, then the chunks hashed again (split over the ranks of a run)

DCP writes `.metadata` last, and a step folder counts as complete once it exists; checksums.json is
written just before it, so every complete step carries the checksums of its data files. A step folder
saved without checksums (before they were written) loads with a warning. The hash is xxh3_64 (the
`xxhash` package, which torchtitan's `datasets` dependency installs): several GB/s a thread, so hashing
costs a small part of a save, beside writing the bytes.
"""

from __future__ import annotations

import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.futures import Future

CHECKSUMS_FILE = "checksums.json"
CHUNK_BYTES = 64 * 2**20  # a multiple of mmap's granularity
ALGORITHM = "xxh3_64"


def hash_threads() -> int:
    """Threads that hash at once (xxhash releases the GIL): a few, beside the other ranks of a node."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def chunk_digest(path: str, start: int, length: int) -> str:
    """xxh3_64 of bytes [start, start + length) of `path`, read through the page cache (no copy)."""
    if length == 0:
        return xxhash.xxh3_64(b"").hexdigest()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), length, offset=start, access=mmap.ACCESS_READ) as m:
        return xxhash.xxh3_64(m).hexdigest()


def chunks_of(size: int) -> list[tuple[int, int]]:
    """(start, length) of each chunk of a file of `size` bytes (one empty chunk for an empty file)."""
    return [(start, min(CHUNK_BYTES, size - start)) for start in range(0, size, CHUNK_BYTES)] or [(0, 0)]


def hash_files(paths: dict[str, str]) -> dict[str, dict]:
    """name -> {"size": bytes, "chunks": [hex digest per chunk]} for name -> path."""
    sizes = {name: os.path.getsize(path) for name, path in paths.items()}
    jobs = [(name, start, length) for name in sorted(paths) for start, length in chunks_of(sizes[name])]
    with ThreadPoolExecutor(hash_threads()) as pool:
        digests = list(pool.map(lambda job: chunk_digest(paths[job[0]], job[1], job[2]), jobs))
    out = {name: {"size": sizes[name], "chunks": []} for name in paths}
    for (name, _, _), digest in zip(jobs, digests):
        out[name]["chunks"].append(digest)
    return out


def write_manifest(folder: str, files: dict[str, dict]) -> None:
    """checksums.json, atomically (a temporary file renamed) and synced before the caller writes .metadata."""
    tmp = os.path.join(folder, CHECKSUMS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"algorithm": ALGORITHM, "chunk_bytes": CHUNK_BYTES, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, CHECKSUMS_FILE))


class _HashedWrites(list):
    """A rank's DCP write results, with the checksums of the files it wrote (`files`), gathered to the coordinator."""

    files: dict[str, dict]


class ChecksummedWriter(FileSystemWriter):
    """DCP's file writer, whose save also leaves checksums.json (written just before .metadata)."""

    def write_data(self, plan, planner) -> Future:
        results = super().write_data(plan, planner)
        results.wait()
        written = _HashedWrites(results.value())
        names = {r.storage_data.relative_path for r in written}
        written.files = hash_files({name: os.path.join(str(self.path), name) for name in names})
        done: Future = Future()
        done.set_result(written)
        return done

    def finish(self, metadata, results) -> None:
        files: dict[str, dict] = {}
        for rank_results in results:
            found = getattr(rank_results, "files", None)
            if found is None:  # a DCP that gathered plain lists: the coordinator hashes that rank's files
                names = {r.storage_data.relative_path for r in rank_results}
                found = hash_files({name: os.path.join(str(self.path), name) for name in names})
            files.update(found)
        write_manifest(str(self.path), files)
        super().finish(metadata, results)


def read_manifest(folder: str) -> dict | None:
    """The folder's checksums.json, or None where the step was saved without one; ValueError if unreadable."""
    path = os.path.join(folder, CHECKSUMS_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        if manifest["algorithm"] != ALGORITHM or not isinstance(manifest["files"], dict):
            raise ValueError(f"algorithm {manifest['algorithm']!r}, expected {ALGORITHM!r}")
        int(manifest["chunk_bytes"])
        return manifest
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e})") from None


def checksum_problem(folder: str, rank: int = 0, world: int = 1) -> str | None:
    """What is wrong with the data files of `folder` against its checksums.json, or None.

    Sizes are checked by every caller; the chunks are hashed by this `rank` of `world` callers only
    (chunk i by rank i % world): the caller combines the ranks' answers. ValueError: no usable checksums."""
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    chunk_bytes = int(manifest["chunk_bytes"])
    jobs = []
    for name, entry in sorted(manifest["files"].items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{path} is missing (listed in {CHECKSUMS_FILE})"
        size = os.path.getsize(path)
        if size != entry["size"]:
            return f"{path} has {size:,} bytes where {entry['size']:,} were saved ({CHECKSUMS_FILE})"
        starts = range(0, size, chunk_bytes) if size else [0]
        jobs += [(path, start, min(chunk_bytes, size - start), digest)
                 for start, digest in zip(starts, entry["chunks"], strict=True)]
    mine = jobs[rank::world]
    with ThreadPoolExecutor(hash_threads()) as pool:
        digests = list(pool.map(lambda job: chunk_digest(*job[:3]), mine))
    for (path, start, length, expected), digest in zip(mine, digests):
        if digest != expected:
            return (f"{path} is corrupt: its bytes {start:,}..{start + length:,} do not match the checksum "
                    f"written when it was saved ({CHECKSUMS_FILE})")
    return None
