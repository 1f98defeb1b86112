"""[training] expandable_segments: refused against an environment that says otherwise, applied to CUDA's
caching allocator before the run's first allocation (train/machine.py)."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from torchtitan_moe.config.sections import ConfigError, allocator_problem
from torchtitan_moe.train.job_config import load_job_config

from test_config import DEBUG


@pytest.mark.parametrize("expandable, env", [
    (True, ""), (False, ""), (True, "expandable_segments:True"), (False, "max_split_size_mb:128,expandable_segments:False"),
    (True, "max_split_size_mb:128"),
])
def test_an_environment_that_agrees_or_is_silent_passes(expandable, env):
    assert allocator_problem(expandable, env) is None


def test_an_environment_that_disagrees_is_refused_naming_both(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:False")
    with pytest.raises(ConfigError) as e:
        load_job_config(["--job.config_file", str(DEBUG)])
    assert str(e.value) == ("[training] expandable_segments = true but PYTORCH_CUDA_ALLOC_CONF says "
                            "'expandable_segments:False': set one of them, or both the same")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(ConfigError, match="expandable_segments = false but"):
        load_job_config(["--job.config_file", str(DEBUG), "--training.no-expandable_segments"])


@pytest.mark.gpu
@pytest.mark.parametrize("expandable", [True, False])
def test_the_key_reaches_the_allocator(expandable):
    # A process of its own: the allocator's settings are per process.
    code = (
        "import torch\nfrom types import SimpleNamespace\nfrom torchtitan_moe.train.machine import configure_allocator\n"
        f"configure_allocator(SimpleNamespace(training=SimpleNamespace(expandable_segments={expandable})))\n"
        "x = torch.empty(64 << 20, device='cuda')\n"
        "print(sorted({s['is_expandable'] for s in torch.cuda.memory_snapshot()}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"[{expandable}]"


def test_without_cuda_nothing_is_set(monkeypatch):
    from torchtitan_moe.train import machine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", lambda s: pytest.fail(f"set {s!r}"))
    machine.configure_allocator(SimpleNamespace(training=SimpleNamespace(expandable_segments=True)))
