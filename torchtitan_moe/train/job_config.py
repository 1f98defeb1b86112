"""Read a job config the way torchtitan does, after checks that fail in one clear line.

    argv ─► TOML structure check ─► CLI key check ─► torchtitan ConfigManager ─► semantics

Our sections join torchtitan's through its custom-config-module hook, added here when
neither the TOML nor the command line names it.
"""

from __future__ import annotations

import os
import sys

from torchtitan_moe.components.data import check_data
from torchtitan_moe.config.sections import ConfigError, check_semantics
from torchtitan_moe.config.structure import check_cli_keys, check_structure
from torchtitan_moe.config.torchtitan_keys import check_tokenizer_file, check_torchtitan_keys
from torchtitan_moe.compat.torchtitan import CUSTOM_CONFIG_MODULE, ConfigParser, merged_config_class

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib


def cli_value(argv: list[str], key: str) -> str | None:
    """The value of `--section.key` (or its dashed spelling) on the command line, if given."""
    flags = (f"--{key}", f"--{key.replace('_', '-')}")
    for i, arg in enumerate(argv):
        for flag in flags:
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
    return None


def read_toml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"--job.config_file {path}: no such file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"--job.config_file {path}: cannot be read ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}): a TOML file must be UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def with_custom_config_module(argv: list[str], toml_values: dict) -> list[str]:
    named = any(a.split("=")[0] in ("--job.custom_config_module", "--job.custom-config-module") for a in argv)
    if named or toml_values.get("job", {}).get("custom_config_module"):
        return argv
    return [*argv, "--job.custom_config_module", CUSTOM_CONFIG_MODULE]


def load_job_config(argv: list[str] | None = None, world_size: int | None = None):
    """Parse `--job.config_file FILE [--section.key value ...]` into a checked JobConfig.

    `world_size`: the number of processes the run will have, when known before launch (a
    launcher's WORLD_SIZE wins); the degrees of parallelism are checked against it."""
    from torchtitan_moe.models.qwen3_moe import FLAVORS

    argv = list(sys.argv[1:] if argv is None else argv)
    path = cli_value(argv, "job.config_file")
    toml_values = read_toml(path) if path else {}
    config_cls = merged_config_class()
    check_structure(toml_values, config_cls, path or "config")
    check_cli_keys(argv, config_cls)
    module = cli_value(argv, "job.custom_config_module") or toml_values.get("job", {}).get(
        "custom_config_module", CUSTOM_CONFIG_MODULE)
    if module != CUSTOM_CONFIG_MODULE:
        raise ConfigError(f"[job] custom_config_module = {module!r}: torchtitan-moe needs {CUSTOM_CONFIG_MODULE!r}")
    config = ConfigParser().parse_args(with_custom_config_module(argv, toml_values))
    world_size = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else world_size
    check_semantics(config, FLAVORS, world_size)
    check_torchtitan_keys(config, world_size)
    if config.data.tokenizer != "bytes":
        check_tokenizer_file(config.data.tokenizer)
    check_data(config, FLAVORS[config.model.flavor].vocab_size)  # every shard's header, before launch
    return config


def run_command(produce, doc: str, argv: list[str] | None = None) -> int:
    """A config command's main: print `produce(argv)`, or its config error as one line (exit status 2);
    -h / --help prints `doc`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(doc)
        return 0
    try:
        print(produce(argv))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0
