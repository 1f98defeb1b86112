"""Test-wide setup: run Triton kernels under the interpreter where there is no GPU, and skip
the tests marked `gpu` there.

TRITON_INTERPRET must be set before any kernel module is imported, hence here. Compile caches
are off for every test.

With FAILURES_LOG=PATH each failure's report is appended to PATH as it happens, so a run that is
stopped by a time limit (a device call) still says what failed (scripts/gpu_tests.sh sets it).

Shared across the session: `debug_seed` (the debug config's seed checkpoint, written once) and
`parity_out` (a parity --out folder that already holds it).
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# No compile caches, here or in the processes tests start: a cached graph keeps an op's old
# registered backward after the op changes (a halved exchange gradient passed a compiled test).
os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
torch.compiler.config.force_disable_caches = True
# Inductor compiles in the process that traces: on 2 cores its pool of compile workers (started per
# process, each importing torch) cost more than it saved (the compiled parity test 37-43 s, not 41-51 s).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_collection_modifyitems(items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    path = os.environ.get("FAILURES_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")


@pytest.fixture(scope="session")
def debug_seed(tmp_path_factory) -> Path:
    """The debug config's seed checkpoint as parity writes it (a folder seed-<key> holding
    checkpoint/step-0 and model_args.json), written once per session by one process."""
    from torchtitan_moe.tools import parity

    config = str(Path(__file__).resolve().parents[1] / "configs" / "debug.toml")
    return parity.seed_checkpoint(config, tmp_path_factory.mktemp("seed"), ["--dispatch.backend", "auto"]).parents[1]


@pytest.fixture
def parity_out(tmp_path, debug_seed) -> Path:
    """A parity --out folder holding the session's debug seed checkpoint: parity.main reuses it for
    every setting whose model args are the debug config's (another model gets a seed of its own)."""
    (tmp_path / debug_seed.name).symlink_to(debug_seed, target_is_directory=True)
    return tmp_path
