"""A real SLURM run on this machine (scripts/slurm_check.sh): munged, slurmctld and two slurmd from the OS
packages, `sbatch --nodes 2 scripts/slurm_train.sbatch configs/debug.toml` trains over gloo (one CPU process
per node, rendezvous at the first node's NodeAddr, node rank from SLURM_NODEID), the job ends COMPLETED with
every step of both nodes in its log, and a bad config is refused by the job in one line. It installs slurm
with apt when missing (root or passwordless sudo), so it runs only where SLURM_CHECK=1 (.ci/run sets it)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

needs_slurm_check = pytest.mark.skipif(
    os.environ.get("SLURM_CHECK") != "1",
    reason="SLURM_CHECK=1 runs the real SLURM run (installs slurm and munge with apt; ~1-2 min)")


@pytest.mark.parametrize("nproc", ["x", "0", "2.5"])
def test_a_bad_process_count_per_node_is_one_line_before_slurm_is_asked(nproc):
    env = dict(os.environ, NPROC_PER_NODE=nproc, SLURM_NNODES="2", SLURM_JOB_NODELIST="n[1-2]")
    run = subprocess.run(["bash", "scripts/slurm_train.sbatch", "configs/debug.toml"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
    assert run.stderr.splitlines() == [f"config error: processes per node = '{nproc}' (NPROC_PER_NODE, else "
                                       "SLURM_GPUS_ON_NODE): must be a whole number >= 1"]


def start_slurm_check() -> None:
    """scripts/slurm_check.sh, started once a session into $SLURM_CHECK_DIR (its stdout, stderr, pid, and its
    exit status once it ends). It waits on its daemons for most of its ~30 s, so conftest.py starts it as
    soon as the test below is collected, from the session's main process (under pytest-xdist, its
    controller): it runs beside the tests before it, and the test may run in any worker."""
    folder = Path(os.environ["SLURM_CHECK_DIR"])
    try:
        (folder / "pid").open("x").close()  # the first caller starts it
    except FileExistsError:
        return
    # PYTHONPATH and the interpreter reach the job's nodes through sbatch's exported environment.
    env = dict(os.environ, PYTHON=sys.executable, STEPS="3")
    check = subprocess.Popen(["bash", "-c", 'bash scripts/slurm_check.sh > "$0/out" 2> "$0/err"; echo $? > "$0/rc~"; mv "$0/rc~" "$0/rc"',
                              str(folder)], cwd=REPO, env=env, start_new_session=True)
    (folder / "pid").write_text(str(check.pid))


@pytest.mark.slow
@needs_slurm_check
def test_sbatch_trains_the_debug_config_on_two_nodes():
    start_slurm_check()
    folder = Path(os.environ["SLURM_CHECK_DIR"])
    deadline = time.monotonic() + 900
    while not (folder / "rc").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    if not (folder / "rc").exists():
        os.killpg(int((folder / "pid").read_text()), signal.SIGKILL)
    stdout, stderr = (folder / "out").read_text(), (folder / "err").read_text()
    assert (folder / "rc").exists() and (folder / "rc").read_text().strip() == "0", stdout + stderr
    assert "trained 3 steps on n[1-2]" in stdout and "COMPLETED" in stdout, stdout
