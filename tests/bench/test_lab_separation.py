"""The product never depends on the lab: no packaged module imports ``experiments``, and the
wheel's package list leaves it out."""

from __future__ import annotations

import pytest

from tests.integration.test_import_direction import ROOT, imported_packages

PRODUCT = ("engine_core", "connectors", "prefill", "decode", "proxy", "deploy", "benchmarks")


@pytest.mark.parametrize("package", PRODUCT)
def test_product_does_not_import_experiments(package: str) -> None:
    violations = [str(path.relative_to(ROOT)) for path in sorted((ROOT / package).rglob("*.py"))
                  if "experiments" in imported_packages(path)]
    assert not violations, violations


def test_wheel_leaves_experiments_out() -> None:
    lines = (ROOT / "pyproject.toml").read_text().splitlines()
    include = next(line for line in lines if line.startswith("include = "))
    exclude = next(line for line in lines if line.startswith("exclude = "))
    assert '"experiments*"' in exclude and "experiments" not in include
    assert (ROOT / "experiments" / "README.md").is_file()
