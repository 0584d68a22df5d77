"""The report end to end on CPU (``--smoke``): a real cluster, real benchmark runs, summary.

A few experiments, each topology launched once (every launch starts real worker processes,
the slow part on two cores): the low-load, proxy-overhead, KV-offload and prefix-affinity
experiments run as one report shared by the tests that read its sections; goodput_2k_2p1d
runs alone (it rebuilds its summary from doctored runs). The rest share their launch, run
and summary code, and their plans are checked without processes in test_disagg_report.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks import disagg_report
from benchmarks.disagg.plan import SMOKE_SCALE


@dataclass(frozen=True)
class Report:
    """One smoke report's exit code, directory and summary."""

    rc: int
    path: Path
    summary: dict


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Report:
    """ttft_overhead, proxy_overhead, kv_offload and prefix_affinity in one report."""
    path = tmp_path_factory.mktemp("report")
    rc = disagg_report.main(["--smoke", "--only",
                             "ttft_overhead,proxy_overhead,kv_offload,prefix_affinity",
                             "--results-dir", str(path), "--disable-tqdm"])
    return Report(rc, path, json.loads((path / "summary.json").read_text()))


def test_report_smoke_runs_every_experiment_healthy(report: Report) -> None:
    """Every run of the report saved, no topology broke (no worker lost, no KV load or send
    failed), nothing left; each worker got the smoke's small KV cache (2,048 tokens), the
    topologies with their own (kv_offload's) theirs."""
    assert report.rc == 0 and report.summary["problems"] == [], report.summary["problems"]
    assert report.summary["left"] == [] and report.summary["need_gpus"] == []
    logs = report.path / "logs"
    for worker_log in ("colo1/colocated0.log", "pd/prefill0.log", "pd/decode0.log"):
        assert "(128 blocks, " in (logs / worker_log).read_text(), worker_log
    assert "(12 blocks, " in (logs / "colo1_offload" / "colocated0.log").read_text()


def test_report_smoke_ttft_and_proxy_overhead(report: Report) -> None:
    """The low-load and proxy-overhead experiments on CPU (they share the colocated
    topology): 1P1D passes the health gate, so its runs are saved and the overhead is
    computed; the proxy overhead's interleaved A/B sends half its requests through the
    proxy."""
    tmp_path, summary = report.path, report.summary
    for name in ("pd", "pd_handoff"):
        pd = json.loads((tmp_path / "raw" / f"ttft_overhead__{name}.json").read_text())
        assert pd["completed"] == pd["num_prompts"] and pd["failed"] == 0
        assert pd["topology"] == name
    section = summary["figures"]["proxy_overhead"]
    assert section["ttft_p50_added_ms"] is not None
    assert section["interleaved"]["ttft_p50_added_ms"] is not None
    assert section["own_overhead_ms"]["p50_ms"] > 0
    mixed = json.loads((tmp_path / "raw" / "proxy_overhead__interleaved.json").read_text())
    halves = mixed["interleaved"]
    assert halves["base"]["completed"] + halves["interleaved"]["completed"] == mixed["completed"]
    assert halves["base"]["completed"] == halves["interleaved"]["completed"] > 0
    # only the odd half went through the proxy (its timings carry the proxy's queue stage)
    assert mixed["server_breakdown"]["proxy_queue"]["count"] == halves["interleaved"]["completed"]
    for name in ("proxy_overhead__direct", "proxy_overhead__proxy"):
        run = json.loads((tmp_path / "raw" / f"{name}.json").read_text())
        assert run["completed"] == run["num_prompts"] and run["failed"] == 0
        assert run["provenance"]["gpus_used"] == [] and run["provenance"]["date"]
    markdown = (tmp_path / "summary.md").read_text()
    assert "## 4. Proxy overhead" in markdown and "raw/proxy_overhead__proxy.json`: 20" in markdown
    assert (tmp_path / "proxy_overhead_cdf.png").stat().st_size > 0


def test_report_smoke_kv_offload(report: Report) -> None:
    """The extra KV-offload experiment on CPU: a device cache too small for the prefixes,
    offload off then on; with it on, host memory served prefix blocks and every request
    completed."""
    tmp_path, summary = report.path, report.summary
    section = summary["figures"]["kv_offload"]
    assert section["off"]["loaded_blocks"] == 0
    assert section["on"]["loaded_blocks"] > 0 and section["on"]["stored_blocks"] > 0
    for state in ("off", "on"):
        run = json.loads((tmp_path / "raw" / f"kv_offload__{state}.json").read_text())
        assert run["completed"] == run["num_prompts"] and run["failed"] == 0
    assert "## KV offload to host memory" in (tmp_path / "summary.md").read_text()


