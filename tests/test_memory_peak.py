"""tools/memory_peak.py: the peak of a memory snapshot's trace and what was active then, by place."""

import pickle

import pytest
import torch

from torchtitan_moe.tools import memory_peak

MiB = 2**20


def frames(*names):
    return [{"filename": f"/x/site-packages/{file}", "line": line, "name": name} for file, line, name in names]


FORWARD = frames(("torch/nn/functional.py", 10, "linear"), ("torchtitan_moe/moe/experts.py", 5, "forward"))
BACKWARD = [{"filename": "??", "line": 0, "name": "torch::autograd::generated::MmBackward0::apply"}]
OPTIMIZER = frames(("torchtitan_moe/components/optimizer.py", 7, "step"))


def snapshot():
    """Before the trace: 100 MiB allocated and still active (a weight), 30 MiB freed in it. In the trace:
    a 40 MiB forward activation, a 60 MiB backward gradient (the peak: 230 MiB), then both freed, then an
    optimizer buffer of 50 MiB."""
    trace = [
        {"action": "alloc", "addr": 1, "size": 40 * MiB, "frames": FORWARD},
        {"action": "free_completed", "addr": 9, "size": 30 * MiB, "frames": OPTIMIZER},
        {"action": "alloc", "addr": 2, "size": 60 * MiB, "frames": BACKWARD},
        {"action": "free_requested", "addr": 1, "size": 40 * MiB, "frames": BACKWARD},
        {"action": "free_completed", "addr": 1, "size": 40 * MiB, "frames": BACKWARD},
        {"action": "free_completed", "addr": 2, "size": 60 * MiB, "frames": BACKWARD},
        {"action": "alloc", "addr": 3, "size": 50 * MiB, "frames": OPTIMIZER},
    ]
    segments = [{"device": 0, "blocks": [
        {"address": 8, "size": 100 * MiB, "state": "active_allocated", "frames": FORWARD[1:]},
        {"address": 3, "size": 50 * MiB, "state": "active_allocated", "frames": OPTIMIZER},
        {"address": 7, "size": 500 * MiB, "state": "inactive", "frames": []}]}]
    return {"device_traces": [trace], "segments": segments}


def test_the_peak_and_what_was_active_then():
    found, length = memory_peak.blocks(snapshot())
    assert length == 7
    assert memory_peak.peak(found, length) == (2, 200 * MiB)  # 100 + 40 + 60: the 30 MiB left before
    text = memory_peak.report(snapshot())
    assert text.splitlines()[0] == ("trace: 7 events; peak active 0.20 GiB in 3 blocks, after event 2 "
                                    "(MmBackward0)")
    rows = [line for line in text.splitlines() if line.startswith("| 0.")]
    assert rows == ["| 0.10 | 1 | 100 | torchtitan_moe/moe/experts.py:5 forward |",
                    "| 0.06 | 1 | 60 | MmBackward0 |",
                    "| 0.04 | 1 | 40 | torchtitan_moe/moe/experts.py:5 forward <- torch/nn/functional.py:10 linear |"]


def test_a_block_freed_but_awaiting_another_stream_is_active():
    s = snapshot()
    trace = s["device_traces"][0]
    trace.insert(6, {"action": "alloc", "addr": 4, "size": 90 * MiB, "frames": OPTIMIZER})  # after both frees
    # addr 2 requested free but completed only after the 90 MiB allocation: 100 + 60 + 90
    completed = trace.pop(5)
    trace.insert(6, completed)
    found, length = memory_peak.blocks(s)
    assert memory_peak.peak(found, length) == (5, 250 * MiB)


def test_blocks_allocated_before_the_trace_count_from_its_start():
    s = {"device_traces": [[{"action": "free_completed", "addr": 9, "size": 30 * MiB, "frames": []}]],
         "segments": [{"blocks": [{"address": 8, "size": 10 * MiB, "state": "active_allocated", "frames": []}]}]}
    assert memory_peak.peak(*memory_peak.blocks(s)) == (-1, 40 * MiB)
    assert "(before the trace)" in memory_peak.report(s)


def test_an_empty_trace_says_how_to_record_one():
    with pytest.raises(SystemExit, match="_record_memory_history"):
        memory_peak.report({"device_traces": [[]], "segments": []})


@pytest.mark.gpu
def test_on_a_gpu_the_peak_holds_the_tensors_live_then(tmp_path):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # frees that earlier tests left pending on other streams complete before the trace
    torch.cuda.memory._record_memory_history(max_entries=10_000)
    try:
        kept = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        passing = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
        del passing
        later = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
        path = tmp_path / "rank0_memory_snapshot.pickle"
        path.write_bytes(pickle.dumps(torch.cuda.memory._snapshot()))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    found, length = memory_peak.blocks(pickle.loads(path.read_bytes()))
    at, best = memory_peak.peak(found, length)
    live = sorted(b.size for b in found if b.start <= at < b.end)
    assert 64 * MiB in live and 256 * MiB in live and 16 * MiB not in live
    assert "test_memory_peak.py" in memory_peak.report(pickle.loads(path.read_bytes()))
    del kept, later
