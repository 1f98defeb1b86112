"""Router-init checks: stop a broken router before step 1.

A zero (or constant) gate makes every score equal; top-k then sends every token to experts
0..k-1 and, under expert parallelism, every rank's tokens to EP rank 0. Per MoE layer:

    gate weights (no forward):  NaN/inf, all zero, constant, duplicated rows,
                                std vs [router] init_std
    a probe batch (random tokens through the whole model, no_grad, every rank):
        tokens_per_expert [E] over all ranks -> load entropy, busiest expert, load CV,
        dead experts, busiest EP rank; ties among each token's top k + 1 choice values;
        scores/probs dtype (router math in fp32); expert bias mean

Each problem is a `Finding`: one line naming the layer, the statistic, its value, the
threshold and the likely cause. All findings are computed from global (all-gathered or
all-reduced) values, so every rank reaches the same verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_moe.moe.router import Router

# Gate std may differ from [router] init_std by this factor either way. A truncated normal at
# +-3 std has 0.99x the std; 10x off means the init was not the configured one (e.g. a std
# scaled by the model dim or an init function that never ran).
GATE_STD_RATIO = 10.0
# Normalized load entropy H(load) / ln E. Balanced: 1; all tokens on the same top_k experts
# (a zero gate): ln k / ln E = 0.33 at 8 experts top-2, 0.43 at 128 top-8. A healthy random
# init scores > 0.95 on the probe.
MIN_LOAD_ENTROPY = 0.75
# Busiest expert's tokens / mean tokens per expert. Balanced: 1; a zero gate: E / k (4 at
# 8 top-2, 16 at 128 top-8); a healthy random init: < 1.6 at both shapes.
MAX_LOAD_OVER_MEAN = 3.0
# Coefficient of variation of tokens_per_expert. A zero gate: sqrt(E/k - 1) = 1.7 at 8 top-2,
# 3.9 at 128 top-8; a healthy random init: < 0.25.
MAX_LOAD_CV = 1.0
# Experts that get no probe token, as a fraction of all experts (a zero gate: 1 - k/E). Only
# judged when a balanced router would leave fewer than MAX_EXPECTED_DEAD of them empty.
MAX_DEAD_FRACTION = 0.25
MAX_EXPECTED_DEAD = 0.01
# Busiest EP rank's tokens / mean over EP ranks: at most halfway from balanced (1) to all on
# one rank (ep), and at most 2 (that rank does twice the expert work; the step waits for it).
MAX_EP_LOAD_OVER_MEAN = 2.0
# Tokens with two equal values among their k + 1 highest choices (score + expert bias): at the
# k-th / (k+1)-th, top-k breaks the tie by expert index, not by the router; above, two experts
# score alike (duplicated gate rows). A zero gate: every token; a healthy fp32 init: none.
MAX_TIE_FRACTION = 0.01
# |mean(expert_bias)|: the balancing update (moe/balance.py) keeps it at 0 up to rounding;
# one full default update step (1e-3) of common drift means something else wrote the bias.
MAX_BIAS_MEAN = 1e-3
# Seed of the probe's random tokens (plus the rank, so ranks see different tokens).
PROBE_SEED = 20240917
# The probe has at least this many routed tokens per expert on average over all ranks: the
# sampling noise of a balanced router's busiest expert is then ~1.4x the mean at 128 experts,
# far from MAX_LOAD_OVER_MEAN.
MIN_PROBE_TOKENS_PER_EXPERT = 64


@dataclass(frozen=True)
class Finding:
    layer: str  # e.g. "layers.3.moe.router"
    statistic: str
    value: float | str
    threshold: str  # the allowed range, in words
    cause: str

    def __str__(self) -> str:
        value = f"{self.value:.4g}" if isinstance(self.value, float) else str(self.value)
        return f"{self.layer}: {self.statistic} = {value} ({self.threshold}): {self.cause}"


def _zero_gate_cause(init_std: float) -> str:
    if init_std == 0:
        return "zero-initialized gate: [router] init_std = 0 (set it > 0, e.g. 0.02)"
    return f"zero-initialized gate although [router] init_std = {init_std}: the init did not run or was overwritten"


# ---------------------------------------------------------------------------------------
# Statistics, each a pure function of tensors -> list[Finding].
# ---------------------------------------------------------------------------------------


def gate_findings(layer: str, weight: torch.Tensor, init_std: float, fresh: bool = True) -> list[Finding]:
    """weight [E, D]: the full gate. `fresh`: the weights are the init (step 0), not trained ones."""
    w = weight.detach().double()
    bad = int((~torch.isfinite(w)).sum())
    if bad:
        return [Finding(layer, "gate weights NaN/inf", float(bad), "allowed: 0",
                        "a bad init or a corrupt checkpoint")]
    if not w.any():
        return [Finding(layer, "gate weight max |w|", 0.0, "must be > 0",
                        _zero_gate_cause(init_std) + "; every token gets the same top-k experts")]
    std = float(w.std(unbiased=False))
    if std == 0:
        return [Finding(layer, "gate weight std", 0.0, "must be > 0",
                        "constant gate: every expert gets the same logit, every token the same top-k experts")]
    duplicates = duplicated_rows(w)
    if duplicates:
        pairs = ", ".join(f"{i}={j}" for i, j in duplicates[:4]) + (", ..." if len(duplicates) > 4 else "")
        return [Finding(layer, "duplicated gate rows (experts)", pairs, "allowed: none",
                        f"{len(duplicates)} expert pairs have equal gate rows: they tie on every token and "
                        "train alike (an init that drew the same values on every rank?)")]
    if fresh and init_std > 0:
        ratio = std / init_std
        if not 1 / GATE_STD_RATIO <= ratio <= GATE_STD_RATIO:
            return [Finding(layer, "gate weight std / [router] init_std", ratio,
                            f"allowed {1 / GATE_STD_RATIO:g}..{GATE_STD_RATIO:g}",
                            f"gate std {std:.3g} vs configured {init_std:g}: the configured init did not run")]
    return []


def duplicated_rows(w: torch.Tensor) -> list[tuple[int, int]]:
    """w [E, D] -> pairs (i, j), i < j, of equal rows; each row paired with its group's first."""
    _, group, counts = torch.unique(w, dim=0, return_inverse=True, return_counts=True)
    pairs = []
    for g in (counts > 1).nonzero().flatten().tolist():
        first, *others = (group == g).nonzero().flatten().tolist()
        pairs += [(first, other) for other in others]
    return sorted(pairs)


