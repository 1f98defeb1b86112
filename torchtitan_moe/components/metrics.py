"""The step line and the per-step record: torchtitan's metrics plus what MoE training needs.

    step:  20  loss:  2.31  grad_norm: 0.41  memory: 0.52GiB  tps: 18,200  tflops: 312.4  mfu: 31.6% (causal 26.1%)
          | moe balance: 1.0031  z: 4.3712  load max/mean: 1.21  cv: 0.09  dead: 0  ep max/mean: 1.04
          | ranks grad max/min: 1.3          (monitor steps only)

`balance` and `z` are the router's balance loss and z-loss before their coefficients (means
over layers; shown when on); `moe/aux_loss` is what they add to the objective, their weighted sum.

MFU is model FLOPs per second (6 x active parameters + attention, per token) over a peak
named once at the start: `[metrics] peak_tflops`, or torchtitan's table for the GPU's name
(dense bf16: 989 for H100 SXM and H200). On a CPU there is no peak and no MFU. Two counts
(components/flops.py): torchtitan's (`tflops`, `mfu(%)`, attention's whole score matrix) and the
causal one Megatron-style counts use (`tflops_causal`, `mfu_causal(%)`, half of it).

Rank 0 also appends every logged step to `<dump_folder>/metrics.jsonl` (full precision),
which the parity harness and the tests read. The MoE numbers come from the statistics the
balancing hook already reduced over all ranks (moe/balance.py): logging adds no collective.
The training-health monitors (checks/monitors.py) add their metrics and warning lines; the
per-rank values they need are gathered by the trainer on monitor steps (`rank_stats`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from torchtitan_moe.components.checks.monitors import TrainingMonitor
from torchtitan_moe.components.flops import causal_flops_per_token
from torchtitan_moe.moe.balance import moe_layers
from torchtitan_moe.moe.experts import working_copy_flags
from torchtitan_moe.compat.torchtitan import MetricsProcessor, logger


def load_stats(loads: torch.Tensor) -> dict[str, float]:
    """loads [L, E] tokens per expert -> the worst layer's max/mean, CV and dead experts."""
    loads = loads.double()
    mean = loads.mean(dim=1).clamp_min(1e-12)
    return {
        "load_max_over_mean": float((loads.max(dim=1).values / mean).max()),
        "load_cv": float((loads.std(dim=1, unbiased=False) / mean).max()),
        "dead_experts": int((loads == 0).sum()),
    }


ROUTER_LOSSES = ("balance_loss", "z_loss")  # the columns of MoE.last_router_losses


def router_coefficients(layers: list) -> torch.Tensor | None:
    """[L, 2] fp64: each layer's coefficients of its router losses, or None when no term is on."""
    coeffs = torch.tensor([[m.router.options.balance_loss_coeff, m.router.options.z_loss_coeff] for m in layers],
                          dtype=torch.float64)
    return coeffs if layers and (coeffs > 0).any() else None


def router_loss_metrics(losses: torch.Tensor, coeffs: torch.Tensor) -> dict[str, float]:
    """losses [L, 2] (before their coefficients), coeffs [L, 2] -> means over layers: each term that is on
    (moe/balance_loss, moe/z_loss) and their weighted sum, what the router adds to the objective (moe/aux_loss)."""
    losses = losses.double()
    metrics = {f"moe/{name}": float(losses[:, i].mean()) for i, name in enumerate(ROUTER_LOSSES)
               if (coeffs[:, i] > 0).any()}
    metrics["moe/aux_loss"] = float((losses * coeffs).sum(dim=1).mean())
    return metrics


def per_layer_router_losses(losses: torch.Tensor, coeffs: torch.Tensor) -> dict[str, list[float]]:
    """metrics.jsonl only: each layer's value of each term that is on."""
    losses = losses.double()
    return {f"moe/{name}_per_layer": losses[:, i].tolist() for i, name in enumerate(ROUTER_LOSSES)
            if (coeffs[:, i] > 0).any()}


