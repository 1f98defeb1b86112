"""End to end on the CPU: 2 processes over gloo train the debug config; resume is exact."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DEBUG = ROOT / "configs" / "debug.toml"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo path; GPU runs are in the GPU worklogs")


def train(dump: Path, *overrides: str, nproc: int = 2, timeout: int = 600) -> list[dict]:
    """torchrun the debug config; returns rank 0's metrics.jsonl records."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "torchtitan_moe.train", "--job.config_file", str(DEBUG),
        "--job.dump_folder", str(dump), "--metrics.disable_color_printing", *overrides,
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    with open(dump / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_two_process_debug_run_learns(tmp_path):
    records = train(tmp_path / "run", "--training.steps", "30")
    losses = [r["loss"] for r in records]
    assert [r["step"] for r in records] == list(range(1, 31))
    assert losses[0] > 0.9 * math.log(2048)  # starts near uniform over the vocabulary
    assert losses[-1] < 0.6 * losses[0]  # and learns the stream's structure
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in records)
    last = records[-1]
    assert last["throughput(tps)"] > 0 and last["memory/max_reserved(GiB)"] > 0
    loads = last["moe/tokens_per_expert"]
    assert len(loads) == 4 and all(sum(layer) == 2 * 8 * 128 * 2 for layer in loads)  # ranks x batch x seq x top-k


@pytest.mark.slow
def test_checkpoint_resume_gives_identical_losses(tmp_path):
    full = tmp_path / "full"
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "5", "--training.steps", "10"]
    reference = train(full, *ckpt)
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(full / "checkpoint" / "step-5", resumed_dir / "checkpoint" / "step-5")
    resumed = train(resumed_dir, *ckpt)
    assert [r["step"] for r in resumed] == [6, 7, 8, 9, 10]
    for a, b in zip(reference[5:], resumed):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a["step"], a["loss"], b["loss"])


@pytest.mark.slow
def test_expert_parallel_bf16_mixed_precision(tmp_path):
    # bf16 parameters under EP: the experts' FSDP group must leave the fp32 probs alone.
    records = train(tmp_path / "run", "--training.steps", "4", "--parallelism.expert_parallel_degree", "2",
                    "--training.mixed_precision_param", "bfloat16")
    assert len(records) == 4 and records[-1]["loss"] < records[0]["loss"]


@pytest.mark.slow
def test_router_recipe_terms_are_logged_each_on_its_own(tmp_path):
    # Global-batch balance loss and z-loss under EP = 2 and 2 micro-batches per step.
    records = train(tmp_path / "run", "--training.steps", "3", "--parallelism.expert_parallel_degree", "2",
                    "--training.global_batch_size", "32", "--router.balance_loss", "global_batch",
                    "--router.balance_loss_coeff", "0.01", "--router.z_loss_coeff", "0.001")
    for r in records:
        balance, z = r["moe/balance_loss_per_layer"], r["moe/z_loss_per_layer"]
        assert len(balance) == len(z) == 4
        assert r["moe/balance_loss"] == pytest.approx(sum(balance) / 4)
        assert r["moe/aux_loss"] == pytest.approx(0.01 * r["moe/balance_loss"] + 0.001 * r["moe/z_loss"])
        assert 0.9 < r["moe/balance_loss"] < 1.5 and 0 < r["moe/z_loss"] < 20  # (ln 8)^2 = 4.3 for small logits
        assert all(sum(layer) == 2 * 2 * 8 * 128 * 2 for layer in r["moe/tokens_per_expert"])  # counted once
