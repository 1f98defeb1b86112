"""Parallelism planner: memory per GPU and the expert exchange's time for each sensible layout.

    python -m torchtitan_moe.tools.plan CONFIG --nodes N --gpus-per-node G [--gpu h200|h100|b200]
        [--global-batch TOKENS] [--breakdown] [--section.key value ...]

For every layout (EP within a node or across nodes, FSDP or HSDP, activation checkpointing off or
on) it prints the memory one GPU needs at the config's micro-batch and sequence, against the GPU's,
and the time one MoE layer's exchange takes (dispatch + combine, forward), from the bytes a rank
sends to other ranks and the link they cross, then recommends the fitting layout with the
shortest estimated step. Nothing runs on a GPU: it is arithmetic on the flavor's shapes. --breakdown
prints instead the config's own layout term by term and the candidates to cut it (tools/plan_memory.py).

Memory, per GPU, from first principles (no term fitted to a measurement). It predicts what
`bench_train` prints: torch's peak *reserved* memory, the caching allocator's segments. The parts:
    persistent  fp32 master weights (4 B), fp32 gradients (4 B; 2 B for experts outside FSDP2 where
                [optimizer] expert_grad_dtype keeps them in bf16) and the AdamW moments (8 B, or 4 B with
                [optimizer] moments_dtype = "bfloat16") per local parameter (all sharded by FSDP/HSDP)
    forward     bf16 compute copies of the weights (one process: autocast's copies of every matrix,
                kept for the backward; FSDP2: two unsharded blocks in flight and the unsharded
                output layer, which is not resharded after the forward; experts whose FSDP group
                has one rank stay outside FSDP2 and keep a bf16 working copy of all their weights),
                the activations each
                layer keeps for its backward, the output layer's loss (ops.linear_cross_entropy:
                one chunk of rows' bf16 logits overwritten by their gradient, the weight's gradient
                summed in fp32 and rounded, the gradient of h) and the dispatcher's send and
                receive rows for one layer
    staging     FSDP2's backward: a block's unsharded bf16 gradients and their fp32 copy for the
                reduce-scatter, for two blocks (the previous reduce-scatter's input is kept until
                the next one starts); experts outside FSDP2: one matrix's bf16 weight gradient
The gradients are counted next to the forward's peak, not instead of it: they are allocated in
the backward at parameter shapes, which the freed activation blocks (other shapes, smaller) do not
fit, and without `expandable_segments` the allocator keeps both sets of segments reserved from one
step to the next. One exception, `reuse`: the segment the loss's last chunk of logits frees at the
end of the forward takes the backward's first large allocations on the compute stream: on one process the
gradients; under FSDP2 the staging (the gradients are the reduce-scatter's outputs there, allocated
on its own stream, whose pool never takes a block the compute stream freed), and the fp32 gradients
of experts outside FSDP2 (made by their GEMM op, on the compute stream). DeepEP's NVLink
buffer (cudaMalloc'd by DeepEP, outside torch's counters) is not counted.

Exchange time: rows of D bf16 values, one per (token, destination rank) as both dispatchers send
them; a token's K experts reach d = EP (1 - C(E - E/EP, K) / C(E, K)) ranks on average (uniform
routing), (EP - 1)/EP of them remote. Bytes over NVLink (ranks of the node) and over the network
(other nodes) each at its link's bandwidth times an efficiency: measured by
kernels/bench_dispatch.py on H200s for NVLink (EFFICIENCY), assumed for the network. DeepEP only
where the EP group is inside one node (its intranode kernels).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from torchtitan_moe.components.flops import flops_per_token
from torchtitan_moe.config.sections import ConfigError
from torchtitan_moe.dispatch import registry
from torchtitan_moe.ops.cross_entropy import default_chunk_rows

GIB = 1024**3
USAGE = ("usage: python -m torchtitan_moe.tools.plan CONFIG --nodes N --gpus-per-node G [--gpu h200|h100|b200] "
         "[--global-batch TOKENS] [--breakdown] [--section.key value ...]")


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float  # what torch.cuda.get_device_properties reports as total
    nvlink_gbs: float  # NVLink per GPU, per direction
    network_gbs: float  # the network per GPU, per direction (ASSUMED: one 400 Gb/s NIC per GPU)
    bf16_tflops: float  # dense bf16 peak (torchtitan's table)


GPUS = {
    # H200: 143,771 MiB measured; NVLink 18 x 26.6 GB/s as bench_dispatch.
    "h200": Gpu("H200", 143_771 / 1024, 18 * 26.6, 50.0, 989.0),
    "h100": Gpu("H100", 81_559 / 1024, 18 * 26.6, 50.0, 989.0),
    "b200": Gpu("B200", 183_359 / 1024, 18 * 50.0, 50.0, 2250.0),
}

# Measured share of the NVLink limit (kernels/bench_dispatch.py, H200, 8192 tokens/rank, Qwen3-30B-A3B
# shapes): all_to_all (NCCL, per-rank rows) 44% at EP 2 and 55% at EP 4;
# DeepEP tuned 38% dispatch, 41% combine at EP 2.
# EP 8 and DeepEP at EP 4/8 are not measured: the nearest measured figure is used.
EFFICIENCY = {
    ("all_to_all", 2): (0.44, 0.44), ("all_to_all", 4): (0.55, 0.55),
    ("deepep", 2): (0.38, 0.41),
}
# A layout fits when its predicted memory is within this share of the GPU's: the prediction is within 10%
# of every measured peak (tests/test_plan.py), so 10% is left for its error.
FIT_SHARE = 0.9
NETWORK_EFFICIENCY = 0.8  # ASSUMED (not measured here): NCCL all-to-all over InfiniBand
# Measured compute rate for the estimated step: bench_train of configs/qwen3_30b_a3b_4gpu.toml as shipped (the
# full 30b-a3b compiled at EP = 1 on 4 H200s, local batch 16, full recompute): 386.7 TFLOP/s of the model's
# FLOPs, 515.6 with the forward run again, i.e. 52.1% of the peak; the same share for other GPUs.
MEASURED_MFU = 386.7 * 4 / 3 / 989.0


def efficiency(dispatcher: str, ep: int) -> tuple[float, float]:
    """(dispatch, combine) share of the NVLink limit, measured or the nearest measured EP's."""
    known = sorted(e for d, e in EFFICIENCY if d == dispatcher)
    nearest = min(known, key=lambda e: (abs(math.log2(ep) - math.log2(e)), -e))
    return EFFICIENCY[(dispatcher, nearest)]