@dataclass
class StepState:
    """What a logging step reads back besides its loss and gradient norm, taken at the end of its step
    (step_state) and read with its log line, which may come a step later (train/step.py):

        tensors["loads"]          [L, E] tokens per expert over all ranks
        tensors["router_losses"]  [L, 2] each layer's balance loss and z-loss before their coefficients
        tensors["rank_stats"]     [W, 2] fp64 each rank's (loss share, gradient norm); monitor steps
        tensors["stale"]          [len(stale_names)] bool: the working copies' check; monitor steps

    each only where there is one (no MoE layer, no router loss on, ...)."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    stale_names: list[str] = field(default_factory=list)


class MoEMetricsProcessor(MetricsProcessor):
    def __init__(self, job_config, parallel_dims, model_args=None, tag: str | None = None):
        super().__init__(job_config, parallel_dims, tag)
        self.jsonl_path = None
        if torch.distributed.get_rank() == 0:
            os.makedirs(job_config.job.dump_folder, exist_ok=True)
            self.jsonl_path = os.path.join(job_config.job.dump_folder, "metrics.jsonl")
        self.monitor = TrainingMonitor(job_config.checks.monitor_freq, parallel_dims.ep)
        # [W, 2] per-rank (loss share, local grad norm) on the device, set by the trainer on monitor steps.
        self.rank_stats: torch.Tensor | None = None
        self.last_logged_step: int | None = None  # monitor steps make the log interval uneven
        self.gpu_peak_flops = peak_flops(job_config.metrics.peak_tflops, self.gpu_peak_flops,
                                         self.device_memory_monitor.device_name)
        self.model_args, self.seq_len = model_args, job_config.training.seq_len  # for the causal count

    def should_log(self, step: int) -> bool:
        # Monitor steps are always logged, so their per-rank numbers reach the step line.
        return super().should_log(step) or self.monitor.is_monitor_step(step)

    def step_state(self, step: int) -> StepState:
        """The step's StepState on the device (nothing read back): call after its optimizer step, before the
        next forward replaces the layers' statistics. On monitor steps it launches the check that the experts'
        working copies are their weights' casts (moe/experts.py: working_copy_flags)."""
        state = StepState()
        layers = moe_layers(self.model_parts or [])
        if layers and layers[0].last_tokens_per_expert is not None:
            state.tensors["loads"] = torch.stack([layer.last_tokens_per_expert for layer in layers])
            if layers[0].last_router_losses is not None and router_coefficients(layers) is not None:
                state.tensors["router_losses"] = torch.stack([layer.last_router_losses for layer in layers])
        if self.rank_stats is not None:
            state.tensors["rank_stats"], self.rank_stats = self.rank_stats, None
        if self.monitor.is_monitor_step(step):
            flags = []
            for part in self.model_parts or []:
                names, found = working_copy_flags(part)
                if found is not None:
                    state.stale_names += names
                    flags.append(found)
            if flags:
                state.tensors["stale"] = torch.cat(flags)
        return state

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None, state: StepState | None = None,
            ntokens: int | None = None, elapsed: float | None = None) -> None:
        """The step line and record. `state` (step_state's, its tensors on the host), `ntokens` (the tokens
        since the last logged step) and `elapsed` (the seconds from its end to this step's) where they were
        taken when the step ended (train/step.py), else (torchtitan's own step, pipeline parallelism) taken
        now: the time from the last line to this one."""
        if elapsed is None:
            elapsed = time.perf_counter() - self.time_last_log
        if ntokens is None:
            ntokens, self.ntokens_since_last_log = self.ntokens_since_last_log, 0
        tps = ntokens / (elapsed * self.parallel_dims.non_data_parallel_size)
        causal = (None if self.model_args is None
                  else causal_flops_per_token(self.num_flops_per_token, self.model_args, self.seq_len))
        rates = flop_rates(tps, self.num_flops_per_token, causal, self.gpu_peak_flops)
        tflops = rates["tflops"]
        mem = self.device_memory_monitor.get_peak_stats()
        state = self.step_state(step) if state is None else state
        host = {name: t.cpu() for name, t in state.tensors.items()}
        loads, rank_stats = host.get("loads"), host.get("rank_stats")
        losses, coeffs = host.get("router_losses"), router_coefficients(moe_layers(self.model_parts or []))
        moe: dict[str, Any] = {f"moe/{k}": v for k, v in load_stats(loads).items()} if loads is not None else {}
        if losses is not None:
            moe.update(router_loss_metrics(losses, coeffs))
        terms = {name: moe[f"moe/{name}"] for name in ROUTER_LOSSES if f"moe/{name}" in moe}
        health, warnings = self.monitor.check(step, global_avg_loss, grad_norm, loads, rank_stats, terms)
        metrics: dict[str, Any] = {
            "loss_metrics/global_avg_loss": global_avg_loss,
            "loss_metrics/global_max_loss": global_max_loss,
            "grad_norm": grad_norm,
            "throughput(tps)": tps,
            **rates,
            "time_metrics/end_to_end(s)": elapsed / (step - self.last_logged_step if self.last_logged_step else 1),
            "memory/max_reserved(GiB)": mem.max_reserved_gib,
            "memory/max_active(GiB)": mem.max_active_gib,
            "memory/num_alloc_retries": mem.num_alloc_retries,  # the allocator freed its cache to fit: memory-bound
            **(extra_metrics or {}),
            **moe,
            **health,
        }
        self.logger.log(metrics, step)  # TensorBoard / W&B: scalars only

        c = self.color
        line = (
            f"{c.red}step: {step:2}  {c.green}loss: {global_avg_loss:8.5f}  "
            f"{c.orange}grad_norm: {grad_norm:7.4f}  {c.turquoise}memory: {mem.max_reserved_gib:5.2f}GiB  "
            f"{c.blue}tps: {round(tps):,}{c.reset}"
        )
        if "mfu(%)" in metrics:  # only where a peak is known (a GPU, or [metrics] peak_tflops)
            line += f"  {c.cyan}tflops: {tflops:,.2f}  {c.magenta}mfu: {metrics['mfu(%)']:.1f}%"
            if "mfu_causal(%)" in metrics:
                line += f" (causal {metrics['mfu_causal(%)']:.1f}%)"
            line += c.reset
        if "moe/load_cv" in metrics:
            line += "  | moe"
            if "moe/balance_loss" in metrics:
                line += f" balance: {metrics['moe/balance_loss']:.4f}"
            if "moe/z_loss" in metrics:
                line += f"  z: {metrics['moe/z_loss']:.4f}"
            line += (
                f"  load max/mean: {metrics['moe/load_max_over_mean']:.2f}  cv: {metrics['moe/load_cv']:.3f}"
                f"  dead: {metrics['moe/dead_experts']}"
            )
            if "moe/ep_load_max_over_mean" in metrics:
                line += f"  ep max/mean: {metrics['moe/ep_load_max_over_mean']:.2f}"
        if "health/grad_norm_rank_max_over_min" in metrics:
            line += f"  | ranks grad max/min: {metrics['health/grad_norm_rank_max_over_min']:.3g}"
        logger.info(line)
        for warning in warnings:
            logger.warning(warning)

        if self.jsonl_path:
            # time: when the step was logged (seconds since the epoch), to line the run up with samples taken beside it
            record = {"step": step, "time": time.time(), "loss": global_avg_loss, "grad_norm": grad_norm, **metrics}
            if loads is not None:
                record["moe/tokens_per_expert"] = loads.tolist()
            if losses is not None:
                record.update(per_layer_router_losses(losses, coeffs))
            if rank_stats is not None:
                record["health/rank_loss_share"] = rank_stats[:, 0].tolist()  # sums to the loss
                record["health/rank_grad_norm"] = rank_stats[:, 1].tolist()
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps(record) + "\n")

        self.last_logged_step = step
        self.data_loading_times.clear()
        self.time_last_log = time.perf_counter()
        self.device_memory_monitor.reset_peak_stats()

        stale = [name for name, differ in zip(state.stale_names, host.get("stale", torch.zeros(0)).tolist()) if differ]
        if stale:  # after the line and the record: the run stops with its last step on record
            raise RuntimeError(f"step {step}: the experts' bf16 working copies of {', '.join(stale)} differ "
                               "from their fp32 weights (changed outside the optimizer's update?): training "
                               "would read stale weights")


