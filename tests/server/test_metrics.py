"""/metrics is Prometheus text with vLLM's names, and its counters move."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import API_KEY


def _scrape(url: str) -> dict[str, float]:
    scrape = urllib.request.Request(url + "/metrics",
                                    headers={"Authorization": f"Bearer {API_KEY}"})
    text = urllib.request.urlopen(scrape, timeout=30).read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if "finished_reason" in sample.labels:
                key += "{" + sample.labels["finished_reason"] + "}"
            values[key] = values.get(key, 0.0) + sample.value
    return values


def test_metrics_parse_and_counters_move(server):
    before = _scrape(server.url)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "pdserve:event_loop_stalls_total", "pdserve:event_loop_stall_seconds_total"):
        assert name in before, name
    request = urllib.request.Request(
        server.url + "/v1/completions", method="POST",
        data=b'{"prompt": "metrics please", "max_tokens": 5, "ignore_eos": true}',
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=60).read()
    after = _scrape(server.url)
    assert after["vllm:request_success_total{length}"] == before.get(
        "vllm:request_success_total{length}", 0) + 1
    assert after["vllm:generation_tokens_total"] == before.get("vllm:generation_tokens_total", 0) + 5
    assert after["vllm:prompt_tokens_total"] > before.get("vllm:prompt_tokens_total", 0)
    assert after["vllm:time_to_first_token_seconds_count"] == before.get(
        "vllm:time_to_first_token_seconds_count", 0) + 1
    assert after["vllm:inter_token_latency_seconds_count"] >= before.get(
        "vllm:inter_token_latency_seconds_count", 0) + 4
    assert after["vllm:e2e_request_latency_seconds_count"] == before.get(
        "vllm:e2e_request_latency_seconds_count", 0) + 1
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    for name in ("vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:request_params_max_tokens"):
        assert after[f"{name}_count"] == before.get(f"{name}_count", 0) + 1, name
    assert after["vllm:request_generation_tokens_sum"] == before.get(
        "vllm:request_generation_tokens_sum", 0) + 5
    assert after["vllm:request_params_max_tokens_sum"] == before.get(
        "vllm:request_params_max_tokens_sum", 0) + 5
    # vLLM's other request and step series: the deprecated TPOT alias sees every inter-token
    # interval, the per-request TPOT one sample, n and the group's longest output one each,
    # and the engine's steps (at least the prefill and four decode steps) their tokens.
    assert after["vllm:time_per_output_token_seconds_count"] - before.get(
        "vllm:time_per_output_token_seconds_count", 0) == after[
        "vllm:inter_token_latency_seconds_count"] - before.get(
        "vllm:inter_token_latency_seconds_count", 0)
    for name, value in (("vllm:request_time_per_output_token_seconds", None),
                        ("vllm:request_params_n", 1), ("vllm:request_max_num_generation_tokens", 5)):
        assert after[f"{name}_count"] == before.get(f"{name}_count", 0) + 1, name
        if value is not None:
            assert after[f"{name}_sum"] == before.get(f"{name}_sum", 0) + value, name
    steps = after["vllm:iteration_tokens_total_count"] - before.get(
        "vllm:iteration_tokens_total_count", 0)
    tokens = after["vllm:iteration_tokens_total_sum"] - before.get(
        "vllm:iteration_tokens_total_sum", 0)
    # As vLLM counts them: the prompt once, when its prefill ends, and the 5 generated.
    assert steps == 5 and tokens == (after["vllm:prompt_tokens_total"]
                                     - before.get("vllm:prompt_tokens_total", 0) + 5), (steps, tokens)


def test_token_counters_follow_the_engine_and_long_latencies_have_buckets() -> None:
    """vllm:prompt_tokens / generation_tokens come from the engine's live totals (vLLM adds
    them every step; counting them when a request ends left rate() at 0 through a long
    generation), the deprecated gpu_cache_usage_perc mirrors kv_cache_usage_perc, and the
    latency histograms reach vLLM's upper ends (TTFT 2560 s, requests 7680 s)."""
    from engine_core.messages import EngineStats
    from engine_core.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.engine_stats = EngineStats(3, 1, 0, 0.25, 0, 0, 0, 0, 0, 1200, 345, 0)
    metrics.observe_first_token(1000.0)
    metrics.observe_finished(5000.0, "length", 10, 5, 5)
    samples = {(s.name, s.labels.get("le")): s.value
               for f in text_string_to_metric_families(metrics.render().decode())
               for s in f.samples}
    assert samples[("vllm:prompt_tokens_total", None)] == 1200
    assert samples[("vllm:generation_tokens_total", None)] == 345
    assert samples[("vllm:gpu_cache_usage_perc", None)] == 0.25
    assert samples[("vllm:time_to_first_token_seconds_bucket", "640.0")] == 0
    assert samples[("vllm:time_to_first_token_seconds_bucket", "2560.0")] == 1
    assert samples[("vllm:e2e_request_latency_seconds_bucket", "2560.0")] == 0
    assert samples[("vllm:e2e_request_latency_seconds_bucket", "7680.0")] == 1


