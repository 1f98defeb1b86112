"""One writer per run folder: a run holds <dump_folder>/run.lock for its lifetime.

The lock file is made with O_CREAT | O_EXCL (atomic on local disks and NFS) and names its holder: host,
pid, the process's start time and the command. A second run on the folder refuses in one line naming
them. A lock is stale, and is taken over with a warning, when its holder is gone:
  - on this host: no process with that pid, or one started at another time (the pid was reused);
  - on another host: the holder has not touched the file for STALE_SECONDS (a running holder touches it
    every HEARTBEAT_SECONDS from a thread, which goes on while its training waits in a collective).
A lock is released (removed) when the run ends, by any exception too; a killed run leaves a stale one.
Global rank 0 holds it for the run (the ranks of every node share the dump folder).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

from torchtitan_moe.config.sections import ConfigError

LOCK_FILE = "run.lock"
HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 600.0


class RunFolderBusy(ConfigError):
    """Another live run holds the dump folder (one line: its host and pid)."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive_here(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    return started is None or _start_time(pid) in (None, started)


def read_lock(path: str) -> dict | None:
    """A lock file's contents, or None when there is no such file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
        return holder if isinstance(holder, dict) and "pid" in holder else {"unreadable": text[:80]}
    except ValueError:
        return {"unreadable": text[:80]}


def holder_of(folder: str) -> dict | None:
    """Who holds the folder's lock (the lock file's contents), or None when no run does."""
    return read_lock(os.path.join(folder, LOCK_FILE))


def why_stale(folder: str, holder: dict) -> str | None:
    """Why the lock of `holder` is stale (its holder is gone), or None when it may be alive."""
    if "unreadable" in holder:
        return "the lock file cannot be read (a run killed while writing it)"
    if holder.get("host") == socket.gethostname():
        if not _alive_here(int(holder["pid"]), holder.get("started")):
            return f"no process {holder['pid']} on this host"
        return None
    try:
        idle = time.time() - os.path.getmtime(os.path.join(folder, LOCK_FILE))
    except FileNotFoundError:
        return "released meanwhile"
    return f"not touched for {idle:.0f} s" if idle > STALE_SECONDS else None


def describe(holder: dict) -> str:
    return f"host {holder.get('host')} pid {holder.get('pid')}"


def refuse_if_held(folder: str) -> None:
    """Before launch: one line if a live run holds `folder` (tools/check_config)."""
    holder = holder_of(folder)
    if holder is not None and why_stale(folder, holder) is None:
        raise RunFolderBusy(f"{folder} is in use by another run ({describe(holder)}, since "
                            f"{holder.get('since', '?')}): one run writes a folder at a time; wait for it, stop it, "
                            "or pick another --job.dump_folder")


class RunFolderLock:
    """The lock on a run's dump folder, held from `acquire()` to `release()`."""

    def __init__(self, folder: str):
        self.folder, self.path = folder, os.path.join(folder, LOCK_FILE)
        self.held = False
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> None:
        from torchtitan_moe.compat.torchtitan import logger

        os.makedirs(self.folder, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": _start_time(os.getpid()),
              "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:500]}
        for _ in range(3):  # a racing run may take or drop the lock between the tries
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = holder_of(self.folder)
                if holder is None:
                    continue  # released meanwhile
                stale = why_stale(self.folder, holder)
                if stale is None:
                    refuse_if_held(self.folder)
                    continue
                if self._take_over(holder):
                    logger.warning(f"{self.path}: taking over the lock of a run that is gone ({describe(holder)}: "
                                   f"{stale})")
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            self._heartbeat = threading.Thread(target=self._touch, name="run-folder-lock", daemon=True)
            self._heartbeat.start()
            return
        raise RunFolderBusy(f"{self.path}: could not take the lock (other runs are starting on this folder)")

    def _take_over(self, stale: dict) -> bool:
        """Move the stale lock aside; False if another run did first (it now holds a fresh lock, or none)."""
        aside = f"{self.path}.stale.{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        moved = read_lock(aside)
        if moved != stale:  # a fresh lock taken meanwhile: put it back (unless yet another run holds one)
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
        os.remove(aside)
        return moved == stale

    def _touch(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        """Remove the lock file (if it is still this process's: a run that took it over keeps its own)."""
        if not self.held:
            return
        self._stop.set()
        self.held = False
        holder = read_lock(self.path) or {}
        if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            try:
                os.remove(self.path)
            except OSError:
                pass
