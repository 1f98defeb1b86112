"""Shared by the multi-process tests: run a worker on W spawned ranks and fail with their messages.

The worker is called as worker(rank, world, port, *args, failures) and puts one line per
failure into `failures` (a spawned process's assertion is otherwise lost).
"""

import socket

import pytest
import torch.multiprocessing as mp


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
