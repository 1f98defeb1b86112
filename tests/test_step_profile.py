"""step_profile: the step-time breakdown of a profiler trace, on a crafted trace and a real CPU run."""

import json
from pathlib import Path

import pytest

from torchtitan_moe.tools import bench_train, step_profile

ROOT = Path(__file__).resolve().parents[1]


def event(name, cat, ts, dur, **extra):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, **extra}


def crafted_trace(path: Path) -> Path:
    """Two steps of 1000 µs. Step 0: a GEMM on stream 7 (100-400) overlapping an NCCL kernel on
    stream 20 (300-600), our Triton kernel (700-750), a copy (800-820); 4 launches, 2 syncs of 50
    and 30 µs. Step 1: one elementwise kernel (1100-1300) and one that runs past the step's end
    (1900-2100: only 100 µs of it is inside); 2 launches, no sync."""
    events = [
        event("ProfilerStep#4", "user_annotation", 0, 1000),
        event("ProfilerStep#5", "user_annotation", 1000, 1000),
        # torch.profiler repeats each step on the GPU timeline: not a step of its own.
        event("ProfilerStep#4", "gpu_user_annotation", 100, 720),
        event("ProfilerStep#5", "gpu_user_annotation", 1100, 1000),
        event("sm90_xmma_gemm_bf16bf16_bf16f32", "kernel", 100, 300, tid=7),
        event("ncclDevKernel_AllToAll", "kernel", 300, 300, tid=20),
        event("_swiglu_prob_fwd_kernel", "kernel", 700, 50, tid=7),
        event("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 800, 20, tid=7),
        event("void at::native::vectorized_elementwise_kernel<4>", "kernel", 1100, 200, tid=7),
        event("triton_poi_fused_add_0", "kernel", 1900, 200, tid=7),
        *[event("cudaLaunchKernel", "cuda_runtime", t, 5) for t in (50, 60, 650, 690, 1050, 1850)],
        event("cudaStreamSynchronize", "cuda_runtime", 200, 50),
        event("cudaDeviceSynchronize", "cuda_runtime", 900, 30),
        event("aten::mm", "cpu_op", 40, 20),
    ]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_breakdown_of_a_crafted_trace(tmp_path):
    result = step_profile.breakdown(step_profile.load(crafted_trace(tmp_path / "t.json")))
    first, second = result["steps"]
    assert first["step"] == 4 and second["step"] == 5
    # Busy: 100-600 (GEMM and NCCL overlap, counted once) + 50 + 20 = 570 µs.
    assert first["wall_ms"] == pytest.approx(1.0)
    assert first["gpu_busy_ms"] == pytest.approx(0.57) and first["gpu_idle_ms"] == pytest.approx(0.43)
    assert (first["launches"], first["host_syncs"]) == (4, 2) and first["host_sync_ms"] == pytest.approx(0.08)
    # Step 1: 200 µs + the 100 µs of the late kernel that fall inside it.
    assert second["gpu_busy_ms"] == pytest.approx(0.3) and (second["launches"], second["host_syncs"]) == (2, 0)
    assert result["mean"]["gpu_busy_ms"] == pytest.approx(0.435)
    classes = {name: k["class"] for name, k in result["kernels"].items()}
    assert classes == {
        "sm90_xmma_gemm_bf16bf16_bf16f32": "GEMM", "ncclDevKernel_AllToAll": "NCCL",
        "_swiglu_prob_fwd_kernel": "Triton ours", "Memcpy DtoD (Device -> Device)": "elementwise/copy",
        "void at::native::vectorized_elementwise_kernel<4>": "elementwise/copy",
        "triton_poi_fused_add_0": "Triton compiled",
    }
    # Per step: the GEMM's 300 µs over 2 steps; a kernel is counted whole in the step it starts in.
    assert result["kernels"]["sm90_xmma_gemm_bf16bf16_bf16f32"]["ms"] == pytest.approx(0.15)
    assert result["classes"]["Triton compiled"] == pytest.approx(0.1)
    table = step_profile.render(result, top=3)
    assert "| mean | 1.00 | 0.43 | 0.56 | 56.5% | 3 | 1 | 0.04 |" in table
    top = table.split("top 3 kernels")[1]
    # Largest first: the GEMM and NCCL kernels (300 µs), then the elementwise one (200); not ours (50).
    assert max(top.index("sm90_xmma_gemm"), top.index("ncclDevKernel")) < top.index("vectorized_elementwise")
    assert "_swiglu_prob_fwd_kernel" not in top
    assert "| sm90_xmma_gemm_bf16bf16_bf16f32 | GEMM | 0.150 | 0.5 |" in top


def test_idle_gaps_go_to_the_host_op_that_launched_the_work_ending_them(tmp_path):
    """One step of 1000 µs. Main thread: aten::mm (40-70) launches K1 (100-300); the optimizer (600-900)
    runs aten::empty (610-620), then launches K4 itself at 630 (850-860) and from aten::_fused_adamw_
    (650-700) K3 (750-800); a stream sync returns at 520. Autograd thread: MmBackward0's aten::mm
    launches K2 (350-500). Gaps: 0-100 (K1), 300-350 (K2), 500-750 (K3, after the sync), 800-850 (K4),
    860-1000 (the step's end): 590 µs, the step's idle time."""
    main, autograd = {"pid": 1, "tid": 1}, {"pid": 1, "tid": 2}

    def launch(t, corr, thread):
        return event("cudaLaunchKernel", "cuda_runtime", t, 5, args={"correlation": corr}, **thread)

    def kernel(name, ts, dur, corr):
        return event(name, "kernel", ts, dur, pid=0, tid=7, args={"correlation": corr})

    events = [
        event("ProfilerStep#4", "user_annotation", 0, 1000, **main),
        event("aten::mm", "cpu_op", 40, 30, **main), launch(50, 1, main), kernel("k1", 100, 200, 1),
        event("autograd::engine::evaluate_function: MmBackward0", "cpu_op", 310, 90, **autograd),
        event("aten::mm", "cpu_op", 320, 70, **autograd), launch(330, 2, autograd), kernel("k2", 350, 150, 2),
        event("cudaStreamSynchronize", "cuda_runtime", 500, 20, **main),
        event("Optimizer.step#AdamW.step", "user_annotation", 600, 300, **main),
        event("aten::empty", "cpu_op", 610, 10, **main), launch(630, 4, main), kernel("k4", 850, 10, 4),
        event("aten::_fused_adamw_", "cpu_op", 650, 50, **main), launch(660, 3, main), kernel("k3", 750, 50, 3),
    ]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    result = step_profile.breakdown(step_profile.load(tmp_path / "t.json"))
    idle = {(r["host_op"], r["launch_op"], r["after_sync"]): (round(r["ms"] * 1e3), r["gaps"]) for r in result["idle"]}
    assert idle == {
        ("aten::mm", "aten::mm", False): (100, 1),
        ("autograd::engine::evaluate_function: MmBackward0", "aten::mm", False): (50, 1),
        ("Optimizer.step#AdamW.step", "aten::_fused_adamw_", True): (250, 1),
        ("Optimizer.step#AdamW.step", "Optimizer.step#AdamW.step", False): (50, 1),
        ("(the step's end: no GPU work left)", "-", False): (140, 1),
    }
    assert sum(ms for ms, _ in idle.values()) / 1e3 == pytest.approx(result["steps"][0]["gpu_idle_ms"])
    table = step_profile.render(result)
    assert table.index("| Optimizer.step#AdamW.step | aten::_fused_adamw_ | yes | 0.25 | 1.0 |") < table.index("| aten::mm | aten::mm |")


def test_the_ranks_side_by_side_show_which_one_waits(tmp_path, capsys):
    """Rank 1 is rank 0 with its GEMM 200 µs longer and its NCCL kernel 200 µs shorter (it arrives
    last, so it waits less): the two kernels lead the table of differences, 0.1 ms a step each."""
    folder = tmp_path / "profile_traces" / "iteration_6"
    folder.mkdir(parents=True)
    rank0 = crafted_trace(folder / "rank0_trace.json")
    events = json.loads(rank0.read_text())["traceEvents"]
    for e in events:
        if e["name"].startswith("sm90_xmma_gemm"):
            e["dur"] += 200
        if e["name"].startswith("ncclDevKernel"):
            e["dur"] -= 200
    (folder / "rank1_trace.json").write_text(json.dumps({"traceEvents": events}))

    profile = bench_train.profile_of(tmp_path, 6)  # rank 0's breakdown, both ranks' under by_rank
    assert profile["steps"] == step_profile.breakdown(step_profile.load(rank0))["steps"]
    assert sorted(profile["by_rank"]) == [0, 1]
    table = step_profile.compare_ranks(profile["by_rank"], top=2)
    assert "| GEMM ms | 0.15 | 0.25 |" in table and "| NCCL ms | 0.15 | 0.05 |" in table
    busy = [profile["by_rank"][r]["compute_idle"]["busy_ms"] for r in (0, 1)]
    assert busy[1] - busy[0] == pytest.approx(0.1)  # rank 1's GEMM: 200 µs longer over 2 steps
    assert f"| compute stream busy ms | {busy[0]:.2f} | {busy[1]:.2f} |" in table
    differ = table.split("differs most")[1]
    assert "| sm90_xmma_gemm_bf16bf16_bf16f32 | GEMM | 0.150 | 0.250 |" in differ
    assert "| ncclDevKernel_AllToAll | NCCL | 0.150 | 0.050 |" in differ
    assert "vectorized_elementwise" not in differ  # equal on both ranks

    assert step_profile.main([str(rank0), str(folder / "rank1_trace.json")]) == 0
    assert "the traces side by side" in capsys.readouterr().out


def test_the_longest_step_is_explained_by_its_extra_kernels(tmp_path):
    """Step 8 (1500 µs) runs the GEMM both steps run plus an all-reduce of 400 µs; step 7 (1000 µs)
    only the GEMM: the all-reduce alone is step 8's extra, and the table says so."""
    events = [
        event("ProfilerStep#7", "user_annotation", 0, 1000),
        event("ProfilerStep#8", "user_annotation", 1000, 1500),
        event("sm90_xmma_gemm_bf16bf16_bf16f32", "kernel", 100, 100, tid=7),
        event("sm90_xmma_gemm_bf16bf16_bf16f32", "kernel", 1100, 100, tid=7),
        event("ncclDevKernel_AllReduce_Sum_f32", "kernel", 1300, 400, tid=20),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    result = step_profile.breakdown(step_profile.load(path))
    assert result["longest_step_extra"] == [{"name": "ncclDevKernel_AllReduce_Sum_f32", "class": "NCCL",
                                             "ms": pytest.approx(0.4), "steps": (8, 7)}]
    table = step_profile.render(result)
    assert "what step 8 (the longest) ran beyond step 7 (the shortest)" in table
    assert "| ncclDevKernel_AllReduce_Sum_f32 | NCCL | 0.400 |" in table


def test_a_trace_without_steps_or_unreadable_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"traceEvents": [event("aten::mm", "cpu_op", 0, 1)]}))
    with pytest.raises(SystemExit, match="no ProfilerStep#N ranges"):
        step_profile.breakdown(step_profile.load(bad))
    (tmp_path / "torn.json").write_text("{")
    with pytest.raises(SystemExit, match="cannot read .*torn.json as a chrome trace"):
        step_profile.load(tmp_path / "torn.json")


