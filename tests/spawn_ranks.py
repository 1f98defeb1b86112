"""Shared by the multi-process tests: run a worker on W ranks (processes forked from a server that
imported torch once) and fail with their messages; run several training runs of the debug config on
one set of ranks, as one torchrun launch would (`launch_plan`).

The worker is called as worker(rank, world, port, *args, failures) and runs its checks inside
`with rank_group(rank, world, port, failures):`, which reports a failure to the parent through
`failures` (a rank process's assertion is otherwise lost).

A failing rank fails the test fast, whatever its peers do: its process group's collectives give up
after PG_TIMEOUT_S (gloo's `timeout`), the peers of a rank that failed get GRACE_S to finish before
they are killed (they may wait forever in a collective the failed rank never joins, or it may hang
tearing its group down under a pending one), and every body has a deadline (DEADLINE_S, or
run_ranks' `deadline_s`). The test's failure names each rank that failed, with its traceback, and
the ranks that were killed, with the Python stack each was stuck in (faulthandler, on SIGUSR1).
"""

import atexit
import contextlib
import faulthandler
import json
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing import connection as mp_connection

# A collective that waits this long for a peer raises (a deadlock shows as an error, not a hang). Long
# enough for a peer still compiling (inductor on 2 busy cores) the graph this rank waits in.
PG_TIMEOUT_S = 120
# After a rank fails (or its process ends), the others have this long to finish or fail too.
GRACE_S = 5
# A body's longest run on every rank, when run_ranks is given no deadline_s.
DEADLINE_S = 300
# Asked for its stack, a rank has this long to write it before it is killed.
DUMP_S = 2
POLL_S = 2  # _launch looks at its ranks at least this often


def _stacks_on_sigusr1(path: str) -> None:
    """This process writes every thread's Python stack to `path` when sent SIGUSR1 (the file is kept open:
    the handler writes from the signal, allocating nothing)."""
    faulthandler.register(signal.SIGUSR1, file=open(path, "a"), all_threads=True)


def _kill_with_stacks(procs: dict[int, "mp.Process"], dumps: dict[int, Path]) -> str:
    """Kill the stuck ranks `procs` ({rank: process}) after asking each for its stacks -> those stacks."""
    if not procs:
        return ""
    for proc in procs.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(DUMP_S)
    for proc in procs.values():
        proc.kill()
        proc.join(timeout=DUMP_S)  # (a process the fork server never reports on: not forever)
    return "".join(f"\nrank {rank} was stuck in:\n{dumps[rank].read_text()[-6000:]}" for rank in procs
                   if dumps[rank].exists())


@contextlib.contextmanager
def rank_group(rank: int, world: int, port: int, failures, backend: str = "gloo", **init_kwargs):
    """This process's default group for the block; an exception there goes to the parent (with its
    traceback) and is raised again; the group is destroyed either way. Its collectives time out after
    PG_TIMEOUT_S unless `timeout` (a timedelta) is given."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_kwargs.setdefault("timeout", timedelta(seconds=PG_TIMEOUT_S))
    dist.init_process_group(backend, rank=rank, world_size=world, **init_kwargs)
    try:
        yield
    except BaseException as e:
        failures.put(f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        e.reported_to_parent = True
        raise
    finally:
        dist.destroy_process_group()


def count_exchanges(calls: list) -> None:
    """From here on in this rank process, each all_to_all_single call appends to `calls`."""
    original = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_to_all_single = counting


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the fork server the ranks are forked from: a rank pays for its test module alone. Where
# there is a GPU, torch alone: torchtitan asks for the device count when imported, which initializes CUDA
# in the server, and a process forked after that cannot use CUDA.
PRELOAD = ["torch", "torch.distributed"] if torch.cuda.is_available() else ["rank_preload"]


TESTS = Path(__file__).resolve().parent
_preload_checked: list[bool] = []


def _context():
    """Ranks forked from a server started once per session, with PRELOAD imported and no Python thread
    running (a plain fork of this pytest process would copy its state, locks held by its threads included;
    the server's native threads, numpy's OpenBLAS server and pyarrow's jemalloc thread, belong to libraries
    that hold their locks across a fork)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    if not _preload_checked:
        # The server imports PRELOAD from a sys.path of its own (Python 3.11 drops the one it is handed, which
        # has tests/) and skips, without a word, a module it cannot import: it starts with tests/ on its
        # PYTHONPATH, and a first rank checks that it did import PRELOAD.
        path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), path]))
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.pop("PYTHONPATH") if path is None else os.environ.update(PYTHONPATH=path)
        missing = ctx.SimpleQueue()
        probe = ctx.Process(target=_not_imported, args=(PRELOAD, missing))
        probe.start()
        probe.join(timeout=60)  # (its exit unreported by the fork server: not forever; see _launch)
        if not_imported := missing.get():
            raise RuntimeError(f"the tests' fork server did not import {not_imported} (spawn_ranks.PRELOAD): every "
                               "rank would import them again")
        _preload_checked.append(True)
    return ctx


