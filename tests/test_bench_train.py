"""bench_train: variants, summaries and one real CPU run of ours (torchtitan's MoE needs CUDA)."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from torchtitan_moe.tools.bench_train import Variant, loss_agreement, main, summarize, table

ROOT = Path(__file__).resolve().parents[1]


def test_variants_set_the_model_router_and_mode():
    assert Variant("torchtitan", "balanced", "compiled").overrides() == [
        "--model.name", "torchtitan_qwen3_moe", "--debug.moe_force_load_balance", "--compile.enable"]
    assert Variant("all_to_all", "learned", "eager").overrides() == [
        "--model.name", "qwen3_moe", "--dispatch.backend", "all_to_all", "--compile.no-enable"]


def test_summary_takes_medians_after_warmup_and_ratios_to_torchtitan():
    records = [{"step": s, "throughput(tps)": tps, "tflops": tps / 100, "mfu(%)": tps / 1000,
                "memory/max_reserved(GiB)": mem, "loss": 10 - s}
               for s, tps, mem in [(1, 10.0, 5.0), (2, 1000.0, 7.0), (3, 3000.0, 6.0), (4, 2000.0, 6.0)]]
    s = summarize(records, warmup=1)
    assert s["tps"] == 2000.0 and s["mfu"] == 2.0 and s["memory_gib"] == 7.0 and s["final_loss"] == 6
    assert "memory_active_gib" not in s and "alloc_retries" not in s  # an older run's log: not made up
    tt = Variant("torchtitan", "learned", "eager")
    ours = Variant("all_to_all", "learned", "eager")
    report = table([tt, ours], {tt.name: {**s, "tps": 1000.0}, ours.name: s})
    assert "| ours/all_to_all learned eager | 2,000 |" in report and "| 2.00x | - |" in report
    assert "retries" not in report


def test_a_run_whose_allocator_retried_says_so():
    # The allocator's retries are cumulative over the run: the last step's count is the run's.
    records = [{"step": s, "throughput(tps)": 100.0, "tflops": 1.0, "memory/max_reserved(GiB)": 137.0,
                "memory/max_active(GiB)": active, "memory/num_alloc_retries": retries, "loss": 1.0}
               for s, active, retries in [(1, 120.5, 5), (2, 121.0, 11), (3, 120.0, 27)]]
    s = summarize(records, warmup=1)
    assert s["memory_active_gib"] == 121.0 and s["alloc_retries"] == 27
    ours = Variant("all_to_all", "learned", "eager")
    assert "| 137.0 (27 allocation retries) |" in table([ours], {ours.name: s})


def test_loss_agreement_compares_compiled_with_eager_at_the_last_step_and_over_a_window():
    eager, compiled = Variant("local", "learned", "eager"), Variant("local", "learned", "compiled")
    lonely = Variant("torchtitan", "learned", "eager")  # no compiled run: no row
    losses = [12.0] * 10 + [10.0]
    results = {eager.name: {"losses": losses}, compiled.name: {"losses": [12.0] * 10 + [10.1]},
               lonely.name: {"losses": losses}}
    report = loss_agreement([lonely, eager, compiled], results)
    rows = [line for line in report.splitlines() if line.startswith("| ours")]
    # last step: 10.1 / 10 - 1 = +1%; last 10 steps: 0.1 / (9 x 12 + 10) = +0.08%
    assert rows == ["| ours/local learned | 11 | 10.0000 | 10.1000 | +1.00% | +0.08% |"]
    assert loss_agreement([lonely], results) == ""
    # logged every 10th step: the row names the last logged step, not how many were logged
    results = {eager.name: {"losses": [12.0, 11.0, 10.0], "loss_steps": [1, 10, 20]},
               compiled.name: {"losses": [12.0, 11.0, 10.1], "loss_steps": [1, 10, 20]}}
    assert "| ours/local learned | 20 | 10.0000 | 10.1000 |" in loss_agreement([eager, compiled], results)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run; GPU results are in the worklogs")
def test_cpu_run_writes_the_table(tmp_path):
    code = main([str(ROOT / "configs" / "debug.toml"), "--models", "local", "--modes", "eager", "--routers",
                 "learned", "--grad-accum", "1,2", "--vary", "kernels.backend=torch", "--steps", "4", "--warmup", "1",
                 "--nproc", "2", "--out", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "bench_train.json").read_text())
    assert set(results) == {"ours/local learned eager kernels.backend=torch",
                            "ours/local learned eager accum 2 kernels.backend=torch"}
    assert all(r["steps"] == 4 and r["tps"] > 0 for r in results.values())
    assert "| ours/local learned eager accum 2 kernels.backend=torch |" in (tmp_path / "bench_train.md").read_text()
    # Accumulating 2 micro-batches: each step sees twice the tokens (2 x 8 x 128 x top-2 per rank and layer).
    slug = "ours_local_learned_eager_accum_2_kernels.backend_torch"
    records = [json.loads(line) for line in (tmp_path / slug / "metrics.jsonl").read_text().splitlines()]
    assert all(sum(layer) == 2 * 2 * 8 * 128 * 2 for layer in records[-1]["moe/tokens_per_expert"])


def test_variants_with_accumulation_set_torchtitans_global_batch():
    assert Variant("local", "learned", "eager").global_batch(2, 8) == []
    assert Variant("local", "learned", "eager", accum=8).global_batch(2, 8) == ["--training.global_batch_size", "128"]


def test_plot_losses_labels_every_curve_and_gives_its_gap_to_the_first(tmp_path):
    import runpy

    plot_losses = runpy.run_path(str(ROOT / "scripts" / "plot_losses.py"))
    a, b = tmp_path / "a" / "bench_train.json", tmp_path / "b.json"
    a.parent.mkdir()
    a.write_text(json.dumps({"ours eager": {"losses": [12.0] * 9 + [10.0]}, "broken": {"failed": "exit 1"}}))
    b.write_text(json.dumps({"ours compiled": {"losses": [12.0] * 9 + [9.8]}}))
    runs = plot_losses["curves"]([str(a), f"{b}=run 2"])
    assert list(runs) == ["ours eager a", "ours compiled run 2"]  # the failed variant has no curve
    # last step: 9.8 / 10 - 1 = -2%; last 10 steps: (108 + 9.8) / (108 + 10) - 1 = -0.17%
    assert "| ours compiled run 2 | 10 | 9.8000 | -2.00% | -0.17% |" in plot_losses["gaps"](runs)


def test_vary_trains_each_combination_of_ours_and_compares_it_with_the_first():
    from torchtitan_moe.tools.bench_train import check_combinations, vary_combinations, vary_gain

    combos = vary_combinations(["dispatch.overlap=none,chunks", "optimizer.moments_dtype=bfloat16"])
    assert combos == [(("dispatch.overlap", "none"), ("optimizer.moments_dtype", "bfloat16")),
                      (("dispatch.overlap", "chunks"), ("optimizer.moments_dtype", "bfloat16"))]
    assert vary_combinations([]) == [()]
    first, chunks = combos
    v = Variant("all_to_all", "learned", "eager", vary=chunks)
    assert v.name == "ours/all_to_all learned eager dispatch.overlap=chunks optimizer.moments_dtype=bfloat16"
    assert v.overrides()[-5:] == ["--dispatch.overlap", "chunks", "--optimizer.moments_dtype", "bfloat16",
                                  "--compile.no-enable"]
    plain = Variant("all_to_all", "learned", "eager", vary=first)
    tt = Variant("torchtitan", "learned", "eager")
    results = {plain.name: {"tps": 1000.0, "final_loss": 5.0}, v.name: {"tps": 1100.0, "final_loss": 5.0},
               tt.name: {"tps": 500.0, "final_loss": 6.0}}
    gain = vary_gain([tt, plain, v], results, first)
    assert gain.endswith(f"| {v.name} | 1,000 | 1,100 | 1.100x | +0.00e+00 |")
    assert plain.name not in gain  # the first combination is the reference, not a row
    rows = table([tt, plain, v], {k: {**r, "tflops": 1.0, "memory_gib": 1.0} for k, r in results.items()})
    assert "| 2.20x | - |" in rows  # against torchtitan as configured
    # A bad key or value stops before anything trains, naming it.
    with pytest.raises(SystemExit, match=r"--vary training.local_batch_size is also set after `--`"):
        check_combinations("configs/debug.toml", ["--training.local_batch_size", "4"],
                           vary_combinations(["training.local_batch_size=2,4"]), 1)
    with pytest.raises(SystemExit, match=r"--vary dispatch.overlap=both: .*overlap must be 'none' \| 'chunks'"):
        check_combinations("configs/debug.toml", [], vary_combinations(["dispatch.overlap=both"]), 1)
    with pytest.raises(SystemExit, match="unknown key 'nokey'"):
        check_combinations("configs/debug.toml", [], vary_combinations(["dispatch.nokey=1"]), 1)
    with pytest.raises(SystemExit, match="expected section.key=value1,value2"):
        vary_combinations(["overlap"])


def test_log_freq_is_passed_to_every_run_and_the_medians_take_the_logged_steps(tmp_path, monkeypatch):
    from torchtitan_moe.tools import bench_train

    seen = []

    def fake_training(config, dump, overrides, nproc, log):
        seen.append(overrides)
        dump.mkdir(parents=True, exist_ok=True)
        rows = [{"step": s, "loss": 10.0 - s / 10, "throughput(tps)": tps, "tflops": 1.0, "memory/max_reserved(GiB)": 1.0}
                for s, tps in [(1, 1.0), (10, 100.0), (20, 300.0), (30, 200.0)]]  # logged every 10 steps
        (dump / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        return 0

    monkeypatch.setattr(bench_train, "run_training", fake_training)
    code = main([str(ROOT / "configs" / "debug.toml"), "--models", "local", "--modes", "eager", "--routers", "learned",
                 "--steps", "30", "--warmup", "5", "--log-freq", "10", "--nproc", "1", "--out", str(tmp_path)])
    assert code == 0 and seen
    assert all(o[o.index("--metrics.log_freq") + 1] == "10" for o in seen)
    assert all(o[o.index("--debug.seed") + 1] == "42" for o in seen)  # the config's [debug] seed
    results = json.loads((tmp_path / "bench_train.json").read_text())
    assert results["ours/local learned eager"]["tps"] == 200.0  # median of steps 10, 20, 30 (after warmup 5)
    assert results["ours/local learned eager"]["loss_steps"] == [1, 10, 20, 30]
    seen.clear()  # a config without a seed: --seed's, the same for every run
    config = tmp_path / "unseeded.toml"
    config.write_text(re.sub(r"(?m)^seed = .*$", "", (ROOT / "configs" / "debug.toml").read_text()))
    assert main([str(config), "--models", "local", "--routers", "learned", "--steps", "30", "--log-freq", "10",
                 "--nproc", "1", "--seed", "7", "--out", str(tmp_path / "unseeded")]) == 0
    assert len(seen) == 2 and all(o[o.index("--debug.seed") + 1] == "7" for o in seen)
    for bad in (["--log-freq", "0"], ["--log-freq", "40"], ["--log-freq", "10", "--warmup", "30"]):
        with pytest.raises(SystemExit):
            bench_train.parse_args(["configs/debug.toml", "--steps", "30", *bad])


def test_repeat_trains_rounds_of_every_variant_and_reports_medians_ranges_and_round_ratios(tmp_path, monkeypatch):
    from torchtitan_moe.tools import bench_train

    order = []
    # Round r's machine speed is 1000 * (1, 0.9, 1.1)[r]; bf16 moments are 10% faster in every round.
    speed = {1: 1000.0, 2: 900.0, 3: 1100.0}

    def fake_training(config, dump, overrides, nproc, log):
        round_ = int(dump.name.rsplit("_run", 1)[1])
        chunks = "bfloat16" in overrides
        order.append((round_, chunks))
        dump.mkdir(parents=True, exist_ok=True)
        tps = speed[round_] * (1.1 if chunks else 1.0)
        rows = [{"step": s, "loss": 5.0, "throughput(tps)": tps, "tflops": 1.0, "memory/max_reserved(GiB)": float(round_)}
                for s in (1, 2, 3)]
        (dump / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        return 0

    monkeypatch.setattr(bench_train, "run_training", fake_training)
    code = main([str(ROOT / "configs" / "debug.toml"), "--models", "local", "--modes", "eager", "--routers", "learned",
                 "--steps", "3", "--warmup", "1", "--nproc", "1", "--repeat", "3", "--vary",
                 "optimizer.moments_dtype=float32,bfloat16", "--out", str(tmp_path)])
    assert code == 0
    assert order == [(1, False), (1, True), (2, True), (2, False), (3, False), (3, True)]  # rounds, A B, B A, A B
    results = json.loads((tmp_path / "bench_train.json").read_text())
    plain = results["ours/local learned eager optimizer.moments_dtype=float32"]
    assert plain["tps"] == 1000.0 and plain["tps_runs"] == [1000.0, 900.0, 1100.0] and plain["memory_gib"] == 3.0
    report = (tmp_path / "bench_train.md").read_text()
    assert "| ours/local learned eager optimizer.moments_dtype=float32 | 1,000 (900-1,100, 3 runs) |" in report
    assert "| 1.100x (1.100-1.100) |" in report  # each round against its own round: the machine's swing cancels
    assert "3 rounds of every variant" in report
    with pytest.raises(SystemExit):
        bench_train.parse_args(["configs/debug.toml", "--repeat", "0"])


def test_resume_trains_only_the_runs_a_time_limit_cut_off_and_reports_every_round(tmp_path, monkeypatch):
    # A device call's time limit kills the bench in round 2's second run, after it wrote some of its steps.
    from torchtitan_moe.tools import bench_train

    trained = []

    def fake_training(config, dump, overrides, nproc, log, cut_off=None):
        trained.append(dump.name)
        dump.mkdir(parents=True, exist_ok=True)
        tps = (300.0 if "--compile.enable" in overrides else 200.0) * int(dump.name[-1])
        rows = [{"step": s, "loss": 5.0, "throughput(tps)": tps, "tflops": 1.0, "memory/max_reserved(GiB)": 1.0}
                for s in (1, 2, 3)]
        (dump / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:2 if dump.name == cut_off else 3]))
        if dump.name == cut_off:
            raise KeyboardInterrupt  # the call's timeout: no exit code, half a run in --out
        return 0

    args = [str(ROOT / "configs" / "debug.toml"), "--models", "local", "--modes", "compiled,eager", "--routers",
            "learned", "--steps", "3", "--warmup", "1", "--nproc", "2", "--repeat", "3", "--out", str(tmp_path)]
    monkeypatch.setattr(bench_train, "run_training",
                        lambda *a: fake_training(*a, cut_off="ours_local_learned_compiled_run2"))
    with pytest.raises(KeyboardInterrupt):
        main(args)
    # round 2 runs in reverse order: eager, then compiled (cut off)
    assert trained == ["ours_local_learned_compiled_run1", "ours_local_learned_eager_run1",
                       "ours_local_learned_eager_run2", "ours_local_learned_compiled_run2"]
    trained.clear()
    monkeypatch.setattr(bench_train, "run_training", fake_training)
    assert main([*args, "--resume"]) == 0
    assert trained == ["ours_local_learned_compiled_run2", "ours_local_learned_compiled_run3",
                       "ours_local_learned_eager_run3"]
    results = json.loads((tmp_path / "bench_train.json").read_text())
    assert results["ours/local learned compiled"]["tps_runs"] == [300.0, 600.0, 900.0]
    assert results["ours/local learned eager"]["tps_runs"] == [200.0, 400.0, 600.0]
    assert (tmp_path / "bench_train.md").read_text().startswith(f"3 of the runs finished earlier in {tmp_path} (--resume)")
    # a run without its marker (it failed, or was cut off) is trained again, not read back
    trained.clear()
    (tmp_path / "ours_local_learned_eager_run1" / "bench_train.finished").unlink()
    assert main([*args, "--resume"]) == 0
    assert trained == ["ours_local_learned_eager_run1"]
    with pytest.raises(SystemExit):
        bench_train.parse_args([*args, "--resume", "--report"])


def test_report_writes_the_tables_of_the_runs_in_out_without_training(tmp_path, monkeypatch):
    # A bench stopped after its last run's timed steps (a call's time limit) left its runs and no tables.
    from torchtitan_moe.tools import bench_train

    def fake_training(config, dump, overrides, nproc, log):
        dump.mkdir(parents=True, exist_ok=True)
        tps = 300.0 if "--compile.enable" in overrides else 200.0
        rows = [{"step": s, "loss": 5.0, "throughput(tps)": tps * s, "tflops": 1.0, "memory/max_reserved(GiB)": 1.0}
                for s in (1, 2, 3)]
        (dump / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        return 0

    args = [str(ROOT / "configs" / "debug.toml"), "--models", "local", "--modes", "compiled,eager", "--routers",
            "learned", "--steps", "3", "--warmup", "1", "--nproc", "2", "--out", str(tmp_path)]
    monkeypatch.setattr(bench_train, "run_training", fake_training)
    assert main(args) == 0
    trained = json.loads((tmp_path / "bench_train.json").read_text())
    (tmp_path / "bench_train.md").unlink()

    def no_training(*args):
        raise AssertionError("--report trained a run")

    monkeypatch.setattr(bench_train, "run_training", no_training)
    assert main([*args, "--report"]) == 0
    assert json.loads((tmp_path / "bench_train.json").read_text()) == trained
    assert trained["ours/local learned compiled"]["tps"] == 750.0  # median of steps 2 and 3
    report = (tmp_path / "bench_train.md").read_text()
    assert report.startswith(f"the runs in {tmp_path}, trained earlier (--report)\n")
    assert "| ours/local learned compiled | 750 |" in report
    # a run missing from --out is reported as failed, as a run that wrote no metrics
    shutil.rmtree(tmp_path / "ours_local_learned_eager")
    assert main([*args, "--report"]) == 1
    assert "failed" in json.loads((tmp_path / "bench_train.json").read_text())["ours/local learned eager"]


def test_a_varied_local_batch_gives_each_rows_tokens_a_step(tmp_path, monkeypatch):
    from torchtitan_moe.tools import bench_train

    def fake_training(config, dump, overrides, nproc, log):
        dump.mkdir(parents=True, exist_ok=True)
        rows = [{"step": s, "loss": 5.0, "throughput(tps)": 100.0, "tflops": 1.0, "mfu(%)": 1.0,
                 "memory/max_reserved(GiB)": 1.0} for s in (1, 2, 3)]
        (dump / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        return 0

    monkeypatch.setattr(bench_train, "run_training", fake_training)
    code = main([str(ROOT / "configs" / "debug.toml"), "--models", "local", "--modes", "eager", "--routers", "learned", "--steps", "3",
                 "--warmup", "1", "--nproc", "2", "--grad-accum", "1,2", "--vary", "training.local_batch_size=2,4",
                 "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "bench_train.json").read_text())
    seq = 128  # configs/debug.toml's
    for batch in (2, 4):
        for accum in (1, 2):
            name = f"ours/local learned eager{f' accum {accum}' if accum > 1 else ''} training.local_batch_size={batch}"
            assert result[name]["tokens_per_step"] == 2 * batch * seq * accum, name


def test_accumulation_rows_give_the_tokens_a_step_and_mfu_in_both_counts(tmp_path, monkeypatch):
    # The full model's rows (issue 51): a plain row and a row of >= 0.5M tokens a step, both MFU counts.
    from torchtitan_moe.tools import bench_train

    def fake_training(config, dump, overrides, nproc, log):
        dump.mkdir(parents=True, exist_ok=True)
        rows = [{"step": s, "loss": 5.0, "throughput(tps)": 7_718.0, "tflops": 215.4, "tflops_causal": 178.2,
                 "mfu(%)": 21.8, "mfu_causal(%)": 18.0, "memory/max_reserved(GiB)": 128.2} for s in (1, 2, 3)]
        (dump / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        return 0

    monkeypatch.setattr(bench_train, "run_training", fake_training)
    code = main([str(ROOT / "configs" / "qwen3_30b_a3b_4gpu.toml"), "--models", "local", "--modes", "compiled",
                 "--routers", "learned", "--grad-accum", "1,3", "--steps", "3", "--warmup", "1", "--nproc", "4",
                 "--out", str(tmp_path), "--", "--kernels.backend", "auto", "--training.local_batch_size", "12"])
    assert code == 0
    report = (tmp_path / "bench_train.md").read_text()
    # 4 processes x 12 sequences x 4096 tokens a micro-batch: 196,608 tokens a step, 589,824 with 3 micro-batches
    assert "| ours/local learned compiled | 7,718 | 196,608 | 215.4 | 21.8% | 18.0% | - | 128.2 |" in report
    assert "| ours/local learned compiled accum 3 | 7,718 | 589,824 | 215.4 | 21.8% | 18.0% | - | 128.2 |" in report
    result = json.loads((tmp_path / "bench_train.json").read_text())["ours/local learned compiled accum 3"]
    assert result["mfu_causal"] == 18.0 and result["tflops_causal"] == 178.2
