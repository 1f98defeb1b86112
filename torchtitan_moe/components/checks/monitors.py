"""Training-health monitors: what the step line shows and warns about while training runs.

    every logged step (free: the values are already on the host)
        loss and grad norm vs their EMA -> spikes (warned at once: a spike is an event)
        the router's balance loss and z-loss, each on its own (where on), vs their EMA -> spikes:
            a z-loss spike is router logits growing, a balance-loss spike routing collapsing
        tokens_per_expert [L, E] (reduced by moe/balance.py) -> dead experts, tokens per
            destination EP rank [L, ep] -> busiest EP rank / mean (warned on monitor steps:
            a state, which would repeat on every line)
    every [checks] monitor_freq steps (one small all-gather, issued by the trainer)
        each rank's share of the loss and local gradient norm [W, 2] -> NaN/inf with the
            ranks that produced them, spread of per-rank grad norms (max / min)

A rank's local gradient norm is the norm of the gradient shards it holds after FSDP's
reduce-scatter (its experts under EP): when routing collapses onto one EP rank, that rank's
expert gradients dwarf the others' (a 143,000x spread in one real run).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_moe import ops
from torchtitan_moe.moe.experts import GroupedExperts

# A logged loss this many times its EMA is a spike (the loss falls during healthy training,
# so it stays below its lagging EMA; 1.5x is far outside step-to-step noise).
LOSS_SPIKE = 1.5
# Grad norms vary more from step to step than the loss; 10x the EMA is a real spike.
GRAD_NORM_SPIKE = 10.0
# The router's losses sit near a floor (balance 1 when balanced, z (ln E)^2 for small logits) and
# move slowly; 1.5x their EMA is routing collapsing or logits blowing up.
ROUTER_LOSS_SPIKE = 1.5
# EMA weight of the past, and logged steps seen before spikes are judged (the first steps
# of a run move fast and would mislead the EMA).
EMA_DECAY = 0.9
SPIKE_WARMUP = 5
# Largest / smallest per-rank local grad norm. Even FSDP shards of a healthy model stay
# within a few x; a collapsed router leaves some EP ranks' experts without any gradient.
MAX_GRAD_NORM_SPREAD = 100.0
# Busiest EP rank's tokens / mean over EP ranks (as in the router-init checks).
MAX_EP_LOAD_OVER_MEAN = 2.0


def local_grad_norm(model_parts: list[nn.Module]) -> torch.Tensor:
    """fp32 scalar: the 2-norm of the gradients this rank holds (local shards of DTensors)."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
             for m in model_parts for p in m.parameters() if p.grad is not None]
    # The experts' gradients kept on their working copies ([optimizer] expert_grad_dtype = "bfloat16").
    grads += [copy.grad for m in model_parts for e in m.modules() if isinstance(e, GroupedExperts) and e.working_gradients
              for copy in e.working.values() if copy.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    # From the gradients as they are: an fp32 copy of the bf16 ones would be 4.8 GB a rank (30B-A3B-8l, EP = 2).
    return ops.sum_of_squares(grads, backend="triton" if grads[0].is_cuda else "torch").sqrt()


def gather_rank_stats(local_loss: torch.Tensor, local_norm: torch.Tensor) -> torch.Tensor:
    """Each rank's (loss, grad norm) -> [W, 2] fp64 on every rank's device, in global rank order, read
    back with the step's log. `local_loss` is the rank's share of the global mean loss (the shares sum to it)."""
    device = local_loss.device  # NCCL needs it on the GPU
    mine = torch.stack([local_loss.detach().double().reshape(()), local_norm.detach().double().reshape(()).to(device)])
    if not dist.is_initialized():
        return mine.view(1, 2)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return torch.stack(everyone)


def ep_rank_loads(loads: torch.Tensor, ep: int) -> torch.Tensor:
    """loads [L, E] tokens per expert -> [L, ep] tokens per destination EP rank.

    Experts are split contiguously: EP rank r owns experts [r E/ep, (r+1) E/ep).
    """
    num_layers, num_experts = loads.shape
    return loads.view(num_layers, ep, num_experts // ep).sum(dim=2)


def nonfinite_ranks(values: torch.Tensor) -> list[int]:
    """values [W] -> the ranks whose value is NaN or inf."""
    return [int(r) for r in torch.nonzero(~torch.isfinite(values)).flatten()]


def grad_norm_spread(norms: torch.Tensor) -> float:
    """norms [W] -> max / min over the finite per-rank grad norms (inf when one rank has none)."""
    finite = norms[torch.isfinite(norms)].double()
    if finite.numel() == 0:
        return math.nan
    low, high = float(finite.min()), float(finite.max())
    if high == 0:
        return 1.0  # no gradient anywhere (e.g. a frozen model): nothing is uneven
    return high / low if low > 0 else math.inf


class SpikeDetector:
    """Compares each value with the EMA of the values before it."""

    def __init__(self, factor: float, decay: float = EMA_DECAY, warmup: int = SPIKE_WARMUP):
        self.factor, self.decay, self.warmup = factor, decay, warmup
        self.ema: float | None = None
        self.seen = 0

    def update(self, value: float) -> float | None:
        """Add a value; returns value / EMA once past the warmup, else None. NaN/inf are skipped."""
        if not math.isfinite(value):
            return None
        ratio = value / self.ema if self.ema and self.seen >= self.warmup else None
        self.ema = value if self.ema is None else self.decay * self.ema + (1 - self.decay) * value
        self.seen += 1
        return ratio


class TrainingMonitor:
    """Turns one logged step's numbers into metrics and warning lines. `freq` 0: all off."""

    def __init__(self, freq: int, ep: int = 1):
        self.freq, self.ep = freq, ep
        self.loss = SpikeDetector(LOSS_SPIKE)
        self.grad_norm = SpikeDetector(GRAD_NORM_SPIKE)
        self.router_losses: dict[str, SpikeDetector] = {}  # one per term, made when first seen

    def is_monitor_step(self, step: int) -> bool:
        return self.freq > 0 and step % self.freq == 0

    def check(self, step: int, loss: float, grad_norm: float, loads: torch.Tensor | None = None,
              rank_stats: torch.Tensor | None = None,
              router_losses: dict[str, float] | None = None) -> tuple[dict[str, float], list[str]]:
        """loads [L, E] tokens per expert of the step (all ranks); rank_stats [W, 2] per-rank
        (loss share, local grad norm) on monitor steps; router_losses: each router loss term
        that is on ('balance_loss', 'z_loss': means over layers, before their coefficients).
        Returns (metrics, warnings)."""
        metrics: dict[str, float] = {}
        if self.freq == 0:
            return metrics, []
        warnings = self._spikes(step, loss, grad_norm, rank_stats is not None, metrics)
        warnings += self._router_losses(step, router_losses or {}, metrics)
        if loads is not None:
            warnings += self._loads(step, loads, metrics)
        if rank_stats is not None:
            warnings += self._ranks(step, rank_stats, metrics)
        return metrics, warnings

    def _spikes(self, step: int, loss: float, grad_norm: float, ranks_known: bool, metrics: dict) -> list[str]:
        warnings = []
        for name, value, spikes in (("loss", loss, self.loss), ("grad_norm", grad_norm, self.grad_norm)):
            if not math.isfinite(value):
                where = "per-rank values below" if ranks_known else "ranks are named on monitor steps"
                warnings.append(f"step {step}: {name} = {value} ({where})")
                continue
            ratio = spikes.update(value)
            if ratio is None:
                continue
            metrics[f"health/{name}_over_ema"] = ratio
            if ratio > spikes.factor:
                warnings.append(f"step {step}: {name} spike: {value:.4g} = {ratio:.1f}x its EMA "
                                f"{spikes.ema:.4g} (warn above {spikes.factor:g}x)")
        return warnings

    def _router_losses(self, step: int, losses: dict[str, float], metrics: dict) -> list[str]:
        warnings = []
        for name, value in losses.items():
            if not math.isfinite(value):
                warnings.append(f"step {step}: router {name} = {value}")
                continue
            ratio = self.router_losses.setdefault(name, SpikeDetector(ROUTER_LOSS_SPIKE)).update(value)
            if ratio is None:
                continue
            metrics[f"health/{name}_over_ema"] = ratio
            if ratio > ROUTER_LOSS_SPIKE:
                warnings.append(f"step {step}: router {name} spike: {value:.4g} = {ratio:.1f}x its EMA "
                                f"{value / ratio:.4g} (warn above {ROUTER_LOSS_SPIKE:g}x)")
        return warnings

    def _loads(self, step: int, loads: torch.Tensor, metrics: dict) -> list[str]:
        warnings = []
        warn = self.is_monitor_step(step)
        dead = (loads == 0).sum(dim=1)
        for layer in torch.nonzero(dead).flatten().tolist() if warn else []:
            warnings.append(f"step {step}: MoE layer {layer}: {int(dead[layer])} of {loads.shape[1]} experts "
                            f"got no tokens (dead experts)")
        if self.ep > 1:
            ranks = ep_rank_loads(loads.double(), self.ep)
            over = ranks.max(dim=1).values / ranks.mean(dim=1).clamp_min(1e-12)
            worst = int(over.argmax())
            metrics["moe/ep_load_max_over_mean"] = float(over[worst])
            if warn and over[worst] > MAX_EP_LOAD_OVER_MEAN:
                warnings.append(
                    f"step {step}: MoE layer {worst}: EP rank {int(ranks[worst].argmax())} receives "
                    f"{float(over[worst]):.2f}x the mean tokens per EP rank (warn above {MAX_EP_LOAD_OVER_MEAN:g}x); "
                    f"tokens per EP rank {ranks[worst].long().tolist()}")
        return warnings

    def _ranks(self, step: int, rank_stats: torch.Tensor, metrics: dict) -> list[str]:
        warnings = []
        losses, norms = rank_stats[:, 0], rank_stats[:, 1]
        bad_loss, bad_grad = nonfinite_ranks(losses), nonfinite_ranks(norms)
        metrics["health/nonfinite_ranks"] = float(len(set(bad_loss) | set(bad_grad)))
        if bad_loss:
            warnings.append(f"step {step}: NaN/inf loss on ranks {bad_loss}")
        if bad_grad:
            warnings.append(f"step {step}: NaN/inf gradients on ranks {bad_grad} (their local gradient shards)")
        spread = grad_norm_spread(norms)
        if math.isnan(spread):
            return warnings
        metrics["health/grad_norm_rank_max_over_min"] = spread
        if spread > MAX_GRAD_NORM_SPREAD:
            largest = int(norms.nan_to_num(-1.0, -1.0, -1.0).argmax())
            smallest = int(norms.nan_to_num(math.inf, math.inf, math.inf).argmin())
            warnings.append(f"step {step}: per-rank grad norms differ {spread:.3g}x (warn above "
                            f"{MAX_GRAD_NORM_SPREAD:g}x): largest on rank {largest}, smallest on rank {smallest}; "
                            f"a collapsed router?")
        return warnings