@dataclass(frozen=True)
class Shape:
    """A flavor's sizes (parameters counted as the model builds them)."""
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    experts: int
    top_k: int
    inter: int

    @classmethod
    def of(cls, args) -> Shape:
        m = args.moe
        return cls(args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim, args.vocab_size,
                   m.num_experts, m.top_k, m.inter_dim)

    @property
    def attention_params(self) -> int:  # wq, wk, wv, wo and the q/k norms, per layer
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return self.dim * (q + 2 * kv) + q * self.dim + 2 * self.head_dim

    @property
    def expert_params(self) -> int:  # w13 [E, 2I, D] and w2 [E, D, I], per layer
        return 3 * self.experts * self.inter * self.dim

    @property
    def layer_params(self) -> int:  # + two norms and the router gate [E, D]
        return self.attention_params + self.expert_params + 2 * self.dim + self.experts * self.dim

    @property
    def params(self) -> int:
        return 2 * self.vocab * self.dim + self.n_layers * self.layer_params + self.dim

    @property
    def active_params(self) -> int:
        """Parameters a token meets, without the input embedding: the experts' top_k / experts share."""
        return (self.params - self.vocab * self.dim
                - self.n_layers * self.expert_params * (self.experts - self.top_k) // self.experts)

    def flops_per_token(self, seq: int, causal: bool = False) -> float:
        """Training FLOPs per token as the trainer counts them (args.get_nparams_and_flops), or the causal count
        (components/flops.py)."""
        return flops_per_token(self.active_params, self.n_layers, self.n_heads, self.head_dim, seq, causal)


@dataclass(frozen=True)
class Layout:
    nodes: int
    gpus_per_node: int
    ep: int
    replicate: int  # HSDP replicas (1: FSDP over every GPU)
    ac: str  # "none", "full", or "selective" (op-level: the breakdown's estimate)
    dispatcher: str = "local"  # one of dispatchers(ep, gpus_per_node)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def shard(self) -> int:
        return self.world // self.replicate

    @property
    def name(self) -> str:
        where = "" if self.ep == 1 else (" node" if self.ep <= self.gpus_per_node else " nodes")
        dp = f"FSDP {self.shard}" if self.replicate == 1 else f"HSDP {self.replicate}x{self.shard}"
        dp = "one process (no FSDP)" if self.world == 1 else dp
        return f"EP {self.ep}{where} {self.dispatcher}, {dp}, AC {self.ac}"


@dataclass(frozen=True)
class Run:
    seq: int
    micro_batch: int  # sequences per GPU per forward (the config's local_batch_size)
    moments_bytes: int = 8  # both AdamW moments per parameter: 8 (fp32) or 4 (bf16)
    buffers: str = "exact"  # [dispatch] buffers
    expert_grad_bytes: int = 4  # experts outside FSDP2: fp32 gradients (4) or kept on the working copies (2)
    expert_copies: bool = True  # experts outside FSDP2 keep bf16 working copies (False: a candidate, cast per use)
    keep_exchanges: bool = True  # a recompute replays its forward's exchanges (False: exchanges again, [dispatch] recompute)
    offload_inputs: bool = False  # full recompute's block inputs in host memory ([activation_checkpoint] offload_inputs)
    offload_attention: bool = False  # and their attention outputs ([activation_checkpoint] offload_attention)

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch


def ranks_per_token(shape: Shape, ep: int) -> float:
    """Expected distinct EP ranks among a token's top-k experts (uniform routing)."""
    per_rank = shape.experts // ep
    miss = math.prod((shape.experts - per_rank - i) / (shape.experts - i) for i in range(shape.top_k))
    return ep * (1 - miss)


def activation_bytes_per_token(shape: Shape, one_process: bool, slots: float) -> float:
    """Bytes one layer keeps for its backward per token. `slots`: expert rows per token.
    One process trains under autocast with fp32 weights, so the residual stream and the norms'
    outputs are fp32 (4 B); under FSDP2 they are bf16 and the router keeps an fp32 copy of its input."""
    D, q, kv = shape.dim, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    s = 4 if one_process else 2
    attention = (s * D  # block input (attention_norm's)
                 + 2 * D  # its normed output, as the q/k/v projections keep it (bf16)
                 + 2 * (q + kv)  # q, k before their norms
                 + 2 * (q + 2 * kv)  # q, k, v into attention
                 + 2 * q + 4 * shape.n_heads  # attention output, log-sum-exp
                 + s * D)  # h, ffn_norm's input
    router = s * D + (0 if one_process else 4 * D) + 4 * shape.experts + 12 * shape.top_k
    experts = slots * 2 * (D + 2 * shape.inter + shape.inter)  # rows in, [a | b], swiglu out (bf16)
    return attention + router + experts


@dataclass
class Memory:
    """Bytes per GPU, by part."""
    params: float
    grads: float
    optimizer: float
    compute_copies: float
    activations: float
    loss: float
    dispatch: float
    staging: float  # FSDP2's reduce-scatter staging in the backward
    reuse: float  # <= 0: the backward's first allocations placed in the logits' freed segment

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.compute_copies + self.activations + self.loss
                + self.dispatch + self.staging + self.reuse)

    def gib(self) -> dict[str, float]:
        parts = {k: v / GIB for k, v in vars(self).items()}
        return {**parts, "total": self.total / GIB}


