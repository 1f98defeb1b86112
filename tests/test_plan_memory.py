"""The full model's memory on 4 GPUs at EP = 1 and 4 (tools/plan.py memory_items, tools/plan_memory.py
--breakdown): the terms against hand arithmetic, against issue 51's measured peaks, and the candidates' savings."""

import contextlib
import dataclasses
import io
from pathlib import Path

import pytest

from torchtitan_moe.models.qwen3_moe import flavor_args
from torchtitan_moe.tools import plan, plan_memory
from torchtitan_moe.tools.plan import GIB, Layout, Run, Shape

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "qwen3_30b_a3b_4gpu.toml"
FULL = Shape.of(flavor_args("30b-a3b"))
EP4 = Layout(1, 4, 4, 1, "full", "all_to_all")
EP1 = Layout(1, 4, 1, 1, "full", "local")

# Issue 51's peaks (torch's max reserved, GiB): 30b-a3b on 4 H200s, EP = 4, seq 4096, full recompute, compiled,
# learned router, one micro-batch a step (so the experts' gradients kept in bf16: expert_grad_dtype "auto").
# (dispatcher, local batch, moments bytes, GiB). The lb 4 run was on another host of the same kind.
MEASURED = [("all_to_all", 2, 8, 134.8), ("deepep", 2, 8, 128.2), ("all_to_all", 4, 4, 126.0)]


@pytest.mark.parametrize("dispatcher, batch, moments, measured", MEASURED)
def test_the_full_model_at_ep4_is_within_10_percent_of_the_measured_peaks(dispatcher, batch, moments, measured):
    layout = dataclasses.replace(EP4, dispatcher=dispatcher)
    predicted = plan.memory(FULL, layout, Run(4096, batch, moments, "exact", 2)).total / GIB
    assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)


# EP = 1 (the experts under FSDP2 over the 4 ranks, the local dispatcher), bf16 moments, the loss in chunks of
# rows, the allocator's fixed-size segments (the planner's model; expandable segments reserve 5.5 GiB less here),
# 2026-11-28: (local batch, GiB). The shipped config's batch.
MEASURED_EP1 = [(16, 119.2)]


@pytest.mark.parametrize("batch, measured", MEASURED_EP1)
def test_the_full_model_at_ep1_is_within_10_percent_of_the_measured_peaks(batch, measured):
    predicted = plan.memory(FULL, EP1, Run(4096, batch, 4)).total / GIB
    assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)


def test_the_experts_stay_outside_fsdp2_only_where_their_group_has_one_rank():
    # parallelize.experts_outside_fsdp: the experts' group is efsdp x the replicas under HSDP. EP 4 on one node of 4
    # has one rank there; with a second replica (HSDP 2 x 4) FSDP2 holds the experts (replicated over the nodes).
    def items(layout):
        return {what for _, what, _ in plan.memory_items(FULL, layout, Run(4096, 2, 4, "exact", 2))}
    assert "experts' bf16 working copies, every layer" in items(EP4)
    for layout in (Layout(2, 4, 4, 2, "full", "all_to_all"), EP1):
        assert "experts' bf16 working copies, every layer" not in items(layout)
        assert "gradients, experts (fp32)" in items(layout)


def test_the_step_estimate_reproduces_the_step_its_rate_was_measured_on():
    # tools/plan.py's compute rate is the shipped setting's run: 13,853 tokens/s/GPU at 4 x 16 x 4096 tokens a step.
    measured = 16 * 4096 / 13_853
    estimate = plan.step_seconds(FULL, EP1, Run(4096, 16, 4), plan.GPUS["h200"])
    assert estimate["exchange"] == 0 and estimate["total"] == pytest.approx(measured, rel=0.01)


@pytest.mark.xfail(strict=True, reason="the planner under-counts local batch 8 with the recompute exchanging again: "
                   "97.5 GiB predicted, 130.7-136.9 measured in five runs (torch's max reserved), of which 115.1 "
                   "allocated at the peak (max active): ~18 GiB of allocations it does not count, ~22 of segments "
                   "reserved but free")
def test_local_batch_8_exchanging_again_is_within_10_percent_of_its_measured_peak():
    # EP 4 at its fastest measured setting: bf16 moments, bf16 expert gradients, [dispatch] recompute = "exchange".
    predicted = plan.memory(FULL, EP4, Run(4096, 8, 4, "exact", 2, keep_exchanges=False)).total / GIB
    assert abs(predicted / 136.6 - 1) <= 0.10, predicted


