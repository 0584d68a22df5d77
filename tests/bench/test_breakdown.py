"""Server-side breakdown: engine timings -> pdserve_timings -> proxy headers -> bench stages."""

from __future__ import annotations

import pytest

from benchmarks.serve.breakdown import request_stages, summarize_stages
from benchmarks.serve.prometheus import histogram_mean, histogram_quantile, parse_samples
from engine_core.messages import RequestTimings
from engine_core.server.timings import breakdown
from proxy.legs import RequestTimer, breakdown_headers

# One host: monotonic 0 == unix 1e9.
NOW_MONO, NOW_UNIX = 50.0, 1e9 + 50.0


def test_colocated_timings() -> None:
    t = RequestTimings(arrival_time=10.0, first_scheduled_time=10.002, compute_start_time=10.002,
                       first_token_time=10.052, finished_time=11.0)
    out = breakdown(t, NOW_MONO, NOW_UNIX)
    assert out["queue_ms"] == pytest.approx(2.0) and out["prefill_ms"] == pytest.approx(50.0)
    assert out["first_token_unix"] == pytest.approx(1e9 + 10.052)
    assert out["decode_ms"] == pytest.approx(948.0) and out["inference_ms"] == pytest.approx(998.0)
    assert "kv_wait_ms" not in out
    stages = request_stages({}, out)
    assert stages == pytest.approx({"prefill_queue": 2.0, "prefill_compute": 50.0})


def test_disaggregated_request_through_the_proxy() -> None:
    prefill = breakdown(RequestTimings(
        arrival_time=10.000, first_scheduled_time=10.001, compute_start_time=10.001,
        first_token_time=10.041), NOW_MONO, NOW_UNIX)
    decode = breakdown(RequestTimings(
        arrival_time=10.000, first_scheduled_time=10.0005, remote_kv_ready_time=10.044,
        compute_start_time=10.045, first_token_time=10.060), NOW_MONO, NOW_UNIX)
    assert decode["kv_wait_ms"] == pytest.approx(43.5)
    assert decode["decode_queue_ms"] == pytest.approx(1.0)
    assert decode["first_step_ms"] == pytest.approx(15.0)
    timer = RequestTimer(arrival=5.0, dispatched=5.0004, prefill_timings=prefill)
    headers = breakdown_headers(timer)
    stages = request_stages(headers, decode)
    assert stages == pytest.approx({
        "proxy_queue": 0.4, "prefill_queue": 1.0, "prefill_compute": 40.0,
        "kv_transfer": 3.0, "decode_queue": 1.0, "first_decode_step": 15.0}, abs=1e-3)


def test_no_pdserve_fields_means_no_stages() -> None:
    assert request_stages({}, None) == {}
    assert summarize_stages([{}, {}]) == {}


def test_summary_mean_p99_count() -> None:
    summary = summarize_stages([{"proxy_queue": float(i)} for i in range(1, 101)])
    assert summary["proxy_queue"]["mean_ms"] == pytest.approx(50.5)
    assert summary["proxy_queue"]["p99_ms"] == pytest.approx(99.01)
    assert summary["proxy_queue"]["count"] == 100


def test_prometheus_histogram_quantile() -> None:
    text = """# HELP x_seconds x
# TYPE x_seconds histogram
x_seconds_bucket{le="0.001",mode="pd"} 10.0
x_seconds_bucket{le="0.002",mode="pd"} 90.0
x_seconds_bucket{le="+Inf",mode="pd"} 100.0
x_seconds_count{mode="pd"} 100.0
x_seconds_sum{mode="pd"} 0.15
"""
    samples = parse_samples(text)
    assert histogram_quantile(samples, "x_seconds", 0.5) == pytest.approx(0.0015)
    assert histogram_quantile(samples, "x_seconds", 0.05) == pytest.approx(0.0005)
    assert histogram_quantile(samples, "x_seconds", 0.99) == pytest.approx(0.002)
    assert histogram_mean(samples, "x_seconds") == pytest.approx(0.0015)


def test_prometheus_counter_by_mode() -> None:
    from benchmarks.serve.prometheus import by_mode, counter

    text = """# HELP r_total routes
# TYPE r_total counter
r_total{mode="pd",prefill="p:1",decode="d:1"} 7.0
r_total{mode="pd",prefill="p:2",decode="d:1"} 3.0
r_total{mode="prefill_overflow",prefill="",decode="d:1"} 4.0
"""
    samples = parse_samples(text)
    assert counter(samples, "r") == 14.0
    assert by_mode(samples, "r") == {"pd": 10.0, "prefill_overflow": 4.0}
    assert by_mode(samples, "other") == {}
