"""Benchmarks write where the user says, else under ``results/`` (ignored by git)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.output import RESULTS_ROOT, default_out, write_json
from benchmarks.serve.report import result_paths


def test_default_out_is_a_json_file_under_results() -> None:
    path = default_out("engine_speed")
    assert RESULTS_ROOT == Path("results")
    assert path.parent == Path("results", "engine_speed") and path.suffix == ".json"


def test_write_json_creates_its_folder(tmp_path: Path) -> None:
    path = write_json(tmp_path / "a" / "b.json", {"x": 1})
    assert path == tmp_path / "a" / "b.json" and json.loads(path.read_text()) == {"x": 1}


def test_bench_serve_results_default_to_results_serve(tmp_path: Path) -> None:
    run = {"model_id": "m", "backend": "openai", "request_rate": 2.0, "date": "20260101-000000"}
    assert result_paths([run], None, "run.json") == [Path("results", "serve", "run.json")]
    assert result_paths([run], str(tmp_path), "run.json") == [tmp_path / "run.json"]
