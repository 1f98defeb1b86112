"""End to end on the CPU: 2 processes over gloo train the debug config (resuming: tests/test_resume.py).
The runs below share one torchrun launch (spawn_ranks.launch_plan); the default one ends with a
Hugging Face export."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spawn_ranks import launch_plan

from torchtitan_moe.hf import convert
from torchtitan_moe.hf.bias_cost import synthetic_held_out
from torchtitan_moe.train.job_config import load_job_config
from torchtitan_moe.components.data.synthetic import chain_entropy
from torchtitan_moe.models.qwen3_moe import Qwen3MoEModel

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo path; GPU runs are in the GPU worklogs"),
]

RUNS = {
    # The default recipe ends with a Hugging Face export of its last step.
    "learns": ["--training.steps", "30", "--checkpoint.enable", "--checkpoint.last_save_in_hf",
               "--checkpoint.last_save_model_only"],
    "ep2_bf16": ["--training.steps", "4", "--parallelism.expert_parallel_degree", "2",
                 "--training.mixed_precision_param", "bfloat16"],
    "ep2_bf16_experts_in_fsdp": ["--training.steps", "4", "--parallelism.expert_parallel_degree", "2",
                                 "--training.mixed_precision_param", "bfloat16"],
    # Our AdamW (bf16 moments) writes the experts' working copies in its update; under FSDP2 it updates
    # the shard FSDP2 casts. The working-copy check runs at steps 2 and 4 (monitor steps).
    "ep2_bf16_adamw": ["--training.steps", "4", "--parallelism.expert_parallel_degree", "2",
                       "--training.mixed_precision_param", "bfloat16", "--optimizer.moments_dtype", "bfloat16",
                       "--checks.monitor_freq", "2", "--optimizer.expert_grad_dtype", "float32"],
    "ep2_bf16_adamw_experts_in_fsdp": ["--training.steps", "4", "--parallelism.expert_parallel_degree", "2",
                                       "--training.mixed_precision_param", "bfloat16", "--optimizer.moments_dtype",
                                       "bfloat16", "--checks.monitor_freq", "2"],
    # The same with the experts' gradients kept on their bf16 working copies ([optimizer] expert_grad_dtype).
    "kept_grads_ep2_bf16_adamw": ["--training.steps", "4", "--parallelism.expert_parallel_degree", "2",
                                  "--training.mixed_precision_param", "bfloat16", "--optimizer.moments_dtype",
                                  "bfloat16", "--checks.monitor_freq", "2", "--optimizer.expert_grad_dtype", "bfloat16"],
    "recipe": ["--training.steps", "3", "--parallelism.expert_parallel_degree", "2",
               "--training.global_batch_size", "32", "--router.balance_loss", "global_batch",
               "--router.balance_loss_coeff", "0.01", "--router.z_loss_coeff", "0.001"],
    "bf16_moments": ["--training.steps", "4", "--optimizer.moments_dtype", "bfloat16", "--checkpoint.enable",
                     "--checkpoint.interval", "4"],
}
# Our train step (no host syncs) against torchtitan's, on the recipe run: 2 micro-batches a step, a
# global token count over 2 ranks, the balance loss over both, logging every step.
RUNS["recipe_torchtitan_step"] = RUNS["recipe"]
# A logging step's line is written once the next step is queued (train/step.py): a run whose data runs out
# after step 5 (the data_runs_out op: 5 batches) still writes step 5's.
RUNS["data_runs_out"] = ["--training.steps", "10", "--metrics.log_freq", "5"]
# Each line timed from the last logged step's end to its own (train_step.mark), not from line to line:
# step 2's optimizer step takes SLOW seconds longer, every step logged.
SLOW = 3.0
RUNS["slow_step_2"] = ["--training.steps", "4"]
# The routers' gates sharded by rows ([parallelism] router = "auto" here) against FSDP2's router groups.
RUNS["recipe_router_fsdp"] = [*RUNS["recipe"], "--parallelism.router", "fsdp"]
# Full recompute with the blocks' inputs in host memory against it without ([activation_checkpoint] offload_inputs).
RUNS["recipe_full_ac"] = [*RUNS["recipe"], "--activation_checkpoint.mode", "full"]
RUNS["recipe_full_ac_offload"] = [*RUNS["recipe_full_ac"], "--activation_checkpoint.offload_inputs"]
# ... and the attention's outputs with them, the recompute taking them ([activation_checkpoint] offload_attention).
RUNS["recipe_full_ac_offload_attention"] = [*RUNS["recipe_full_ac_offload"],
                                            "--activation_checkpoint.offload_attention"]
# Clipping inside the optimizer against torchtitan's clip (the "_torchtitan_clip" runs), clipping every
# step (max_norm well below the debug run's grad norms), under EP = 2 (gradients on two meshes), with
# torch's fused AdamW and with ours (bf16 moments, and fp32 moments: [optimizer] update = "triton").
CLIP = ["--training.steps", "3", "--parallelism.expert_parallel_degree", "2", "--training.max_norm", "0.05"]
for moments, update in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "triton")):
    for clip in ("", "_torchtitan_clip"):
        name = f"clip_{moments}" + ("_triton" if update == "triton" else "") + clip
        RUNS[name] = [*CLIP, "--optimizer.moments_dtype", moments, "--optimizer.update", update]


ROOT = Path(__file__).resolve().parents[1]
# What a plain CPU run must not print: warnings that say nothing a user can act on,
# torchtitan's A100 fallback and the MFU columns without a peak, colour codes in a log file.
NOISE = ("Warning", "warnings.warn", "lspci", "Peak flops", "Peak FLOPS", "tflops", "mfu", "\x1b[",
         "OMP_NUM_THREADS", "will be overridden")


def test_the_readme_command_trains_quietly(tmp_path):
    # The README's first command, as a user runs it with its output going to a file.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NO_COLOR")}
    env.update(PYTHON=sys.executable, NPROC="2", PYTHONUNBUFFERED="1")
    dump = tmp_path / "run"
    result = subprocess.run(["bash", "scripts/train.sh", "configs/debug.toml", "--job.dump_folder", str(dump),
                             "--training.steps", "3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    assert [line for line in log.splitlines() if any(n in line for n in NOISE)] == []
    assert sum(" step: " in line for line in log.splitlines()) == 3


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    """The folder holding each run's dump folder (one torchrun launch for all of RUNS)."""
    d = tmp_path_factory.mktemp("train_cpu")
    plan = [{"train": ["--job.dump_folder", str(d / name), *overrides]} for name, overrides in RUNS.items()]
    for op, name in zip(plan, RUNS):
        if name.startswith("ep2_bf16"):
            op.update(experts=str(d / f"{name}.experts.json"), experts_in_fsdp=name.endswith("in_fsdp"))
        if name.endswith("_torchtitan_clip"):
            op.update(clip="torchtitan")
        if name.endswith("_torchtitan_step"):
            op.update(step="torchtitan")
        if name == "data_runs_out":
            op.update(batches=5, order=str(d / "data_runs_out.order.json"))
        if name == "slow_step_2":
            op.update(slow_step=[2, SLOW])
    # A working copy changed behind the update's back after step 2 (a monitor step) stops the run.
    plan.append({"stale": ["--job.dump_folder", str(d / "stale"), "--training.steps", "4", "--checks.monitor_freq",
                           "2", "--parallelism.expert_parallel_degree", "2", "--training.mixed_precision_param",
                           "bfloat16"], "out": str(d / "stale.txt")})
    # lr 1e4 diverges after step 1: the run stops at the next save (step 2 is saved, finite) or logged step,
    # naming the first non-finite step and the last good checkpoint ([training] on_nonfinite = "stop").
    plan.append({"diverged": ["--job.dump_folder", str(d / "diverged"), "--training.steps", "8", "--optimizer.lr",
                              "1e4", "--lr_scheduler.warmup_steps", "1", "--checkpoint.enable", "--checkpoint.interval",
                              "2", "--metrics.log_freq", "3"], "out": str(d / "diverged.txt")})
    # The same with on_nonfinite = "skip_step": every step after step 1 is skipped, and the run stops at the second.
    plan.append({"diverged": ["--job.dump_folder", str(d / "skipped"), "--training.steps", "8", "--optimizer.lr", "1e4",
                              "--lr_scheduler.warmup_steps", "1", "--training.on_nonfinite", "skip_step",
                              "--training.max_skipped_steps", "2"], "out": str(d / "skipped.txt")})
    # A run's close() stops its data worker (the debug config has one), not the garbage collector 5 s later.
    plan.append({"train": ["--job.dump_folder", str(d / "workers"), "--training.steps", "2"],
                 "data_workers": str(d / "data_workers.json")})
    launch_plan(plan, d)
    return d


