"""What a run loads is checked first: each refusal is one line that says what to do (in-process, fast)."""

import copy
import dataclasses
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan_moe.train.checkpoint import (
    CheckpointError,
    check_checkpoint_to_load,
    expected_shapes,
    read_model_args,
    write_model_args,
)
from torchtitan_moe.config.sections import ConfigError
from torchtitan_moe.train.job_config import load_job_config
from torchtitan_moe.models.qwen3_moe import flavor_args
from torchtitan_moe.models.qwen3_moe.state_dict_adapter import hf_config

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.toml")


_BASE = []


def job(dump: Path, **changes):
    """configs/debug.toml with checkpoints on, dumping to `dump`, with `section__key=value` changes
    (parsed once: these tests exercise the checks, not the parser)."""
    if not _BASE:
        _BASE.append(load_job_config(["--job.config_file", DEBUG, "--checkpoint.enable"]))
    config = copy.deepcopy(_BASE[0])
    config.job.dump_folder = str(dump)
    for name, value in changes.items():
        section, key = name.split("__")
        setattr(getattr(config, section), key, value)
    return config


def parse(dump: Path, *overrides: str):
    return load_job_config(["--job.config_file", DEBUG, "--job.dump_folder", str(dump), "--checkpoint.enable",
                            *overrides])


def run_args(config):
    args = flavor_args(config.model.flavor)
    args.update_from_config(config)
    return args


def save_step(folder: Path, args, full: bool = True, dp_ranks: int = 2) -> None:
    """A step folder as our trainer writes it: the model, and for a full one the training state."""
    state = {key: torch.zeros(shape) for key, shape in expected_shapes(args).items()}
    if full:
        state["train_state"] = {"step": 4, "ntokens_seen": 0}
        state["optimizer"] = {"state": {"norm.weight": {"exp_avg": torch.zeros(args.dim)}}}
        state["dataloader"] = {**{f"dp_rank_{r}": b"position" for r in range(dp_ranks)}, "world_size": dp_ranks}
    dcp.save(state, checkpoint_id=str(folder))
    write_model_args(str(folder), args)


def refusal(config, dp: int = 2) -> str:
    with pytest.raises(CheckpointError) as info:
        check_checkpoint_to_load(config, run_args(config), dp)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_full_checkpoint_resumes(tmp_path):
    config = job(tmp_path)
    save_step(tmp_path / "checkpoint" / "step-4", run_args(config))
    plan = check_checkpoint_to_load(config, run_args(config), 2)
    assert plan.step == 4 and not plan.model_only


def test_model_only_step_is_refused_with_how_to_start_from_it(tmp_path):
    config = job(tmp_path)
    args = run_args(config)
    save_step(tmp_path / "checkpoint" / "step-2", args)
    save_step(tmp_path / "checkpoint" / "step-4", args, full=False)
    message = refusal(config)
    step4 = tmp_path / "checkpoint" / "step-4"
    assert f"{step4} holds the model only" in message
    assert f"--checkpoint.initial_load_path {step4} (in a new --job.dump_folder)" in message
    assert "or resume from step 2 (--checkpoint.load_step 2)" in message
    # The suggested start works: a new run takes its weights (model only, any dp degree).
    new = job(tmp_path / "new", checkpoint__initial_load_path=str(step4))
    assert check_checkpoint_to_load(new, run_args(new), 1).model_only


def test_other_experts_or_flavor_is_refused_naming_the_difference(tmp_path):
    save_step(tmp_path / "checkpoint" / "step-4", run_args(job(tmp_path)))
    message = refusal(job(tmp_path, moe__num_experts=16))
    assert "num_experts 8 vs 16 (checkpoint vs this run); set [moe] num_experts" in message
    message = refusal(job(tmp_path, model__flavor="30b-a3b-8l"))
    assert "n_layers 4 vs 8" in message and "dim 128 vs 2048" in message
    assert "set [model] flavor" in message and "(flavor 'debug' has its shapes)" in message
    message = refusal(job(tmp_path, moe__inter_dim=64))
    assert "inter_dim 128 vs 64" in message and "[moe] inter_dim" in message


def test_other_data_parallel_degree_is_refused_unless_data_restarts(tmp_path):
    config = job(tmp_path)
    save_step(tmp_path / "checkpoint" / "step-4", run_args(config), dp_ranks=2)
    message = refusal(config, dp=4)
    assert "data positions of 2 data-parallel ranks and this run has 4" in message
    assert "--checkpoint.exclude_from_loading dataloader" in message
    restarted = job(tmp_path, checkpoint__exclude_from_loading=["dataloader"])
    assert check_checkpoint_to_load(restarted, run_args(restarted), 4).step == 4


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage, expected", [
    ("distcp", "is truncated ("),
    ("metadata", "its .metadata cannot be read ("),
    ("model_args", "model_args.json cannot be read (JSONDecodeError"),
])
def test_an_unreadable_step_is_refused_naming_it_and_the_step_to_resume_from(tmp_path, damage, expected):
    config = job(tmp_path)
    args = run_args(config)
    for step in (2, 4, 6):
        save_step(tmp_path / "checkpoint" / f"step-{step}", args)
    step6 = tmp_path / "checkpoint" / "step-6"
    target = {"distcp": next(step6.glob("*.distcp")), "metadata": step6 / ".metadata",
              "model_args": step6 / "model_args.json"}[damage]
    _truncate(target)
    before = {p: p.read_bytes() for p in (tmp_path / "checkpoint").rglob("*") if p.is_file()}
    message = refusal(config)
    assert str(step6) in message and expected in message
    assert "nothing was changed on disk; resume from step 4 with --checkpoint.load_step 4" in message
    assert {p: p.read_bytes() for p in (tmp_path / "checkpoint").rglob("*") if p.is_file()} == before
    # The step it names loads.
    assert check_checkpoint_to_load(job(tmp_path, checkpoint__load_step=4), args, 2).step == 4


