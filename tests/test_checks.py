"""Router-init checks and training-health monitors: each fires on a crafted bad case and stays
quiet on a healthy one; end to end, a zero-initialized gate stops the debug run before step 1."""

import contextlib
import json
import logging
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from spawn_ranks import torchrun_env, launch_plan

from torchtitan_moe.components.checks import router_init as ri
from torchtitan_moe.components.checks import monitors as mon
from torchtitan_moe.models.qwen3_moe import Qwen3MoEModel, flavor_args
from torchtitan_moe.moe.balance import moe_layers, update_expert_bias
from torchtitan_moe.moe.options import RouterOptions
from torchtitan_moe.moe.router import Router

ROOT = Path(__file__).resolve().parents[1]


def statistics(findings):
    return {f.statistic.split(" (")[0] for f in findings}


# ---------------------------------------------------------------------------------------
# Gate weights.
# ---------------------------------------------------------------------------------------


def healthy_gate(num_experts=8, dim=64, std=0.02, seed=0):
    torch.manual_seed(seed)
    router = Router(dim, num_experts, 2, RouterOptions(init_std=std))
    router.init_weights()
    return router.gate.weight.detach()


def test_gate_healthy_init_is_quiet():
    assert ri.gate_findings("r", healthy_gate(), 0.02) == []
    assert ri.gate_findings("r", healthy_gate(128, 2048), 0.02) == []


@pytest.mark.parametrize("init_std, cause", [(0.0, "[router] init_std = 0"), (0.02, "did not run")])
def test_gate_all_zero_fires_and_names_the_cause(init_std, cause):
    (finding,) = ri.gate_findings("layers.3.moe.router", torch.zeros(8, 64), init_std)
    line = str(finding)
    assert line.startswith("layers.3.moe.router: gate weight max |w| = 0")
    assert "zero-initialized gate" in line and cause in line and "\n" not in line


def test_gate_constant_fires():
    (finding,) = ri.gate_findings("r", torch.full((8, 64), 0.01), 0.02)
    assert "constant gate" in finding.cause


def test_gate_nan_or_inf_fires():
    for bad in (math.nan, math.inf):
        weight = healthy_gate()
        weight[2, 5] = bad
        (finding,) = ri.gate_findings("r", weight, 0.02)
        assert finding.statistic == "gate weights NaN/inf" and finding.value == 1.0


@pytest.mark.parametrize("scale", [20.0, 0.05])
def test_gate_std_off_by_more_than_10x_fires_only_at_init(scale):
    weight = healthy_gate() * scale
    (finding,) = ri.gate_findings("r", weight, 0.02)
    assert finding.statistic == "gate weight std / [router] init_std"
    assert finding.value == pytest.approx(scale, rel=0.1)
    assert ri.gate_findings("r", weight, 0.02, fresh=False) == []  # a trained gate may move away
    assert ri.gate_findings("r", healthy_gate() * 3, 0.02) == []  # within 10x


# ---------------------------------------------------------------------------------------
# Loads on the probe (tokens per expert over all ranks).
# ---------------------------------------------------------------------------------------


def routed_loads(num_experts, top_k, tokens=4096, dim=64, seed=0):
    """A healthy random router on random inputs -> tokens_per_expert [E]."""
    torch.manual_seed(seed)
    router = Router(dim, num_experts, top_k)
    router.init_weights()
    with torch.no_grad():
        return router(F.rms_norm(torch.randn(tokens, dim), (dim,))).tokens_per_expert


@pytest.mark.parametrize("num_experts, top_k, ep", [(8, 2, 1), (8, 2, 2), (8, 2, 8), (128, 8, 8)])
def test_loads_of_a_healthy_router_are_quiet(num_experts, top_k, ep):
    assert ri.load_findings("r", routed_loads(num_experts, top_k), top_k, ep) == []


def test_loads_of_a_collapsed_router_fire_on_every_statistic():
    # What a zero gate does: every token on experts 0 and 1, so EP rank 0 gets everything.
    loads = torch.tensor([1000, 1000, 0, 0, 0, 0, 0, 0])
    found = statistics(ri.load_findings("r", loads, 2, ep=4))
    assert found == {"load entropy / ln E", "busiest expert tokens / mean", "load CV",
                     "share of experts with no tokens", "busiest EP rank"}


