"""benchmarks/kv_transfer.py end to end on CPU (``--smoke``): producer and consumer engines in
two processes over the CPU transport, with per-layer compute, one call per layer and grouped
calls (each combination is a fresh pair of processes, the slow part). Checks the benchmark's
own bookkeeping; the numbers mean nothing."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import kv_transfer


def test_kv_transfer_smoke(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    kv_transfer.main(["--smoke", "--sizes-mb", "5", "--min-call-bytes", "0", "33554432",
                      "--layer-us", "300", "--trials", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    (size,) = result["sizes"]
    assert size["blocks"] == 2 and size["raw_gbps"] is None
    assert len(result["connector"]) == 2
    for key, measured in result["connector"].items():
        row = measured[str(size["bytes"])]
        assert row["failed"] == 0, key
        assert row["nccl_calls_per_request"] == (36 if key.startswith("min_call_bytes=0,") else 1)
        assert 0 < row["tail_ms_median"] <= row["e2e_ms_median"], key
        assert row["data_gbps"] is None and row["data_vs_raw"] is None  # no GPU time on CPU
        assert key.endswith("layer_us=300")
        assert row["e2e_ms_median"] >= 36 * 0.3  # 36 layers of 0.3 ms before the last hook
        consumer = measured["stats"]["kv_consumer"]
        assert consumer["transfers_received"] == 3 and consumer["recv_buffer_bytes_in_use"] == 0
