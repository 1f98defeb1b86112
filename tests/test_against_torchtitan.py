"""Ours against torchtitan 0.2.2's Qwen3-MoE from identical weights: the init copy, the same
forward (CPU, fp32), and the parity harness's `--against torchtitan` / `--seed init` logic.
The 200-step bf16 runs are GPU work (scripts/against_torchtitan_gpu.sh)."""

import json
from pathlib import Path

import pytest
import torch

from torchtitan_moe.tools import parity
from torchtitan_moe.models.baseline import BaselineModel, init_fingerprint, torchtitan_args
from torchtitan_moe.models.qwen3_moe import flavor_args
from torchtitan_moe.models.qwen3_moe.model import Qwen3MoEModel

from test_parity import records

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "debug.toml")


def both_models(seed: int = 3, copy_init: bool = True):
    """Ours and torchtitan's debug model, each initialized from `seed` (theirs from ours when copy_init)."""
    args = flavor_args("debug")
    args.init_seed = seed  # [debug] seed
    targs = torchtitan_args(args)
    targs.ours = args if copy_init else None
    with torch.device("meta"):
        ours, theirs = Qwen3MoEModel(args), BaselineModel(targs)
    for model in (ours, theirs):
        model.to_empty(device="cpu")
        torch.manual_seed(seed + 1)  # torchtitan's own init draws from the RNG as it is
        with torch.no_grad():
            model.init_weights()
    return ours, theirs


def test_torchtitan_starts_from_our_init_and_the_fingerprint_says_so():
    ours, theirs = both_models()
    mine = init_fingerprint(ours)
    assert len(mine) == 4 * 12 + 3 and mine == init_fingerprint(theirs)
    ours_w13 = ours.layers["1"].moe.experts.w13
    assert torch.equal(theirs.layers["1"].moe.experts.w3, ours_w13[:, ours_w13.shape[1] // 2:])
    torch.manual_seed(99)  # our init draws from its seed alone, whatever the RNG held before
    with torch.no_grad():
        ours.init_weights()
    assert init_fingerprint(ours) == mine
    _, own = both_models(copy_init=False)
    assert init_fingerprint(own) != mine
    _, other_seed = both_models(seed=4)
    assert init_fingerprint(other_seed) != mine


def test_both_models_compute_the_same_logits(monkeypatch):
    # torchtitan's MoE counts tokens with torch.histc, which has no CPU kernel for int64 indices.
    histc = torch.histc
    monkeypatch.setattr(torch, "histc", lambda x, *a, **k: histc(x.float(), *a, **k).to(x.dtype))
    ours, theirs = both_models()
    for block in theirs.layers.values():
        block.moe.experts.use_grouped_mm = False  # the CPU path: a loop over experts
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = theirs(tokens).double(), ours(tokens).double()
    error = (got - expected).abs().max() / expected.abs().max()
    assert error < 1e-5, f"relative error {error:.2e}"


def test_against_torchtitan_switches_each_difference_back_alone():
    settings = parity.against_torchtitan(CONFIG, [])
    names = [s.name for s in settings]
    # debug.toml trains with the global-batch balance loss; on CPU its gate and kernels already match (fp32, torch).
    assert names == ["torchtitan", "ours as torchtitan", "torchtitan, again", "torchtitan, 2 micro-batches",
                     "+ fp32 gate", "+ our kernels and loss", "+ balance and z losses", "ours", "torchtitan, own init"]
    as_tt, losses = dict(settings[1].values), dict(settings[6].values)
    assert as_tt["router.balance_loss"] == "none" and losses["router.balance_loss"] == "global_batch"
    assert losses["router.balance_loss_coeff"] == "0.1"
    keys = ("router.balance_loss", "router.balance_loss_coeff", "router.z_loss_coeff")
    assert {k: v for k, v in losses.items() if k not in keys} == {k: v for k, v in as_tt.items() if k not in keys}
    assert [s.checked for s in settings[1:]] == [True] + [False] * 7
    assert settings[2].values == settings[0].values
    # The rounding control: torchtitan on the same global batch (8 sequences a process) in two halves.
    control = dict(settings[3].values)
    assert control == {**dict(settings[0].values), "training.local_batch_size": "4", "training.global_batch_size": "8"}
    assert dict(parity.against_torchtitan(CONFIG, [], nproc=2)[3].values)["training.global_batch_size"] == "16"
    assert not settings[-1].same_init and dict(settings[0].values)["model.init_from"] == "qwen3_moe"
    bias = parity.against_torchtitan(CONFIG, ["--router.bias_update_rate", "1e-3", "--router.balance_loss", "none",
                                              "--router.balance_loss_coeff", "0"])
    (update,) = [s for s in bias if s.name == "+ expert-bias update"]
    assert dict(update.values)["router.bias_update_rate"] == "0.001"
    assert "+ balance and z losses" not in [s.name for s in bias]


def fake_launch(prints_of):
    """A training run that writes its metrics and the fingerprint `prints_of(dump)`."""
    def launch(config, dump, overrides, nproc, log):
        assert "--checks.init_fingerprint" in overrides and "--checkpoint.initial_load_path" not in overrides
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records([5.0, 4.0], [1.0, 0.5])) + "\n")
        (dump / "init_fingerprint.json").write_text(json.dumps(prints_of(dump)))
    return launch


