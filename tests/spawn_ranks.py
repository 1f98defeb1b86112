"""Shared by the multi-process tests: run a worker on W spawned ranks and fail with their messages;
run several training runs of the debug config in one torchrun launch (`torchrun_plan`).

The worker is called as worker(rank, world, port, *args, failures) and runs its checks inside
`with rank_group(rank, world, port, failures):`, which reports a failure to the parent through
`failures` (a spawned process's assertion is otherwise lost).
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing import connection as mp_connection


@contextlib.contextmanager
def rank_group(rank: int, world: int, port: int, failures, backend: str = "gloo", **init_kwargs):
    """This process's default group for the block; an exception there goes to the parent (with its
    traceback) and is raised again; the group is destroyed either way."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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


class _Pool:
    """`world` spawned processes, process r running each body it is sent as rank r. The start-up
    (a process, torch and the test module imported) is paid once per test module and world size,
    not once per test; a process that ends (os._exit) is started again for the next body."""

    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.failures = ctx.SimpleQueue()
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, child, self.failures), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, worker, world: int, args: tuple) -> bool:
        """Run worker(rank, world, port, *args, failures) on every rank; False if a process ended
        (its exit code, when not 0, is a failure; ranks still running a minute later are killed)."""
        job = (worker, world, free_port(), args, list(sys.path), dict(os.environ))
        for conn in self.conns:
            conn.send(job)
        pending = dict(enumerate(self.conns))
        ended = []
        while pending:
            waits = [*pending.values(), *(self.procs[r].sentinel for r in pending)]
            if not mp_connection.wait(waits, timeout=60 if ended else None):
                self.failures.put(f"ranks {sorted(pending)} still running a minute after rank(s) {ended} ended")
                return False
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
                        self.failures.put(f"rank {rank}: the process ended with exit code {proc.exitcode}")
        return not ended

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            with contextlib.suppress(OSError):
                conn.send(None)
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def _serve(rank: int, conn, failures) -> None:
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
        finally:
            import torch._dynamo

            torch._dynamo.reset()  # no compiled graph carried into the next body
        conn.send(True)


_pools: dict[int, _Pool] = {}
_pools_module: list[str] = [""]


def run_ranks(worker, world: int, *args) -> None:
    """Run worker(rank, world, port, *args, failures) on `world` ranks and fail with their messages.
    The processes are kept for the next call from the same test module (so one module's bodies may
    share a process's imports and module state, never another module's)."""
    if _pools_module[0] != worker.__module__:
        for pool in _pools.values():
            pool.close()
        _pools.clear()
        _pools_module[0] = worker.__module__
    pool = _pools.get(world) or _pools.setdefault(world, _Pool(world))
    if not pool.run(worker, world, args):
        pool.close()
        del _pools[world]
    messages = []
    while not pool.failures.empty():
        messages.append(pool.failures.get())
    if messages:
        pytest.fail("\n".join(messages))

ROOT = Path(__file__).resolve().parents[1]


def torchrun_env() -> dict[str, str]:
    """Training processes run the kernels' torch paths (no Triton interpreter), one thread each."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def torchrun_plan(plan: list[dict], folder: Path, nproc: int = 2, timeout: int = 600) -> None:
    """Run tests/resume_harness.py's operations (training runs, copies, ...) in ONE torchrun launch of
    `nproc` processes: the start-up (imports, process group) is paid once, not once per run. The
    launch's output is in folder/harness.log; a failed launch fails the test with its tail."""
    (folder / "plan.json").write_text(json.dumps(plan))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "tests" / "resume_harness.py"), str(folder / "plan.json")]
    result = subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=timeout)
    (folder / "harness.log").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def train_debug(dump: Path, *overrides: str, nproc: int = 2) -> list[dict]:
    """One run of the debug config on `nproc` processes (torchrun_plan); rank 0's metrics.jsonl records."""
    dump.parent.mkdir(parents=True, exist_ok=True)
    torchrun_plan([{"train": ["--job.dump_folder", str(dump), *overrides]}], dump.parent, nproc)
    with open(dump / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]
