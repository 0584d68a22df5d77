"""Where a benchmark writes when the user names no path: ``results/`` under the working
directory, which the repository ignores, so runs are output and never committed history."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

RESULTS_ROOT = Path("results")


def default_out(benchmark: str) -> Path:
    """``results/<benchmark>/<UTC time stamp>.json``: a fresh file for each run."""
    return RESULTS_ROOT / benchmark / f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"


def write_json(path: str | Path, payload: Any, indent: int = 2) -> Path:
    """Write ``payload`` as JSON to ``path`` (its folder created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent, default=str) + "\n")
    return path
