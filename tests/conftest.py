"""Test-wide setup: run Triton kernels under the interpreter where there is no GPU, and skip
the tests marked `gpu` there.

TRITON_INTERPRET must be set before any kernel module is imported, hence here. Compile caches
are off for every test.

With FAILURES_LOG=PATH each failure's report is appended to PATH as it happens, so a run that is
stopped by a time limit (a device call) still says what failed (scripts/gpu_tests.sh sets it).

Shared across the session: `debug_seed` (the debug config's seed checkpoint, written once) and
`parity_out` (a parity --out folder that already holds it).
"""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# No graph caches, here or in the processes tests start: a cached graph keeps an op's old registered
# backward after the op changes (a halved exchange gradient passed a compiled test), and a profile of
# earlier compiles would change what a later test compiles. Inductor's kernels are keyed by their
# generated source, so they share one cache for the session (fresh each session, removed at its end):
# compiled once, not once per rank and per test (a C++ build is seconds on the CPU); pytest-xdist's workers
# inherit their controller's.
os.environ.update(TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0",
                  TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO="0", TORCH_DYNAMO_AUTOMATIC_DYNAMIC_REMOTE_PGO="0")
os.environ.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchinductor-tests-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
# Inductor compiles in the process that traces: on 2 cores its pool of compile workers (started per
# process, each importing torch) cost more than it saved (the compiled parity test 37-43 s, not 41-51 s).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
import torch._dynamo.config  # noqa: E402  (after the environment: inductor's config reads it once)
import torch._functorch.config  # noqa: E402
import torch._inductor.config  # noqa: E402

torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False
torch._dynamo.config.automatic_dynamic_local_pgo = False


def pytest_collection_modifyitems(items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    # The real SLURM job's folder (tests/test_slurm.py), made before pytest-xdist's workers start: they
    # inherit this environment.
    if os.environ.get("SLURM_CHECK") == "1" and "SLURM_CHECK_DIR" not in os.environ:
        os.environ["SLURM_CHECK_DIR"] = tempfile.mkdtemp(prefix="slurm-check-")
        atexit.register(shutil.rmtree, os.environ["SLURM_CHECK_DIR"], ignore_errors=True)


def _start_slurm_check(nodeids) -> None:
    # The real SLURM job waits on its daemons most of the time: started once its test is collected, it runs
    # beside the tests before it (the kernel tests, which leave a core idle).
    if os.environ.get("SLURM_CHECK") == "1" and any(i.endswith("::test_sbatch_trains_the_debug_config_on_two_nodes")
                                                    for i in nodeids):
        from test_slurm import start_slurm_check

        start_slurm_check()


def pytest_collection_finish(session):
    # (Under pytest-xdist the controller starts it, once: below.)
    if not hasattr(session.config, "workerinput"):
        _start_slurm_check(item.nodeid for item in session.items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    _start_slurm_check(ids)


def pytest_runtest_logreport(report):
    path = os.environ.get("FAILURES_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")


@pytest.fixture
def forked_launches(monkeypatch) -> None:
    """The tools' launches in this test (tools/parity.py's run_logged: parity's and bench_train's runs) on
    ranks forked from the session's fork server (spawn_ranks.launch_command), not on the fresh interpreters
    torchrun starts (~6 s of CPU a rank to import torch and torchtitan). Real torchrun launches of the tools
    stay in test_all_gather.py and test_bench_train.py."""
    from spawn_ranks import launch_command

    from torchtitan_moe.tools import parity

    monkeypatch.setattr(parity, "run_logged", launch_command)


@pytest.fixture(scope="session")
def debug_seed(tmp_path_factory) -> Path:
    """The debug config's seed checkpoint as parity writes it (a folder seed-<key> holding
    checkpoint/step-0 and model_args.json), written once per session (a pytest-xdist worker) by one process
    forked as `forked_launches` forks them."""
    from spawn_ranks import launch_command

    from torchtitan_moe.tools import parity

    config = str(Path(__file__).resolve().parents[1] / "configs" / "debug.toml")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(parity, "run_logged", launch_command)
        return parity.seed_checkpoint(config, tmp_path_factory.mktemp("seed"), ["--dispatch.backend", "auto"]).parents[1]


@pytest.fixture
def parity_out(tmp_path, debug_seed) -> Path:
    """A parity --out folder holding the session's debug seed checkpoint: parity.main reuses it for
    every setting whose model args are the debug config's (another model gets a seed of its own)."""
    (tmp_path / debug_seed.name).symlink_to(debug_seed, target_is_directory=True)
    return tmp_path
