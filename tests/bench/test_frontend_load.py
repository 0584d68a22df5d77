"""The front-end load benchmark end to end at a small scale: a real API server on the token
pump engine, streams read to the end, every token counted, the loop never held."""

from __future__ import annotations

from benchmarks.frontend_load import measure


def test_frontend_load_counts_every_token() -> None:
    result = measure(streams=4, tokens=30, step_ms=10.0)
    assert result["tokens"] == 4 * 30
    assert 0 < result["received_tokens_per_s"] <= 1.2 * result["offered_tokens_per_s"]
    assert result["gap_ms_p50"] is not None and result["gap_ms_max"] < 1000.0
    assert "pdserve:event_loop_stalls_total 0.0" in result["server_stall_metrics"]