def flat(num_experts, **special):
    """Loads of 1000 per expert, except experts named e<i> in `special`."""
    loads = torch.full((num_experts,), 1000.0)
    for key, value in special.items():
        loads[int(key[1:])] = value
    return loads


@pytest.mark.parametrize("loads, top_k, ep, statistic", [
    # one expert at 4x the mean, the rest balanced: entropy and CV stay healthy
    (flat(64, e0=4200.0), 8, 1, "busiest expert tokens / mean"),
    # 20 of 64 experts empty, the rest even: busiest 1.45x, CV 0.67
    (torch.cat([torch.zeros(20), torch.full((44,), 1000.0)]), 8, 1, "share of experts with no tokens"),
    # 19 of 64 experts carry 89% of the tokens: busiest 2.99x, entropy 0.82, CV 1.29
    (torch.cat([torch.full((19,), 2800.0), torch.full((45,), 150.0)]), 8, 1, "load CV"),
    # two experts of EP rank 0 at 2.5x: rank 0 gets 2.5x the mean of 4 EP ranks
    (flat(8, e0=5000.0, e1=5000.0), 2, 4, "busiest EP rank"),
])
def test_each_load_statistic_fires_alone(loads, top_k, ep, statistic):
    assert statistics(ri.load_findings("r", loads.round().long(), top_k, ep)) == {statistic}


def test_entropy_fires_when_tokens_spread_over_too_few_experts():
    # 3 of 8 experts: entropy ln 3 / ln 8 = 0.53
    findings = ri.load_findings("r", torch.tensor([900, 900, 900, 0, 0, 0, 0, 0]), 2)
    assert "load entropy / ln E" in statistics(findings)
    entropy = next(f for f in findings if f.statistic == "load entropy / ln E").value
    assert entropy == pytest.approx(math.log(3) / math.log(8))


def test_dead_experts_are_not_judged_on_a_probe_too_small_to_reach_them():
    # 8 tokens x top-2 over 64 experts: a balanced router leaves most experts empty too.
    loads = torch.zeros(64, dtype=torch.long)
    loads[:16] = 1
    assert "share of experts with no tokens" not in statistics(ri.load_findings("r", loads, 2))


def test_ep_threshold_for_two_ranks_is_halfway_to_all_on_one():
    # ep = 2: all on one rank is 2x the mean, so the limit is 1.5x
    assert ri.load_findings("r", flat(8, e0=1600.0, e1=1600.0, e2=1600.0, e3=1600.0), 2, ep=2) == []  # 1.23x
    found = ri.load_findings("r", flat(8, e0=4000.0, e1=4000.0, e2=4000.0, e3=4000.0), 2, ep=2)  # 1.6x
    assert statistics(found) == {"busiest EP rank"} and "rank 0" in found[0].statistic


# ---------------------------------------------------------------------------------------
# Ties, dtypes, expert bias.
# ---------------------------------------------------------------------------------------


def test_ties_of_a_zero_gate_fire_and_random_scores_are_quiet():
    equal = torch.full((100, 8), 1 / 8)
    ties, pairs = ri.count_ties(equal, 2)
    assert ties == 100 and pairs.sum() == 200  # (1st, 2nd) and (2nd, 3rd) on every token
    random_scores = torch.softmax(torch.randn(100, 8), dim=-1)
    assert ri.count_ties(random_scores, 2)[0] == 0
    assert ri.count_ties(equal, 8)[0] == 0  # top-k = all experts: nothing to choose
    (finding,) = ri.tie_findings("r", 100, 100, pairs)
    assert finding.statistic == "tokens with tied top-k+1 choices" and finding.value == 1.0
    assert ri.tie_findings("r", 0, 100, torch.zeros(8, 8, dtype=torch.int64)) == []