@pytest.fixture(scope="module")
def runs(launched):
    """name -> rank 0's metrics.jsonl records of that run of the debug config on 2 processes."""
    out = {}
    for name in RUNS:
        with open(launched / name / "metrics.jsonl") as f:
            out[name] = [json.loads(line) for line in f]
    return out


def test_a_run_stops_its_data_worker_when_it_closes(launched):
    # Left to the garbage collector, the worker never got its stop signal and was killed after 5 s
    # (torchtitan_moe/components/data: stop_workers): 5 s of every run in a multi-run launch.
    assert json.loads((launched / "data_workers.json").read_text()) == [0]


def test_two_process_debug_run_learns(runs):
    records = runs["learns"]
    losses = [r["loss"] for r in records]
    assert [r["step"] for r in records] == list(range(1, 31))
    assert 0.9 * math.log(2048) < losses[0] < 1.1 * math.log(2048)  # starts near uniform over the vocabulary
    # and learns the stream's structure: within 1.25 nats of its entropy (1.16) by step 30
    # (2.19 measured). A "loss fell by 40%" bound (4.9) also held for a model with cloned experts.
    assert losses[-1] < chain_entropy(4) + 1.25, losses
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in records)
    last = records[-1]
    assert last["throughput(tps)"] > 0 and last["memory/max_reserved(GiB)"] > 0
    loads = last["moe/tokens_per_expert"]
    assert len(loads) == 4 and all(sum(layer) == 2 * 8 * 128 * 2 for layer in loads)  # ranks x batch x seq x top-k
    # A sharded init that gives both ranks the same values makes experts 0-3 clones of 4-7:
    # their loads repeat with period 4 from step 1 on.
    for layer in records[0]["moe/tokens_per_expert"]:
        assert layer[:4] != layer[4:], records[0]["moe/tokens_per_expert"]


