"""The parallelism planner (torchtitan_moe.tools.plan): its memory prediction against the peaks bench_train
measured, its exchange bytes against bench_dispatch's rows, its parameter counts against the model's,
and its recommendation; the exchanges it counts under full activation checkpointing against what the dispatcher
keeps on two gloo ranks. Arithmetic otherwise (seconds); the refusals of bad flags are rows of
test_bad_inputs.py's PLAN table."""

import contextlib
import dataclasses
import io
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from spawn_ranks import rank_group, run_ranks
from torchtitan_moe.tools import plan
from torchtitan_moe.models.qwen3_moe import Qwen3MoEModel, flavor_args
from torchtitan_moe.tools.plan import GIB, GPUS, Layout, Run, Shape

ROOT = Path(__file__).resolve().parents[1]
SHAPE_8L = Shape.of(flavor_args("30b-a3b-8l"))

# bench_train's peak memory (torch's max reserved, GiB), 30b-a3b-8l, seq 4096, learned router, H200, AC none
# (configs/qwen3_30b_a3b_8l.toml). (GPUs, EP, local batch, moments bytes, [dispatch] buffers, experts' gradient
# bytes, GiB, run)
# EP = 2: experts outside FSDP2 with bf16 working copies of their weights, the layout the code has (peaks of
# layouts it no longer has, experts under FSDP2 on a one-rank group or cast per use, are left out). The first
# four rows were measured with the train step's host syncs; the train step that never syncs (the host a step
# ahead) raised the EP = 2 peaks by ~4 GiB (fp32 moments, our AdamW as `update = "auto"` picks on a GPU).
# EP = 1: measured with the fused output-layer loss the model counts (earlier peaks, without it, left out).
MEASURED = [
    (2, 2, 4, 8, "worst_case", 4, 69.3, "deepep compiled, step with host syncs"),
    (2, 2, 4, 4, "worst_case", 4, 59.7, "deepep compiled, step with host syncs, bf16 moments"),
    (2, 2, 4, 4, "worst_case", 4, 59.0, "deepep compiled, step with host syncs, bf16 moments, run 2"),
    (2, 2, 4, 4, "worst_case", 4, 58.8, "deepep compiled, step with host syncs, bf16 moments, run 3"),
    (2, 2, 4, 8, "worst_case", 4, 74.0, "deepep compiled"),
    (2, 2, 4, 8, "worst_case", 4, 74.3, "deepep compiled, update triton"),
    (2, 2, 2, 8, "worst_case", 4, 56.8, "deepep compiled, local batch 2"),
    (1, 1, 2, 8, "exact", 4, 98.5, "eager"),
    (1, 1, 4, 8, "exact", 4, 109.9, "eager"),
    (1, 1, 2, 4, "exact", 4, 77.1, "eager, bf16 moments"),
    (1, 1, 4, 4, "exact", 4, 84.2, "eager, bf16 moments"),
    (2, 2, 4, 8, "worst_case", 2, 73.9, "deepep compiled, experts' gradients kept in bf16"),
    (2, 2, 2, 8, "worst_case", 2, 59.1, "deepep compiled, experts' gradients kept in bf16, local batch 2"),
]


@pytest.mark.parametrize("gpus, ep, local_batch, moments, buffers, grads, measured, run", MEASURED,
                         ids=[f"ep{e}-lb{b}-m{m}-{bu}-g{g}-{r.replace(' ', '-')}" for _, e, b, m, bu, g, _, r in MEASURED])
def test_memory_is_within_10_percent_of_the_measured_peak(gpus, ep, local_batch, moments, buffers, grads, measured, run):
    layout = Layout(1, gpus, ep, 1, "none", "local" if ep == 1 else "all_to_all")
    predicted = plan.memory(SHAPE_8L, layout, Run(4096, local_batch, moments, buffers, grads)).total / GIB
    assert abs(predicted / measured - 1) <= 0.10, (run, predicted, measured)


def test_bf16_moments_save_4_bytes_per_local_parameter():
    layout = Layout(1, 2, 2, 1, "none", "all_to_all")
    fp32, bf16 = (plan.memory(SHAPE_8L, layout, Run(4096, 2, m)) for m in (8, 4))
    assert fp32.total - bf16.total == pytest.approx(4 * SHAPE_8L.params / 2)