def test_ties_above_the_kth_choice_count_and_name_the_expert_pair():
    # Experts 2 and 6 share the top score: a tie at the 1st / 2nd choice, which the k-th vs
    # (k+1)-th comparison alone never sees.
    scores = torch.softmax(torch.randn(50, 8), dim=-1)
    scores[:, [2, 6]] = 0.9
    ties, pairs = ri.count_ties(scores, 2)
    assert ties == 50 and pairs[2, 6] == 50 and pairs.sum() == 50
    (finding,) = ri.tie_findings("layers.1.moe.router", ties, 50, pairs)
    assert "most often experts 2 and 6 (50 tokens)" in str(finding)
    assert str(finding).startswith("layers.1.moe.router: tokens with tied top-k+1 choices = 1")


def test_duplicated_gate_rows_are_found_with_the_expert_pairs():
    gate = healthy_gate()
    gate[4], gate[7] = gate[0], gate[0]  # the clone pattern of a rank-replicated sharded init
    gate[5] = gate[1]
    (finding,) = ri.gate_findings("layers.0.moe.router", gate, 0.02)
    assert finding.statistic == "duplicated gate rows (experts)" and finding.value == "0=4, 0=7, 1=5"
    assert str(finding).startswith("layers.0.moe.router: duplicated gate rows (experts) = 0=4, 0=7, 1=5")
    assert ri.duplicated_rows(healthy_gate(128, 2048)) == []


def test_probe_finds_the_ties_of_a_model_with_cloned_gate_rows():
    model = debug_model()
    gate = model.layers["1"].moe.router.gate.weight
    with torch.no_grad():
        gate[3] = gate[5]
    findings = ri.run_router_init_checks([model], JOB, None, torch.device("cpu"))
    assert {(f.layer, f.statistic) for f in findings} == {("layers.1.moe.router", "duplicated gate rows (experts)"),
                                                         ("layers.1.moe.router", "tokens with tied top-k+1 choices")}
    (ties,) = [f for f in findings if f.statistic.startswith("tokens with tied")]
    assert "experts 3 and 5" in ties.cause


def test_router_math_outside_fp32_fires():
    assert ri.dtype_findings("r", torch.float32, torch.float32) == []
    (finding,) = ri.dtype_findings("r", torch.bfloat16, torch.float32)
    assert str(finding).startswith("r: router scores dtype = bfloat16 (must be float32)")


def test_expert_bias_mean_and_nan_fire_and_balanced_updates_are_quiet():
    router = Router(16, 8, 2, RouterOptions(bias_update_rate=1e-3))
    layer = SimpleNamespace(router=router)
    for _ in range(50):  # the balancing update moves single experts, never the mean
        update_expert_bias([layer], torch.randint(0, 100, (1, 8)).double())
    assert router.expert_bias.abs().max() > 0 and ri.bias_findings("r", router.expert_bias) == []
    (finding,) = ri.bias_findings("r", router.expert_bias + 0.01)
    assert finding.statistic == "expert_bias mean" and finding.value == pytest.approx(0.01, abs=1e-4)
    bias = router.expert_bias.clone()
    bias[3] = math.nan
    assert ri.bias_findings("r", bias)[0].statistic == "expert_bias NaN/inf"


# ---------------------------------------------------------------------------------------
# The probe on the debug model, single process.
# ---------------------------------------------------------------------------------------


def debug_model(init_std=0.02, n_layers=2, seed=0):
    torch.manual_seed(seed)
    args = flavor_args("debug")
    args.n_layers = n_layers
    args.moe = replace(args.moe, router=replace(args.moe.router, init_std=init_std))
    model = Qwen3MoEModel(args)
    with torch.no_grad():
        model.init_weights()
    return model


JOB = SimpleNamespace(training=SimpleNamespace(local_batch_size=4, seq_len=64))


def test_healthy_debug_model_passes_and_zero_init_fails_on_every_layer():
    assert ri.run_router_init_checks([debug_model()], JOB, None, torch.device("cpu")) == []
    findings = ri.run_router_init_checks([debug_model(init_std=0.0)], JOB, None, torch.device("cpu"))
    for layer in ("layers.0.moe.router", "layers.1.moe.router"):
        found = statistics(f for f in findings if f.layer == layer)
        assert {"gate weight max |w|", "load entropy / ln E", "busiest expert tokens / mean", "load CV",
                "share of experts with no tokens", "tokens with tied top-k+1 choices"} <= found


