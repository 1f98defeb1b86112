"""What stops a run, piece by piece (docs/failures.md): checksummed checkpoints, [training] on_nonfinite and
the save guard, the run folder's lock, the hang watchdog, training processes dying with their launcher.
In-process and seconds, but for one launch (`slow`) that kills a real launcher. The refusals' one lines are
tests/test_bad_inputs.py's; a diverged 2-process run is in tests/test_train_cpu.py's shared launch."""

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from spawn_ranks import rank_group, run_ranks, torchrun_env

from torchtitan_moe.train import checksums, divergence, run_folder, watchdog
from torchtitan_moe.train.checksums import ChecksummedWriter, checksum_problem
from torchtitan_moe.train.divergence import NONE, NonFiniteError, NonFiniteWatch

ROOT = Path(__file__).resolve().parents[1]


# -- checksums ---------------------------------------------------------------------------------------------


def test_a_corrupt_chunk_is_found_by_the_rank_that_hashes_it(tmp_path, monkeypatch):
    monkeypatch.setattr(checksums, "CHUNK_BYTES", 4096)  # a few chunks a file
    dcp.save({"w": torch.arange(4096, dtype=torch.float32)}, storage_writer=ChecksummedWriter(str(tmp_path)),
             no_dist=True)
    manifest = json.loads((tmp_path / "checksums.json").read_text())
    assert manifest["chunk_bytes"] == 4096 and len(manifest["files"]["__0_0.distcp"]["chunks"]) >= 4
    assert checksum_problem(str(tmp_path)) is None
    data = bytearray((tmp_path / "__0_0.distcp").read_bytes())
    data[5000] ^= 1  # one bit of the second chunk
    (tmp_path / "__0_0.distcp").write_bytes(bytes(data))
    problem = checksum_problem(str(tmp_path))
    assert problem.endswith("__0_0.distcp is corrupt: its bytes 4,096..8,192 do not match the checksum written when "
                            "it was saved (checksums.json)")
    assert checksum_problem(str(tmp_path), rank=0, world=2) is None  # chunk 1 is rank 1's to hash
    assert checksum_problem(str(tmp_path), rank=1, world=2) == problem


def checksum_worker(rank, world, port, folder, failures):
    from torchtitan_moe.train.checkpoint import CheckpointError, check_checksums

    with rank_group(rank, world, port, failures):
        with pytest.raises(CheckpointError, match="__0_0.distcp is corrupt: its bytes 4,096..8,192"):
            check_checksums(folder, split_over_ranks=True)


def test_every_rank_refuses_the_chunk_one_rank_found_corrupt(tmp_path, monkeypatch):
    monkeypatch.setattr(checksums, "CHUNK_BYTES", 4096)
    dcp.save({"w": torch.arange(4096, dtype=torch.float32)}, storage_writer=ChecksummedWriter(str(tmp_path)),
             no_dist=True)
    data = bytearray((tmp_path / "__0_0.distcp").read_bytes())
    data[5000] ^= 1  # chunk 1: rank 1 of 2 hashes it
    (tmp_path / "__0_0.distcp").write_bytes(bytes(data))
    run_ranks(checksum_worker, 2, str(tmp_path))


