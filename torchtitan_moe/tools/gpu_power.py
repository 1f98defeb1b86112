"""The GPUs' power draw, SM clock, temperature and clock-limit reasons through a run, sampled with nvidia-smi.

    with GPUSampler(path) as sampler:      # nvidia-smi every SAMPLE_MS into `path`, stopped on exit
        train(...)
    samples = read_samples(path)           # [Sample(time, gpu, watts, sm_mhz, celsius, reasons, uuid)]
    during(samples, start, end)            # those taken between two wall-clock times (time.time())
    on(samples, run_devices(nproc))        # those of the GPUs the run used, not the idle ones beside it
    summarize(samples)                     # per GPU: median SM MHz, W and °C, mean W, share of samples at the power cap

On 2 H200s our training step runs at the GPUs' 700 W software power cap with the SM clock well below its
maximum, and one setting's tokens/s moved by 6% between two rounds
of one run while torchtitan's did not: these figures, beside each
run's tokens/s (`bench_train --gpu-power`), tell a GPU running slower (at the cap, hotter: its leakage takes more
of the same watts) from a host launching slower. At the cap a step's time is its energy over the cap's watts, so
only less energy per token makes it faster: the mean power (energy over time) gives each run's tokens per joule.
Over bench_train's usual window (10 steps, ~2 s, ~10 samples a GPU) it moved by up to 7% between runs of one
setting on one host: compare energies over longer windows or several runs.

nvidia-smi samples every GPU of the host; a run's figures are over the GPUs it used alone (`run_devices`: the
first nproc of CUDA_VISIBLE_DEVICES, else 0..nproc-1, as torchrun's local ranks take cuda:0..nproc-1): an idle
GPU's ~70 W beside four busy ones would lower their mean power and raise tokens per joule. Indices are matched
as nvidia-smi numbers GPUs (PCI bus order), which is CUDA's order where CUDA_DEVICE_ORDER=PCI_BUS_ID and on a
node of one GPU model (CUDA's fastest-first order ties there and falls back to the bus); UUIDs (GPU-...) match
whatever the order.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

SAMPLE_MS = 200
QUERY = "timestamp,index,power.draw,clocks.sm,temperature.gpu,clocks_event_reasons.active,uuid"
# nvmlClocksEventReasons bits: the SM clock held down by the power cap (software cap, hardware brake) or by heat.
POWER_CAP = 0x4 | 0x80
THERMAL = 0x8 | 0x20 | 0x40


@dataclass(frozen=True)
class Sample:
    time: float  # seconds since the epoch (time.time())
    gpu: int
    watts: float
    sm_mhz: float
    celsius: float
    reasons: int  # clocks_event_reasons.active bit mask
    uuid: str = ""  # GPU-...; "" in files sampled before it was queried


def run_devices(nproc: int, env: dict[str, str] | None = None) -> list[str]:
    """The GPUs a run of `nproc` processes uses, as CUDA_VISIBLE_DEVICES names them (indices or GPU-UUIDs),
    or SystemExit naming what stops telling them."""
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(nproc)]
    devices = [d.strip() for d in visible.split(",")][:nproc]
    if len(devices) < nproc or not all(d.isdigit() or d.startswith("GPU-") for d in devices):
        raise SystemExit(f"--gpu-power: CUDA_VISIBLE_DEVICES={visible!r} does not name {nproc} GPUs by index or "
                         f"GPU-UUID, so the run's GPUs cannot be told from the others in nvidia-smi's samples")
    return devices


def on(samples: list[Sample], devices: list[str]) -> list[Sample]:
    """The samples of `devices` (run_devices'): by index, or by UUID (CUDA takes a UUID's unique prefix)."""
    return [s for s in samples if any(d == str(s.gpu) if d.isdigit() else s.uuid.startswith(d) for d in devices)]


def nvidia_smi() -> str:
    """nvidia-smi's path, or SystemExit saying what needs it."""
    path = shutil.which("nvidia-smi")
    if path is None:
        raise SystemExit("--gpu-power samples the GPUs with nvidia-smi, which is not on PATH (a machine without "
                         "NVIDIA's driver tools): leave --gpu-power out")
    return path


class GPUSampler:
    """nvidia-smi writing every GPU's sample every SAMPLE_MS ms to `path` while the block runs."""

    def __init__(self, path: Path):
        self.path = path
        self.command = [nvidia_smi(), f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(SAMPLE_MS)]

    def __enter__(self) -> GPUSampler:
        self.file = open(self.path, "w")
        self.process = subprocess.Popen(self.command, stdout=self.file, stderr=subprocess.STDOUT)
        return self

    def __exit__(self, *exc) -> None:
        code = self.process.poll()
        if code is not None:  # it stopped by itself: a query this nvidia-smi refuses, or no GPU; say so
            self.file.flush()
            said = self.path.read_text().strip().splitlines()
            print(f"gpu_power: nvidia-smi stopped during the run (exit {code}): {said[0] if said else 'no output'}",
                  file=sys.stderr, flush=True)
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.file.close()


def read_samples(path: Path) -> list[Sample]:
    """The samples in `path` (lines nvidia-smi could not fill, e.g. "[N/A]", are skipped)."""
    samples = []
    for line in path.read_text().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) not in (6, 7):  # 6: sampled before the uuid was queried
            continue
        try:
            when = datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()  # local time, as time.time()
            samples.append(Sample(when, int(fields[1]), float(fields[2]), float(fields[3]), float(fields[4]),
                                  int(fields[5], 16), fields[6] if len(fields) == 7 else ""))
        except ValueError:
            continue
    return samples


def during(samples: list[Sample], start: float, end: float) -> list[Sample]:
    return [s for s in samples if start <= s.time <= end]


def summarize(samples: list[Sample]) -> dict[int, dict[str, float]]:
    """GPU index -> median SM MHz, watts and temperature, mean watts (the energy over the samples' time, at a steady
    sampling rate), and the share of samples held at the power cap or by heat."""
    by_gpu: dict[int, list[Sample]] = {}
    for s in samples:
        by_gpu.setdefault(s.gpu, []).append(s)
    return {gpu: {"sm_mhz": statistics.median(s.sm_mhz for s in mine),
                  "watts": statistics.median(s.watts for s in mine),
                  "celsius": statistics.median(s.celsius for s in mine),
                  "mean_watts": statistics.fmean(s.watts for s in mine),
                  "power_cap": sum(bool(s.reasons & POWER_CAP) for s in mine) / len(mine),
                  "thermal": sum(bool(s.reasons & THERMAL) for s in mine) / len(mine),
                  "samples": len(mine)}
            for gpu, mine in sorted(by_gpu.items())}