def test_probe_leaves_statistics_modes_and_training_untouched():
    probed, reference = debug_model(), debug_model()
    probed.train()
    reference.train()
    stats = ri.probe_routers(probed, torch.randint(0, 2048, (4, 64)))
    assert all(s["loads"].sum() == 4 * 64 * 2 and s["dtypes"] == (torch.float32, torch.float32)
               for s in stats.values())
    assert all(m.training for m in probed.modules())
    for layer in moe_layers([probed]):
        assert layer.tokens_per_expert.sum() == 0 and (layer.router_loss_sums == 0).all()
        assert (layer.router.global_counts == 0).all()
        assert layer.router.expert_bias.abs().sum() == 0
    # The same training step on both models gives the same loss and gradients.
    tokens = torch.randint(0, 2048, (2, 64))
    losses = []
    for model in (probed, reference):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        losses.append(loss.detach())
    assert losses[0] == losses[1]
    for p, q in zip(probed.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


def trainer_stub(mode, init_std):
    job = SimpleNamespace(checks=SimpleNamespace(router_init=mode), training=JOB.training)
    return SimpleNamespace(job_config=job, model_parts=[debug_model(init_std)], parallel_dims=None,
                           device=torch.device("cpu"), step=0, maybe_enable_amp=contextlib.nullcontext())


def test_router_init_modes_error_warn_off(caplog):
    from torchtitan_moe.train.trainer import MoETrainer, RouterInitError

    caplog.set_level(logging.INFO)
    with pytest.raises(RouterInitError, match=r'^router-init checks failed: \d+ findings \(see above\); '
                                              r'set \[checks\] router_init = "warn" to train anyway$'):
        MoETrainer.check_router_init(trainer_stub("error", 0.0))
    assert "router-init: layers.0.moe.router: gate weight max |w| = 0" in caplog.text
    caplog.clear()
    MoETrainer.check_router_init(trainer_stub("warn", 0.0))  # logs and trains on
    assert "router-init: layers.1.moe.router" in caplog.text and "training anyway" in caplog.text
    caplog.clear()
    MoETrainer.check_router_init(trainer_stub("off", 0.0))
    MoETrainer.check_router_init(trainer_stub("error", 0.02))
    assert "router-init: " not in caplog.text and "router-init checks passed" in caplog.text


# ---------------------------------------------------------------------------------------
# Monitors.
# ---------------------------------------------------------------------------------------


def test_spike_detector_waits_for_warmup_then_flags_spikes():
    spikes = mon.SpikeDetector(factor=1.5, warmup=3)
    assert [spikes.update(2.0) for _ in range(3)] == [None, None, None]
    assert spikes.update(2.0) == pytest.approx(1.0)
    assert spikes.update(4.0) == pytest.approx(2.0)  # 2x the EMA
    assert spikes.update(math.nan) is None and spikes.seen == 5


def run_monitor(losses, grad_norms, **kwargs):
    monitor = mon.TrainingMonitor(freq=5, **kwargs)
    warnings = []
    for step, (loss, norm) in enumerate(zip(losses, grad_norms), start=1):
        warnings += monitor.check(step, loss, norm)[1]
    return warnings


def test_falling_loss_is_quiet_and_loss_and_grad_spikes_warn():
    falling = [8.0 * 0.95**i for i in range(30)]
    assert run_monitor(falling, [1.0] * 30) == []
    (warning,) = run_monitor(falling[:20] + [3 * falling[20]], [1.0] * 21)
    assert warning.startswith("step 21: loss spike")
    (warning,) = run_monitor(falling[:21], [1.0] * 20 + [20.0])
    assert warning.startswith("step 21: grad_norm spike")


def test_router_loss_terms_are_watched_each_on_its_own():
    monitor = mon.TrainingMonitor(freq=5)
    warnings, metrics = [], {}
    for step in range(1, 21):
        z = 4.4 if step < 20 else 9.0  # logits blow up at step 20; the balance loss stays put
        metrics, found = monitor.check(step, 2.0, 1.0, router_losses={"balance_loss": 1.02, "z_loss": z})
        warnings += found
    assert warnings == ["step 20: router z_loss spike: 9 = 2.0x its EMA 4.4 (warn above 1.5x)"]
    assert metrics["health/balance_loss_over_ema"] == pytest.approx(1.0)
    assert metrics["health/z_loss_over_ema"] == pytest.approx(9.0 / 4.4)
    _, warnings = mon.TrainingMonitor(freq=5).check(3, 2.0, 1.0, router_losses={"balance_loss": math.nan})
    assert warnings == ["step 3: router balance_loss = nan"]


def test_nonfinite_values_name_the_ranks():
    rank_stats = torch.tensor([[2.0, 1.0], [math.nan, 1.0], [2.0, math.inf], [2.0, 1.1]], dtype=torch.float64)
    metrics, warnings = mon.TrainingMonitor(freq=5).check(10, math.nan, math.inf, rank_stats=rank_stats)
    assert "step 10: NaN/inf loss on ranks [1]" in warnings
    assert any(w.startswith("step 10: NaN/inf gradients on ranks [2]") for w in warnings)
    assert metrics["health/nonfinite_ranks"] == 2
    healthy = torch.tensor([[2.0, 1.0], [2.1, 1.2]], dtype=torch.float64)
    assert mon.TrainingMonitor(freq=5).check(10, 2.0, 1.0, rank_stats=healthy)[1] == []


def test_grad_norm_spread_between_ranks():
    assert mon.grad_norm_spread(torch.tensor([1.0, 2.0, math.nan])) == 2.0
    assert mon.grad_norm_spread(torch.tensor([0.0, 3.0])) == math.inf
    rank_stats = torch.tensor([[2.0, 143000.0], [2.0, 1.0]], dtype=torch.float64)
    metrics, warnings = mon.TrainingMonitor(freq=5).check(5, 2.0, 1.0, rank_stats=rank_stats)
    assert metrics["health/grad_norm_rank_max_over_min"] == 143000.0
    (warning,) = warnings
    assert "largest on rank 0, smallest on rank 1" in warning
    quiet = torch.tensor([[2.0, 1.5], [2.0, 1.0]], dtype=torch.float64)
    metrics, warnings = mon.TrainingMonitor(freq=5).check(5, 2.0, 1.0, rank_stats=quiet)
    assert metrics["health/grad_norm_rank_max_over_min"] == 1.5 and warnings == []


def test_tokens_per_destination_ep_rank_and_dead_experts():
    assert mon.ep_rank_loads(torch.arange(8).view(1, 8), 4).tolist() == [[1, 5, 9, 13]]
    collapsed = torch.tensor([[524288, 524288, 0, 0, 0, 0, 0, 0], [100] * 8])
    metrics, warnings = mon.TrainingMonitor(freq=5, ep=4).check(5, 2.0, 1.0, loads=collapsed)
    assert metrics["moe/ep_load_max_over_mean"] == 4.0
    assert any("MoE layer 0: 6 of 8 experts got no tokens" in w for w in warnings)
    assert any("MoE layer 0: EP rank 0 receives 4.00x" in w and "[1048576, 0, 0, 0]" in w for w in warnings)
    metrics, warnings = mon.TrainingMonitor(freq=5, ep=4).check(4, 2.0, 1.0, loads=collapsed)
    assert metrics["moe/ep_load_max_over_mean"] == 4.0 and warnings == []  # warned on monitor steps only
    metrics, warnings = mon.TrainingMonitor(freq=5, ep=4).check(5, 2.0, 1.0, loads=torch.full((2, 8), 100))
    assert metrics["moe/ep_load_max_over_mean"] == 1.0 and warnings == []


def test_monitors_off_and_monitor_steps():
    monitor = mon.TrainingMonitor(freq=0)
    assert not monitor.is_monitor_step(10)
    assert monitor.check(10, math.nan, math.nan, loads=torch.zeros(1, 8)) == ({}, [])
    assert [s for s in range(1, 21) if mon.TrainingMonitor(freq=10).is_monitor_step(s)] == [10, 20]


def test_local_grad_norm_and_single_process_gather():
    model = torch.nn.Linear(4, 3)
    model(torch.randn(5, 4)).sum().backward()
    expected = torch.cat([model.weight.grad.flatten(), model.bias.grad]).norm()
    assert mon.local_grad_norm([model]) == pytest.approx(float(expected))
    stats = mon.gather_rank_stats(torch.tensor(2.5), torch.tensor(0.5))
    assert stats.tolist() == [[2.5, 0.5]]


def test_local_grad_norm_reads_bf16_gradients_without_an_fp32_copy():
    # The norm of fp32 and bf16 gradients together, accumulated in fp32 from the bf16 values themselves:
    # no copy of a gradient in another dtype (one per bf16 gradient was 4.8 GB a rank at 30B-A3B-8l, EP = 2).
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8).to(torch.bfloat16))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 3
    expected = torch.cat([p.grad.double().flatten() for p in model.parameters()]).norm()

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.casts = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_) and args[0].numel() > 1:
                self.casts.append(str(func))
            return out

    with Copies() as seen:
        norm = mon.local_grad_norm([model])
    assert seen.casts == []
    assert norm.dtype == torch.float32 and float(norm) == pytest.approx(float(expected), rel=1e-6)


