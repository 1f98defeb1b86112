"""A training step reads nothing back to the host besides logging: with
`[dispatch] buffers = "worst_case"` the EP = 2 step has no per-layer split-size sync either. Counted on
CPU/gloo (tests/host_reads.py: each read there is a host sync on a GPU), over the whole train_step
(forward, backward, clipping, optimizer and expert-bias update) of steps that log nothing.
Measured: none with worst-case buffers (torchtitan's own step read its global token count back,
`dist_sum(...).item()`: train/step.py keeps it on the device); one per MoE layer with exact ones; with
[dispatch] overlap = "chunks", one per chunk and layer. On a GPU the blocking copies of the batches count
too (tests/host_reads.py): none either (tests/test_gpu_e2e.py)."""

import json

import pytest
import torch
from spawn_ranks import launch_plan

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo count")]

LAYERS = 4  # the debug flavor's


def test_a_training_step_never_syncs_with_the_host_outside_logging(tmp_path):
    ep2 = ["--parallelism.expert_parallel_degree", "2"]
    runs = {"worst_case": [], "exact": [], "worst_case_chunks": ["--dispatch.overlap", "chunks"],
            "exact_chunks": ["--dispatch.overlap", "chunks"]}
    plan = [{"host_syncs": [*ep2, "--dispatch.buffers", name.removesuffix("_chunks"), *extra, "--job.dump_folder",
                            str(tmp_path / name)], "out": str(tmp_path / f"{name}.json")} for name, extra in runs.items()]
    launch_plan(plan, tmp_path)
    worst, exact, worst_chunks, exact_chunks = (json.loads((tmp_path / f"{b}.json").read_text()) for b in runs)
    assert worst == [0, 0], worst  # torchtitan's step read the global token count back: 1 a step
    # The exact buffers read each layer's split sizes once: the count tells them apart.
    assert all(n == w + LAYERS for n, w in zip(exact, worst)), (exact, worst)
    # [dispatch] overlap = "chunks": no more with worst-case buffers; exact ones read them once per chunk.
    assert worst_chunks == worst, (worst_chunks, worst)
    assert all(n == w + 2 * LAYERS for n, w in zip(exact_chunks, worst)), (exact_chunks, worst)