def test_report_smoke_prefix_affinity(report: Report) -> None:
    """The extra routing experiment on CPU: two colocated workers with small caches behind
    the proxy, round robin then prefix affinity; every request completes on each, round
    robin uses both workers, and the affinity proxy was started with that policy."""
    tmp_path, summary = report.path, report.summary
    section = summary["figures"]["prefix_affinity"]
    assert set(section) == {"round_robin", "prefix_affinity"}
    for routing in section:
        run = json.loads((tmp_path / "raw" / f"prefix_affinity__{routing}.json").read_text())
        assert run["completed"] == run["num_prompts"] and run["failed"] == 0
        workers = section[routing]["workers"]
        assert len(workers) == 2  # (the counts include the run's warm-up requests)
        assert sum(w["requests_finished"] for w in workers) >= run["num_prompts"]
    assert all(w["requests_finished"] > 0 for w in section["round_robin"]["workers"])
    for topology, routing in (("colo2_smallkv", "round_robin"), ("colo2_affinity",
                                                                  "prefix_affinity")):
        proxy_log = (tmp_path / "logs" / topology / "proxy.log").read_text()
        assert f"routing {routing})" in proxy_log
    assert "## Prefix-affinity routing" in (tmp_path / "summary.md").read_text()


def test_report_smoke_goodput_2k_2p1d(tmp_path: Path) -> None:
    """The extra 2P1D experiment on CPU: 2P1D (the proxy's prefills round robin over both P
    workers) and three colocated replicas at goodput_2k's smoke points, every request served
    and no worker lost; then goodput_2k's runs set beside it by a rebuilt summary."""
    rc = disagg_report.main(["--smoke", "--only", "goodput_2k_2p1d", "--results-dir",
                             str(tmp_path), "--disable-tqdm"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert rc == 0 and summary["problems"] == [], summary["problems"]
    raw = tmp_path / "raw"
    for topology, roles in (("pd2p1d", ["D", "P", "P"]),
                            ("colo3", ["colocated", "colocated", "colocated"])):
        for rate in SMOKE_SCALE.sweep_2k.rates:
            run = json.loads((raw / f"goodput_2k_2p1d__{topology}__r{rate:g}.json").read_text())
            assert run["completed"] == run["num_prompts"] and run["failed"] == 0
            assert run["topology"] == topology
            workers = run["scraped"]["workers"]
            assert sorted(w["role"] for w in workers) == roles
            assert all(w["requests_finished"] > 0 for w in workers)  # round robin: all used
            assert set(run["scraped"]["proxy"]["routes"]) == {
                "pd" if topology == "pd2p1d" else "colocated"}
    section = summary["figures"]["goodput_2k_2p1d"]
    assert section["points_compared"] == len(SMOKE_SCALE.sweep_2k.rates)
    assert section["goodput_ratio"] is not None and set(section["per_gpu"]) == {"pd2p1d",
                                                                                 "colo3"}
    markdown = (tmp_path / "summary.md").read_text()
    assert "## Goodput on three GPUs: 2P1D vs three colocated replicas" in markdown
    # goodput_2k's runs (here the same runs under its names: same prompts, same machine).
    for ours, theirs in (("pd2p1d", "pd"), ("colo3", "colo2")):
        for path in raw.glob(f"goodput_2k_2p1d__{ours}__r*.json"):
            (raw / path.name.replace(f"goodput_2k_2p1d__{ours}", f"goodput_2k__{theirs}")
             ).write_bytes(path.read_bytes())
    assert disagg_report.main(["--smoke", "--summary-only", "--results-dir",
                               str(tmp_path)]) == 0
    per_gpu = json.loads((tmp_path / "summary.json").read_text())["figures"][
        "goodput_2k_2p1d"]["per_gpu"]
    assert per_gpu["pd"]["per_gpu"] == pytest.approx(per_gpu["pd2p1d"]["per_gpu"] * 3 / 2)
    assert per_gpu["pd2p1d_per_gpu_over_pd"]["ratio"] == pytest.approx(2 / 3)
    markdown = (tmp_path / "summary.md").read_text()
    assert "over the 2 rates all 4 sweeps ran" in markdown and "other prompts" not in markdown