def _not_imported(modules: list[str], out) -> None:
    out.put([m for m in modules if m not in sys.modules])


class _Pool:
    """`world` processes forked from the session's fork server, process r running each body it is sent
    as rank r. The start-up (the test module imported, the group's processes) is paid once per test
    module and world size, not once per test; a process that ends (os._exit) or is killed is started
    again for the next body."""

    def __init__(self, world: int):
        ctx = _context()
        self.failures = ctx.SimpleQueue()
        self.conns, self.procs = [], []
        self.stacks = Path(tempfile.mkdtemp(prefix="rank-stacks-"))  # where a stuck rank writes its stacks
        atexit.register(shutil.rmtree, self.stacks, ignore_errors=True)
        self.dumps = {rank: self.stacks / f"stack{rank}.txt" for rank in range(world)}
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, child, self.failures, str(self.dumps[rank])), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def _reported(self) -> list[str]:
        messages = []
        while not self.failures.empty():
            messages.append(self.failures.get())
        return messages

    def run(self, worker, world: int, args: tuple, deadline_s: float) -> tuple[bool, list[str]]:
        """Run worker(rank, world, port, *args, failures) on every rank -> (the processes can run the
        next body, the failures reported). Ranks still running GRACE_S after one failed or ended, or
        at the deadline, are killed."""
        job = (worker, world, free_port(), args, list(sys.path), dict(os.environ))
        for conn in self.conns:
            conn.send(job)
        start = time.monotonic()
        pending = dict(enumerate(self.conns))
        messages, ended, failed_at = [], [], None
        while pending:
            messages += self._reported()
            if (messages or ended) and failed_at is None:
                failed_at = time.monotonic()
            limit = start + deadline_s if failed_at is None else min(start + deadline_s, failed_at + GRACE_S)
            # The failures queue too: a rank that failed may never finish (stuck tearing its group down).
            waits = [*pending.values(), *(self.procs[r].sentinel for r in pending), self.failures._reader]
            if not mp_connection.wait(waits, timeout=max(0.0, limit - time.monotonic())):
                messages += self._reported()
                if failed_at is None:
                    why = f"the body's deadline of {deadline_s:g} s passed"
                else:
                    why = f"still running {GRACE_S} s after a rank failed or ended"
                stacks = _kill_with_stacks({r: self.procs[r] for r in pending}, self.dumps)
                messages.append(f"ranks {sorted(pending)} killed: {why} (waiting for a peer in a collective?){stacks}")
                return False, messages
            for rank, conn in list(pending.items()):
                with contextlib.suppress(EOFError):
                    if conn.poll():
                        conn.recv()
                        del pending[rank]
                        continue
                proc = self.procs[rank]
                if not proc.is_alive():
                    del pending[rank]
                    ended.append(rank)
                    if proc.exitcode != 0:
                        messages.append(f"rank {rank}: the process ended with exit code {proc.exitcode}")
        return not ended, messages + self._reported()

    def close(self, kill: bool = False) -> None:
        """Stop the processes: each after its body (kill: at once, wherever it is)."""
        for conn, proc in zip(self.conns, self.procs):
            if kill:
                proc.kill()
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _serve(rank: int, conn, failures, dump: str) -> None:
    _stacks_on_sigusr1(dump)
    # A forked child inherits the server's start method: processes it starts (a DataLoader's workers) would
    # come from the fork server too. The platform's default, as in a fresh process.
    multiprocessing.set_start_method(None, force=True)
    while (job := conn.recv()) is not None:
        worker, world, port, args, path, env = job
        sys.path[:] = path  # as a freshly spawned process would see them
        os.environ.clear()
        os.environ.update(env)
        try:
            worker(rank, world, port, *args, failures)
        except BaseException as e:  # raised outside rank_group too: the parent must hear of it
            if not getattr(e, "reported_to_parent", False):
                failures.put(f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        conn.send(True)  # done: the parent's grace for the other ranks does not wait for what follows
        if "torch._dynamo" in sys.modules:  # (its first import takes seconds: only where a body compiled)
            sys.modules["torch._dynamo"].reset()  # no compiled graph carried into the next body


_pools: dict[int, _Pool] = {}
_pools_module: list[str] = [""]


def run_ranks(worker, world: int, *args, deadline_s: float = DEADLINE_S) -> None:
    """Run worker(rank, world, port, *args, failures) on `world` ranks and fail with their messages,
    within `deadline_s` seconds (ranks still running then are killed). The processes are kept for the
    next call from the same test module (so one module's bodies may share a process's imports and module
    state, never another module's); after a rank was killed or ended, they are started again."""
    if _pools_module[0] != worker.__module__:
        for pool in _pools.values():
            pool.close()
        _pools.clear()
        _pools_module[0] = worker.__module__
    pool = _pools.get(world) or _pools.setdefault(world, _Pool(world))
    reusable, messages = pool.run(worker, world, args, deadline_s)
    if not reusable:
        pool.close(kill=True)
        del _pools[world]
    if messages:
        pytest.fail("\n".join(messages))


def torchrun_env() -> dict[str, str]:
    """Training processes run the kernels' torch paths (no Triton interpreter), one thread each."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def launch_plan(plan: list[dict], folder: Path, nproc: int = 2, timeout: int = 600) -> None:
    """Run tests/resume_harness.py's operations (training runs, copies, ...) on `nproc` ranks forked from
    the session's fork server, as one torchrun launch of the harness would (the same environment
    variables, one process group for every run): the start-up is paid once a plan, and the imports once
    a session. Every rank's output goes to folder/harness.log. A rank that fails (its traceback is in
    the log) stops the others after GRACE_S, as torchrun does; so does `timeout`. Either fails the test
    with the log's tail. (torchrun itself is tested where users meet it: the README's command, the
    launcher's tests, SLURM, a parity launch.)"""
    (folder / "plan.json").write_text(json.dumps(plan))
    log = folder / "harness.log"
    log.write_text("")
    why = _launch(_plan_rank, (str(folder / "plan.json"), str(log), torchrun_env()), nproc, folder / "stack", timeout)
    if why:
        pytest.fail(f"{why}; the end of {log}:\n{log.read_text()[-9000:]}")


