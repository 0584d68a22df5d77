"""Packages depend one way: engine_core <- connectors <- prefill, decode, proxy <- deploy."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FORBIDDEN = {
    "engine_core": {"connectors", "prefill", "decode", "proxy", "deploy"},
    "connectors": {"prefill", "decode", "proxy", "deploy"},
    # Each role is wiring over engine_core and connectors: neither imports the other or
    # the proxy (what a worker shares with the proxy lives in engine_core.cluster).
    "prefill": {"decode", "proxy", "deploy"},
    "decode": {"prefill", "proxy", "deploy"},
    "proxy": {"deploy"},
}


def imported_packages(path: Path) -> set[str]:
    """Top-level package of every import in ``path`` (function-level imports included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_direction(package: str) -> None:
    sources = sorted((ROOT / package).rglob("*.py"))
    assert sources or package in ("connectors",), f"no sources under {package}/"
    violations = [f"{path.relative_to(ROOT)} imports {bad}"
                  for path in sources
                  for bad in sorted(imported_packages(path) & FORBIDDEN[package])]
    assert not violations, "\n".join(violations)


def test_scanner_sees_function_level_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("import os\n\ndef f():\n    from proxy.app import x\n    import deploy.cli\n")
    assert imported_packages(source) == {"os", "proxy", "deploy"}