def test_the_default_run_ends_with_a_hugging_face_export_of_what_it_trained(runs, launched):
    # debug.toml trains with Qwen3's global-batch balance loss and no expert bias, so last_save_in_hf is
    # allowed and the export routes as the trained model did.
    exported = launched / "learns" / "checkpoint" / "step-30"
    args = convert.read_hf_args(str(exported))
    state = convert.load_hf(str(exported), args, show_progress=False)
    ours = Qwen3MoEModel(args).eval()
    ours.load_state_dict(state)
    job = load_job_config(["--job.config_file", "configs/debug.toml"])
    ((inputs, labels),) = synthetic_held_out(job, args.vocab_size, 1)
    with torch.no_grad():
        logits = ours(inputs)
    held_out = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))
    # What the run learned, on tokens it never saw: near its last training loss (measured: 2.35 held out, 2.27
    # at step 30), far below the untrained ln(2048) = 7.6.
    assert held_out < runs["learns"][-1]["loss"] + 0.4, (held_out, runs["learns"][-1]["loss"])
    transformers = pytest.importorskip("transformers", reason="the Hugging Face parity needs `pip install -e .[test]`")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(exported), torch_dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    with torch.no_grad():
        expected = theirs(inputs[:2]).logits
    error = float((logits[:2] - expected).norm() / expected.norm())
    assert error < 1e-5, error  # transformers runs the export as our model does


