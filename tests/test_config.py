"""Config validation: bad configs stop with one line naming the key; the bundled ones pass."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan.config import ConfigManager

from torchtitan_moe.compat.torchtitan import ConfigParser
from torchtitan_moe.tools.check_config import check
from torchtitan_moe.config.sections import ConfigError
from torchtitan_moe.train.job_config import load_job_config, read_toml, with_custom_config_module

ROOT = Path(__file__).resolve().parents[1]
DEBUG = ROOT / "configs" / "debug.toml"


def write_toml(path: Path, values: dict) -> str:
    lines = []
    for section, table in values.items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            text = repr(value) if not isinstance(value, bool) else str(value).lower()
            lines.append(f"{key} = {text.replace(chr(39), chr(34))}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def debug_with(tmp_path: Path, **changes) -> str:
    """configs/debug.toml with `section__key=value` changes (value None removes the key)."""
    values = read_toml(str(DEBUG))
    for name, value in changes.items():
        section, key = name.split("__")
        table = values.setdefault(section, {})
        if value is None:
            table.pop(key, None)
        else:
            table[key] = value
    return write_toml(tmp_path / "config.toml", values)


@pytest.mark.parametrize("name", ["debug.toml", "qwen3_30b_a3b.toml", "qwen3_30b_a3b_8l.toml", "qwen3_30b_a3b_4gpu.toml"])
def test_bundled_configs_pass(name):
    # EP = 8 in the 30B configs: the check needs the run's process count
    assert check([str(ROOT / "configs" / name), "--nproc", "8"]).startswith("ok: qwen3_moe")


@pytest.mark.parametrize("name", ["debug.toml", "qwen3_30b_a3b_4gpu.toml"])
def test_our_parse_gives_torchtitans_config_and_its_help(name, capsys):
    # ConfigParser skips tyro's search for comments to show as help: the config must be torchtitan's own, field
    # for field, and --help the same text.
    path = str(ROOT / "configs" / name)
    argv = with_custom_config_module(["--job.config_file", path, "--moe.top_k", "4", "--training.steps=7",
                                      "--compile.no-enable", "--router.init_std", "0.01"], read_toml(path))
    ours, theirs = ConfigParser().parse_args(argv), ConfigManager().parse_args(argv)
    assert dataclasses.asdict(ours) == dataclasses.asdict(theirs)  # (each parse merges a class of its own)
    assert (ours.moe.top_k, ours.training.steps, ours.compile.enable) == (4, 7, False)
    helps = []
    for parser in (ConfigParser(), ConfigManager()):
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--help"])
        helps.append(capsys.readouterr().out)
    assert helps[0] == helps[1] and "How many train steps to run" in helps[0]


def test_cli_overrides_apply():
    config = load_job_config(["--job.config_file", str(DEBUG), "--moe.top_k", "4", "--router.init_std=0.01"])
    assert config.moe.top_k == 4 and config.router.init_std == 0.01


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"bogus__key": 1}, "unknown section [bogus]"),
        ({"moe__experts": 4}, "unknown key [moe] experts"),
        ({"moe__top_k": "two"}, "[moe] top_k = 'two': expected int | unset"),
        ({"router__init_std": "big"}, "[router] init_std = 'big': expected float"),
        ({"moe__padding": "sometimes"}, "[moe] padding = 'sometimes': expected 'none' | 'auto' | 'always'"),
        ({"moe__top_k": 9}, "[moe] top_k = 9: must be in 1..num_experts (8)"),
        ({"moe__align": 12}, "[moe] align = 12: must be one of 8, 16, 32"),
        ({"parallelism__expert_parallel_degree": 3}, "expert_parallel_degree = 3: must divide [moe] num_experts (8)"),
        ({"parallelism__expert_parallel_degree": 2, "dispatch__backend": "local"}, "[dispatch] backend = 'local' needs [parallelism] expert_parallel_degree = 1"),
        ({"dispatch__backend": "all_to_all"}, "needs [parallelism] expert_parallel_degree > 1"),
        ({"parallelism__tensor_parallel_degree": 2}, "tensor_parallel_degree = 2: qwen3_moe supports FSDP and EP only"),
        ({"router__init_std": -1.0}, "[router] init_std = -1.0: must be >= 0"),
        ({"training__dataset": "text"}, "[training] dataset_path = None: no such file or folder"),
        ({"training__dataset": "c4"}, "[training] dataset = 'c4': expected 'synthetic' or 'text'"),
        ({"data__tokenizer": "missing.json"}, "[data] tokenizer = 'missing.json': expected 'bytes' or the path"),
        ({"model__flavor": "huge"}, "[model] flavor = 'huge': expected one of 'debug'"),
        ({"router__balance_loss": "batch"}, "[router] balance_loss = 'batch': expected 'none' | 'sequence'"),
        ({"router__balance_loss_coeff": 0.0}, "[router] balance_loss = 'global_batch' needs balance_loss_coeff > 0"),
        ({"router__balance_loss": "none"}, "[router] balance_loss_coeff = 0.1 has no loss to weigh"),
        ({"router__balance_loss": "sequence", "router__balance_loss_coeff": -1.0}, "balance_loss_coeff = -1.0: must be >= 0"),
        ({"router__z_loss_coeff": -0.001}, "[router] z_loss_coeff = -0.001: must be >= 0"),
        ({"router__n_groups": 3}, "[router] n_groups = 3: must divide [moe] num_experts (8)"),
        ({"router__n_groups": 0}, "[router] n_groups = 0: must be >= 1"),
        ({"router__n_groups": 4, "router__topk_groups": 5}, "[router] topk_groups = 5: must be in 1..n_groups (4)"),
        ({"router__topk_groups": 2}, "[router] topk_groups = 2: must be in 1..n_groups (1)"),
        ({"router__n_groups": 4, "router__topk_groups": 1, "moe__top_k": 3}, "[moe] top_k = 3: more than topk_groups x experts per group (1 x 2)"),
        ({"router__n_groups": 4, "router__topk_groups": 3}, "[router] topk_groups = 3: more than top_k (2) groups"),
        ({"router__n_groups": 4, "router__force_balance": True}, "[router] force_balance sends tokens round-robin"),
        ({"router__aux_loss_coeff": 0.01}, "[router] aux_loss_coeff was replaced by balance_loss = \"sequence\""),
    ],
)
def test_bad_config_is_one_clear_line(tmp_path, changes, expected):
    path = debug_with(tmp_path, **changes)
    with pytest.raises(ConfigError) as err:
        load_job_config(["--job.config_file", path])
    message = str(err.value)
    assert expected in message and "\n" not in message


def test_dispatch_section_does_not_bind_torchtitans_model(tmp_path):
    # bench_train trains torchtitan's Qwen3-MoE from our configs, whose [dispatch] may name all_to_all.
    path = debug_with(tmp_path, dispatch__backend="all_to_all", model__name="torchtitan_qwen3_moe")
    assert load_job_config(["--job.config_file", path]).dispatch.backend == "all_to_all"


def test_unknown_cli_key_is_rejected():
    with pytest.raises(ConfigError, match=r"--moe.experts: unknown key 'experts' in \[moe\]"):
        load_job_config(["--job.config_file", str(DEBUG), "--moe.experts", "4"])


def test_replaced_cli_key_names_its_replacement():
    with pytest.raises(ConfigError, match=r"--router.aux_loss_coeff: \[router\] aux_loss_coeff was replaced by"):
        load_job_config(["--job.config_file", str(DEBUG), "--router.aux_loss_coeff", "0.01"])


def test_router_recipe_reaches_the_model_args():
    from torchtitan_moe.models.qwen3_moe import flavor_args

    config = load_job_config(["--job.config_file", str(DEBUG), "--router.balance_loss", "global_batch",
                              "--router.balance_loss_coeff", "0.01", "--router.z_loss_coeff", "0.001",
                              "--router.n_groups", "4", "--router.topk_groups", "2"])
    args = flavor_args("debug")
    args.update_from_config(config)
    moe = args.moe.router
    assert (moe.balance_loss, moe.balance_loss_coeff, moe.z_loss_coeff, moe.n_groups, moe.topk_groups) == (
        "global_batch", 0.01, 0.001, 4, 2)


def test_a_config_without_router_keys_trains_qwen3s_recipe_and_may_export_to_hf(tmp_path):
    # The code's defaults are the shipped configs' recipe (the global-batch balance loss, no expert
    # bias): a user's config without [router] keys trains a model Hugging Face's Qwen3-MoE can hold.
    from torchtitan_moe.models.qwen3_moe import flavor_args

    values = read_toml(str(DEBUG))
    values.pop("router")
    path = write_toml(tmp_path / "config.toml", values)
    config = load_job_config(["--job.config_file", path, "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only"])
    args = flavor_args("debug")
    args.update_from_config(config)
    moe = args.moe.router
    assert (moe.bias_update_rate, moe.balance_loss, moe.balance_loss_coeff) == (0.0, "global_batch", 1e-3)


def test_ep_must_divide_the_process_count(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "6")
    path = debug_with(tmp_path, parallelism__expert_parallel_degree=4, dispatch__backend="all_to_all")
    with pytest.raises(ConfigError, match=r"expert_parallel_degree = 4: must divide the FSDP group size \(6"):
        load_job_config(["--job.config_file", path])


def test_check_config_cli_prints_one_line_and_exits_2(tmp_path):
    path = debug_with(tmp_path, moe__top_k=99)
    result = subprocess.run([sys.executable, "-m", "torchtitan_moe.tools.check_config", path], capture_output=True, text=True)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("config error:")]
    assert errors == [f"config error: [moe] top_k = 99: must be in 1..num_experts (8)"]
    assert "Traceback" not in result.stderr


def test_check_config_cli_accepts_the_debug_config():
    result = subprocess.run([sys.executable, "-m", "torchtitan_moe.tools.check_config", str(DEBUG)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: qwen3_moe debug")
