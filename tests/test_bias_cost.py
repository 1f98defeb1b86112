"""`convert to-hf --drop-expert-bias` measures what dropping the expert bias costs (bias_cost.py), against the
whole model run with and without its bias; a zero bias costs nothing; the refusals are one line each."""

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from test_hf import build_ours, randomize_

from torchtitan_moe.hf import convert
from torchtitan_moe.hf.bias_cost import measure_bias_cost
from torchtitan_moe.train.checkpoint import write_model_args
from torchtitan_moe.models.qwen3_moe import flavor_args

BIAS_STD = (0.1, 0.3, 0.05, 0.0)  # per layer; layer 3's bias is zero and changes nothing


def save(model, folder) -> str:
    dcp.save(model.state_dict(), checkpoint_id=str(folder))
    write_model_args(str(folder), model.model_args)
    return str(folder)


def model_with_bias(bias_std=BIAS_STD, args=None):
    model = build_ours(args or flavor_args("debug"))
    randomize_(model, seed=3)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer, std in zip(model.layers.values(), bias_std):
            layer.moe.router.expert_bias.copy_(std * torch.randn(8, generator=g))
    return model


def held_out(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (12, 33), generator=torch.Generator().manual_seed(11))  # 2 batches of 8, 4 rows


@torch.no_grad()
def reference(model, rows: torch.Tensor) -> tuple[float, float, list[float]]:
    """Loss of the whole model with its bias and with every bias at zero, and per layer the share of tokens
    whose expert set the router itself picks otherwise when run again on the same input with a zero bias."""
    inputs, labels = rows[:, :-1], rows[:, 1:]
    changed = []

    def rerouted(router, args, routing):
        saved = router.expert_bias.clone()
        router.expert_bias.zero_()
        plain = router.forward(*args)  # not router(...): that would call this hook again
        router.expert_bias.copy_(saved)
        same = (plain.experts.sort(-1).values == routing.experts.sort(-1).values).all(-1)
        changed.append((~same).sum().item() / same.numel())

    hooks = [layer.moe.router.register_forward_hook(rerouted) for layer in model.layers.values()]
    with_bias = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).item()
    for hook in hooks:
        hook.remove()
    for layer in model.layers.values():
        layer.moe.router.expert_bias.zero_()
    without = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).item()
    return with_bias, without, changed