def test_torchtitans_saves_write_checksums_once_routed(tmp_path):
    import torchtitan.components.checkpoint as torchtitan_checkpoint

    from torchtitan_moe.compat.torchtitan import route_checkpoint_saves

    route_checkpoint_saves(ChecksummedWriter)
    route_checkpoint_saves(ChecksummedWriter)  # twice: still one writer, not a writer around a writer
    torchtitan_checkpoint.dcp.save({"w": torch.ones(8)}, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    assert sorted(p.name for p in (tmp_path / "step-1").iterdir()) == [".metadata", "__0_0.distcp", "checksums.json"]
    assert checksum_problem(str(tmp_path / "step-1")) is None


# -- [training] on_nonfinite and the save guard -------------------------------------------------------------


def test_stop_keeps_the_first_bad_step_on_the_device_and_stops_naming_it(tmp_path):
    watch = NonFiniteWatch("stop", torch.device("cpu"))
    finite, nan, inf = torch.tensor(1.0), torch.tensor(math.nan), torch.tensor(math.inf)
    for step, loss, norm in [(5, finite, finite), (6, finite, inf), (7, nan, nan), (8, finite, finite)]:
        assert watch.allows_update(step, loss, norm)  # "stop" never skips: it stops at the next read
    assert int(watch.first) == 6 * 4 + 2  # step 6, the gradient norm
    (tmp_path / "checkpoint" / "step-4").mkdir(parents=True)
    (tmp_path / "checkpoint" / "step-4" / ".metadata").write_bytes(b"")
    with pytest.raises(NonFiniteError) as stopped:
        watch.check(int(watch.first), str(tmp_path / "checkpoint"))
    assert str(stopped.value).startswith("step 6: the gradient norm is not finite: training diverged; nothing was "
                                         "saved from step 6 on; the last good checkpoint is step 4 (")
    watch.check(NONE, str(tmp_path))  # every step finite: no stop


@pytest.mark.parametrize("loss, norm, allowed", [(1.0, 1.0, True), (math.nan, 1.0, False), (1.0, math.inf, False),
                                                 (math.nan, math.nan, False)])
def test_skip_step_skips_an_update_whose_loss_or_gradient_norm_is_not_finite(loss, norm, allowed):
    watch = NonFiniteWatch("skip_step", torch.device("cpu"))
    assert watch.allows_update(3, torch.tensor(loss), torch.tensor(norm)) is allowed
    assert NonFiniteWatch("warn", torch.device("cpu")).allows_update(3, torch.tensor(loss), torch.tensor(norm))
    watch.check(3 * 4 + 1, None)  # only "stop" stops


def test_skip_step_stops_the_run_after_max_skipped_steps_in_a_row():
    watch = NonFiniteWatch("skip_step", torch.device("cpu"), max_skipped=3)
    finite, nan = torch.tensor(1.0), torch.tensor(math.nan)
    # Two bad steps, a good one (the count starts over), two bad ones: never three in a row.
    for step, loss in enumerate([nan, nan, finite, nan, nan], start=1):
        assert watch.allows_update(step, loss, finite) is (loss is finite)
    with pytest.raises(NonFiniteError) as stopped:
        watch.allows_update(6, nan, finite)
    assert str(stopped.value).startswith("step 6: the loss is not finite, 3 steps in a row skipped: training diverged")
    assert "[training] max_skipped_steps = 3" in str(stopped.value)


def fake_trainer(tmp_path, mode="warn", poison=None):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    if poison == "weight":
        model[1].weight.data[0, 1] = math.inf
    if poison == "moment":
        optimizer.state[model[0].bias]["exp_avg_sq"][2] = math.nan
    checkpointer = SimpleNamespace(folder=str(tmp_path), enable=True)
    return SimpleNamespace(model_parts=[model], optimizers=SimpleNamespace(optimizers=[optimizer]),
                           nonfinite=NonFiniteWatch(mode, torch.device("cpu")), checkpointer=checkpointer)


@pytest.mark.parametrize("poison, named", [("weight", "1.weight on this rank"),
                                           ("moment", "optimizer state exp_avg_sq of 0.bias on this rank")])
def test_a_save_from_nonfinite_weights_or_moments_is_refused_naming_the_tensor(tmp_path, poison, named):
    divergence.check_before_save(fake_trainer(tmp_path), 10)  # healthy: saved
    with pytest.raises(NonFiniteError) as refused:
        divergence.check_before_save(fake_trainer(tmp_path, poison=poison), 10)
    assert str(refused.value).startswith(f"step 10: not saved: {named} holds a NaN or inf; no checkpoint was saved")


def test_a_stop_not_yet_read_back_is_found_before_the_save(tmp_path):
    trainer = fake_trainer(tmp_path, mode="stop")
    trainer.nonfinite.allows_update(9, torch.tensor(math.nan), torch.tensor(1.0))
    with pytest.raises(NonFiniteError, match="^step 9: the loss is not finite"):
        divergence.check_before_save(trainer, 10)


def test_a_save_that_fails_while_writing_is_one_line_with_the_space_left(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    from torchtitan_moe.train.checkpoint import CheckpointError, saving

    full = OSError(28, "No space left on device")
    with pytest.raises(CheckpointError) as failed:
        with saving(str(tmp_path), 40):
            raise CheckpointException("save failed", {1: (full, None), 0: (full, None)})
    line = str(failed.value)
    assert line.startswith(f"saving step 40 into {tmp_path} failed (OSError: [Errno 28] No space left on device); ")
    assert " GiB free on its disk; the step folder left has no .metadata, so a resume skips it" in line
    assert "\n" not in line
    with pytest.raises(KeyError):  # not an I/O failure: left as it is
        with saving(str(tmp_path), 40):
            raise KeyError("x")


# -- one writer per run folder ------------------------------------------------------------------------------


def test_a_held_folder_is_refused_and_a_dead_runs_lock_taken_over(tmp_path):
    lock = run_folder.RunFolderLock(str(tmp_path))
    lock.acquire()
    holder = json.loads((tmp_path / "run.lock").read_text())
    assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
    with pytest.raises(run_folder.RunFolderBusy, match=f"in use by another run \\(host {socket.gethostname()} pid "
                                                         f"{os.getpid()}, since "):
        run_folder.RunFolderLock(str(tmp_path)).acquire()
    lock.release()
    assert not (tmp_path / "run.lock").exists()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
    assert run_folder.why_stale(str(tmp_path), run_folder.holder_of(str(tmp_path))) == f"no process {dead.pid} on this host"
    taker = run_folder.RunFolderLock(str(tmp_path))
    taker.acquire()
    assert run_folder.holder_of(str(tmp_path))["pid"] == os.getpid()
    taker.release()


def test_a_lock_of_another_host_is_stale_once_its_heartbeat_stops(tmp_path):
    (tmp_path / "run.lock").write_text(json.dumps({"host": "node-9", "pid": 1}))
    assert run_folder.why_stale(str(tmp_path), run_folder.holder_of(str(tmp_path))) is None  # touched just now
    old = time.time() - run_folder.STALE_SECONDS - 5
    os.utime(tmp_path / "run.lock", (old, old))
    assert run_folder.why_stale(str(tmp_path), run_folder.holder_of(str(tmp_path))).startswith("not touched for")
    # this process's own lock, by a pid reused since: another start time
    (tmp_path / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "1"}))
    assert run_folder.why_stale(str(tmp_path), run_folder.holder_of(str(tmp_path))) is not None