def launch_command(cmd: list[str], log: Path, timeout: int = 600) -> int:
    """A tool's launch (tools/parity.py's `run_logged`, which bench_train's runs go through too) with its
    ranks forked from the session's fork server instead of started by torchrun: the tools' tests pay no
    interpreter start-up a rank. `python -m torch.distributed.run [...] --nproc_per_node=N [...] -m MODULE
    ARGS` runs MODULE as __main__ on N ranks with torchrun's environment, `python -m MODULE ARGS` on one.
    The log starts with the command, as run_logged's does; rank 0's output follows, another rank's goes to
    LOG.rank<r>. Returns the exit status: 1 when a rank failed or was killed, as torchrun's."""
    if cmd[:2] != [sys.executable, "-m"]:
        raise ValueError(f"launch_command: not `python -m ...`: {cmd}")
    if cmd[2] == "torch.distributed.run":
        at = cmd.index("-m", 3)
        flags, (module, *argv) = cmd[3:at], cmd[at + 1:]
        nproc = [int(f.split("=", 1)[1]) for f in flags if f.startswith("--nproc_per_node=")]
        if len(nproc) != 1:
            raise ValueError(f"launch_command: no --nproc_per_node=N in {flags}")
        nproc, torchrun = nproc[0], True
    else:
        (module, *argv), nproc, torchrun = cmd[2:], 1, False
    log.write_text(" ".join(cmd) + "\n")
    why = _launch(_module_rank, (module, argv, str(log), torchrun_env(), torchrun), nproc,
                  log.with_name(log.name + ".stack"), timeout)
    if why:
        with open(log, "a") as f:
            f.write(f"launch_command: {why}\n")
    return 1 if why else 0


def _launch(target, args: tuple, nproc: int, stacks: Path, timeout: int) -> str:
    """Fork target(rank, nproc, port, stack_file, *args) on `nproc` ranks from the session's fork server and
    wait -> "" when every rank ended with 0, else what went wrong: the ranks that failed, and those killed
    (still running GRACE_S after a rank failed, as torchrun stops them, or at `timeout`) with the stacks
    each wrote to its stack_file (`stacks`<rank>.txt, registered with _stacks_on_sigusr1)."""
    ctx, port = _context(), free_port()
    files = {rank: stacks.with_name(f"{stacks.name}{rank}.txt") for rank in range(nproc)}
    for rank in range(nproc):
        _exit_file(files[rank]).unlink(missing_ok=True)
    ranks = [ctx.Process(target=target, args=(rank, nproc, port, str(files[rank]), *args)) for rank in range(nproc)]
    for proc in ranks:
        proc.start()
    deadline, failed_at = time.monotonic() + timeout, None
    codes: dict[int, int | None] = {}  # rank -> exit status, once it ended (None: ended, status unknown)
    gone_since: dict[int, float] = {}  # pid -> when its process was first seen gone without a word
    while len(codes) < nproc:
        for rank, proc in enumerate(ranks):
            if rank not in codes and (code := _ended(proc, files[rank], gone_since)) is not _RUNNING:
                codes[rank] = code
        if failed_at is None and any(code != 0 for code in codes.values()):
            failed_at = time.monotonic()
        limit = deadline if failed_at is None else min(deadline, failed_at + GRACE_S)
        if len(codes) == nproc or time.monotonic() >= limit:
            break
        # The fork server reports an exit through the sentinel; at times it reported none for minutes after the
        # rank had ended and was reaped (a test's launch then waited for its whole timeout): look every POLL_S.
        running = [proc.sentinel for rank, proc in enumerate(ranks) if rank not in codes]
        mp_connection.wait(running, timeout=min(POLL_S, limit - time.monotonic()))
    killed = [rank for rank in range(nproc) if rank not in codes]
    stacks_text = _kill_with_stacks({rank: ranks[rank] for rank in killed}, files)
    codes = {rank: code for rank, code in codes.items() if code != 0}
    if not (codes or killed):
        return ""
    cause = f"the launch ran past {timeout} s" if failed_at is None else "a rank failed"
    return (f"ranks {killed} killed ({cause}); " if killed else "") + f"exit codes {codes}{stacks_text}"