# Where each term goes in Memory: the parts `memory_items` names its terms by.
PARTS = ("params", "grads", "optimizer", "compute_copies", "activations", "loss", "dispatch", "staging", "reuse")


def experts_outside_fsdp(layout: Layout) -> bool:
    """The experts' FSDP group (efsdp, and the replicas under HSDP) has one rank: they stay outside FSDP2,
    with bf16 working copies and gradients of their own (parallelize.keep_experts_unsharded)."""
    return layout.world > 1 and layout.replicate * (layout.shard // layout.ep) == 1


def memory_items(shape: Shape, layout: Layout, run: Run) -> list[tuple[str, str, float]]:
    """Every term of one GPU's memory: (Memory part, what it is, bytes); `memory` sums them by part."""
    T, D, V, K = run.tokens, shape.dim, shape.vocab, shape.top_k
    L, ep = shape.n_layers, layout.ep
    one_process = layout.world == 1
    # FSDP/HSDP shard every parameter; EP x efsdp = shard for the experts.
    experts_local = L * shape.expert_params / layout.shard
    dense_local = (shape.params - L * shape.expert_params) / layout.shard
    outside = experts_outside_fsdp(layout)
    grad_bytes = run.expert_grad_bytes if outside else 4
    items = [
        ("params", "weights, dense (fp32)", 4 * dense_local),
        ("params", "weights, experts (fp32)", 4 * experts_local),
        ("grads", "gradients, dense (fp32)", 4 * dense_local),
        ("grads", f"gradients, experts ({'bf16' if grad_bytes == 2 else 'fp32'})", grad_bytes * experts_local),
        ("optimizer", f"AdamW moments, dense ({'bf16' if run.moments_bytes == 4 else 'fp32'})",
         run.moments_bytes * dense_local),
        ("optimizer", f"AdamW moments, experts ({'bf16' if run.moments_bytes == 4 else 'fp32'})",
         run.moments_bytes * experts_local),
    ]
    block = shape.attention_params + 2 * D + (0 if outside else shape.expert_params / ep)  # unsharded
    staging = 0.0
    if one_process:  # autocast's bf16 copies of every matrix but the embedding and the fp32 router
        items.append(("compute_copies", "autocast's bf16 copies of the matrices",
                      2 * (shape.params - shape.vocab * D - L * (shape.experts * D + 2 * D) - D)))
    else:  # two unsharded blocks in flight (the router all-gathered in fp32), the output layer kept
        items.append(("compute_copies", "two unsharded blocks in flight (bf16; the router fp32)",
                      2 * (2 * block + 4 * shape.experts * D)))
        items.append(("compute_copies", "the output layer, unsharded (bf16)", 2 * V * D))
        staging = 2 * (2 + 4) * block  # bf16 gradients + their fp32 reduce-scatter input, two blocks
        items.append(("staging", "FSDP2's reduce-scatter staging, two blocks (bf16 + fp32)", staging))
        if outside:
            if run.expert_copies:
                items.append(("compute_copies", "experts' bf16 working copies, every layer",
                              2 * L * shape.expert_params / ep))
            else:  # a candidate: each layer's experts cast when used, forward and backward
                items.append(("compute_copies", "experts cast to bf16 per use, one layer", 2 * shape.expert_params / ep))
            if run.expert_grad_bytes == 4:  # one bf16 weight gradient (w13) before its fp32 copy
                w13 = 2 * (shape.experts // ep) * 2 * shape.inter * D
                items.append(("staging", "experts' w13 bf16 gradient before its fp32 copy", w13))
                staging += w13
    received = T * ranks_per_token(shape, ep) if ep > 1 else 0.0  # rows per (token, rank), per rank
    slots = T * K
    if ep > 1 and run.buffers == "worst_case":  # every token of every rank may bring min(K, E_local) slots
        slots = ep * T * min(K, shape.experts // ep)
        received = ep * T
    per_layer = activation_bytes_per_token(shape, one_process, slots / T) * T
    s = 4 if one_process else 2
    # A recomputed block that replays its exchanges (dispatch/replay.py) keeps from each forward the rows and
    # metadata it received ([R, D] bf16, [R, 2K] fp32) and the rows its combine received back ([R, D] bf16).
    kept = (2 * D + 8 * K + 2 * D) * received if run.keep_exchanges else 0.0
    if layout.ac == "none":
        items.append(("activations", "every layer's activations", L * per_layer))
    elif layout.ac == "full":
        if run.offload_inputs:  # at the backward's start: the last block's, the one offloaded last, one brought back
            items.append(("activations", "block inputs: the last block's, the one offloaded last, one brought back "
                          "(the rest in host memory)", min(L, 3) * s * D * T))
            if run.offload_attention:  # out [T, H x Dh] in the blocks' dtype, lse [H, T] fp32
                items.append(("activations", "attention outputs: the ones offloaded last, ones brought back",
                              min(L - 1, 2) * T * shape.n_heads * (shape.head_dim * s + 4)))
        else:
            items.append(("activations", "block inputs", L * s * D * T))
        items.append(("activations", "exchanges kept for the recompute", L * kept))
        items.append(("activations", "one block recomputed", per_layer))
    else:  # selective: what parallelize's op list saves (an estimate: not measured)
        items.append(("activations", "op outputs saved (selective: the op list's)",
                      L * sac_bytes_per_token(shape, one_process, slots / T) * T))
        items.append(("activations", "exchanges kept for the recompute", L * kept))
        items.append(("activations", "one block recomputed", per_layer))
    logits = 2 * V * default_chunk_rows(T, V, 2)  # one chunk's, bf16, overwritten by their gradient
    items.append(("loss", "the loss: one chunk of logits (bf16), d weight (fp32 sum, bf16), d h",
                  logits + 6 * V * D + 2 * T * D))
    items.append(("dispatch", "one layer's send and receive rows (bf16)", 2 * 2 * D * received))
    # The backward's first large allocations on the compute stream: one process, the gradients; FSDP2,
    # its staging, and the fp32 gradients of experts outside it (their op makes them on that stream).
    expert_grads = run.expert_grad_bytes * L * shape.expert_params / ep if outside else 0.0
    on_compute = 4 * (dense_local + experts_local) if one_process else staging + expert_grads
    items.append(("reuse", "the backward's first allocations in the logits' freed segment", -min(logits, on_compute)))
    return items


def sac_bytes_per_token(shape: Shape, one_process: bool, slots: float) -> float:
    """Bytes a layer keeps per token under selective (op) checkpointing: the outputs of the ops
    parallelize._SAC_SAVE_LIST names, every second mm among them (torchtitan's policy): q and v (wq, wv; not
    wk, wo), the gate's logits (fp32), attention's output and log-sum-exp, both grouped GEMMs' outputs, and
    the block input. An estimate from the op list, not a measurement."""
    D, q, kv = shape.dim, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    s = 4 if one_process else 2
    attention = s * D + 2 * q + 2 * kv + 2 * q + 4 * shape.n_heads
    experts = slots * 2 * (2 * shape.inter + D)  # [a | b] and the w2 output, bf16
    return attention + 4 * shape.experts + experts


def memory(shape: Shape, layout: Layout, run: Run) -> Memory:
    parts = dict.fromkeys(PARTS, 0.0)
    for part, _, size in memory_items(shape, layout, run):
        parts[part] += size
    return Memory(**parts)


@dataclass
class Exchange:
    """One MoE layer's forward exchange for one rank."""
    nvlink_bytes: float
    network_bytes: float
    dispatch_s: float
    combine_s: float

    @property
    def total_s(self) -> float:
        return self.dispatch_s + self.combine_s


def exchange(shape: Shape, layout: Layout, run: Run, gpu: Gpu) -> Exchange:
    """Rows a rank sends to other ranks and the time they take (combine sends them back)."""
    ep, G = layout.ep, layout.gpus_per_node
    if ep == 1:
        return Exchange(0.0, 0.0, 0.0, 0.0)
    remote = run.tokens * ranks_per_token(shape, ep) * (ep - 1) / ep * shape.dim * 2
    # EP groups are consecutive ranks: a group of EP <= G ranks stays in a node; a larger group spans
    # EP / G nodes, and a rank's peers outside its node are (EP - G) of its EP - 1 peers.
    share_network = 0.0 if ep <= G else (ep - G) / (ep - 1)
    nvlink, network = remote * (1 - share_network), remote * share_network
    eff = efficiency(layout.dispatcher, min(ep, G))

    def seconds(e: float) -> float:
        return max(nvlink / (gpu.nvlink_gbs * 1e9 * e), network / (gpu.network_gbs * 1e9 * NETWORK_EFFICIENCY))

    return Exchange(nvlink, network, seconds(eff[0]), seconds(eff[1]))


def fsdp_seconds(shape: Shape, layout: Layout, gpu: Gpu) -> tuple[float, float]:
    """(per micro-batch, per step) FSDP traffic time. Per micro-batch: parameters all-gathered twice
    (forward, backward) in bf16 and gradients reduce-scattered in fp32, the dense ones over the shard
    group, the experts over their efsdp group (shard / EP ranks); per step (HSDP): the shards' fp32
    all-reduce across replicas. Over NVLink while the shard group fits a node, else the network; NCCL
    at the all-to-all's measured NVLink efficiency (ASSUMED the same for these collectives)."""
    S, R, ep = layout.shard, layout.replicate, layout.ep
    experts = shape.n_layers * shape.expert_params
    dense = shape.params - experts
    sent = (S - 1) * dense / S * (2 + 2 + 4) + (S // ep - 1) * experts / S * (2 + 2 + 4)
    if S <= layout.gpus_per_node:
        bandwidth = gpu.nvlink_gbs * efficiency("all_to_all", min(S, 4))[0]
    else:
        bandwidth = gpu.network_gbs * NETWORK_EFFICIENCY
    across = 2 * (R - 1) / R * shape.params / S * 4
    return sent / (bandwidth * 1e9), across / (gpu.network_gbs * NETWORK_EFFICIENCY * 1e9)


def step_seconds(shape: Shape, layout: Layout, run: Run, gpu: Gpu, accum: int = 1) -> dict[str, float]:
    """An estimate to rank layouts by, per optimizer step of `accum` micro-batches: compute at the
    measured MFU (a third more with full AC: the forward again), the exchange (forward and backward, and
    the recompute's where it exchanges again; not hidden), FSDP traffic hidden behind compute except for
    what exceeds it, HSDP's all-reduce not hidden."""
    compute = shape.flops_per_token(run.seq) * run.tokens / (gpu.bf16_tflops * 1e12 * MEASURED_MFU)
    if layout.ac == "full":
        compute *= 4 / 3
    passes = 3 if layout.ac != "none" and not run.keep_exchanges else 2
    exch = passes * shape.n_layers * exchange(shape, layout, run, gpu).total_s
    fsdp, allreduce = fsdp_seconds(shape, layout, gpu)
    total = accum * (max(compute, fsdp) + exch) + allreduce
    return {"compute": accum * compute, "exchange": accum * exch, "fsdp": accum * fsdp + allreduce, "total": total}


def dispatchers(ep: int, gpus_per_node: int) -> list[str]:
    """The dispatchers that take a bf16 run at this EP (dispatch/registry.py) and whose exchange is modelled
    here: measured (EFFICIENCY), or none at EP = 1."""
    run = registry.Run(ep, procs_per_node=gpus_per_node)
    return [e.name for e in registry.usable(run) if ep == 1 or any(d == e.name for d, _ in EFFICIENCY)]


def layouts(nodes: int, gpus_per_node: int, experts: int) -> list[Layout]:
    """EP: powers of two dividing the experts, up to a node or across whole nodes; FSDP over all
    GPUs or HSDP with a shard group of one or more whole nodes; AC off and on."""
    world = nodes * gpus_per_node
    out = []
    replicas = [r for r in range(1, nodes + 1) if nodes % r == 0]
    ep = 1
    while ep <= min(world, experts):
        if experts % ep == 0 and (ep <= gpus_per_node or ep % gpus_per_node == 0):
            for r in replicas:
                if (world // r) % ep == 0 and (r == 1 or world // r >= gpus_per_node):
                    for dispatcher in dispatchers(ep, gpus_per_node):
                        for ac in ("none", "full"):
                            out.append(Layout(nodes, gpus_per_node, ep, r, ac, dispatcher))
        ep *= 2
    return out


@dataclass
class Row:
    layout: Layout
    memory: Memory
    exchange: Exchange
    step: dict[str, float]

    def fits(self, gpu: Gpu) -> bool:
        return self.memory.total / GIB <= FIT_SHARE * gpu.memory_gib


def plan(shape: Shape, run: Run, nodes: int, gpus_per_node: int, gpu: Gpu, accum: int = 1) -> list[Row]:
    """Every layout, fitting ones first, each group by estimated step time."""
    rows = [Row(lay, memory(shape, lay, run), exchange(shape, lay, run, gpu), step_seconds(shape, lay, run, gpu, accum))
            for lay in layouts(nodes, gpus_per_node, shape.experts)]
    return sorted(rows, key=lambda r: (not r.fits(gpu), r.step["total"], r.memory.total))


def recommend(rows: list[Row], gpu: Gpu) -> Row | None:
    """The fitting layout with the shortest estimated step; ties: less memory."""
    fitting = [r for r in rows if r.fits(gpu)]
    return min(fitting, key=lambda r: (round(r.step["total"], 6), r.memory.total), default=None)


# ----------------------------------------------------------------------------------------- CLI

def _take(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag or arg.startswith(flag + "="):
            if "=" in arg:
                del argv[i]
                return arg.split("=", 1)[1]
            value = argv[i + 1] if i + 1 < len(argv) else ""
            del argv[i : i + 2]
            return value
    return None


def _positive(argv: list[str], flag: str, required: bool, what: str) -> int | None:
    text = _take(argv, flag)
    if text is None:
        if required:
            raise ConfigError(f"{flag} is missing: {what}")
        return None
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{flag} {text!r}: must be {what}")
    return int(text)


def parse(argv: list[str]):
    """(config, Shape, Run, nodes, gpus_per_node, Gpu, accumulation steps)."""
    from torchtitan_moe.train.job_config import load_job_config
    from torchtitan_moe.config.torchtitan_keys import expert_gradient_conflicts
    from torchtitan_moe.models.qwen3_moe import flavor_args

    argv = list(argv)
    if not argv or argv[0].startswith("-"):
        raise ConfigError(USAGE)
    nodes = _positive(argv, "--nodes", True, "a number of nodes >= 1")
    per_node = _positive(argv, "--gpus-per-node", True, "a number of GPUs per node >= 1")
    gpu_name = _take(argv, "--gpu") or "h200"
    if gpu_name not in GPUS:
        raise ConfigError(f"--gpu {gpu_name!r}: expected one of {', '.join(GPUS)}")
    global_batch = _positive(argv, "--global-batch", False, "a number of tokens >= 1")
    config = load_job_config(["--job.config_file", argv[0], *argv[1:]])
    if config.model.name != "qwen3_moe":
        raise ConfigError(f"[model] name = {config.model.name!r}: the planner knows 'qwen3_moe'")
    args = flavor_args(config.model.flavor)
    args.update_from_config(config)
    shape = Shape.of(args)
    seq, micro = config.training.seq_len, config.training.local_batch_size
    world = nodes * per_node
    accum = 1
    if global_batch is not None:
        if global_batch % (world * seq * micro):
            raise ConfigError(f"--global-batch {global_batch}: must be a multiple of GPUs x seq_len x local_batch_size "
                              f"({world} x {seq} x {micro} = {world * seq * micro} tokens)")
        accum = global_batch // (world * seq * micro)
    moments = 4 if config.optimizer.moments_dtype == "bfloat16" else 8
    setting = config.optimizer.expert_grad_dtype  # "auto": kept in bf16 where nothing stops it (on a GPU)
    kept = setting == "bfloat16" or (setting == "auto" and accum == 1 and not expert_gradient_conflicts(config))
    expert_grads = 2 if kept else 4
    run = Run(seq, micro, moments, config.dispatch.buffers, expert_grads,
              keep_exchanges=config.dispatch.recompute == "replay",
              offload_inputs=config.activation_checkpoint.offload_inputs,
              offload_attention=config.activation_checkpoint.offload_attention)
    return config, shape, run, nodes, per_node, GPUS[gpu_name], accum


def report(argv: list[str]) -> str:
    argv = list(argv)
    breakdown = "--breakdown" in argv
    if breakdown:
        argv.remove("--breakdown")
    config, shape, run, nodes, per_node, gpu, accum = parse(argv)
    if breakdown:
        from torchtitan_moe.tools import plan_memory

        return plan_memory.render(shape, plan_memory.config_layout(config, nodes, per_node), run, gpu)
    rows = plan(shape, run, nodes, per_node, gpu, accum)
    best = recommend(rows, gpu)
    world = nodes * per_node
    lines = [
        f"{config.model.flavor}: {shape.params / 1e9:.1f}B parameters, {shape.n_layers} layers, "
        f"{shape.experts} experts top-{shape.top_k}; {nodes} x {per_node} {gpu.name} ({gpu.memory_gib:.1f} GiB each); "
        f"micro-batch {run.micro_batch} x {run.seq} tokens per GPU, {accum} per step "
        f"({accum * run.tokens * world:,} tokens per step); AdamW moments {run.moments_bytes} B/param, "
        f"experts' gradients outside FSDP2 {run.expert_grad_bytes} B/param, buffers {run.buffers}",
        "",
        "| layout | params+grads+optimizer GiB | compute copies | activations | loss | dispatch | staging | reuse | total GiB "
        f"| fits {FIT_SHARE:.0%} | exchange/layer us (NVLink MB, network MB) | est. step s (compute, exchange, fsdp) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r.memory.gib()
        e, s = r.exchange, r.step
        lines.append(
            f"| {r.layout.name} | {m['params'] + m['grads'] + m['optimizer']:.1f} | {m['compute_copies']:.1f} | "
            f"{m['activations']:.1f} | {m['loss']:.1f} | {m['dispatch']:.2f} | {m['staging']:.1f} | {m['reuse']:.1f} | {m['total']:.1f} | "
            f"{'yes' if r.fits(gpu) else 'no'} | {e.total_s * 1e6:.0f} ({e.nvlink_bytes / 1e6:.0f}, "
            f"{e.network_bytes / 1e6:.0f}) | {s['total']:.2f} ({s['compute']:.2f}, {s['exchange']:.2f}, {s['fsdp']:.2f}) |")
    lines.append("")
    if best is None:
        lines.append(f"recommended: none fits {FIT_SHARE:.0%} of {gpu.memory_gib:.1f} GiB; lower [training] local_batch_size, "
                     "use [optimizer] moments_dtype = 'bfloat16', or more GPUs")
    else:
        lines.append(f"recommended: {best.layout.name}: {best.memory.total / GIB:.1f} of {gpu.memory_gib:.1f} GiB, "
                     f"exchange {best.exchange.total_s * 1e6:.0f} us per layer, est. {best.step['total']:.2f} s "
                     "per step")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from torchtitan_moe.train.job_config import run_command

    return run_command(report, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