def test_printed_cost_is_the_whole_models_with_and_without_bias(tmp_path, capsys):
    model = model_with_bias()
    step = save(model, tmp_path / "step")
    rows = held_out(model.model_args.vocab_size)
    torch.save(rows, tmp_path / "tokens.pt")
    # All 12 rows in one reference pass; the export scores them in batches of 8 (the file's 8 and 4).
    state = {k: v.clone() for k, v in model.state_dict().items()}
    loss_with, loss_without, changed = reference(model, rows)
    assert changed[3] == 0 and changed[1] > 0.2 and loss_without > loss_with + 1e-3  # the bias matters here

    assert convert.main(["to-hf", step, str(tmp_path / "hf"), "--dtype", "float32", "--drop-expert-bias",
                         "--eval-tokens", str(tmp_path / "tokens.pt")]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("dropping the expert bias (max |bias| ")
    assert f"held-out loss {loss_with:.4f} with it, {loss_without:.4f} without" in line
    assert "384 tokens" in line  # 12 rows of 32
    assert "per layer: " + " ".join(f"{c:.1%}" for c in changed) in line

    cost = measure_bias_cost(model.model_args, lambda keys: {k: state[k] for k in keys},
                             [(rows[:8, :-1], rows[:8, 1:]), (rows[8:, :-1], rows[8:, 1:])])
    assert cost.loss_with == pytest.approx(loss_with, rel=1e-5)
    assert cost.loss_without == pytest.approx(loss_without, rel=1e-5)
    assert cost.changed_per_layer == pytest.approx(changed, abs=1e-9)
    assert cost.max_abs_bias == pytest.approx(float(state["layers.1.moe.router.expert_bias"].abs().max()))
    # The export is the model without its bias: its config reads back, no bias key in the weights.
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_experts"] == 8


def test_zero_bias_costs_nothing_and_needs_no_tokens(tmp_path, capsys):
    model = model_with_bias(bias_std=(0.0,) * 4)
    state = dict(model.state_dict())
    rows = held_out(model.model_args.vocab_size)
    cost = measure_bias_cost(model.model_args, lambda keys: {k: state[k] for k in keys}, [(rows[:, :-1], rows[:, 1:])])
    assert cost.loss_with == cost.loss_without and cost.changed_per_layer == [0.0] * 4 and cost.max_abs_bias == 0
    step = save(model, tmp_path / "step")
    assert convert.main(["to-hf", step, str(tmp_path / "hf"), "--drop-expert-bias"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == ("the expert bias is zero in every layer: the export routes as "
                                                        "the trained model does")


def test_the_synthetic_stream_of_the_run_is_held_out(tmp_path, capsys):
    args = flavor_args("debug")
    args.moe.router = dataclasses.replace(args.moe.router, route_norm=not args.moe.router.route_norm)  # unlike debug.toml's
    step = save(model_with_bias(args=args), tmp_path / "step")
    environ = dict(os.environ)
    assert convert.main(["to-hf", step, str(tmp_path / "hf"), "--drop-expert-bias", "--config", "configs/debug.toml",
                         "--eval-batches", "1"]) == 0
    assert dict(os.environ) == environ  # reading --config is not training's set-up (no RANK / WORLD_SIZE left)
    assert "1,024 tokens" in capsys.readouterr().out.splitlines()[0]  # one batch of the run's 8 x 128
    # The model is what the step folder recorded (model_args.json); --config only names the held-out data.
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["norm_topk_prob"] == args.moe.router.route_norm
    from torchtitan_moe.hf.bias_cost import HELD_OUT_RANK, synthetic_held_out
    from torchtitan_moe.train.job_config import load_job_config

    job = load_job_config(["--job.config_file", "configs/debug.toml"])
    ((inputs, labels),) = synthetic_held_out(job, 2048, 1)
    assert inputs.shape == (8, 128) and torch.equal(inputs[:, 1:], labels[:, :-1])
    from torchtitan_moe.components.data.synthetic import SyntheticMarkovDataset

    trained = next(iter(SyntheticMarkovDataset(2048, 128, 0, seed=job.data.synthetic_seed)))[0]["input"]
    assert HELD_OUT_RANK < 0 and not torch.equal(trained, inputs[0])  # not rank 0's first sample


@pytest.mark.parametrize("extra, message", [
    ([], "--drop-expert-bias measures what dropping the bias costs on held-out tokens first: pass --config"),
    (["--eval-batches", "0"], "--eval-batches 0: must be >= 1"),
    (["--eval-tokens", "FLOAT"], "expected an integer tensor [sequences, length + 1] saved with torch.save"),
    (["--eval-tokens", "HUGE"], "token ids must be in 0..2047 (the model's vocabulary), found 0..5000"),
])
def test_drop_expert_bias_refusals_are_one_line(tmp_path, capsys, extra, message):
    step = save(model_with_bias(), tmp_path / "step")
    torch.save(torch.rand(4, 9), tmp_path / "FLOAT")
    torch.save(torch.tensor([[0, 5000]]), tmp_path / "HUGE")
    extra = [str(tmp_path / e) if e in ("FLOAT", "HUGE") else e for e in extra]
    assert convert.main(["to-hf", step, str(tmp_path / "hf"), "--drop-expert-bias", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("convert: error: ") and message in err[0], err
    assert not (tmp_path / "hf").exists()  # refused before anything is written


def test_eval_options_without_drop_expert_bias_and_training_text_are_refused(tmp_path, capsys):
    step = save(model_with_bias(), tmp_path / "step")
    assert convert.main(["to-hf", step, str(tmp_path / "hf"), "--eval-batches", "2"]) == 2
    assert capsys.readouterr().err.strip() == ("convert: error: --eval-tokens and --eval-batches pick the held-out "
                                               "tokens --drop-expert-bias measures on: pass them with --drop-expert-bias")
    (tmp_path / "docs.txt").write_text("some text")
    toml = tmp_path / "text.toml"
    toml.write_text(open("configs/debug.toml").read().replace(
        'dataset = "synthetic"', f'dataset = "text"\ndataset_path = "{tmp_path / "docs.txt"}"'))
    assert convert.main(["to-hf", step, str(tmp_path / "hf"), "--drop-expert-bias", "--config", str(toml)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "[training] dataset = 'text' is what the run trained on, not held out: pass " \
        "--eval-tokens FILE" in err[0], err