def test_profiled_steps_are_left_out_of_the_medians():
    records = [{"step": s, "throughput(tps)": 100.0 if s <= 6 else 1.0, "tflops": 1.0, "loss": 1.0,
                "memory/max_reserved(GiB)": 1.0} for s in range(1, 11)]
    assert bench_train.summarize(records, warmup=2, last_untimed=4)["tps"] == 100.0
    assert bench_train.summarize(records, warmup=2)["tps"] < 100.0


@pytest.mark.slow
def test_bench_train_profile_on_cpu(tmp_path, forked_launches):
    # torchtitan's [profiling] through our trainer on a CPU machine (the shim gives its profiler the
    # host alone), the trace found and broken down in the report.
    code = bench_train.main([str(ROOT / "configs" / "debug.toml"), "--steps", "6", "--warmup", "1", "--nproc", "1",
                             "--models", "local", "--routers", "learned", "--modes", "eager", "--profile",
                             "--out", str(tmp_path)])
    report = (tmp_path / "bench_train.md").read_text()
    assert code == 0, report
    assert "the last 4 (profiled) left out" in report and "step-time breakdown" in report
    assert "no GPU activity in this trace" in report
    assert sum(line.startswith("| ") and line.split("|")[1].strip().isdigit() for line in report.splitlines()) == 3