def test_incomplete_step_is_skipped_with_a_warning(tmp_path, caplog):
    config = job(tmp_path)
    save_step(tmp_path / "checkpoint" / "step-4", run_args(config))
    save_step(tmp_path / "checkpoint" / "step-6", run_args(config))
    (tmp_path / "checkpoint" / "step-6" / ".metadata").unlink()  # killed while saving: DCP writes it last
    with caplog.at_level(logging.WARNING):
        assert check_checkpoint_to_load(config, run_args(config), 2).step == 4
    assert "step-6 is incomplete" in caplog.text
    message = refusal(job(tmp_path, checkpoint__load_step=6))
    assert "--checkpoint.load_step 6" in message and "incomplete" in message


def test_hugging_face_export_step_is_refused_for_resume(tmp_path):
    config = job(tmp_path)
    step = tmp_path / "checkpoint" / "step-10"
    step.mkdir(parents=True)
    (step / "model.safetensors.index.json").write_text("{}")
    message = refusal(config)
    assert "is a Hugging Face export (weights only)" in message and "--checkpoint.initial_load_in_hf" in message


def test_hugging_face_initial_load_checks_config_json(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    args = flavor_args("debug")
    args.moe = dataclasses.replace(args.moe, num_experts=16)
    (hf / "config.json").write_text(json.dumps(hf_config(args)))
    load = {"checkpoint__initial_load_path": str(hf), "checkpoint__initial_load_in_hf": True}
    assert "num_experts 16 vs 8" in refusal(job(tmp_path / "run", **load))
    fitting = job(tmp_path / "run", **load, moe__num_experts=16)
    assert check_checkpoint_to_load(fitting, run_args(fitting), 2).from_hf


def test_model_args_round_trip(tmp_path):
    args = flavor_args("debug")
    args.moe = dataclasses.replace(args.moe, top_k=3, router=dataclasses.replace(args.moe.router, route_norm=False))
    write_model_args(str(tmp_path), args)
    assert read_model_args(str(tmp_path)) == args


# model_args.json of configs/debug.toml's run as written before the router's settings had a table of their own:
# flat in "moe", the gate's init std as router_init_std and its dtype as router_gate_dtype.
FLAT_MODEL_ARGS = """{
  "_enforced": "This field is used to enforce all fields have defaults.",
  "dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "head_dim": 32, "vocab_size": 2048, "norm_eps": 1e-06,
  "rope_theta": 10000.0, "qk_norm": true, "max_seq_len": 128, "attn_type": "sdpa", "attn_mask_type": "causal",
  "enable_weight_tying": false,
  "moe": {
    "num_experts": 8, "top_k": 2, "inter_dim": 128, "score_func": "softmax", "route_norm": true, "route_scale": 1.0,
    "router_init_std": 0.02, "bias_update_rate": 0, "balance_loss": "global_batch", "balance_loss_coeff": 0.1,
    "z_loss_coeff": 0.0, "n_groups": 1, "topk_groups": 1, "force_balance": false, "router_gate_dtype": "float32",
    "padding": "auto", "align": 8, "kernels": "auto"
  },
  "init_seed": 42
}"""


def test_a_step_saved_with_flat_model_args_still_resumes_and_converts(tmp_path, caplog):
    from torchtitan_moe.hf import convert

    config = job(tmp_path)
    args = run_args(config)
    step = tmp_path / "checkpoint" / "step-4"
    save_step(step, args)
    (step / "model_args.json").write_text(FLAT_MODEL_ARGS)
    saved = read_model_args(str(step))
    assert saved.moe.router == args.moe.router
    # The flat layout kept the gate's dtype only: with an fp32 gate the parameters' dtype is not in it.
    assert dataclasses.replace(saved, moe=dataclasses.replace(saved.moe, param_dtype=args.moe.param_dtype)) == args
    with caplog.at_level(logging.WARNING):
        assert check_checkpoint_to_load(config, args, 2).step == 4
    assert "was saved by a run with" not in caplog.text
    assert convert.main(["to-hf", str(step), str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf["norm_topk_prob"], hf["router_aux_loss_coef"], hf["num_experts"]) == (True, 0.1, 8)

    # The renamed keys: a bf16 gate (gate_precision 'param' in bf16), another init std.
    flat = json.loads(FLAT_MODEL_ARGS)
    flat["moe"].update(router_gate_dtype="bfloat16", router_init_std=0.01, route_norm=False)
    (step / "model_args.json").write_text(json.dumps(flat))
    moe = read_model_args(str(step)).moe
    assert (moe.router.gate_precision, moe.param_dtype, moe.router.init_std, moe.router.route_norm) == (
        "param", "bfloat16", 0.01, False)


def test_checkpoint_config_defaults_and_refusals(tmp_path):
    assert job(tmp_path).checkpoint.last_save_model_only is False  # a finished run can be extended
    with pytest.raises(ConfigError, match="also set last_save_model_only = true"):
        parse(tmp_path, "--checkpoint.last_save_in_hf")
    with pytest.raises(ConfigError, match="bias_update_rate = 0.001: Hugging Face Qwen3-MoE has no expert bias"):
        parse(tmp_path, "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only",
              "--router.bias_update_rate", "1e-3")
    ok = parse(tmp_path, "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only")  # the default recipe
    assert ok.checkpoint.last_save_in_hf


def test_progress_bar_without_tqdm(monkeypatch, capsys):
    from torchtitan_moe.hf import convert

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    assert list(convert.progress(range(3), "layers")) == [0, 1, 2]
    assert capsys.readouterr().err.endswith("layers [" + "#" * 30 + "] 3/3\n")