# -- the hang watchdog --------------------------------------------------------------------------------------


def waits_in_a_collective(seconds: float) -> None:
    time.sleep(seconds)


def test_a_hang_is_one_line_naming_where_the_rank_waits_with_its_stack_on_disk(tmp_path):
    lines = []
    dog = watchdog.HangWatchdog(str(tmp_path), 0, 1, lambda: 0.5, on_hang=lines.append).start()
    dog.beat("step 3")
    waits_in_a_collective(2.0)
    dog.close()
    assert len(lines) == 1
    assert lines[0].startswith("hang: no progress for ") and " s during step 3; " in lines[0]
    assert "rank 0 waits in waits_in_a_collective (test_failures.py:" in lines[0]
    assert lines[0].endswith(f"every rank's stack: {tmp_path / 'hang'}{os.sep}")
    stack = (tmp_path / "hang" / "rank-0.txt").read_text()
    assert stack.startswith("waits_in_a_collective (test_failures.py:") and "Thread 0x" in stack
    assert "\nChild processes (data workers):\n" in stack


def test_a_hang_s_dump_names_the_rank_s_child_processes_and_where_they_wait(tmp_path):
    # a data worker's Python stack cannot be asked for: /proc gives its state and where in the kernel it waits
    child = subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait(30)"])
    try:
        time.sleep(1.0)  # in its wait by now
        dog = watchdog.HangWatchdog(str(tmp_path), 0, 1, lambda: 0.5, on_hang=lambda line: None).start()
        waits_in_a_collective(1.5)
        dog.close()
        stack = (tmp_path / "hang" / "rank-0.txt").read_text()
        children = stack.split("Child processes (data workers):\n")[1].splitlines()
        mine = [c for c in children if c.startswith(f"pid {child.pid} (")]
        assert len(mine) == 1 and ": state S, waits in " in mine[0], children
        assert mine[0].endswith("import threading; threading.Event().wait(30)"), mine
    finally:
        child.kill()
        child.wait()


def test_a_watchdog_that_hears_of_progress_stays_quiet(tmp_path):
    lines = []
    dog = watchdog.HangWatchdog(str(tmp_path), 0, 1, lambda: 0.6, on_hang=lines.append).start()
    for step in range(8):
        dog.beat(f"step {step}")
        time.sleep(0.15)
    dog.close()
    assert lines == [] and not (tmp_path / "hang").exists()


