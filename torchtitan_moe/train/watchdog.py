"""A hang becomes one line and every rank's stack, within a bounded time, instead of silence.

Each rank runs a thread that the trainer tells of progress (`beat`: a step starts or ends, a save starts
or ends). When no beat comes for `timeout()` seconds ([checks] hang_timeout; by default 90% of the
collectives' own timeout, so this comes first), the rank writes the stacks of all its threads
(faulthandler) to <dump_folder>/hang/rank-R.txt, headed by one line saying where its main thread waits, and
below them its child processes (its data workers) as Linux's /proc sees them: their Python stacks cannot be
asked for, their state and kernel wait channel say whether one waits on a lock (futex) or for input.
Rank 0 then waits up to GATHER_SECONDS for the other ranks' files (every rank of a hung run fires: the
one that is stuck, and the ones waiting for it in a collective) and prints one line naming, for each
place, the ranks waiting there, and exits with status 4 (the others exit after it; torchrun stops them).

    hang: no progress for 90 s since step 12 started; ranks 0, 2-7 wait in all_reduce (distributed_c10d.py:2950)
    from train_step (step.py:75), rank 1 in _next (text.py:80) from ...; every rank's stack: outputs/run/hang/
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable

EXIT_STATUS = 4
GATHER_SECONDS = 20.0
_OURS = os.sep + "torchtitan_moe" + os.sep


def _where(frame) -> str:
    """'func (file:line)' of a frame's innermost call, and of the innermost one of this package below it."""
    def name(f) -> str:
        return f"{f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)}:{f.f_lineno})"

    text, ours = name(frame), frame
    while ours is not None and _OURS not in ours.f_code.co_filename:
        ours = ours.f_back
    if ours is not None and ours is not frame:
        text += f" from {name(ours)}"
    return text


def ranges(ranks: list[int]) -> str:
    """[0, 2, 3, 4, 7] -> '0, 2-4, 7'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def summary(where: dict[int, str], world: int) -> str:
    """rank -> where it waits (from its file) -> the ranks waiting at each place, most first."""
    places: dict[str, list[int]] = {}
    for rank in sorted(where):
        places.setdefault(where[rank], []).append(rank)
    parts = [f"rank{'s' * (len(r) > 1)} {ranges(r)} {'wait' if len(r) > 1 else 'waits'} in {place}"
             for place, r in sorted(places.items(), key=lambda item: (-len(item[1]), item[1]))]
    missing = [r for r in range(world) if r not in where]
    if missing:
        parts.append(f"no stack yet from rank{'s' * (len(missing) > 1)} {ranges(missing)}")
    return "; ".join(parts)


def child_processes(pid: int | None = None) -> list[str]:
    """'pid P (name): state S, waits in WCHAN: command' for each child of process `pid` (this one), from /proc;
    [] where there is none (or no /proc)."""
    pid = pid or os.getpid()
    children = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += f.read().split()
    except OSError:
        return []
    lines = []
    for child in children:
        try:
            with open(f"/proc/{child}/stat") as f:
                stat = f.read()
            with open(f"/proc/{child}/wchan") as f:
                wchan = f.read().strip() or "-"
            with open(f"/proc/{child}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
        lines.append(f"pid {child} ({name}): state {state}, waits in {wchan}: {command[:160]}")
    return lines


class HangWatchdog:
    """Fires when no `beat()` comes for `timeout()` seconds (timeout() <= 0: off)."""

    def __init__(self, folder: str, rank: int, world: int, timeout: Callable[[], float],
                 on_hang: Callable[[str], None] | None = None):
        self.folder = os.path.join(folder, "hang")
        self.rank, self.world, self.timeout = rank, world, timeout
        self.on_hang = on_hang or self._stop_process
        self.main = threading.main_thread().ident
        self.last, self.doing = time.monotonic(), "start"
        self._beat = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def start(self) -> "HangWatchdog":
        self._thread.start()
        return self

    def beat(self, doing: str) -> None:
        """Progress: `doing` is what the run does from now on ('step 12', 'saving step 12')."""
        self.last, self.doing = time.monotonic(), doing
        self._beat.set()

    def close(self) -> None:
        self._closed.set()
        self._beat.set()

    def _watch(self) -> None:
        while not self._closed.is_set():
            timeout = self.timeout()
            if timeout <= 0:
                self._beat.wait(5.0)
            else:
                self._beat.wait(max(0.0, self.last + timeout - time.monotonic()))
            self._beat.clear()
            if self._closed.is_set():
                return
            idle = time.monotonic() - self.last
            if timeout > 0 and idle >= timeout:
                self.on_hang(self._fire(idle))
                return

    def _fire(self, idle: float) -> str:
        """Write this rank's stacks; on rank 0 gather the others' heads. Returns the line."""
        os.makedirs(self.folder, exist_ok=True)
        frame = sys._current_frames().get(self.main)
        where = _where(frame) if frame is not None else "an unknown place (no main thread)"
        path = os.path.join(self.folder, f"rank-{self.rank}.txt")
        with open(path + ".tmp", "w") as f:
            f.write(f"{where}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            children = child_processes()
            f.write("\nChild processes (data workers):\n" + "\n".join(children or ["none"]) + "\n")
        os.replace(path + ".tmp", path)
        heads = {self.rank: where}
        deadline = time.monotonic() + (GATHER_SECONDS if self.rank == 0 else 0)
        while self.rank == 0 and len(heads) < self.world and time.monotonic() < deadline:
            time.sleep(0.2)
            for r in range(self.world):
                other = os.path.join(self.folder, f"rank-{r}.txt")
                if r not in heads and os.path.isfile(other):
                    with open(other) as f:
                        heads[r] = f.readline().strip()
        return (f"hang: no progress for {idle:.3g} s during {self.doing}; {summary(heads, self.world)}; "
                f"every rank's stack: {self.folder}{os.sep}")

    def _stop_process(self, line: str) -> None:
        """Rank 0 says the line and exits; the others leave it the time to gather their files first."""
        if self.rank != 0:
            time.sleep(GATHER_SECONDS + 10)
        else:
            print(line, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_STATUS)
