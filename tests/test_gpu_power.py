"""torchtitan_moe/tools/gpu_power.py and `bench_train --gpu-power`: nvidia-smi's samples read, windowed to each run's
timed steps and summarized per GPU (a stand-in nvidia-smi, tests/fakes/nvidia_smi, on PATH)."""

import json
import os
import time
from datetime import datetime
from pathlib import Path

import pytest

from torchtitan_moe.tools import bench_train, gpu_power

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "fakes" / "nvidia_smi"


def smi_line(when: float, gpu: int, watts: float, mhz: int, celsius: int, reasons: int) -> str:
    stamp = datetime.fromtimestamp(when).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    return f"{stamp}, {gpu}, {watts:.2f}, {mhz}, {celsius}, 0x{reasons:016x}"


def test_samples_are_read_windowed_and_summarized_per_gpu(tmp_path):
    t0 = 1_790_000_000.0
    lines = [smi_line(t0 + i, gpu, 600 + 10 * i * i, 1400 + 100 * i, 60 + i, [0x4, 0x0, 0x80, 0x20][i]) for i in range(4)
             for gpu in (0, 1)]
    lines.insert(3, f"{lines[0].split(',')[0]}, 0, [N/A], 1500, 60, 0x0")  # a sample nvidia-smi could not fill
    path = tmp_path / "gpus.csv"
    path.write_text("\n".join(lines) + "\n")
    samples = gpu_power.read_samples(path)
    assert len(samples) == 8 and samples[0] == gpu_power.Sample(t0, 0, 600.0, 1400.0, 60.0, 0x4)
    window = gpu_power.during(samples, t0 + 1, t0 + 3)  # samples 1, 2 and 3 of each GPU
    summary = gpu_power.summarize(window)
    assert list(summary) == [0, 1]
    assert summary[0] == {"sm_mhz": 1600.0, "watts": 640.0, "celsius": 62.0, "mean_watts": pytest.approx(1940 / 3),
                          "power_cap": 1 / 3, "thermal": 1 / 3, "samples": 3}


def test_tokens_per_joule_is_tokens_per_second_over_the_gpus_mean_power():
    gpus = {"0": {"watts": 700.0, "mean_watts": 600.0}, "1": {"watts": 700.0, "mean_watts": 400.0}}
    assert bench_train.tokens_per_joule(50_000.0, gpus) == 100.0  # 50,000 tokens/s/GPU at 500 W a GPU
    assert bench_train.tokens_per_joule(70_000.0, {"0": {"watts": 700.0}}) == 100.0  # a run read back from before


def test_the_runs_gpus_are_cuda_visible_devices_first_nproc_else_the_first_nproc():
    assert gpu_power.run_devices(2, {}) == ["0", "1"]
    assert gpu_power.run_devices(2, {"CUDA_VISIBLE_DEVICES": "2,3,0"}) == ["2", "3"]
    assert gpu_power.run_devices(1, {"CUDA_VISIBLE_DEVICES": "GPU-3333, 0"}) == ["GPU-3333"]
    for visible in ("2", "MIG-abcd,MIG-ef01", ""):
        with pytest.raises(SystemExit, match=f"CUDA_VISIBLE_DEVICES='{visible}' does not name 2 GPUs"):
            gpu_power.run_devices(2, {"CUDA_VISIBLE_DEVICES": visible})
    t0 = 1_790_000_000.0
    samples = [gpu_power.Sample(t0, gpu, 100.0, 1.0, 1.0, 0, f"GPU-{gpu}{gpu}{gpu}{gpu}-x") for gpu in range(4)]
    assert [s.gpu for s in gpu_power.on(samples, ["1", "3"])] == [1, 3]
    assert [s.gpu for s in gpu_power.on(samples, ["GPU-2222", "GPU-0000-x"])] == [0, 2]