def hang_worker(rank, world, port, folder, failures):
    with rank_group(rank, world, port, failures):
        lines = []
        dog = watchdog.HangWatchdog(folder, rank, world, lambda: 1.0, on_hang=lines.append).start()
        if rank == 1:
            waits_in_a_collective(4.0)  # the stuck rank; rank 0 waits for it in the all-reduce
        dist.all_reduce(torch.ones(1))
        dog.close()
        if rank == 0:
            assert len(lines) == 1, lines
            assert "rank 0 waits in " in lines[0] and "all_reduce" in lines[0], lines[0]
            assert "rank 1 waits in waits_in_a_collective (test_failures.py:" in lines[0], lines[0]
            assert sorted(os.listdir(os.path.join(folder, "hang"))) == ["rank-0.txt", "rank-1.txt"]


def test_every_ranks_place_is_in_rank_0s_line(tmp_path):
    run_ranks(hang_worker, 2, str(tmp_path))


def test_ranks_are_named_in_ranges():
    assert watchdog.ranges([0, 2, 3, 4, 7]) == "0, 2-4, 7"
    where = {0: "all_reduce (c10d.py:1)", 2: "all_reduce (c10d.py:1)", 1: "next (text.py:8)"}
    assert watchdog.summary(where, 4) == ("ranks 0, 2 wait in all_reduce (c10d.py:1); rank 1 waits in next (text.py:8); "
                                          "no stack yet from rank 3")


# -- training processes die with their launcher ------------------------------------------------------------

LAUNCHER = """
import os, subprocess, sys, time
env = dict(os.environ, TORCHELASTIC_RUN_ID="test", TORCHTITAN_MOE_LAUNCHER_PID=str(os.getpid()))
child = subprocess.Popen([sys.executable, "-c", "from torchtitan_moe.train.launch import die_with_launcher; "
                          "die_with_launcher(); import time; print('ready', flush=True); time.sleep(60)"],
                         env=env, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "ready\\n"
print(child.pid, flush=True)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux parent-death signal")
def test_a_training_process_dies_with_its_launcher():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    child = int(launcher.stdout.readline())
    assert alive(child)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), "the training process outlived its launcher"


def children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError):  # a process that ended meanwhile
            pass
    return found


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() or not sys.platform.startswith("linux"), reason="CPU/gloo launch")
def test_killing_the_launcher_alone_stops_its_run_and_a_second_run_is_refused_meanwhile(tmp_path):
    """scripts/train.sh trains 2 processes; a second launch on its folder (the launcher directly, past the
    config check) is refused by its rank 0 in one line naming the holder, no launcher report; SIGKILL to the
    first launcher alone then takes its training processes with it."""
    env = {**torchrun_env(), "PYTHON": sys.executable, "NPROC": "2"}
    dump = tmp_path / "run"
    first = subprocess.Popen(["bash", "scripts/train.sh", "configs/debug.toml", "--job.dump_folder", str(dump),
                              "--training.steps", "10000", "--training.seq_len", "32", "--training.local_batch_size",
                              "1"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (dump / "run.lock").exists() or len(children(first.pid)) < 2:
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.1)
        workers = children(first.pid)
        holder = json.loads((dump / "run.lock").read_text())
        for pid in workers:  # paused while the second launch starts: 2 cores for 4 processes, otherwise
            os.kill(pid, signal.SIGSTOP)
        second = subprocess.run([sys.executable, "-m", "torchtitan_moe.train.launch", "--standalone",
                                 "--nproc_per_node", "2", "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
                                 "-m", "torchtitan_moe.train", "--job.config_file", "configs/debug.toml",
                                 "--job.dump_folder", str(dump)], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=300)
        said = [line for line in (second.stdout + second.stderr).splitlines() if "error" in line or "train:" in line]
        assert second.returncode == 2, second.stderr[-3000:]
        assert said == [f"[rank0]:config error: {dump} is in use by another run (host {holder['host']} pid "
                        f"{holder['pid']}, since {holder['since']}): one run writes a folder at a time; wait for it, "
                        "stop it, or pick another --job.dump_folder"], said
        assert "Traceback" not in second.stderr and "ChildFailedError" not in second.stderr
        for pid in workers:  # training again when their launcher dies
            os.kill(pid, signal.SIGCONT)
        first.send_signal(signal.SIGKILL)
        first.wait()
        deadline = time.monotonic() + 10
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(w) for w in workers), "training processes outlived their launcher"
    finally:
        for pid in [first.pid, *children(first.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