def test_expert_parallel_bf16_mixed_precision(runs):
    # bf16 parameters under EP: the experts' FSDP group must leave the fp32 probs alone.
    records = runs["ep2_bf16"]
    assert len(records) == 4 and records[-1]["loss"] < records[0]["loss"]


@pytest.mark.parametrize("optimizer", ["torch", "ours"])
def test_experts_outside_fsdp_train_as_under_it_without_its_copies(runs, launched, optimizer):
    # EP = 2 on 2 processes: the experts' FSDP group would have one rank. They stay outside FSDP2 (fp32
    # master weights on the EP mesh and a bf16 working copy the GEMMs read: no all-gather or reduce-scatter
    # copies) and train bit for bit as they did under FSDP2 (the same casts; a sum over one rank
    # is exact): torch's AdamW (the copies cast after each step) and ours (the copies written by the update).
    name = {"torch": "ep2_bf16", "ours": "ep2_bf16_adamw"}[optimizer]
    layouts = {n: json.loads((launched / f"{n}.experts.json").read_text()) for n in (name, f"{name}_experts_in_fsdp")}
    assert layouts[name] == [{"fsdp": False, "mesh": ["ep"], "weight": "torch.float32",
                              "grad": "torch.float32"}] * 4, layouts[name]
    assert all(seen["fsdp"] for seen in layouts[f"{name}_experts_in_fsdp"]), layouts
    outside, inside = runs[name], runs[f"{name}_experts_in_fsdp"]
    assert len(outside) == 4
    assert [(r["loss"], r["grad_norm"]) for r in outside] == [(r["loss"], r["grad_norm"]) for r in inside]


def test_expert_gradients_kept_in_bf16_train_as_the_fp32_ones(runs):
    # EP = 2 on 2 processes, experts outside FSDP2: their gradients stay on the bf16 working copies, the same
    # values as the fp32 copies (widening is exact). The norm sums the squares of each rank's shards over the
    # EP ranks: the same norm up to fp32 order. Below max_norm (1.0) nothing is clipped, so AdamW reads the
    # same values either way and the losses are equal to the bit.
    kept, fp32 = runs["kept_grads_ep2_bf16_adamw"], runs["ep2_bf16_adamw"]
    assert len(kept) == len(fp32) == 4
    for a, b in zip(kept, fp32):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5) and b["grad_norm"] < 1.0
        assert a["loss"] == b["loss"]


def test_router_recipe_terms_are_logged_each_on_its_own(runs):
    # Global-batch balance loss and z-loss under EP = 2 and 2 micro-batches per step.
    records = runs["recipe"]
    for r in records:
        balance, z = r["moe/balance_loss_per_layer"], r["moe/z_loss_per_layer"]
        assert len(balance) == len(z) == 4
        assert r["moe/balance_loss"] == pytest.approx(sum(balance) / 4)
        assert r["moe/aux_loss"] == pytest.approx(0.01 * r["moe/balance_loss"] + 0.001 * r["moe/z_loss"])
        assert 0.9 < r["moe/balance_loss"] < 1.5 and 0 < r["moe/z_loss"] < 20  # (ln 8)^2 = 4.3 for small logits
        assert all(sum(layer) == 2 * 2 * 8 * 128 * 2 for layer in r["moe/tokens_per_expert"])  # counted once


def test_gates_sharded_by_rows_train_as_fsdp_router_groups_to_the_bit(runs):
    # The recipe run (EP = 2, 2 micro-batches, the global-batch balance loss and z-loss) with each router
    # gathering its gate's rows and reduce-scattering its gradient, against an FSDP2 group per router: the
    # same fp32 all-gather and the same sum of the same terms, so the same losses and grad norms.
    rows, fsdp = runs["recipe"], runs["recipe_router_fsdp"]
    assert len(rows) == 3
    assert [(r["loss"], r["grad_norm"]) for r in rows] == [(r["loss"], r["grad_norm"]) for r in fsdp]


