"""One definition per knob (moe/options.py): every [router] and [moe] key set in the TOML or on the command line
reaches every MoE layer and its router unchanged, and a bad value is refused by the layer and by the config check
in the same words (the config naming each key with its section: [router] n_groups, [moe] top_k)."""

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from test_config import debug_with

from torchtitan_moe.config.sections import ConfigError, Moe, check_semantics, moe_args
from torchtitan_moe.config.sections import Router as RouterSection
from torchtitan_moe.models.qwen3_moe import FLAVORS, Qwen3MoEModel, flavor_args
from torchtitan_moe.moe import MoE, Router
from torchtitan_moe.moe.balance import moe_layers
from torchtitan_moe.moe.options import MoEOptions, RouterOptions
from torchtitan_moe.train.job_config import load_job_config

DEBUG = str(Path(__file__).resolve().parents[1] / "configs" / "debug.toml")

# Values unlike both a bare layer's and a run's defaults, valid together; force_balance (which needs
# n_groups = 1) in a case of its own. Together the cases set every key of RouterOptions and MoEOptions.
CASES = [
    {"router": dict(score_func="sigmoid", route_norm=False, route_scale=2.5, init_std=0.011, bias_update_rate=0.004,
                    balance_loss="sequence", balance_loss_coeff=0.02, z_loss_coeff=0.003, n_groups=2, topk_groups=2,
                    gate_precision="param"),
     "moe": dict(num_experts=16, top_k=4, inter_dim=64, padding="always", align=16)},
    {"router": dict(force_balance=True, balance_loss="micro_batch"), "moe": {}},
]


def test_the_cases_set_every_key():
    assert {k for case in CASES for k in case["router"]} == {f.name for f in dataclasses.fields(RouterOptions)}
    assert {k for case in CASES for k in case["moe"]} == {f.name for f in dataclasses.fields(MoEOptions)}


def as_flags(case: dict) -> list[str]:
    """`--section.key value`; a plain bool is a flag (`--router.force_balance`), an optional one takes a value."""
    flags = []
    for section, table in case.items():
        types = {f.name: f.type for f in dataclasses.fields({"router": RouterSection, "moe": Moe}[section])}
        for key, value in table.items():
            flags += [f"--{section}.{key}"] if types[key] is bool and value else [f"--{section}.{key}", str(value)]
    return flags


@pytest.mark.parametrize("source", ["toml", "cli"])
@pytest.mark.parametrize("case", CASES, ids=["all", "force_balance"])
def test_every_knob_set_in_the_config_reaches_every_layer_and_its_router(tmp_path, case, source):
    precision = {"training__mixed_precision_param": "bfloat16"}  # what gate_precision = 'param' computes in
    if source == "toml":
        changes = {f"{section}__{key}": value for section, table in case.items() for key, value in table.items()}
        config = load_job_config(["--job.config_file", debug_with(tmp_path, **changes, **precision)])
    else:
        config = load_job_config(["--job.config_file", debug_with(tmp_path, **precision), *as_flags(case)])
    args = flavor_args(config.model.flavor)
    args.update_from_config(config)
    with torch.device("meta"):
        model = Qwen3MoEModel(args)
    layers = moe_layers([model])
    assert len(layers) == args.n_layers
    for layer in layers:
        options = layer.router.options
        for key, value in case["router"].items():
            assert getattr(options, key) == value, key
        for key, value in case["moe"].items():
            assert getattr(layer.args, key) == value, key
        # The keys left out: the config's value, or the flavor's where the config leaves it unset (None).
        flavor = FLAVORS["debug"].moe
        for section, have, theirs, cls in (("router", options, flavor.router, RouterOptions),
                                           ("moe", layer.args, flavor, MoEOptions)):
            for f in dataclasses.fields(cls):
                if f.name not in case[section]:
                    value = getattr(getattr(config, section), f.name)
                    assert getattr(have, f.name) == (getattr(theirs, f.name) if value is None else value), f.name
        assert (layer.router.num_experts, layer.router.top_k) == (layer.args.num_experts, layer.args.top_k)
    if "gate_precision" in case["router"]:
        assert layers[0].router.gate_dtype == torch.bfloat16
    if "num_experts" in case["moe"]:
        assert tuple(layers[0].experts.w2.shape) == (16, 128, 64)


# Bad values of the right type (the types are config/structure.py's, before any of this), as TOML changes
# of configs/debug.toml. Each check of moe/options.py is here once.
BAD = [
    {"moe__num_experts": 0},
    {"moe__top_k": 9},
    {"moe__inter_dim": 0},
    {"moe__align": 12},
    {"router__init_std": -0.1},
    {"router__route_scale": 0.0},
    {"router__bias_update_rate": -1.0},
    {"router__balance_loss": "sequence", "router__balance_loss_coeff": -1.0},
    {"router__balance_loss_coeff": 0.0},
    {"router__balance_loss": "none"},
    {"router__z_loss_coeff": -0.001},
    {"router__n_groups": 0},
    {"router__n_groups": 3},
    {"router__n_groups": 4, "router__topk_groups": 5},
    {"router__n_groups": 4, "router__topk_groups": 1, "moe__top_k": 3},
    {"router__n_groups": 4, "router__topk_groups": 3},
    {"router__n_groups": 4, "router__force_balance": True},
]
_GOOD = []


def parsed_debug_config():
    if not _GOOD:
        _GOOD.append(load_job_config(["--job.config_file", DEBUG]))
    return copy.deepcopy(_GOOD[0])


@pytest.mark.parametrize("changes", BAD, ids=["-".join(f"{k.split('__')[1]}={v}" for k, v in c.items()) for c in BAD])
def test_the_layer_and_the_config_refuse_a_bad_knob_in_the_same_words(tmp_path, changes):
    with pytest.raises(ConfigError) as from_toml:
        load_job_config(["--job.config_file", debug_with(tmp_path, **changes)])
    said = str(from_toml.value)
    # The same settings, checked as the config check does, then built into a layer and a router.
    config = parsed_debug_config()
    for name, value in changes.items():
        section, key = name.split("__")
        setattr(getattr(config, section), key, value)
    with pytest.raises(ConfigError) as checked:
        check_semantics(config, FLAVORS)
    assert str(checked.value) == said
    args = moe_args(config, FLAVORS[config.model.flavor].moe)
    with pytest.raises(ValueError) as layer:
        MoE(args, dim=16)
    # The config names each key in its section; the layer names the key alone. Otherwise word for word.
    assert said.startswith(("[router] ", "[moe] ")) and "\n" not in said
    assert said.replace("[router] ", "").replace("[moe] ", "") == str(layer.value)
    if not {"moe__inter_dim", "moe__align"} & set(changes):  # the router's own checks
        with pytest.raises(ValueError) as router:
            Router(16, args.num_experts, args.top_k, args.router)
        assert str(router.value) == str(layer.value)
