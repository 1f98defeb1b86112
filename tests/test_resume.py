"""Resuming on the CPU (gloo): a finished run extended, a killed run resumed, other EP degrees and
world sizes, Hugging Face weights in and out under EP. Losses are compared step by step.

The runs are the debug model at 2 x 64 tokens per rank, with a learning rate that is constant after
warmup (decay_ratio 0), so a 4-step run extended to 6 steps is the same run as a 6-step one.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from spawn_ranks import torchrun_env, launch_plan

ROOT = Path(__file__).resolve().parents[1]
DEBUG = ROOT / "configs" / "debug.toml"
COMMON = [
    "--training.local_batch_size", "2", "--training.seq_len", "64", "--lr_scheduler.warmup_steps", "2",
    "--lr_scheduler.decay_ratio", "0", "--checks.router_init", "off", "--checkpoint.enable",
    "--checkpoint.interval", "2",
]

DOCS = [str(ROOT / "README.md"), str(ROOT / "tests" / "README.md"), str(ROOT / "docs")]


def shards(folder: str) -> list[str]:
    return ["--training.dataset", "shards", "--training.dataset_path", folder, "--data.attention", "document"]


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo path; GPU runs are in the GPU worklogs"),
]


def records(dump: Path) -> list[dict]:
    """metrics.jsonl's complete lines (a line being written, or cut by a kill, is left out)."""
    with open(dump / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def by_step(recs: list[dict]) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in recs}


def assert_close(a: dict, b: dict, steps, rtol: float) -> None:
    for step in steps:
        for x, y, what in zip(a[step], b[step], ("loss", "grad_norm")):
            assert abs(x - y) <= rtol * abs(y), (step, what, x, y)