def test_offloaded_block_inputs_train_as_kept_ones_to_the_bit(runs, launched):
    # The recipe under full recompute, each block's input but the last's offloaded: the same values, bit for bit.
    offloaded, kept = runs["recipe_full_ac_offload"], runs["recipe_full_ac"]
    assert len(offloaded) == 3
    assert [(r["loss"], r["grad_norm"]) for r in offloaded] == [(r["loss"], r["grad_norm"]) for r in kept]
    assert "Block inputs offloaded to host memory between forward and backward: 3 of 4 blocks" in \
        (launched / "harness.log").read_text()


def test_kept_attention_outputs_train_as_recomputed_ones(runs, launched):
    # The same recipe with each offloaded block's attention outputs kept for its recompute (ops.causal_attention,
    # torch's CPU flash kernel) against torchtitan's SDPA recomputed.
    kept, recomputed = runs["recipe_full_ac_offload_attention"], runs["recipe_full_ac"]
    assert len(kept) == 3
    assert [(r["loss"], r["grad_norm"]) for r in kept] == [(r["loss"], r["grad_norm"]) for r in recomputed]
    assert "Attention outputs kept in host memory for the recompute: 3 of 4 blocks" in \
        (launched / "harness.log").read_text()


def test_bf16_adamw_moments_train_sharded_and_are_saved_in_bf16(runs, launched):
    # FSDP2 over 2 ranks: the optimizer updates each rank's shard; the checkpoint holds bf16 moments.
    from torch.distributed.checkpoint import FileSystemReader

    records = runs["bf16_moments"]
    assert len(records) == 4 and records[-1]["loss"] < records[0]["loss"]
    step = launched / "bf16_moments" / "checkpoint" / "step-4"
    meta = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    weights = {k for k in meta if k.split(".")[0] in ("tok_embeddings", "layers", "norm", "output")
               and not k.endswith(".expert_bias")}  # a buffer, moved by the balancing hook
    moments = {k.removeprefix("optimizer.state."): m.properties.dtype for k, m in meta.items()
               if k.startswith("optimizer.state.") and "exp_avg" in k}
    assert set(moments) == {f"{w}.{m}" for w in weights for m in ("exp_avg", "exp_avg_sq")}
    assert set(moments.values()) == {torch.bfloat16}, moments


def test_our_train_step_trains_as_torchtitans_bit_for_bit(runs):
    # train/step.py is torchtitan's step without its host syncs, its lines written a step later: every
    # value of every line the same (losses, grad norms, tokens seen, learning rate, MoE statistics and
    # router losses per layer), but for the timings.
    ours, theirs = runs["recipe"], runs["recipe_torchtitan_step"]
    assert len(ours) == len(theirs) == 3
    timings = ("time", "throughput(tps)", "tflops", "mfu(%)", "tflops_causal", "mfu_causal(%)",
               "time_metrics/end_to_end(s)", "memory/max_reserved(GiB)", "memory/max_active(GiB)",
               "memory/num_alloc_retries")
    for a, b in zip(ours, theirs):
        assert "moe/balance_loss_per_layer" in a and a["n_tokens_seen"] == b["n_tokens_seen"] > 0
        assert {k: v for k, v in a.items() if k not in timings} == {k: v for k, v in b.items() if k not in timings}
        assert a["throughput(tps)"] > 0


def test_a_step_line_is_written_once_the_next_step_is_queued(launched, runs):
    # Reading a logged step's values before the next step is queued would drain the GPU (train/step.py).
    # Step 5's line comes when step 6 finds no data; then the run ends, its line written.
    order = json.loads((launched / "data_runs_out.order.json").read_text())
    assert order == [["step", 1], ["step", 2], ["line", 1], ["step", 3], ["step", 4], ["step", 5], ["line", 5]]
    assert [r["step"] for r in runs["data_runs_out"]] == [1, 5]
    assert runs["data_runs_out"][-1]["throughput(tps)"] > 0


