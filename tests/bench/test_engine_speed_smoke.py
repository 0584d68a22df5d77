"""benchmarks/engine_speed.py end to end on CPU (``--smoke``: tiny shapes, float32), with
async scheduling on and off: every part it runs reports timed steps and no error, so the
GPU measurement script cannot rot unnoticed between device sessions."""

from __future__ import annotations

import json

import pytest

from benchmarks import engine_speed


@pytest.mark.parametrize("async_flag", ["--async-scheduling", "--no-async-scheduling"])
def test_engine_speed_smoke(tmp_path, async_flag):
    out = tmp_path / "speed.json"
    rc = engine_speed.main(["--smoke", "--device", "cpu", "--only", "decode,mixed,prefill,small",
                            "--out", str(out), async_flag])
    results = json.loads(out.read_text())
    assert rc == 0 and not results["errors"]
    assert results["meta"]["args"]["async_scheduling"] == (async_flag == "--async-scheduling")
    assert [(c["batch"], c["context"]) for c in results["decode"]] == [(1, 64), (8, 128)]
    for case in results["decode"] + results["small"]:
        assert "skipped" not in case
        assert len(case["raw_step_ms"]) == 5 and min(case["raw_step_ms"]) > 0
        # The timed steps were decode steps of the whole batch (no pad rows on CPU).
        assert case["padded_batch"] == case["batch"]
    assert [p["tokens"] for p in results["prefill"]] == [128, 512]
    for prefill in results["prefill"]:
        # Timed to the first token: the prompt's forward is inside the measured time.
        assert prefill["raw_step_ms"][0] >= prefill["raw_forward_ms"][0] > 0
    assert {case["enforce_eager"] for case in results["small"]} == {True, False}
    (mixed,) = results["mixed"]
    # Every timed step held the new prompt beside the decoding batch.
    assert "skipped" not in mixed and mixed["mixed_forwards"] == mixed["timed_steps"]
    assert len(mixed["raw_decode_only_step_ms"]) == mixed["timed_steps"]
