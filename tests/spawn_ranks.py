"""Shared by the multi-process tests: run a worker on W spawned ranks and fail with their messages.

The worker is called as worker(rank, world, port, *args, failures) and runs its checks inside
`with rank_group(rank, world, port, failures):`, which reports a failure to the parent through
`failures` (a spawned process's assertion is otherwise lost).
"""

import contextlib
import os
import socket
import traceback

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


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
        raise
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, world: int, *args) -> None:
    # SimpleQueue.put is synchronous: a worker may end with os._exit and lose nothing.
    failures = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(worker, args=(world, free_port(), *args, failures), nprocs=world)
    except Exception:
        pass
    messages = []
    while not failures.empty():
        messages.append(failures.get())
    if messages:
        pytest.fail("\n".join(messages))