def test_the_experts_state_by_hand():
    # An EP = 4 rank holds 32 experts x 48 layers x 3 x 768 x 2048 = 7.25B expert parameters: fp32 weights (4 B),
    # bf16 working copies (2), bf16 gradients (2), fp32 moments (8): 16 B each.
    items = {what: size for _, what, size in plan.memory_items(FULL, EP4, Run(4096, 2, 8, "exact", 2))}
    experts = 48 * 32 * 3 * 768 * 2048
    assert experts == 7_247_757_312
    assert items["weights, experts (fp32)"] == 4 * experts and items["gradients, experts (bf16)"] == 2 * experts
    assert items["AdamW moments, experts (fp32)"] == 8 * experts
    assert items["experts' bf16 working copies, every layer"] == 2 * experts


def test_full_recompute_keeps_both_exchanges_of_every_layer():
    # Each forward keeps for its replay (dispatch/replay.py) the rows and metadata it received and the rows its
    # combine received back: (2 D + 8 K + 2 D) bytes per (token, rank) row; at 8192 tokens a rank, 29,713 rows
    # (bench_dispatch's count at EP 4, test_plan.py).
    run = Run(4096, 2, 8, "exact", 2)
    items = {what: size for _, what, size in plan.memory_items(FULL, EP4, run)}
    rows = 8192 * plan.ranks_per_token(FULL, 4)
    assert rows == pytest.approx(29_713, rel=0.002)
    assert items["exchanges kept for the recompute"] == pytest.approx(48 * (4 * 2048 + 64) * rows)
    redone = {what for _, what, _ in plan.memory_items(FULL, EP4, dataclasses.replace(run, keep_exchanges=False))}
    assert plan.memory(FULL, EP4, run).total - plan.memory(FULL, EP4, dataclasses.replace(run, keep_exchanges=False)).total \
        == pytest.approx(items["exchanges kept for the recompute"])
    assert "exchanges kept for the recompute" in redone  # a row of 0 bytes, not a missing one


def test_the_candidates_save_what_they_drop():
    run = Run(4096, 2, 8, "exact", 2)
    total = plan.memory(FULL, EP4, run).total
    experts, local = 48 * 32 * 3 * 768 * 2048, FULL.params / 4
    assert total - plan.memory(FULL, EP4, dataclasses.replace(run, moments_bytes=4)).total == pytest.approx(4 * local)
    # no working copies: every layer's bf16 copy gone, one layer's cast in flight instead
    cast = plan.memory(FULL, EP4, dataclasses.replace(run, expert_copies=False)).total
    assert total - cast == pytest.approx(2 * experts - 2 * experts / 48)
    rows = {what: (lay, r) for what, lay, r, _ in plan_memory.candidates(EP4, run)}
    assert "experts' gradients in bf16 (one micro-batch a step)" not in rows  # the config already has them
    assert rows["no recompute"][0].ac == "none" and rows["the same, no recompute"][1].expert_copies is False


def breakdown(*overrides: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = plan.main([str(CONFIG), "--nodes", "1", "--gpus-per-node", "4", "--breakdown", *overrides])
    text = out.getvalue()
    assert code == 0, text
    return text


def test_the_breakdown_of_the_shipped_4_gpu_config():
    # Shipped: EP = 1, local batch 16, bf16 moments: no exchange, the experts' gradients FSDP2's (fp32).
    text = breakdown()
    assert text.startswith("## Memory of one GPU: EP 1 local, FSDP 4, AC full, local batch 16 x 4096")
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and line.count("|") == 4]
    parts = [r for r in rows if r[0].removeprefix("| ") in plan.PARTS]
    shipped = Run(4096, 16, 4)
    total = plan.memory(FULL, EP1, shipped).total / GIB
    assert sum(float(r[2].rstrip(" |")) for r in parts) == pytest.approx(total, abs=0.01 * len(parts))
    assert f"| total | torch's peak reserved, predicted | {total:.1f} |" in text
    assert "| grads | gradients, experts (fp32) | 27.00 |" in text and "working copies" not in text
    fp32 = plan.memory(FULL, EP1, dataclasses.replace(shipped, moments_bytes=8)).total / GIB
    assert f"| fp32 AdamW moments | {fp32:.1f} | +{fp32 - total:.1f} |" in text
    assert "| bf16 AdamW moments |" not in text  # the config's own setting is no candidate
    # nothing of the experts' own state nor of exchanges to cut at EP = 1: no rows that change nothing
    candidates = text.split("## Candidates")[1]
    assert "exchang" not in candidates and "expert gradients" not in candidates
    assert candidates.count("| +0.0 |") == 1  # as configured


