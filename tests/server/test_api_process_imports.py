"""A server's API process reaches its engine spawn without importing torch.

Every ``pdserve serve``/worker start parses its flags and builds its ``EngineConfig`` in
the API process before it spawns the engine; torch there (about 1.3 s of CPU) would delay
every start. Only the engine process, and a GGUF file's conversion, need it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine_core.arg_utils import engine_config_from_args
from engine_core.default_model import default_model_path
from engine_core.demo_model import random_demo_model_path
from tests.integration.cluster_harness import child_env

PROBE = """
import sys
from deploy.cli import build_parser
from engine_core.arg_utils import engine_config_from_args, resolve_model_argument
from engine_core.server.server_args import server_options
import engine_core.server.api_server, engine_core.server.worker, connectors
args = build_parser().parse_args([{argv}])
server_options(args)
resolve_model_argument(args)
config = engine_config_from_args(args)
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


@pytest.mark.parametrize("argv", [
    ["serve", "DEMO_DIR"], ["prefill", "DEMO_DIR"], ["serve", "--demo-random"],
    ["serve", "--demo"], ["decode"]], ids=["serve", "prefill", "demo-random", "demo", "default"])
def test_flags_and_config_import_no_torch(argv: list[str]) -> None:
    """A checkpoint directory, the random demo model and the default model (a GGUF file
    converted before: converting needs torch once)."""
    random_demo = str(random_demo_model_path())
    if "--demo" in argv or argv == ["decode"]:
        _convert_default_model()
    argv = [random_demo if arg == "DEMO_DIR" else arg for arg in argv] + ["--device", "cpu"]
    out = subprocess.run([sys.executable, "-c", PROBE.format(argv=repr(argv)[1:-1])],
                         env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def _convert_default_model() -> None:
    """The default model's cached conversion, as a first ``pdserve serve --demo`` makes it."""
    from deploy.cli import build_parser

    engine_config_from_args(build_parser().parse_args(
        ["serve", str(default_model_path()), "--device", "cpu"]))
