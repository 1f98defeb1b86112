"""The multi-rank harness (tests/spawn_ranks.py) fails fast: ranks that raise are named with their
tracebacks, peers left waiting in a collective are killed within seconds, a collective waiting for a
peer that never comes times out, a body past its deadline is killed, and the fork server ranks come from
imported what it preloads."""

import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import spawn_ranks
from spawn_ranks import GRACE_S, rank_group, run_ranks


def exchange_worker(rank, world, port, failures):
    with rank_group(rank, world, port, failures):
        x = torch.arange(world, dtype=torch.float32) + 10 * rank
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        assert out.tolist() == [rank + 10 * r for r in range(world)], out


def raising_worker(rank, world, port, failures):
    """Ranks 2 and 3 start the second exchange and raise an IndexError before waiting for it; ranks 0 and
    1 wait in another collective, which no peer joins (gloo would wait for 30 minutes by default)."""
    with rank_group(rank, world, port, failures):
        splits = [1, 1]  # one split too few for 4 ranks: ranks 2 and 3 read past its end
        x = torch.arange(world, dtype=torch.float32)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        if rank >= 2:
            pending = dist.all_to_all_single(out, x, async_op=True)  # noqa: F841 (kept alive)
            x = x[: splits[rank]]
        dist.all_reduce(x)


def test_ranks_that_raise_mid_exchange_fail_the_test_within_seconds_naming_each_rank():
    run_ranks(exchange_worker, 4)  # a healthy body passes (and the timing below leaves out the start-up)
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        run_ranks(raising_worker, 4, deadline_s=120)
    seconds = time.monotonic() - start
    message = str(failure.value)
    for rank in (2, 3):
        assert f"rank {rank}: IndexError: list index out of range\nTraceback (most recent call last):" in message
    assert message.count("x = x[: splits[rank]]") == 2  # each rank's traceback, down to the line
    assert "killed: still running" in message  # the waiting peers (and ranks stuck in the teardown)
    assert seconds < GRACE_S + 15, seconds  # not the deadline, not gloo's timeout


def waiting_worker(rank, world, port, failures):
    spawn_ranks.PG_TIMEOUT_S = 2  # this rank process's default, as rank_group reads it
    with rank_group(rank, world, port, failures):
        if rank > 0:
            dist.barrier()
        else:
            time.sleep(3)  # in the group (its connections open), but never in the barrier


def test_a_collective_no_peer_joins_times_out():
    run_ranks(exchange_worker, 2)
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        run_ranks(waiting_worker, 2, deadline_s=120)
    message = str(failure.value)
    assert re.search(r"^rank 1: RuntimeError: \S+ Timed out waiting 2000ms", message, re.M), message
    assert "rank 0" not in message
    assert time.monotonic() - start < GRACE_S + 15


def sleeping_worker(rank, world, port, seconds, failures):
    with rank_group(rank, world, port, failures, timeout=timedelta(seconds=600)):
        time.sleep(seconds)


def test_a_body_past_its_deadline_is_killed():
    run_ranks(exchange_worker, 2)
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"ranks \[0, 1\] killed: the body's deadline of 3 s passed") as failure:
        run_ranks(sleeping_worker, 2, 60, deadline_s=3)
    assert time.monotonic() - start < 3 + 15
    for rank in (0, 1):  # where each was stuck, down to the line
        assert re.search(rf"rank {rank} was stuck in:\n(.*\n)*.*line \d+ in sleeping_worker", str(failure.value))


def test_a_fork_server_that_did_not_import_the_preload_is_an_error():
    # Python 3.11's fork server skips a preload module it cannot import without a word (each rank would then
    # pay the imports again, ~6 s of CPU): spawn_ranks checks that it imported them.
    code = ("import spawn_ranks; spawn_ranks.PRELOAD = ['no_such_module_anywhere']\n"
            "if __name__ == '__main__': spawn_ranks._context()")
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(spawn_ranks.__file__).parent, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1 and ("RuntimeError: the tests' fork server did not import ['no_such_module_anywhere'] "
                                    "(spawn_ranks.PRELOAD)") in run.stderr, run.stderr


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["--no-such-flag"], 2)])
def test_a_launch_sees_its_ranks_end_when_the_fork_server_does_not_say_so(tmp_path, monkeypatch, argv, code):
    # The fork server at times reported a rank's exit minutes after the rank had ended and been reaped: the
    # launch (launch_plan, launch_command) waited for its whole timeout. Here it reports nothing at all: the
    # launch still ends within seconds, with the exit status each rank left.
    from multiprocessing.context import ForkServerProcess

    monkeypatch.setattr(ForkServerProcess, "is_alive", lambda self: True)
    start = time.monotonic()
    got = spawn_ranks.launch_command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m",
                                      "json.tool", *argv], tmp_path / "log", timeout=120)
    assert got == int(code != 0) and time.monotonic() - start < 30