def train_cmd(dump: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "torchtitan_moe.train", "--job.config_file", str(DEBUG),
            "--job.dump_folder", str(dump), "--metrics.disable_color_printing", *COMMON, *overrides]


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> Path:
    """One process trains 8 steps, checkpointing every 2; SIGKILL lands in step 6 (after step 5 is
    logged); the same command then runs again in the same folder and finishes."""
    dump = tmp_path_factory.mktemp("killed")
    proc = subprocess.Popen(train_cmd(dump, "--training.steps", "8"), cwd=ROOT, env=torchrun_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not ((dump / "metrics.jsonl").exists() and any(r["step"] >= 5 for r in records(dump))):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 5"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    logged = "".join(json.dumps(r) + "\n" for r in records(dump))  # without a line the kill may have cut
    (dump / "metrics.jsonl").write_text(logged)
    (dump / "killed.jsonl").write_text(logged)
    # What a kill during a save leaves: data files, no .metadata (DCP writes it last).
    steps = dump / "checkpoint"
    newest = max(int(p.name.split("-")[1]) for p in steps.iterdir() if (p / ".metadata").exists())
    partial = steps / f"step-{newest + 2}"
    if not partial.exists():
        partial.mkdir()
        shutil.copy(steps / f"step-{newest}" / "__0_0.distcp", partial)
    result = subprocess.run(train_cmd(dump, "--training.steps", "8"), cwd=ROOT, env=torchrun_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (dump / "resume.log").write_text(result.stdout + result.stderr)
    return dump


def test_killed_run_resumes_from_last_complete_checkpoint_losing_nothing(killed_run):
    killed = by_step(records(killed_run)[: len((killed_run / "killed.jsonl").read_text().splitlines())])
    resumed = by_step(records(killed_run)[len(killed):])
    log = (killed_run / "resume.log").read_text()
    first = min(resumed)
    assert first % 2 == 1 and first <= max(killed) + 1  # right after the newest complete checkpoint
    assert f"step-{first + 1} is incomplete" in log  # the partial save was skipped, with a warning
    assert sorted(resumed) == list(range(first, 9))
    for step in set(killed) & set(resumed):  # the steps done again are the same steps
        assert killed[step] == resumed[step], (step, killed[step], resumed[step])


@pytest.fixture(scope="module")
def harness(tmp_path_factory, killed_run) -> Path:
    """Every 2-process run of the tests below, in one torchrun launch (tests/resume_harness.py)."""
    d = tmp_path_factory.mktemp("runs")
    ck = "checkpoint"
    plan = [
        {"train": ["--job.dump_folder", f"{d}/ref", "--training.steps", "6"]},
        # A finished 4-step run, then the same command with 6 steps.
        {"train": ["--job.dump_folder", f"{d}/ext", "--training.steps", "4"]},
        {"train": ["--job.dump_folder", f"{d}/ext", "--training.steps", "6"]},
        # EP = 1 -> 2 from ref's step 4; then EP = 2 -> 2 and 2 -> 1 from that run's step 6.
        {"copy": [f"{d}/ref/{ck}/step-4", f"{d}/ep12/{ck}/step-4"]},
        {"train": ["--job.dump_folder", f"{d}/ep12", "--training.steps", "6",
                   "--parallelism.expert_parallel_degree", "2"]},
        {"copy": [f"{d}/ep12/{ck}/step-6", f"{d}/ep22/{ck}/step-6"]},
        {"train": ["--job.dump_folder", f"{d}/ep22", "--training.steps", "8",
                   "--parallelism.expert_parallel_degree", "2"]},
        {"copy": [f"{d}/ep12/{ck}/step-6", f"{d}/ep21/{ck}/step-6"]},
        {"train": ["--job.dump_folder", f"{d}/ep21", "--training.steps", "8"]},
        # World size 1 -> 2: refused for the data position, then resumed with the data restarted.
        {"copy": [f"{killed_run}/{ck}/step-8", f"{d}/world/{ck}/step-8"]},
        {"refused": ["--job.dump_folder", f"{d}/world", "--training.steps", "10"], "out": f"{d}/world.txt"},
        {"train": ["--job.dump_folder", f"{d}/world", "--training.steps", "10",
                   "--checkpoint.exclude_from_loading", "dataloader"]},
        # Hugging Face in and out at EP = 2, sharded: load ref's weights, train one step at lr 0, export.
        {"to_hf": [f"{d}/ref/{ck}/step-6", f"{d}/hf_in"]},
        {"train": ["--job.dump_folder", f"{d}/hf", "--training.steps", "1", "--parallelism.expert_parallel_degree",
                   "2", "--checkpoint.initial_load_path", f"{d}/hf_in", "--checkpoint.initial_load_in_hf",
                   "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only", "--optimizer.lr", "0",
                   "--router.bias_update_rate", "0"]},
        {"split_rows": f"{d}/split_rows.json"},
        # Real text: the repository's own docs prepared into token shards, trained with document masking, and
        # a 4-step run extended to 6 against a 6-step one (the data position in the checkpoint).
        {"prepare": DOCS, "out": f"{d}/shards"},
        {"train": ["--job.dump_folder", f"{d}/shards_ref", "--training.steps", "6", *shards(f"{d}/shards")]},
        {"train": ["--job.dump_folder", f"{d}/shards_ext", "--training.steps", "4", *shards(f"{d}/shards")]},
        {"train": ["--job.dump_folder", f"{d}/shards_ext", "--training.steps", "6", *shards(f"{d}/shards")]},
    ]
    for op in plan:
        for key in ("train", "refused"):
            if key in op:
                op[key] = COMMON + op[key]
    launch_plan(plan, d)
    return d


def test_finished_run_is_extended_with_optimizer_and_data_position(harness):
    ref, ext = by_step(records(harness / "ref")), records(harness / "ext")
    assert [r["step"] for r in ext] == [1, 2, 3, 4, 5, 6]
    assert by_step(ext) == ref  # bit for bit: the 4-step run's last step was saved in full


def test_resume_at_other_expert_parallel_degree_matches_same_layout(harness):
    ref = by_step(records(harness / "ref"))
    ep12 = by_step(records(harness / "ep12"))
    assert sorted(ep12) == [5, 6]
    assert_close(ep12, ref, [5, 6], rtol=1e-5)  # EP = 1 -> 2 against EP = 1 -> 1
    ep22, ep21 = by_step(records(harness / "ep22")), by_step(records(harness / "ep21"))
    assert sorted(ep22) == sorted(ep21) == [7, 8]
    assert_close(ep21, ep22, [7, 8], rtol=1e-5)  # EP = 2 -> 1 against EP = 2 -> 2


def test_resume_at_other_world_size(harness, killed_run):
    message = (harness / "world.txt").read_text()
    assert "data positions of 1 data-parallel ranks and this run has 2" in message
    assert "--checkpoint.exclude_from_loading dataloader" in message
    world = by_step(records(harness / "world"))
    assert sorted(world) == [9, 10]
    # The 2-rank run goes on from the 1-rank run's weights, far below a fresh model's ln V = 7.6.
    # (Lower than the 1-rank run's last loss, too: rank 0 reads again the samples it trained on
    # first, which is why restarting the data is a flag and not the default.)
    last = by_step(records(killed_run))[8][0]
    assert all(math.isfinite(loss) and loss < min(last, 0.8 * math.log(2048)) for loss, _ in world.values())


def test_prepared_shards_train_with_document_masking_and_resume_exactly(harness):
    ref, ext = by_step(records(harness / "shards_ref")), records(harness / "shards_ext")
    assert [r["step"] for r in ext] == [1, 2, 3, 4, 5, 6]
    assert by_step(ext) == ref  # bit for bit: the shard loader's position resumed exactly
    losses = [loss for loss, _ in ref.values()]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] < 1.1 * math.log(2048)
    manifest = json.loads((harness / "shards" / "prepare.json").read_text())
    assert manifest["complete"] and manifest["num_tokens"] > 50_000


def test_hugging_face_load_and_save_under_expert_parallelism(harness):
    from safetensors.torch import load_file

    exported = harness / "hf" / "checkpoint" / "step-1"
    assert json.loads((exported / "config.json").read_text())["model_type"] == "qwen3_moe"
    loaded = load_file(harness / "hf_in" / "model.safetensors")
    saved = {}
    for path in exported.glob("*.safetensors"):
        saved |= load_file(path)
    assert sorted(saved) == sorted(loaded)
    assert all(saved[k].equal(loaded[k]) for k in loaded)  # in, one step at lr 0, out: the same weights
    assert json.loads((harness / "split_rows.json").read_text()) == {"to_hf_exact": True, "round_trip_exact": True}
