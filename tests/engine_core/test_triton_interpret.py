"""The Triton kernel tests on CPU, under the Triton interpreter, in a subprocess.

``TRITON_INTERPRET=1`` must be set before the kernels are defined (``triton.jit`` reads it
then), and this pytest process may already hold compiled kernels, so the interpreter run
gets its own process: test_triton_kernels.py with its ``interpret`` cases (small shapes,
CPU tensors). Skipped where triton is not installed, as in CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_core.kernels import triton_available

pytestmark = pytest.mark.skipif(
    not triton_available(),
    reason="triton is not installed (pip install triton): the interpreter cases need it")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_triton_kernels_under_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-m", "not gpu", "-k", "interpret",
               str(ROOT / "tests" / "engine_core" / "test_triton_kernels.py")]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=840)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout and " failed" not in proc.stdout, report