def test_every_vllm_series_carries_model_name_and_engine_labels() -> None:
    """vLLM V1 labels its metrics {model_name, engine}: every vllm:* sample here has both,
    and the cache settings are exported as vllm:cache_config_info."""
    from engine_core.messages import EngineStats
    from engine_core.server.metrics import ServerMetrics

    metrics = ServerMetrics("m", cache_info={"block_size": "16", "cache_dtype": "auto"})
    metrics.engine_stats = EngineStats(1, 0, 0, 0.5, 0, 0, 0, 0, 0, 10, 2, 0)
    metrics.observe_first_token(0.1)
    metrics.observe_finished(1.0, "stop", 10, 2, 4)
    samples = [s for f in text_string_to_metric_families(metrics.render().decode())
               for s in f.samples if s.name.startswith("vllm:")]
    assert len(samples) > 50
    assert all(s.labels.get("model_name") == "m" and s.labels.get("engine") == "0"
               for s in samples), [s for s in samples if "engine" not in s.labels][:3]
    (info,) = [s for s in samples if s.name == "vllm:cache_config_info"]
    assert info.value == 1 and info.labels["block_size"] == "16"


def test_every_connector_counter_of_the_worker_is_exported() -> None:
    """Each event counter the P2P connector worker keeps reaches /metrics as a Prometheus
    counter (an operator sees restarts, expired leases and push-backs, not only bytes)."""
    from connectors.p2p_nccl.worker_state import EVENT_COUNTERS
    from engine_core.messages import EngineStats
    from engine_core.server.metrics import CONNECTOR_COUNTERS, ServerMetrics

    # control_messages_sent is kept for tests; control-message counts are not an SLO.
    missing = set(EVENT_COUNTERS) - set(CONNECTOR_COUNTERS) - {"control_messages_sent"}
    assert not missing, sorted(missing)
    metrics = ServerMetrics("m")
    metrics.engine_stats = EngineStats(0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0,
                                       connector={k: 3.0 for k in CONNECTOR_COUNTERS})
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    for key in CONNECTOR_COUNTERS:
        family = families[f"pdserve:kv_transfer_{key}"]
        assert family.type == "counter" and family.samples[0].value == 3.0, key


def test_step_tokens_and_sample_groups_are_histograms() -> None:
    """vllm:iteration_tokens_total is a histogram of the engine's steps by their tokens,
    built from the engine's per-bucket counts (cumulative in the export); a request's TPOT
    is its decode time over its tokens after the first (0 with one token, as vLLM), and a
    prompt's n samples count once
    in request_params_n and request_max_num_generation_tokens, with the longest output."""
    from engine_core.messages import ITERATION_TOKEN_BUCKETS, EngineStats
    from engine_core.sched.scheduler import SchedulerCounters
    from engine_core.server.metrics import ServerMetrics

    counters = SchedulerCounters()
    for tokens in (1, 1, 7, 8, 9, 100000):
        counters.count_iteration(tokens)
    metrics = ServerMetrics("m")
    metrics.engine_stats = EngineStats(0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0,
                                       iteration_token_counts=counters.iteration_token_counts,
                                       iteration_tokens_sum=counters.iteration_tokens_sum)
    metrics.observe_finished(2.0, "stop", 10, 5, 8, decode_seconds=1.0)
    metrics.observe_finished(2.0, "stop", 10, 1, 8, decode_seconds=0.0)  # 1 token: TPOT 0
    metrics.observe_group(3, 7)
    samples = {(s.name, s.labels.get("le")): s.value
               for f in text_string_to_metric_families(metrics.render().decode())
               for s in f.samples}
    assert len(counters.iteration_token_counts) == len(ITERATION_TOKEN_BUCKETS) + 1
    assert samples[("vllm:iteration_tokens_total_bucket", "1.0")] == 2
    assert samples[("vllm:iteration_tokens_total_bucket", "8.0")] == 4
    assert samples[("vllm:iteration_tokens_total_bucket", "16.0")] == 5
    assert samples[("vllm:iteration_tokens_total_bucket", "16384.0")] == 5
    assert samples[("vllm:iteration_tokens_total_bucket", "+Inf")] == 6
    assert samples[("vllm:iteration_tokens_total_count", None)] == 6
    assert samples[("vllm:iteration_tokens_total_sum", None)] == 100026
    assert samples[("vllm:request_time_per_output_token_seconds_count", None)] == 2
    assert samples[("vllm:request_time_per_output_token_seconds_sum", None)] == 0.25
    assert samples[("vllm:request_params_n_sum", None)] == 3
    assert samples[("vllm:request_max_num_generation_tokens_sum", None)] == 7