@pytest.mark.parametrize("wrong", ["ep2", None])
def test_seed_init_fails_a_setting_that_started_from_other_weights(tmp_path, monkeypatch, wrong):
    monkeypatch.setattr(parity, "launch", fake_launch(
        lambda dump: {"w": [1.0, 2.0 + (dump.name == wrong) * 1e-6]}))
    argv = [CONFIG, "--vary", "parallelism.expert_parallel_degree=1,2", "--seed", "init", "--nproc", "2",
            "--out", str(tmp_path), "--no-plot"]
    assert parity.main(argv) == (1 if wrong else 0)
    report = (tmp_path / "parity.md").read_text()
    assert ("from other weights (w: sum" in report) == bool(wrong)


def test_against_torchtitan_checks_that_its_own_init_differs(tmp_path, monkeypatch, capsys):
    # Every run from the same weights except torchtitan's own init: the harness passes ...
    own = "torchtitan_own_init"
    monkeypatch.setattr(parity, "launch", fake_launch(lambda dump: {"w": [1.0, 2.0 + (dump.name == own)]}))
    argv = [CONFIG, "--against", "torchtitan", "--out", str(tmp_path), "--no-plot"]
    assert parity.main(argv) == 0
    report = (tmp_path / "parity.md").read_text()
    assert "| + balance and z losses | 5.0000 | 4.0000 | +0.0000 | +0.0000 |" not in report  # no step 30 here
    assert "| + balance and z losses | 4.0000 | +0.0000 |" in report and "(attribution)" in report
    # ... and fails when the own init was not one (the copy went the wrong way, or not at all).
    monkeypatch.setattr(parity, "launch", fake_launch(lambda dump: {"w": [1.0, 2.0]}))
    assert parity.main(argv) == 1


@pytest.mark.parametrize("ours_apart", [0.0, 0.5])
def test_against_torchtitan_reports_ours_next_to_torchtitans_rounding_spread(tmp_path, monkeypatch, ours_apart):
    def launch(config, dump, overrides, nproc, log):
        dump.mkdir(parents=True, exist_ok=True)
        losses = {"ours_as_torchtitan": [5.0, 4.0 + ours_apart], "torchtitan_2_micro-batches": [5.0, 4.1]}
        (dump / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records(
            losses.get(dump.name, [5.0, 4.0]), [1.0, 0.5])) + "\n")
        (dump / "init_fingerprint.json").write_text(json.dumps({"w": [1.0, 2.0]}))

    monkeypatch.setattr(parity, "launch", launch)
    parity.main([CONFIG, "--against", "torchtitan", "--only", "ours as torchtitan", "--only",
                 "torchtitan, 2 micro-batches", "--out", str(tmp_path), "--no-plot"])
    report = (tmp_path / "parity.md").read_text()
    line = next(x for x in report.splitlines() if x.startswith("rounding spread:"))
    # The control's loss is 0.1 / 4.1 apart at step 2, ours 0 or 0.5 / 4.5; the grad norms agree.
    assert "2 micro-batches 2.44e-02 and 0.00e+00" in line, line
    assert f"ours / control {'4.56x' if ours_apart else '0.00x'} and 1.00x" in line, line


def test_the_bf16_gate_is_torchtitans_gate():
    from torch import nn
    from torchtitan_moe.moe.router import Router, RouterOptions

    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    fp32 = Router(128, 8, 2, RouterOptions(route_norm=False))
    bf16 = Router(128, 8, 2, RouterOptions(route_norm=False, gate_precision="param"), param_dtype=torch.bfloat16)
    bf16.load_state_dict(fp32.state_dict())
    theirs = nn.Linear(128, 8, bias=False).to(torch.bfloat16)  # torchtitan's gate under bf16 mixed precision
    theirs.weight.data.copy_(fp32.gate.weight)
    expected = torch.softmax(theirs(x.to(torch.bfloat16)).float(), dim=-1)
    assert torch.equal(bf16(x).probs, expected.gather(1, bf16(x).experts))
    assert not torch.equal(fp32(x).probs, bf16(x).probs)
