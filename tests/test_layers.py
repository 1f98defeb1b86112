"""The package is a house read from the ground up: each room imports only itself and the rooms below it.

Read from the source (every `import`, also those inside functions), so a lazy import that runs back up
fails here as surely as one at the top of a file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan_moe"
ROOMS = ["compat", "ops", "dispatch", "moe", "config", "parallel", "components", "models", "train", "hf", "tools"]


def room_of(module: str) -> str | None:
    """'torchtitan_moe.moe.router' -> 'moe'; the package itself (its version string) is the ground: None."""
    parts = module.split(".")
    if parts[0] != "torchtitan_moe" or len(parts) == 1:
        return None
    if parts[1] not in ROOMS:
        raise AssertionError(f"torchtitan_moe.{parts[1]} is in no room: add it to a subpackage of {ROOMS}")
    return parts[1]


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, package: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import of ours in `path`; `from torchtitan_moe import ops` is ops."""
    own = module_name(path, package)
    package = own if path.name == "__init__.py" else own.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            if base == "torchtitan_moe":
                found += [(node.lineno, f"torchtitan_moe.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, base))
    return [(line, m) for line, m in found if m.split(".")[0] == "torchtitan_moe"]


def upward_imports(package: Path = PACKAGE) -> list[str]:
    bad = []
    for path in sorted(package.rglob("*.py")):
        here = room_of(module_name(path, package))
        for line, module in imported_modules(path, package):
            there = room_of(module)
            if here is not None and there is not None and ROOMS.index(there) > ROOMS.index(here):
                bad.append(f"{path.relative_to(package.parent)}:{line} ({here}) imports {module} ({there})")
            if here is None and there is not None:
                bad.append(f"{path.relative_to(package.parent)}:{line}: the package's own __init__ imports {module}")
    return bad


def test_every_import_runs_down_the_house():
    assert upward_imports() == []


def test_an_import_up_the_house_is_named(tmp_path):
    """The check itself: a moe module importing the trainer, lazily, is caught with its line."""
    pkg = tmp_path / "torchtitan_moe"
    (pkg / "moe").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "moe" / "__init__.py").write_text("")
    (pkg / "moe" / "router.py").write_text(
        "from torchtitan_moe import ops\n\ndef f():\n    from ..train import trainer\n")
    assert upward_imports(pkg) == ["torchtitan_moe/moe/router.py:4 (moe) imports torchtitan_moe.train (train)"]


def test_a_module_outside_the_rooms_is_refused(tmp_path):
    pkg = tmp_path / "torchtitan_moe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text("import os\n")
    with pytest.raises(AssertionError, match="torchtitan_moe.helpers is in no room"):
        upward_imports(pkg)