EP4_LB8 = ("--parallelism.expert_parallel_degree", "4", "--dispatch.backend", "all_to_all", "--training.local_batch_size", "8")


def test_the_breakdown_at_ep4():
    text = breakdown(*EP4_LB8, "--dispatch.recompute", "exchange")
    assert text.startswith("## Memory of one GPU: EP 4 node all_to_all, FSDP 4, AC full, local batch 8 x 4096")
    exchanging = Run(4096, 8, 4, "exact", 2, keep_exchanges=False)  # one micro-batch: bf16 expert gradients
    total = plan.memory(FULL, EP4, exchanging).total / GIB
    assert f"| total | torch's peak reserved, predicted | {total:.1f} |" in text
    assert "| activations | exchanges kept for the recompute | 0.00 |" in text
    cast = plan.memory(FULL, EP4, dataclasses.replace(exchanging, expert_copies=False)).total / GIB
    assert f"| no bf16 working copies of the experts (cast per use) | {cast:.1f} | {cast - total:+.1f} |" in text


def test_the_breakdown_reads_how_the_config_recomputes_its_exchanges():
    text = breakdown(*EP4_LB8, "--training.local_batch_size", "2", "--dispatch.recompute", "replay")
    replaying = plan.memory(FULL, EP4, Run(4096, 2, 4, "exact", 2)).total / GIB
    assert f"| total | torch's peak reserved, predicted | {replaying:.1f} |" in text
    exchanging = plan.memory(FULL, EP4, Run(4096, 2, 4, "exact", 2, keep_exchanges=False)).total / GIB
    assert f"| the recompute exchanges again (nothing kept for it) | {exchanging:.1f} | -{replaying - exchanging:.1f} " \
           "| yes | yes |" in text
    assert "| the recompute replays its exchanges (kept for it) |" not in text


def test_the_breakdown_refuses_what_it_cannot_model():
    with pytest.raises(plan.ConfigError, match=r"\[activation_checkpoint\] mode = 'selective', selective_ac_option = '2'"):
        plan.report([str(CONFIG), "--nodes", "1", "--gpus-per-node", "4", "--breakdown",
                     "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"])


def test_offloaded_block_inputs_leave_three_on_the_gpu():
    # [activation_checkpoint] offload_inputs: of the 48 blocks' bf16 inputs [T, D] the last block's and two
    # brought back stay; the breakdown reads the key and offers the other setting.
    kept, offloaded = (plan.memory(FULL, EP1, Run(4096, 16, 4, offload_inputs=o)).total for o in (False, True))
    assert kept - offloaded == 45 * 2 * FULL.dim * 16 * 4096
    text = breakdown("--activation_checkpoint.offload_inputs")
    assert "| activations | block inputs: the last block's, the one offloaded last, one brought back (the rest in host memory) | 0.75 |" in text
    assert f"| block inputs on the GPU | {kept / GIB:.1f} | +{(kept - offloaded) / GIB:.1f} |" in text
    assert "| block inputs in host memory" not in text


def test_offloaded_attention_outputs_add_two_blocks_of_theirs():
    # [activation_checkpoint] offload_attention: the last offloaded block's out [T, 32 x 128] bf16 and lse [32, T]
    # fp32 stay until its backward, and one block's come back ahead of it.
    base, kept = (plan.memory(FULL, EP1, Run(4096, 16, 4, offload_inputs=True, offload_attention=a)).total
                  for a in (False, True))
    assert kept - base == 2 * 16 * 4096 * 32 * (128 * 2 + 4)
    text = breakdown("--activation_checkpoint.offload_inputs", "--activation_checkpoint.offload_attention")
    assert "| activations | attention outputs: the ones offloaded last, ones brought back | 1.02 |" in text
