"""The config's structure: unknown sections or keys and wrongly typed values, in the TOML file and in
`--section.key value` overrides, each reported as one `ConfigError` line naming the key and what it takes.

Judged against the merged config dataclass (torchtitan's JobConfig and ours, config/sections.py), passed in:
this module imports nothing from torchtitan. The semantic checks (impossible combinations of valid
values) are config/sections.py's.
"""

import dataclasses
import types
import typing
from typing import Any, Literal

from torchtitan_moe.config.sections import REPLACED_KEYS, ConfigError


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        return f"list of {_describe(inner)}"
    if origin is dict:
        return "table"
    if tp is type(None):
        return "unset"
    return getattr(tp, "__name__", str(tp))


def _matches(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if origin is list:
        args = typing.get_args(tp)
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value) if args else isinstance(value, list)
    if origin is dict:
        return isinstance(value, dict)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def check_structure(values: dict[str, Any], config_cls: type, source: str) -> None:
    """Check a TOML dict against the (merged) config dataclass: sections, keys, types."""
    sections = {f.name: f.type for f in dataclasses.fields(config_cls)}
    for section, table in values.items():
        if section not in sections:
            raise ConfigError(
                f"{source}: unknown section [{section}]; known sections: {', '.join(sorted(sections))}"
            )
        section_cls = sections[section]
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [{section}] must be a table of keys, got {table!r}")
        keys = {f.name: f.type for f in dataclasses.fields(section_cls)}
        for key, value in table.items():
            if (section, key) in REPLACED_KEYS:
                raise ConfigError(f"{source}: [{section}] {key} was {REPLACED_KEYS[section, key]}")
            if key not in keys:
                raise ConfigError(
                    f"{source}: unknown key [{section}] {key}; known keys: {', '.join(sorted(keys))}"
                )
            if not _matches(value, keys[key]):
                raise ConfigError(
                    f"{source}: [{section}] {key} = {value!r}: expected {_describe(keys[key])}"
                )


def _cli_value_ok(text: str, tp: Any) -> bool:
    """Would the command line's `text` parse as `tp`? Only scalar types are judged (booleans are
    tyro flags, lists take several words): anything else is left to torchtitan's parser."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        return text == "None" or any(_cli_value_ok(text, a) for a in arms)
    if origin is Literal:
        return text in [str(a) for a in typing.get_args(tp)]
    try:
        if tp is int:
            int(text)
        elif tp is float:
            float(text)
    except ValueError:
        return False
    return True


def check_cli_keys(args: list[str], config_cls: type) -> None:
    """Reject `--section.key` overrides that name no known section or key, or give a value that is
    not of the key's type (one line here, rather than the parser's multi-line box)."""
    sections = {f.name: f.type for f in dataclasses.fields(config_cls)}
    for i, arg in enumerate(args):
        if not arg.startswith("--") or "." not in arg or arg in ("--help", "-h"):
            continue
        name = arg[2:].split("=", 1)[0].replace("-", "_")
        section, key = name.split(".", 1)
        if section.startswith("no_"):  # tyro's negated boolean flags: --no-section.key
            section = section[3:]
        if section not in sections:
            raise ConfigError(f"{arg}: unknown section '{section}'; known: {', '.join(sorted(sections))}")
        if (section, key) in REPLACED_KEYS:
            raise ConfigError(f"{arg}: [{section}] {key} was {REPLACED_KEYS[section, key]}")
        keys = {f.name: f.type for f in dataclasses.fields(sections[section])}
        if key.startswith("no_") and key[3:] in keys:  # tyro's negated booleans: --section.no-key
            key = key[3:]
        if key not in keys:
            raise ConfigError(f"{arg}: unknown key '{key}' in [{section}]; known: {', '.join(sorted(keys))}")
        text = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else None)
        if text is not None and (("=" in arg) or not text.startswith("--")) and not _cli_value_ok(text, keys[key]):
            raise ConfigError(f"--{section}.{key} {text}: [{section}] {key} must be {_describe(keys[key])}")