def test_kernels_count_in_the_step_that_launched_them_when_the_gpu_runs_behind(tmp_path):
    """No sync ends step 4 (log_freq > 1): its AdamW kernel, launched at 900, runs at 1200-1500, inside
    step 5's host range; step 5 (which ends in a sync) launches its own at 1900, run at 2000-2300. Each
    step has one AdamW kernel; the GPU's busy time stays where the GPU was busy."""
    def launch(t, corr):
        return event("cudaLaunchKernel", "cuda_runtime", t, 5, pid=1, tid=1, args={"correlation": corr})

    def kernel(ts, corr):
        return event("_adamw_kernel", "kernel", ts, 300, pid=0, tid=7, args={"correlation": corr})

    events = [event("ProfilerStep#4", "user_annotation", 0, 1000, pid=1, tid=1),
              event("ProfilerStep#5", "user_annotation", 1000, 1400, pid=1, tid=1),
              launch(900, 1), kernel(1200, 1), launch(1900, 2), kernel(2000, 2),
              event("cudaStreamSynchronize", "cuda_runtime", 1950, 400, pid=1, tid=1)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    result = step_profile.breakdown(step_profile.load(path))
    assert result["kernels"]["_adamw_kernel"]["calls"] == 1.0  # one a step: 2 kernels over 2 steps
    assert result["longest_step_extra"] == []  # the same kernels in both steps
    first, second = result["steps"]
    assert first["gpu_busy_ms"] == 0 and second["gpu_busy_ms"] == pytest.approx(0.6)


def test_a_kernel_launched_before_the_trace_counts_in_no_step(tmp_path):
    """The profiler's warm-up step launched an AdamW kernel whose launch the trace does not hold (correlation
    3); it runs at 200-500, inside step 4's host range, behind the GPU's backlog. Step 4 launches its own at
    900 (run at 1200-1500): one AdamW kernel a step, not two in step 4 (a real trace was counted AdamW at
    26.8 ms a step for its 20.1)."""
    events = [event("ProfilerStep#4", "user_annotation", 0, 1000, pid=1, tid=1),
              event("ProfilerStep#5", "user_annotation", 1000, 1000, pid=1, tid=1),
              event("_adamw_kernel", "kernel", 200, 300, pid=0, tid=7, args={"correlation": 3}),
              event("cudaLaunchKernel", "cuda_runtime", 900, 5, pid=1, tid=1, args={"correlation": 4}),
              event("_adamw_kernel", "kernel", 1200, 300, pid=0, tid=7, args={"correlation": 4}),
              event("cudaLaunchKernel", "cuda_runtime", 1900, 5, pid=1, tid=1, args={"correlation": 5}),
              event("_adamw_kernel", "kernel", 1950, 300, pid=0, tid=7, args={"correlation": 5})]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    result = step_profile.breakdown(step_profile.load(tmp_path / "t.json"))
    assert result["kernels"]["_adamw_kernel"]["calls"] == 1.0
    assert result["kernels"]["_adamw_kernel"]["ms"] == pytest.approx(0.3)


def test_compute_stream_idle_goes_to_the_kernel_running_beside_each_gap(tmp_path):
    """Two steps. The compute stream (7, the most kernel time) runs K1 100-300, K2 500-600 and K3 700-800 in
    step 0 and K4 1100-1150 in step 1; stream 20 runs DeepEP's dispatch 250-480 (through most of the gap
    300-500, where a reduce-scatter on stream 26 runs 485-495; its 50 µs beside K1 are no gap) and an all-gather
    620-650 (30 of the gap 600-700's 100 µs, the only kernel there); nothing runs in 800-1100, the gap before
    step 1's first kernel."""
    events = [
        event("ProfilerStep#1", "user_annotation", 0, 1000), event("ProfilerStep#2", "user_annotation", 1000, 1000),
        *[event("sm90_gemm", "kernel", t, d, tid=7) for t, d in ((100, 200), (500, 100), (700, 100), (1100, 50))],
        event("void deep_ep::intranode::dispatch<2, 768, 8192>(int4*, float*)", "kernel", 250, 230, tid=20),
        event("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", 620, 30, tid=20),
        event("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", 485, 10, tid=26),
    ]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    idle = step_profile.breakdown(step_profile.load(tmp_path / "t.json"))["compute_idle"]
    assert idle["stream"] == 7 and idle["busy_ms"] == pytest.approx(0.225) and idle["idle_ms"] == pytest.approx(0.3)
    beside = {r["kernel"]: (r["ms"], r["gaps"]) for r in idle["beside"]}
    assert beside == {"deep_ep::intranode::dispatch<2, 768, 8192>": (pytest.approx(0.1), 0.5),
                      "ncclDevKernel_AllGather_RING_LL": (pytest.approx(0.05), 0.5),
                      "(nothing: the host, or an event)": (pytest.approx(0.15), 0.5)}
    table = step_profile.render(step_profile.breakdown(step_profile.load(tmp_path / "t.json")))
    assert "the compute stream (stream 7): 0.23 ms busy, 0.30 ms idle per step" in table
    assert "| deep_ep::intranode::dispatch<2, 768, 8192> | 0.10 | 0.5 |" in table


def test_gemms_started_beside_another_streams_kernel_against_the_same_gemm_alone(tmp_path):
    """One step of 2000 µs. The compute stream (7) runs a grouped GEMM G three times: 0-100 and 1000-1100
    alone, 400-700 started while an all-gather (stream 20, 350-450) ran: 200 µs over the median alone. The
    dense GEMM D starts at 800, as a reduce-scatter ends (720-800: not running), and the Triton kernel at
    360 runs beside the all-gather: neither counts. The trace comes back gzipped (read as it is)."""
    import gzip

    grouped = "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel" + "S27_" * 10
    events = [
        event("ProfilerStep#3", "user_annotation", 0, 2000),
        *[event(grouped, "kernel", t, d, tid=7) for t, d in ((0, 100), (400, 300), (1000, 100))],
        event("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "kernel", 800, 100, tid=7),
        event("_swiglu_prob_fwd_kernel", "kernel", 360, 30, tid=7),
        event("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", 350, 100, tid=20),
        event("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", 720, 80, tid=20),
    ]
    path = tmp_path / "rank0_trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    result = step_profile.breakdown(step_profile.load(path))
    assert result["gemms_beside"] == [{"name": grouped, "alone": 2, "alone_us": 100.0, "beside": 1, "beside_us": 300.0,
                                       "extra_ms": pytest.approx(0.2), "by": "ncclDevKernel_AllGather_RING_LL"}]
    table = step_profile.render(result)
    assert "GEMMs started while another stream's kernel ran" in table
    assert f"| {step_profile.abbreviate(grouped)} | 2, 100.0 | 1, 300.0 | 0.20 | ncclDevKernel_AllGather_RING_LL |" in table
    assert step_profile.abbreviate(grouped).endswith(grouped[-25:])  # the tail that tells the variants apart
    side = step_profile.compare_ranks({0: result, 1: step_profile.breakdown(step_profile.load(path))})
    assert "| GEMMs' extra beside other streams ms | 0.20 | 0.20 |" in side


def test_a_gap_goes_to_the_stream_that_ran_through_most_of_it(tmp_path):
    """The backward's exchange as the H200 trace showed it: the compute stream idles 1000-1660 while DeepEP's
    notify (1005-1240) and dispatch (1240-1650) run on stream 20 and FSDP's reduce-scatter (1006-1490) on stream
    26. The reduce-scatter outlasts each DeepEP kernel (484 µs against 410) but not their chain (645): the gap is
    DeepEP's, whose dispatch the compute stream waited for."""
    events = [
        event("ProfilerStep#1", "user_annotation", 0, 3000),
        *[event("sm90_gemm", "kernel", t, 1000, tid=7) for t in (0, 1660)],
        event("void deep_ep::intranode::cached_notify_dispatch<2>(int const*)", "kernel", 1005, 235, tid=20),
        event("void deep_ep::intranode::dispatch<2, 768, 8192>(int4*, float*)", "kernel", 1240, 410, tid=20),
        event("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", 1006, 484, tid=26),
    ]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    idle = step_profile.breakdown(step_profile.load(tmp_path / "t.json"))["compute_idle"]
    assert idle["stream"] == 7
    assert idle["beside"] == [{"kernel": "deep_ep::intranode::dispatch<2, 768, 8192>", "ms": pytest.approx(0.66), "gaps": 1}]


def test_gaps_lists_the_compute_streams_waits_in_order_with_the_call_behind_each(tmp_path, capsys):
    """One step: the compute stream runs 0-1000, 1300-1400 and 1450-2450; DeepEP's dispatch runs 1010-1290 beside
    the first gap (300 µs), nothing beside the second (50 µs, under --min-us 100). The kernel after the first gap
    was launched inside combine_backward's host op (correlation 2)."""
    events = [
        event("ProfilerStep#1", "user_annotation", 0, 3000),
        event("autograd::engine::evaluate_function: FunctionBackward", "cpu_op", 100, 200, tid=1),
        event("torchtitan_moe::combine_backward", "cpu_op", 110, 100, tid=1),
        *[event("cudaLaunchKernel", "cuda_runtime", t, 5, tid=1, args={"correlation": c})
          for t, c in ((10, 1), (120, 2), (400, 3))],
        event("sm90_gemm", "kernel", 0, 1000, tid=7, args={"correlation": 1}),
        event("_gather_kernel", "kernel", 1300, 100, tid=7, args={"correlation": 2}),
        event("sm90_gemm", "kernel", 1450, 1000, tid=7, args={"correlation": 3}),
        event("void deep_ep::intranode::dispatch<2, 768, 8192>(int4*, float*)", "kernel", 1010, 280, tid=20),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    rows = step_profile.compute_stream_gaps(step_profile.load(path), 0, 100)
    assert rows == [{"at_ms": 1.0, "gap_us": 300, "after": "sm90_gemm", "before": "_gather_kernel",
                     "beside": "deep_ep::intranode::dispatch<2, 768, 8192>",
                     "host_ops": ["autograd::engine::evaluate_function: FunctionBackward",
                                  "torchtitan_moe::combine_backward"]}]
    assert step_profile.main([str(path), "--gaps", "0", "--min-us", "40"]) == 0
    table = capsys.readouterr().out
    assert "| 1.00 | 300 | sm90_gemm | _gather_kernel | deep_ep::intranode::dispatch<2, 768, 8192> |" in table
    assert "| 1.40 | 50 | _gather_kernel | sm90_gemm | (nothing: the host, or an event) | - |" in table
    with pytest.raises(SystemExit, match="--gaps 1: the trace has 1 profiled steps"):
        step_profile.main([str(path), "--gaps", "1"])