def run_bench_with_the_fake(tmp_path, monkeypatch, nproc: int, visible: str | None = None) -> int:
    """bench_train --gpu-power of one variant, twice (--repeat 2), against the fake nvidia-smi (four GPUs)."""
    monkeypatch.setenv("PATH", f"{FAKE}{os.pathsep}{os.environ['PATH']}")
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)

    def fake_training(config, dump, overrides, nproc, log):
        dump.mkdir(parents=True, exist_ok=True)
        samples, deadline = dump.parent / f"{dump.name}.gpus.csv", time.time() + 30
        while not (samples.exists() and samples.stat().st_size) and time.time() < deadline:
            time.sleep(0.01)  # the sampler is running: some samples come before the run's first step
        rows = []
        for step in (1, 2, 3):  # step 1 untimed (--warmup 1): the window runs from its log to step 3's
            time.sleep(0.3)
            rows.append({"step": step, "time": time.time(), "loss": 5.0, "throughput(tps)": 100_000.0 * step,
                         "tflops": 1.0, "memory/max_reserved(GiB)": 1.0})
        (dump / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        return 0

    monkeypatch.setattr(bench_train, "run_training", fake_training)
    return bench_train.main([str(ROOT / "configs" / "debug.toml"), "--models", "local", "--modes", "eager",
                             "--routers", "learned", "--steps", "3", "--warmup", "1", "--nproc", str(nproc),
                             "--repeat", "2", "--gpu-power", "--out", str(tmp_path)])


def test_bench_train_reports_the_gpus_beside_each_run(tmp_path, monkeypatch):
    assert run_bench_with_the_fake(tmp_path, monkeypatch, nproc=2) == 0
    result = json.loads((tmp_path / "bench_train.json").read_text())["ours/local learned eager"]
    assert len(result["gpus_runs"]) == 2
    assert all(set(gpus) == {"0", "1"} for gpus in result["gpus_runs"])  # not the idle GPUs 2 and 3
    for run, gpus in enumerate(result["gpus_runs"], 1):
        assert gpus["0"]["sm_mhz"] == 1500 and gpus["1"]["sm_mhz"] == 1700
        # the samples taken from the last untimed step's log to the last timed step's, no others
        times = [json.loads(line)["time"] for line in
                 (tmp_path / f"ours_local_learned_eager_run{run}" / "metrics.jsonl").read_text().splitlines()]
        taken = [s.time for s in gpu_power.read_samples(tmp_path / f"ours_local_learned_eager_run{run}.gpus.csv")
                 if s.gpu == 0]
        assert gpus["0"]["samples"] == sum(times[0] <= t <= times[-1] for t in taken) < len(taken)
    report = (tmp_path / "bench_train.md").read_text()
    # 250,000 tokens/s/GPU at 670 W a GPU (GPUs 0 and 1; with the idle two, 370 W): 373.1 tokens per joule
    assert ("| ours/local learned eager | 2 | 250,000 | 1,500 / 1,700 | 690 / 650 | 71 / 64 | 100% / 0% | 0% / 0% | "
            "373.1 |") in report
    # The main table: each run's 373.1, their median; the debug config's 8 x 128 tokens on 2 processes a step.
    assert "| ours/local learned eager | 250,000 (250,000-250,000, 2 runs) | 2,048 | 1.0 | - | - | 373.1 |" in report


def test_bench_train_counts_the_gpus_cuda_visible_devices_names(tmp_path, monkeypatch):
    assert run_bench_with_the_fake(tmp_path, monkeypatch, nproc=2, visible="2,3") == 0
    result = json.loads((tmp_path / "bench_train.json").read_text())["ours/local learned eager"]
    assert all(set(gpus) == {"2", "3"} for gpus in result["gpus_runs"])
    # 250,000 tokens/s/GPU at 70 W a GPU
    assert result["tokens_per_joule"] == pytest.approx(250_000 / 70)


def test_gpu_power_without_nvidia_smi_is_one_error_before_anything_trains(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(bench_train, "run_training", lambda *a: pytest.fail("trained"))
    with pytest.raises(SystemExit, match="--gpu-power samples the GPUs with nvidia-smi, which is not on PATH"):
        bench_train.main([str(ROOT / "configs" / "debug.toml"), "--models", "local", "--steps", "3", "--warmup", "1",
                          "--gpu-power", "--out", str(tmp_path / "out")])


def test_an_nvidia_smi_that_stops_is_reported_and_its_runs_have_no_samples(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'Field \"temperature.gpu\" is not a valid field to query.'\nexit 2\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    with gpu_power.GPUSampler(tmp_path / "gpus.csv"):
        time.sleep(0.5)
    assert "nvidia-smi stopped during the run (exit 2): Field \"temperature.gpu\"" in capsys.readouterr().err
    assert gpu_power.read_samples(tmp_path / "gpus.csv") == []