def test_each_line_times_its_own_steps(runs):
    # Written a step late, line 1 would also time step 2 (its slow optimizer step) and the last line would
    # come right after the one before it (a time near 0, a huge throughput).
    seconds = [r["time_metrics/end_to_end(s)"] for r in runs["slow_step_2"]]
    assert [r["step"] for r in runs["slow_step_2"]] == [1, 2, 3, 4]
    assert seconds[1] >= SLOW and max(seconds[0], seconds[2], seconds[3]) < SLOW, seconds
    assert min(seconds) > 0.01, seconds


def test_a_stale_working_copy_stops_the_run_after_writing_its_step(launched):
    # The check runs with the monitor step's log, read back once step 3 is queued: the run stops there.
    message = (launched / "stale.txt").read_text()
    assert message.startswith("step 2: the experts' bf16 working copies of ") and "w2 differ" in message, message
    assert "w13" not in message, message
    records = [json.loads(line) for line in (launched / "stale" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]


@pytest.mark.parametrize("moments", ["float32", "bfloat16", "float32_triton"])
def test_clipping_inside_the_optimizer_trains_as_torchtitans_clip(runs, moments):
    ours, theirs = runs[f"clip_{moments}"], runs[f"clip_{moments}_torchtitan_clip"]
    assert all(r["grad_norm"] > 0.05 for r in theirs)  # every step clips
    assert ours[0]["grad_norm"] == theirs[0]["grad_norm"]  # the same norm of the same gradients
    for a, b in zip(ours, theirs):  # then grad / scale against grad * coefficient: rounding apart
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_a_run_that_skips_every_step_stops(launched):
    # [training] on_nonfinite = "skip_step" with max_skipped_steps = 2: lr 1e4 breaks the weights at step 1's update,
    # the steps after it are not finite, the run stops at the second of them (the trainer passes the limit to its watch).
    message = (launched / "skipped.txt").read_text()
    assert re.match(r"step \d+: the (loss|gradient norm|loss and the gradient norm) is not finite, 2 steps in a row "
                    r"skipped: training diverged; .*\[training\] max_skipped_steps = 2", message), message


def test_a_diverged_run_stops_before_saving_nan(launched):
    # lr 1e4 blows the weights up after step 1: the run stops at its next save or logged step, naming the first
    # non-finite step and the last good checkpoint; every saved step is older than it and finite.
    from torchtitan_moe.hf.convert import load_dcp
    from torchtitan_moe.train.checkpoint import model_shapes, read_dcp_metadata

    message = (launched / "diverged.txt").read_text()
    found = re.match(r"step (\d+): the (loss|gradient norm|loss and the gradient norm) is not finite: training "
                     r"diverged; nothing was saved from step \1 on; ", message)
    assert found, message
    bad = int(found[1])
    dump = launched / "diverged"
    saved = sorted(int(p.name.split("-")[1]) for p in (dump / "checkpoint").glob("step-*"))
    assert all(s < bad for s in saved), (saved, bad)
    assert (f"the last good checkpoint is step {saved[-1]} " in message) if saved else "no checkpoint was saved" in message
    for step in saved:
        folder = str(dump / "checkpoint" / f"step-{step}")
        metadata = read_dcp_metadata(folder)
        tensors = load_dcp(folder, list(model_shapes(metadata)), metadata)
        assert all(bool(t.isfinite().all()) for t in tensors.values()), step
    logged = {r["step"]: r["loss"] for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}
    assert all(math.isfinite(loss) for step, loss in logged.items() if step < bad)


def test_every_saved_step_carries_checksums_that_verify(launched):
    from torchtitan_moe.train.checksums import CHECKSUMS_FILE, checksum_problem

    step = launched / "bf16_moments" / "checkpoint" / "step-4"
    manifest = json.loads((step / CHECKSUMS_FILE).read_text())
    assert sorted(manifest["files"]) == sorted(p.name for p in step.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert checksum_problem(str(step)) is None
