"""Where one GPU's memory goes, term by term, for the config's own layout, and what each candidate cut leaves.

    python -m torchtitan_moe.tools.plan CONFIG --nodes N --gpus-per-node G --breakdown [--section.key value ...]

The terms are the planner's (tools/plan.py memory_items: the same arithmetic as its layout table), for the
layout the config trains: its EP degree, FSDP over every GPU (HSDP where it replicates), its activation
checkpointing, its dispatcher and buffers, its AdamW moments and the experts' gradients as the trainer
resolves them. The candidates are the same arithmetic with one setting changed, then several together, at
the config's local batch and at twice it: bf16 (or fp32) AdamW moments ([optimizer] moments_dtype), the experts'
gradients kept in bf16 ([optimizer] expert_grad_dtype; one micro-batch a step), no bf16 working copies of
the experts (cast per use: not in the code today), a recompute that exchanges again instead of replaying what
its forward kept ([dispatch] recompute), full recompute's block inputs in host memory ([activation_checkpoint]
offload_inputs), selective recompute (an estimate from the op list) and none.
"""

from __future__ import annotations

import dataclasses

from torchtitan_moe.tools.plan import (FIT_SHARE, GIB, Gpu, Layout, Run, Shape, dispatchers, experts_outside_fsdp, memory,
                                       memory_items)


def config_layout(config, nodes: int, gpus_per_node: int) -> Layout:
    """The layout `config` trains on nodes x gpus_per_node GPUs."""
    from torchtitan_moe.config.sections import ConfigError

    ac = config.activation_checkpoint
    if ac.mode not in ("none", "full", "selective") or (ac.mode == "selective" and ac.selective_ac_option != "op"):
        option = f", selective_ac_option = {ac.selective_ac_option!r}" if ac.mode == "selective" else ""
        raise ConfigError(f"[activation_checkpoint] mode = {ac.mode!r}{option}: the breakdown knows 'none', 'full' "
                          "and 'selective' with selective_ac_option = 'op'")
    p = config.parallelism
    ep, replicate = p.expert_parallel_degree, max(p.data_parallel_replicate_degree, 1)
    modelled = dispatchers(ep, gpus_per_node)  # the registry's that the planner models, its default first
    dispatcher = config.dispatch.backend if config.dispatch.backend in modelled else modelled[0]
    return Layout(nodes, gpus_per_node, ep, replicate, config.activation_checkpoint.mode, dispatcher)


def candidates(layout: Layout, run: Run) -> list[tuple[str, Layout, Run, bool]]:
    """(what, layout, run, in the code today) for the configured setting and each cut, alone and together: the
    cuts of the experts' own state where they are outside FSDP2, of the kept exchanges where there are any."""
    change = dataclasses.replace
    outside, exchanges = experts_outside_fsdp(layout), layout.ep > 1
    cuts = [
        ("bf16 AdamW moments", layout, change(run, moments_bytes=4), True),
        ("fp32 AdamW moments", layout, change(run, moments_bytes=8), True),
    ]
    if outside:
        cuts += [
            ("experts' gradients in bf16 (one micro-batch a step)", layout, change(run, expert_grad_bytes=2), True),
            ("experts' gradients in fp32 (gradient accumulation)", layout, change(run, expert_grad_bytes=4), True),
            ("no bf16 working copies of the experts (cast per use)", layout, change(run, expert_copies=False), False),
        ]
    if exchanges:
        cuts += [
            ("the recompute exchanges again (nothing kept for it)", layout, change(run, keep_exchanges=False), True),
            ("the recompute replays its exchanges (kept for it)", layout, change(run, keep_exchanges=True), True),
        ]
    if layout.ac == "full":
        cuts += [
            ("block inputs in host memory", layout, change(run, offload_inputs=True), True),
            ("block inputs on the GPU", layout, change(run, offload_inputs=False), True),
        ]
    cuts += [
        ("selective recompute (op list; estimate)", change(layout, ac="selective"), run, True),
        ("full recompute", change(layout, ac="full"), run, True),
        ("no recompute", change(layout, ac="none"), run, True),
    ]
    rows = [("as configured", layout, run, True)]
    rows += [c for c in cuts if c[2] != run or c[1] != layout]  # a cut the config already makes is no row
    double = change(run, micro_batch=2 * run.micro_batch)
    if not outside:
        rows.append((f"as configured, local batch {double.micro_batch}", layout, double, True))
        if layout.ac == "full" and not run.offload_inputs:
            rows.append((f"block inputs in host memory, local batch {double.micro_batch}", layout,
                         change(double, offload_inputs=True), True))
        return rows
    lean = change(run, moments_bytes=4, expert_grad_bytes=2, expert_copies=False)
    rows.append(("bf16 moments + bf16 expert gradients + no working copies", layout, lean, False))
    recompute = {"full": "full recompute", "selective": "selective recompute (estimate)", "none": "no recompute"}
    rows += [(f"the same, {recompute[ac]}", change(layout, ac=ac), lean, False) for ac in recompute if ac != layout.ac]
    if exchanges:
        rows.append(("the same, full recompute exchanging again", change(layout, ac="full"),
                     change(lean, keep_exchanges=False), False))
    rows.append((f"as configured, local batch {double.micro_batch}", layout, double, True))
    rows.append((f"bf16 moments + bf16 expert gradients, local batch {double.micro_batch}", layout,
                 change(double, moments_bytes=4, expert_grad_bytes=2), True))
    if exchanges:
        rows.append((f"the same, exchanging again, local batch {double.micro_batch}", layout,
                     change(double, moments_bytes=4, expert_grad_bytes=2, keep_exchanges=False), True))
    rows.append((f"+ no working copies, local batch {double.micro_batch}", layout,
                 change(double, moments_bytes=4, expert_grad_bytes=2, expert_copies=False), False))
    return rows


def render(shape: Shape, layout: Layout, run: Run, gpu: Gpu) -> str:
    items = memory_items(shape, layout, run)
    total = memory(shape, layout, run).total
    experts_local = shape.n_layers * shape.expert_params / layout.shard
    lines = [
        f"## Memory of one GPU: {layout.name}, local batch {run.micro_batch} x {run.seq}, buffers {run.buffers}",
        "",
        f"{experts_local / 1e9:.2f}B of the {shape.params / 1e9:.2f}B parameters are this GPU's experts; "
        f"{(shape.params - shape.n_layers * shape.expert_params) / layout.shard / 1e9:.2f}B its shard of the rest.",
        "",
        "| part | what | GiB |",
        "|---|---|---|",
    ]
    lines += [f"| {part} | {what} | {size / GIB:.2f} |" for part, what, size in items]
    lines += [f"| total | torch's peak reserved, predicted | {total / GIB:.1f} |", "",
              f"## Candidates (fits: within {FIT_SHARE:.0%} of {gpu.name}'s {gpu.memory_gib:.1f} GiB)", "",
              "| candidate | GiB | vs configured | fits | in the code today |", "|---|---|---|---|---|"]
    for what, lay, r, today in candidates(layout, run):
        gib = memory(shape, lay, r).total / GIB
        lines.append(f"| {what} | {gib:.1f} | {gib - total / GIB:+.1f} | {'yes' if gib <= FIT_SHARE * gpu.memory_gib else 'no'} "
                     f"| {'yes' if today else 'no'} |")
    return "\n".join(lines)
