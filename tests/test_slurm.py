"""A real SLURM run on this machine (scripts/slurm_check.sh): munged, slurmctld and two slurmd from the OS
packages, `sbatch --nodes 2 scripts/slurm_train.sbatch configs/debug.toml` trains over gloo (one CPU process
per node, rendezvous at the first node's NodeAddr, node rank from SLURM_NODEID), the job ends COMPLETED with
every step of both nodes in its log, and a bad config is refused by the job in one line. It installs slurm
with apt when missing (root or passwordless sudo), so it runs only where SLURM_CHECK=1 (.ci/run sets it)."""

import os
import subprocess
import sys
import tempfile
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


_check: list = []  # [the process, its stdout file, its stderr file]


def start_slurm_check() -> list:
    """scripts/slurm_check.sh, started once. It waits on its daemons for most of its ~30 s, so conftest.py
    starts it as soon as the test below is collected: it runs beside the tests before it."""
    if not _check:
        # PYTHONPATH and the interpreter reach the job's nodes through sbatch's exported environment.
        env = dict(os.environ, PYTHON=sys.executable, STEPS="3")
        # Output to files, not pipes: a session that ends before the test reads them leaves no full pipe to block on.
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        _check.extend([subprocess.Popen(["bash", "scripts/slurm_check.sh"], cwd=REPO, env=env, stdout=out, stderr=err),
                       out, err])
    return _check


@pytest.mark.slow
@needs_slurm_check
def test_sbatch_trains_the_debug_config_on_two_nodes():
    check, out, err = start_slurm_check()
    try:
        check.wait(timeout=900)
    except subprocess.TimeoutExpired:
        check.kill()
        check.wait()
    stdout, stderr = (f.seek(0) or f.read() for f in (out, err))
    assert check.returncode == 0, stdout + stderr
    assert "trained 3 steps on n[1-2]" in stdout and "COMPLETED" in stdout, stdout