def test_kept_expert_gradients_save_2_bytes_per_expert_weight_outside_fsdp():
    # EP = 2 on 2 GPUs: the experts outside FSDP2 (one-rank group); their bf16 gradients replace the fp32 ones
    # and the transient bf16 weight gradient before its fp32 copy. Under FSDP2 (EP = 2 on 4 GPUs) nothing changes.
    outside, inside = Layout(1, 2, 2, 1, "none", "all_to_all"), Layout(1, 4, 2, 1, "none", "all_to_all")
    kept, fp32 = (plan.memory(SHAPE_8L, outside, Run(4096, 2, expert_grad_bytes=b)) for b in (2, 4))
    expert_weights = SHAPE_8L.n_layers * SHAPE_8L.expert_params / 2
    assert fp32.grads - kept.grads == pytest.approx(2 * expert_weights)
    assert fp32.staging - kept.staging == pytest.approx(2 * (SHAPE_8L.experts // 2) * 2 * SHAPE_8L.inter * SHAPE_8L.dim)
    assert plan.memory(SHAPE_8L, inside, Run(4096, 2, expert_grad_bytes=2)) == plan.memory(SHAPE_8L, inside, Run(4096, 2))


@pytest.mark.parametrize("flavor", ["debug", "30b-a3b-8l", "235b-a22b"])
def test_parameter_count_is_the_models(flavor):
    args = flavor_args(flavor)
    with torch.device("meta"):
        model = Qwen3MoEModel(args)
    assert Shape.of(args).params == sum(p.numel() for p in model.parameters())


def test_235b_flavor_is_qwen3_235b_a22b():
    shape = Shape.of(flavor_args("235b-a22b"))
    assert (shape.n_layers, shape.dim, shape.experts, shape.top_k, shape.inter) == (94, 4096, 128, 8, 1536)
    assert 234e9 < shape.params < 236e9


@pytest.mark.parametrize("ep, rows", [(2, 16338), (4, 29713)])
def test_rows_per_rank_match_bench_dispatch(ep, rows):
    """Rows rank 0 sent at 8192 tokens, random top-8 of 128 (kernels/bench_dispatch.py on 4 H200s)."""
    assert 8192 * plan.ranks_per_token(SHAPE_8L, ep) == pytest.approx(rows, rel=0.002)


@pytest.mark.parametrize("dispatcher, ep, dispatch_us, combine_us", [
    ("deepep", 2, 185, 171),  # tuned, on 2 H200s
    ("all_to_all", 2, 158, 158),  # exchange each way (NCCL, per-rank rows)
    ("all_to_all", 4, 346, 346),
])
def test_exchange_time_matches_bench_dispatch(dispatcher, ep, dispatch_us, combine_us):
    layout = Layout(1, 8, ep, 1, "none", dispatcher)
    e = plan.exchange(SHAPE_8L, layout, Run(4096, 2), GPUS["h200"])
    assert e.network_bytes == 0
    assert e.dispatch_s * 1e6 == pytest.approx(dispatch_us, rel=0.05)
    assert e.combine_s * 1e6 == pytest.approx(combine_us, rel=0.05)


def test_a_recompute_that_exchanges_again_exchanges_half_as_much_again():
    # forward and backward: 2 exchanges a layer; a checkpointed layer whose recompute exchanges again: 3.
    gpu, layout = GPUS["h200"], Layout(1, 4, 4, 1, "full", "all_to_all")
    replaying = plan.step_seconds(SHAPE_8L, layout, Run(4096, 8), gpu)
    exchanging = plan.step_seconds(SHAPE_8L, layout, Run(4096, 8, keep_exchanges=False), gpu)
    assert exchanging["exchange"] == pytest.approx(1.5 * replaying["exchange"]) and replaying["exchange"] > 0
    assert exchanging["compute"] == replaying["compute"]
    unchecked = dataclasses.replace(layout, ac="none")  # nothing recomputed: the setting does nothing
    assert plan.step_seconds(SHAPE_8L, unchecked, Run(4096, 8, keep_exchanges=False), gpu)["exchange"] == \
        pytest.approx(replaying["exchange"])


def test_an_ep_group_across_nodes_sends_over_the_network_and_never_with_deepep():
    layouts = plan.layouts(8, 4, 128)  # EP 8 spans two nodes of 4 GPUs here
    assert {lay.ep for lay in layouts if lay.dispatcher == "deepep"} == {2, 4}
    assert {lay.ep for lay in layouts} == {1, 2, 4, 8, 16, 32}
    assert {lay.ep for lay in plan.layouts(4, 8, 128) if lay.dispatcher == "deepep"} == {2, 4, 8}
    run, gpu = Run(4096, 2), GPUS["h200"]
    inside = plan.exchange(SHAPE_8L, Layout(4, 8, 8, 1, "none", "all_to_all"), run, gpu)
    across = plan.exchange(SHAPE_8L, Layout(4, 8, 16, 1, "none", "all_to_all"), run, gpu)
    assert inside.network_bytes == 0 and across.network_bytes > 0
    assert across.total_s > inside.total_s  # the network is ~10x slower than NVLink


def test_recommendation_is_the_fastest_layout_that_fits():
    gpu, run = GPUS["h100"], Run(4096, 8)
    rows = plan.plan(SHAPE_8L, run, 1, 2, gpu)
    best = plan.recommend(rows, gpu)
    assert best is not None and best.fits(gpu)
    assert [r for r in rows if not r.fits(gpu)], "the case should have layouts that do not fit"
    assert all(best.step["total"] <= r.step["total"] for r in rows if r.fits(gpu))
    # Memory decides: on 2 H100s at local batch 8 only activation checkpointing fits.
    assert best.layout.ac == "full"


def test_no_layout_fits_235b_on_one_node_of_h200s():
    shape, gpu = Shape.of(flavor_args("235b-a22b")), GPUS["h200"]
    rows = plan.plan(shape, Run(4096, 1), 1, 8, gpu)
    assert plan.recommend(rows, gpu) is None
    assert plan.recommend(plan.plan(shape, Run(4096, 1), 8, 8, gpu), gpu) is not None


def test_the_cli_prints_every_layout_and_a_recommendation():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = plan.main([str(ROOT / "configs" / "qwen3_30b_a3b_8l.toml"), "--nodes", "2", "--gpus-per-node", "8",
                          "--gpu", "h100", "--global-batch", str(4 * 16 * 2 * 4096)])
    text = out.getvalue()
    assert code == 0, text
    assert "4 per step (524,288 tokens per step)" in text
    table = [line for line in text.splitlines() if line.startswith("| EP ")]
    assert len(table) == len(plan.layouts(2, 8, 128))
    assert text.splitlines()[-1].startswith("recommended: EP ")


def test_a_layout_fits_only_with_the_models_10_percent_left():
    gpu = GPUS["h200"]
    layout = Layout(1, 2, 2, 1, "none", "all_to_all")
    run = Run(4096, 2)
    row = plan.Row(layout, plan.memory(SHAPE_8L, layout, run), None, {})
    need = row.memory.total / GIB
    assert row.fits(plan.Gpu("x", need / 0.89, 1, 1, 1))
    assert not row.fits(plan.Gpu("x", need / 0.95, 1, 1, 1))
    assert gpu.memory_gib == pytest.approx(140.4, abs=0.05)


@pytest.mark.parametrize("flags, grad_bytes", [
    ([], 2),  # "auto": one micro-batch a step, our AdamW: kept in bf16
    (["--global-batch", str(2 * 2 * 2 * 4096)], 4),  # 2 micro-batches a step: fp32
    (["--optimizer.update", "torch"], 4),  # torchtitan's AdamW reads only the weights' own gradients
    (["--optimizer.expert_grad_dtype", "float32"], 4),
])
def test_the_planner_reads_expert_grad_dtype_auto_as_the_trainer_resolves_it(flags, grad_bytes):
    _, _, run, *_ = plan.parse([str(ROOT / "configs" / "qwen3_30b_a3b_8l.toml"), "--nodes", "1", "--gpus-per-node",
                                "2", "--training.local_batch_size", "2", *flags])
    assert run.expert_grad_bytes == grad_bytes


# bench_train's peak memory (GiB), 30b-a3b-8l, seq 4096, local batch 2, learned router, fp32 moments, H200s, with
# activation checkpointing full and without it, the same settings otherwise. (GPUs, EP, [dispatch] buffers, experts'
# gradient bytes, [activation_checkpoint] mode, GiB, run)
# Eager: worklogs/2026-11-28-planner-checkpointing-peaks.md (EP = 1 on one H200; EP = 2 all_to_all on 2 H200s, the
# experts' gradients kept in bf16 as 'auto' picks there). Compiled, EP = 1: worklogs/2026-11-25-export.md.
MEASURED_AC = [
    (1, 1, "exact", 4, "none", 97.4, "eager"),
    (1, 1, "exact", 4, "full", 87.2, "eager, AC full"),
    (2, 2, "exact", 2, "none", 50.7, "all_to_all eager"),
    (2, 2, "exact", 2, "full", 47.2, "all_to_all eager, AC full"),
    (1, 1, "exact", 4, "none", 98.5, "export eager"),
    (1, 1, "exact", 4, "none", 97.2, "export compiled"),
    (1, 1, "exact", 4, "full", 86.6, "export compiled, AC full"),
]
# The planner counts eager's memory; compiled under full checkpointing at EP = 1 peaked 10.3% below its figure (it
# counts 6.3 GiB saved by checkpointing there, eager measured 10.2 GiB saved): a known gap, kept in view.
# The eager AC-full peak was measured with the loss's logits in one piece; the planner now counts the chunked
# loss's fp32 sum of the output layer's gradient (1.2 GiB), which that run did not hold: to be measured again.
GAPS = {"export compiled, AC full": "10.3% above the compiled peak: less saved by full checkpointing at EP = 1 "
                                    "than measured",
        "eager, AC full": "10.8% above a peak measured before the loss came in chunks (its fp32 sum of the output "
                          "layer's gradient, 1.2 GiB, not in that run)"}


@pytest.mark.parametrize("gpus, ep, buffers, grads, ac, measured, run", [
    pytest.param(*row, marks=[pytest.mark.xfail(strict=True, reason=GAPS[row[-1]])] if row[-1] in GAPS else [],
                 id=f"ep{row[1]}-ac_{row[4]}-{row[-1].replace(' ', '-').replace(',', '')}") for row in MEASURED_AC])
def test_memory_with_and_without_checkpointing_is_within_10_percent_of_the_measured_peak(gpus, ep, buffers, grads, ac,
                                                                                         measured, run):
    layout = Layout(1, gpus, ep, 1, ac, "local" if ep == 1 else "all_to_all")
    predicted = plan.memory(SHAPE_8L, layout, Run(4096, 2, 8, buffers, grads)).total / GIB
    assert abs(predicted / measured - 1) <= 0.10, (run, predicted, measured)


# -- the exchanges a checkpointed layer keeps, measured on gloo ranks --------------------------------------------

KEPT_SHAPE = Shape(dim=64, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=64, vocab=100, experts=16, top_k=4, inter=32)
KEPT_TOKENS = 4096


def kept_worker(rank, world, port, failures):
    """One MoE layer at EP = 2 whose dispatcher keeps its exchanges for a recompute, routed as the planner assumes
    (each token's k experts uniform among all), under bf16 autocast; -> the bytes it kept, through `failures`
    if wrong."""
    from torchtitan_moe.dispatch.all_to_all import AllToAllDispatcher
    from torchtitan_moe.dispatch.seam import Routing
    from torchtitan_moe.moe import MoE, MoEArgs

    with rank_group(rank, world, port, failures):
        s, T = KEPT_SHAPE, KEPT_TOKENS
        torch.manual_seed(0)
        layer = MoE(MoEArgs(num_experts=s.experts, top_k=s.top_k, inter_dim=s.inter, padding="none"), s.dim)
        layer.init_weights(out_std=0.1)
        mine = slice(rank * s.experts // world, (rank + 1) * s.experts // world)
        layer.experts.w13 = torch.nn.Parameter(layer.experts.w13.detach()[mine].clone())
        layer.experts.w2 = torch.nn.Parameter(layer.experts.w2.detach()[mine].clone())
        dispatcher = AllToAllDispatcher(s.experts, dist.group.WORLD)
        dispatcher.keep_exchanges = True  # as parallelize sets it for a checkpointed block
        layer.set_dispatcher(dispatcher)
        g = torch.Generator().manual_seed(10 + rank)
        experts = torch.rand(T, s.experts, generator=g).argsort(dim=1)[:, : s.top_k]
        routing = Routing(torch.full((T, s.top_k), 1 / s.top_k), experts,
                          torch.bincount(experts.flatten(), minlength=s.experts), torch.zeros(T, s.experts), None)
        layer.router.forward = lambda x, **kwargs: routing
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(torch.randn(1, T, s.dim, generator=g, requires_grad=True))
        kept = sum(t.nbytes for item in dispatcher._kept if isinstance(item, list) for t in item
                   if isinstance(t, torch.Tensor))
        total = torch.tensor(float(kept), dtype=torch.float64)
        dist.all_reduce(total)
        predicted = (plan.memory(s, Layout(1, 2, 2, 1, "full", "all_to_all"), Run(T, 1)).activations
                     - plan.memory(s, Layout(1, 2, 1, 1, "full", "local"), Run(T, 1)).activations)
        mean = total.item() / world  # the planner's figure is a rank's on average
        assert abs(predicted / mean - 1) < 0.02, (rank, kept, mean, predicted)


def test_full_checkpointing_keeps_the_exchanges_the_dispatcher_keeps():
    # What EP adds to a checkpointed model's memory is the exchanges its dispatchers keep for the recompute: the
    # rows in, their metadata and the rows back (2.27 MB a rank here), measured against the planner's count.
    run_ranks(kept_worker, 2)