def test_wandb_goes_offline_without_a_key(monkeypatch, tmp_path):
    from torchtitan_moe.train.trainer import wandb_offline_without_key

    config = SimpleNamespace(metrics=SimpleNamespace(enable_wandb=True))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    wandb_offline_without_key(config)
    assert os.environ["WANDB_MODE"] == "offline"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    wandb_offline_without_key(config)
    assert "WANDB_MODE" not in os.environ
    monkeypatch.delenv("WANDB_API_KEY")
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    wandb_offline_without_key(config)
    assert "WANDB_MODE" not in os.environ
    wandb_offline_without_key(SimpleNamespace(metrics=SimpleNamespace(enable_wandb=False)))
    assert "WANDB_MODE" not in os.environ


# ---------------------------------------------------------------------------------------
# End to end: 2 processes over gloo on the debug config.
# ---------------------------------------------------------------------------------------


def torchrun(dump: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "torchtitan_moe.train", "--job.config_file", str(ROOT / "configs" / "debug.toml"),
        "--job.dump_folder", str(dump), "--metrics.disable_color_printing", *overrides,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=300)


def records(dump: Path) -> list[dict]:
    with open(dump / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo path")
def test_zero_initialized_gate_stops_the_run_before_step_1(tmp_path):
    result = torchrun(tmp_path, "--router.init_std", "0")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert not (tmp_path / "metrics.jsonl").exists()  # no step ran
    assert "step:  1" not in output
    assert "layers.0.moe.router: gate weight max |w| = 0 (must be > 0): zero-initialized gate" in output
    assert ('router-init checks failed: 24 findings (see above); set [checks] router_init = "warn" to train anyway'
            in result.stderr)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo path")
def test_default_run_passes_and_checks_and_monitors_leave_training_unchanged(tmp_path):
    # Both runs in one torchrun launch; each run's output (both ranks) in its own .out / .err.
    launch_plan([
        {"train": ["--job.dump_folder", str(tmp_path / "checked"), "--training.steps", "6",
                   "--checks.monitor_freq", "3"], "log": str(tmp_path / "checked")},
        {"train": ["--job.dump_folder", str(tmp_path / "plain"), "--training.steps", "6",
                   "--checks.router_init", "off", "--checks.monitor_freq", "0"], "log": str(tmp_path / "plain")},
    ], tmp_path)
    checked_out, plain_out = (tmp_path / "checked.out").read_text(), (tmp_path / "plain.out").read_text()
    assert checked_out.count("router-init checks passed") == 2  # both ranks
    assert "WARNING - step" not in checked_out  # no monitor warning on a healthy run
    with_checks, without = records(tmp_path / "checked"), records(tmp_path / "plain")
    assert [(r["loss"], r["grad_norm"]) for r in with_checks] == [(r["loss"], r["grad_norm"]) for r in without]
    monitored = [r for r in with_checks if "health/grad_norm_rank_max_over_min" in r]
    assert [r["step"] for r in monitored] == [3, 6]
    for r in monitored:
        assert len(r["health/rank_grad_norm"]) == 2 and 1 <= r["health/grad_norm_rank_max_over_min"] < 10
        assert r["health/nonfinite_ranks"] == 0
    assert "ranks grad max/min" in checked_out and "ranks grad max/min" not in plain_out