def load_findings(layer: str, loads: torch.Tensor, top_k: int, ep: int = 1) -> list[Finding]:
    """loads [E]: tokens per expert over all ranks (each token counted top_k times)."""
    num_experts = loads.numel()
    loads = loads.double()
    slots = float(loads.sum())
    if top_k >= num_experts or slots == 0:
        return []  # every token already goes to every expert: nothing to judge
    collapse = "tokens crowd onto a few experts: a zero or constant gate, or inputs that do not vary across tokens"
    found = []
    mean = slots / num_experts
    p = loads / slots
    entropy = float(-(p[p > 0] * p[p > 0].log()).sum() / math.log(num_experts))
    if entropy < MIN_LOAD_ENTROPY:
        found.append(Finding(layer, "load entropy / ln E", entropy, f"must be >= {MIN_LOAD_ENTROPY}, balanced 1",
                             collapse))
    busiest = float(loads.max()) / mean
    if busiest > MAX_LOAD_OVER_MEAN:
        found.append(Finding(layer, "busiest expert tokens / mean", busiest,
                             f"allowed <= {MAX_LOAD_OVER_MEAN:g}, balanced 1", collapse))
    cv = float(loads.std(unbiased=False)) / mean
    if cv > MAX_LOAD_CV:
        found.append(Finding(layer, "load CV", cv, f"allowed <= {MAX_LOAD_CV:g}, balanced 0", collapse))
    # Chance that a balanced router leaves a given expert without any of the probe's tokens.
    expected_dead = (1 - top_k / num_experts) ** (slots / top_k)
    dead = float((loads == 0).double().mean())
    if expected_dead < MAX_EXPECTED_DEAD and dead > MAX_DEAD_FRACTION:
        found.append(Finding(layer, "share of experts with no tokens", dead,
                             f"allowed <= {MAX_DEAD_FRACTION:g}", collapse))
    if ep > 1:
        # Rank r owns experts [r E/ep, (r+1) E/ep): its tokens are the sum over that block.
        rank_loads = loads.view(ep, num_experts // ep).sum(dim=1)
        ep_busiest = float(rank_loads.max()) / (slots / ep)
        limit = min(MAX_EP_LOAD_OVER_MEAN, (1 + ep) / 2)
        if ep_busiest > limit:
            rank = int(rank_loads.argmax())
            found.append(Finding(layer, f"busiest EP rank (rank {rank}) tokens / mean", ep_busiest,
                                 f"allowed <= {limit:g}, balanced 1, all on one rank {ep}",
                                 "one EP rank receives most tokens: " + collapse))
    return found


def count_ties(choice: torch.Tensor, top_k: int) -> tuple[int, torch.Tensor]:
    """choice [T, E] (score + expert bias) -> (tokens with two equal values among their top_k + 1,
    pairs [E, E] int64: pairs[i, j], i < j, tokens on which experts i and j tie there)."""
    num_experts = choice.shape[1]
    pairs = torch.zeros(num_experts, num_experts, dtype=torch.int64, device=choice.device)
    if top_k >= num_experts:
        return 0, pairs  # every token gets every expert: nothing to choose
    top = choice.topk(top_k + 1, dim=-1)
    tied = top.values[:, 1:] == top.values[:, :-1]  # [T, K]: sorted, so equal values are neighbours
    a, b = top.indices[:, 1:][tied], top.indices[:, :-1][tied]
    pairs.index_put_((torch.minimum(a, b), torch.maximum(a, b)), torch.ones_like(a), accumulate=True)
    return int(tied.any(dim=1).sum()), pairs


def tie_findings(layer: str, ties: int, tokens: int, pairs: torch.Tensor) -> list[Finding]:
    """ties: tokens with a tie among their top k + 1 choices; pairs [E, E]: per expert pair."""
    share = ties / max(tokens, 1)
    if share > MAX_TIE_FRACTION:
        flat = int(pairs.argmax())
        i, j = divmod(flat, pairs.shape[1])
        return [Finding(layer, "tokens with tied top-k+1 choices", share, f"allowed <= {MAX_TIE_FRACTION}",
                        f"equal scores, most often experts {i} and {j} ({int(pairs[i, j])} tokens): top-k picks "
                        "by expert index (a zero or constant gate, duplicated gate rows, a saturated sigmoid)")]
    return []


def dtype_findings(layer: str, scores_dtype: torch.dtype, probs_dtype: torch.dtype) -> list[Finding]:
    found = []
    for name, dtype in (("scores", scores_dtype), ("probs", probs_dtype)):
        if dtype != torch.float32:
            found.append(Finding(layer, f"router {name} dtype", str(dtype).removeprefix("torch."), "must be float32",
                                 "router math left fp32: low-precision scores tie and flip top-k choices"))
    return found


def bias_findings(layer: str, bias: torch.Tensor) -> list[Finding]:
    """bias [E]: the router's expert_bias (selection only)."""
    bias = bias.detach().double()
    bad = int((~torch.isfinite(bias)).sum())
    if bad:
        return [Finding(layer, "expert_bias NaN/inf", float(bad), "allowed: 0",
                        "a corrupt checkpoint or a bad bias update")]
    mean = float(bias.mean())
    if abs(mean) > MAX_BIAS_MEAN:
        return [Finding(layer, "expert_bias mean", mean, f"allowed |mean| <= {MAX_BIAS_MEAN:g}",
                        "the balancing update keeps the mean at 0: something else wrote the bias")]
    return []


# ---------------------------------------------------------------------------------------
# The probe and the whole check.
# ---------------------------------------------------------------------------------------


def routers(model_parts: list[nn.Module]) -> dict[str, Router]:
    return {name: m for part in model_parts for name, m in part.named_modules() if isinstance(m, Router)}


@torch.no_grad()
def probe_routers(model: nn.Module, tokens: torch.Tensor, group=None) -> dict[str, dict]:
    """Run tokens [B, S] through `model` in eval mode and return, per router, the statistics
    summed over the ranks of `group`: loads [E] int64, ties (tokens with tied top-k+1 choices),
    tie_pairs [E, E], tokens, and the local dtypes.

    Every rank must call this (FSDP all-gathers inside the forward). Eval mode keeps the MoE
    layers from counting the probe into their step statistics; train/eval flags are restored.
    """
    found = routers([model])
    # Per router, one row: loads [E] | tie pairs [E * E] | tied tokens | tokens.
    stats = {name: {"counts": torch.zeros(r.num_experts * (r.num_experts + 1) + 2, dtype=torch.float64,
                                          device=tokens.device)}
             for name, r in found.items()}

    def hook(name):
        def record(router: Router, args, routing) -> None:
            counts, num_experts = stats[name]["counts"], router.num_experts
            ties, pairs = count_ties(routing.scores.float() + router.expert_bias, router.top_k)
            counts[:num_experts] += routing.tokens_per_expert.double()
            counts[num_experts:-2] += pairs.flatten().double()
            counts[-2] += ties
            counts[-1] += routing.experts.shape[0]
            stats[name]["dtypes"] = (routing.scores.dtype, routing.probs.dtype)
        return record

    modes = {m: m.training for m in model.modules()}
    handles = [r.register_forward_hook(hook(name)) for name, r in found.items()]
    try:
        model.eval()
        model(tokens)
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.train(training)
    if found and dist.is_initialized():
        packed = torch.stack([s["counts"] for s in stats.values()])  # one collective for all layers
        dist.all_reduce(packed, group=group)
        for s, row in zip(stats.values(), packed):
            s["counts"] = row
    result = {}
    for name, s in stats.items():
        counts, num_experts = s["counts"], found[name].num_experts
        result[name] = {"loads": counts[:num_experts].long(), "ties": int(counts[-2]), "tokens": int(counts[-1]),
                        "tie_pairs": counts[num_experts:-2].long().view(num_experts, num_experts),
                        "dtypes": s["dtypes"]}
    return result


def run_router_init_checks(model_parts: list[nn.Module], job_config, parallel_dims, device: torch.device,
                           fresh: bool = True) -> list[Finding]:
    """All checks on every router of the model; collective (every rank calls it, same result).

    The probe is one micro-batch of the training shape (local_batch_size x seq_len) of uniform
    random token ids per rank, with more sequences where that gives fewer than
    MIN_PROBE_TOKENS_PER_EXPERT per expert. `fresh` (step 0) also compares the gate std with
    init_std; trained gates have moved away from it.
    """
    if len(model_parts) != 1:
        raise ValueError("router-init checks need the whole model in one part (no pipeline parallelism)")
    model = model_parts[0]
    found = routers(model_parts)
    if not found:
        return []
    loss_mesh = parallel_dims.get_optional_mesh("loss") if parallel_dims is not None else None
    group = loss_mesh.get_group() if loss_mesh is not None else None
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    seq_len = job_config.training.seq_len
    router = next(iter(found.values()))
    wanted = MIN_PROBE_TOKENS_PER_EXPERT * router.num_experts / router.top_k  # tokens over all ranks
    num_seqs = max(job_config.training.local_batch_size, math.ceil(wanted / (ranks * seq_len)))
    rank = dist.get_rank() if dist.is_initialized() else 0
    generator = torch.Generator().manual_seed(PROBE_SEED + rank)
    tokens = torch.randint(model.tok_embeddings.num_embeddings, (num_seqs, seq_len), generator=generator)
    stats = probe_routers(model, tokens.to(device), group)

    ep = parallel_dims.ep if parallel_dims is not None else 1
    findings: list[Finding] = []
    for name, router in found.items():
        weight = router.gate.weight
        weight = weight.full_tensor() if isinstance(weight, DTensor) else weight  # collective under FSDP
        s = stats[name]
        findings += gate_findings(name, weight, router.options.init_std, fresh)
        findings += load_findings(name, s["loads"], router.top_k, ep)
        findings += tie_findings(name, s["ties"], s["tokens"], s["tie_pairs"])
        findings += dtype_findings(name, *s["dtypes"])
        findings += bias_findings(name, router.expert_bias)
    return findings