def flop_rates(tps: float, flops_per_token: int, causal_flops_per_token: int | None,
               peak_flops: float | None) -> dict[str, float]:
    """tokens/s/GPU -> TFLOP/s and MFU in torchtitan's count (`tflops`, `mfu(%)`) and the causal count
    (`tflops_causal`, `mfu_causal(%)`; components/flops.py), each MFU only where a peak is known."""
    rates = {"tflops": flops_per_token * tps / 1e12}
    if causal_flops_per_token is not None:
        rates["tflops_causal"] = causal_flops_per_token * tps / 1e12
    if peak_flops:
        rates["mfu(%)"] = 100 * rates["tflops"] * 1e12 / peak_flops
        if "tflops_causal" in rates:
            rates["mfu_causal(%)"] = 100 * rates["tflops_causal"] * 1e12 / peak_flops
    return rates


def peak_flops(override_tflops: float, table_flops: float, device_name: str) -> float | None:
    """The peak MFU is measured against, logged once: the override, else torchtitan's table
    entry for this GPU; None on a CPU (no MFU there)."""
    if override_tflops > 0:
        logger.info(f"MFU against a peak of {override_tflops:g} TFLOP/s ([metrics] peak_tflops)")
        return override_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    logger.info(f"MFU against a peak of {table_flops / 1e12:g} TFLOP/s, torchtitan's dense bf16 figure for "
                f"{device_name!r}; set [metrics] peak_tflops to use another")
    return table_flops


def build_metrics_processor(job_config, parallel_dims, model_args=None, tag: str | None = None) -> MoEMetricsProcessor:
    return MoEMetricsProcessor(job_config, parallel_dims, model_args, tag)
