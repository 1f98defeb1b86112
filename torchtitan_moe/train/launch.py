"""The launcher and its training processes: they live and die together, and a stop is one line.

    python -m torchtitan_moe.train.launch [torchrun's flags] -m torchtitan_moe.train --job.config_file ...

is torchrun (torch.distributed.run, in this process) with two differences:
  - a failed run ends in one line, not torchrun's report: a rank that stopped with one line of its own
    (a refusal: exit status 2, a diverged run: 3, a hang: 4, the router-init checks: 1 after their
    findings) is not reported again; any other failure is one line naming the rank, its exit status or
    signal; the launcher exits with the rank's status;
  - its training processes die with it: each asks Linux for SIGKILL when its parent (this process) dies
    (`die_with_launcher`, prctl PR_SET_PDEATHSIG, called first thing by `python -m torchtitan_moe.train`),
    so a killed launcher leaves no orphan training on and writing into its run folder.
scripts/train.sh runs it after the config check.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

LAUNCHER_PID = "TORCHTITAN_MOE_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1
# Exit statuses of `python -m torchtitan_moe.train` whose reason the rank has said in one line.
SAID = {1: "router-init checks failed", 2: "refused", 3: "diverged", 4: "hung"}
# torchrun's own lines about a failure, which the launcher's line replaces.
_TORCHRUN_NOISE = ("Sending process", "failed (exitcode", "Closing process")


def die_with_launcher() -> None:
    """In a process torchrun started: be killed (SIGKILL) when the launcher dies. Linux only; no-op elsewhere
    and outside torchrun. A launcher that died before the request was made is found by the pid it exported."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not allowed here (a sandbox): the launcher's own signals still reach its process group
    expected = os.environ.get(LAUNCHER_PID)
    parent = os.getppid()
    if (expected is not None and str(parent) != expected) or parent == 1:
        os._exit(1)  # the launcher is already gone


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TORCHRUN_NOISE)


def describe_failure(error) -> tuple[str | None, int]:
    """torchrun's ChildFailedError -> (the launcher's line, or None where the rank said it; exit status)."""
    rank, failure = error.get_first_failure()
    code = failure.exitcode
    if code in SAID:
        return None, code
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (out of host memory?)" if -code == signal.SIGKILL else ""
        return f"train: rank {rank} (pid {failure.pid}) was killed by {name}{hint}; the run stopped", 128 - code
    return f"train: rank {rank} (pid {failure.pid}) stopped with exit status {code}; its output is above", code


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.get_args_parser().parse_args(sys.argv[1:] if argv is None else argv)
    os.environ[LAUNCHER_PID] = str(os.getpid())
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_DropNoise())
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        line, code = describe_failure(e)
        if line:
            print(line, file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