_RUNNING = object()


def _exit_file(stacks: Path | str) -> Path:
    """Where a rank of _launch leaves its exit status before it ends (next to its stacks' file)."""
    return Path(f"{stacks}.exit")


def _ended(proc, stacks: Path, gone_since: dict) -> int | None | object:
    """A rank of _launch: _RUNNING, or its exit status: the fork server's word, else, once its process is gone
    (ended and reaped, or a zombie), the status it left in its exit file; with neither GRACE_S after it went,
    None (ended, status unknown: killed)."""
    if not proc.is_alive():
        return proc.exitcode
    try:
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                return _RUNNING
    except FileNotFoundError:
        pass
    exit_file = _exit_file(stacks)
    if exit_file.exists():
        return int(exit_file.read_text())
    went = gone_since.setdefault(proc.pid, time.monotonic())
    return None if time.monotonic() - went > GRACE_S else _RUNNING


def _exit(code: int) -> None:
    """End a rank of _launch with `code` (os._exit, made by _as_torchrun_rank to leave it in its exit file)."""
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)  # (no atexit handlers of the fork server's modules)


def _leave_exit_status(stacks: str) -> None:
    """Make this rank's os._exit leave its status in its exit file first (see _ended): the rank's own ends and
    the package's (compat.exit_process ends a gloo run with os._exit)."""
    real_exit = os._exit

    def exit_leaving_status(code: int) -> None:
        with contextlib.suppress(OSError):
            _exit_file(stacks).write_text(str(code))
        real_exit(code)

    os._exit = exit_leaving_status


def _as_torchrun_rank(rank: int, world: int, port: int, env: dict[str, str], torchrun: bool, out: str,
                      stacks: str) -> None:
    """This forked process as a fresh one torchrun started (`torchrun`: its environment, else a plain
    process's), its output to `out`, its stacks to `stacks` on SIGUSR1, one intra-op thread.
    (The fork server's modules read TRITON_INTERPRET when it imported them; what a run checks reads this
    environment, and training on the CPU runs no Triton kernel.)"""
    multiprocessing.set_start_method(None, force=True)  # the platform's default, as in a fresh process
    os.environ.clear()
    os.environ.update(env)
    # PYTHONPATH's entries first, as a fresh interpreter's (a test's fake DeepEP): the fork server's was read
    # when it started.
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    if torchrun:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1), os.dup2(fd, 2)
    _stacks_on_sigusr1(stacks)
    _leave_exit_status(stacks)
    torch.set_num_threads(1)  # OMP_NUM_THREADS=1 is read once, at torch's first parallel region


def _plan_rank(rank: int, world: int, port: int, stacks: str, plan_path: str, log_path: str,
               env: dict[str, str]) -> None:
    """One rank of launch_plan: the harness, every rank's output in the log."""
    _as_torchrun_rank(rank, world, port, env, True, log_path, stacks)
    import resume_harness

    _exit(resume_harness.main(plan_path))


def _module_rank(rank: int, world: int, port: int, stacks: str, module: str, argv: list[str], log_path: str,
                 env: dict[str, str], torchrun: bool) -> None:
    """One rank of launch_command: `python -m module *argv`."""
    _as_torchrun_rank(rank, world, port, env, torchrun, log_path if rank == 0 else f"{log_path}.rank{rank}", stacks)
    sys.argv = [module, *argv]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # as the interpreter would: a message is printed, exit status 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    _exit(code)


def train_debug(dump: Path, *overrides: str, nproc: int = 2) -> list[dict]:
    """One run of the debug config on `nproc` processes (launch_plan); rank 0's metrics.jsonl records."""
    dump.parent.mkdir(parents=True, exist_ok=True)
    launch_plan([{"train": ["--job.dump_folder", str(dump), *overrides]}], dump.parent, nproc)
    with open(dump / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]
