"""benchmarks/offload_sleep.py on CPU (``--smoke``): the GPU measurement cannot rot between
device sessions; the prefix came back from host memory and both sleep levels ran."""

from __future__ import annotations

import json

from benchmarks import offload_sleep


def test_offload_sleep_smoke(tmp_path) -> None:
    out = tmp_path / "f.json"
    assert offload_sleep.main(["--smoke", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    reuse = results["prefix_reuse"]
    assert reuse["offload"]["host_blocks_loaded"] == 63 // 16  # every full block of the prompt
    for key in ("recomputed_ms", "device_hit_ms", "host_hit_ms"):
        assert reuse["offload"][key] > 0
    assert reuse["no_offload"]["recomputed_after_eviction_ms"] > 0
    for run in ("level_1_first", "level_1_again", "level_2"):
        assert results["sleep"][run]["wake_up_s"] > 0
        assert results["sleep"][run]["first_request_after_ms"] > 0
        assert set(results["sleep"][run]["sleep_phases_s"]) == {"kv_cache_s", "weights_s"}
        assert set(results["sleep"][run]["wake_up_phases_s"]) == {"weights_s", "kv_cache_s"}
