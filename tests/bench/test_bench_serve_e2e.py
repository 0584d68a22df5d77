"""`pdserve bench serve` against a real `pdserve serve --demo-random` subprocess."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.cli import main
from deploy.launch import free_port


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A demo-model server on a free port; yields its base URL."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "serve", "--demo-random", "--port", str(port),
         "--num-gpu-blocks-override", "256", "--max-model-len", "512",
         "--log-stats-interval", "0", "--device", "cpu"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, Path(log.name).read_text()
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _bench(url: str, *argv: str) -> int:
    return main(["bench", "serve", "--base-url", url, "--disable-tqdm", "--dataset-name",
                 "random", "--random-input-len", "32", "--random-output-len", "8",
                 "--ignore-eos", *argv])


def test_sweep_results_json_and_plots(demo_server: str, tmp_path: Path) -> None:
    code = _bench(demo_server, "--num-prompts", "6", "--request-rate", "20,inf",
                  "--goodput", "ttft:60000", "tpot:60000",
                  "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                  "--num-warmups", "1", "--save-result", "--result-dir", str(tmp_path),
                  "--result-filename", "run.json", "--label", "demo", "--metadata", "kind=e2e")
    assert code == 0
    paced, burst = (json.loads((tmp_path / f"run-{r}qps.json").read_text())
                    for r in ("20.0", "inf"))
    assert (paced["request_rate"], burst["request_rate"]) == (20.0, "inf")
    assert paced["seed"] != burst["seed"]  # fresh prompts per sweep point
    for result in (paced, burst):
        assert result["completed"] == 6 and result["failed"] == 0 and result["errors"] == []
        assert result["model_id"] == "pdserve-demo-random" and result["label"] == "demo"
        assert result["kind"] == "e2e" and result["backend"] == "openai"
        assert result["total_input_tokens"] == 192 and result["total_output_tokens"] == 48
        assert result["output_lens"] == [8] * 6 and len(result["ttfts"]) == 6
        for metric in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "median", "std", "p50", "p99"):
                assert result[f"{stat}_{metric}_ms"] > 0
        assert result["p99_ttft_ms"] <= result["p99_e2el_ms"]
        assert result["slo_attainment"] == 1.0
        assert result["request_goodput"] == pytest.approx(result["request_throughput"])
        assert result["request_throughput"] * result["duration"] == pytest.approx(6)
        stages = result["server_breakdown"]
        assert stages["prefill_compute"]["count"] == 6 and stages["prefill_queue"]["count"] == 6
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (tmp_path / "run-20.0qps-cdf.png").is_file() == has_matplotlib
    assert (tmp_path / "run-20.0qps-slo.png").is_file() == has_matplotlib


def test_chat_endpoint(demo_server: str, tmp_path: Path) -> None:
    code = _bench(demo_server, "--endpoint", "/v1/chat/completions", "--num-prompts", "3",
                  "--save-result", "--no-plot", "--result-dir", str(tmp_path),
                  "--result-filename", "chat.json")
    assert code == 0
    result = json.loads((tmp_path / "chat.json").read_text())
    assert result["backend"] == "openai-chat" and result["completed"] == 3
    assert result["total_output_tokens"] == 24


def test_failures_are_counted_and_summarised(demo_server: str, tmp_path: Path) -> None:
    from engine_core.demo_model import random_demo_model_path

    code = _bench(demo_server, "--model", "no-such-model", "--tokenizer",
                  str(random_demo_model_path()), "--num-prompts", "4", "--ready-check-timeout-sec", "0",
                  "--save-result", "--no-plot", "--result-dir", str(tmp_path),
                  "--result-filename", "fail.json")
    assert code == 2  # nothing completed
    result = json.loads((tmp_path / "fail.json").read_text())
    assert result["completed"] == 0 and result["failed"] == 4
    assert result["mean_ttft_ms"] is None
    (error,) = result["errors"]
    assert error["count"] == 4 and "HTTP 404" in error["error"] and "no-such-model" in error["error"]


def test_ready_check_fails_fast_on_a_client_error(demo_server: str) -> None:
    from engine_core.demo_model import random_demo_model_path

    started = time.monotonic()
    assert _bench(demo_server, "--model", "no-such-model", "--tokenizer",
                  str(random_demo_model_path()), "--num-prompts", "2") == 1
    assert time.monotonic() - started < 30


def test_a_stop_string_ending_the_request_keeps_its_timings(demo_server: str) -> None:
    """A stop string is matched in the API process, which ends the request before the engine
    does: its pdserve_timings come from the engine's first-token stamps, ended there."""
    def complete(**extra) -> dict:
        request = urllib.request.Request(
            demo_server + "/v1/completions", method="POST",
            data=json.dumps({"prompt": [5, 6, 7, 8], "max_tokens": 16, "temperature": 0.0,
                             "ignore_eos": True, **extra}).encode(),
            headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(request, timeout=60).read())

    text = complete()["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    body = complete(stop=[stop])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and stop not in choice["text"]
    assert body["usage"]["completion_tokens"] < 16  # the API ended it, not max_tokens
    timings = body["pdserve_timings"]
    assert timings["queue_ms"] >= 0 and timings["prefill_ms"] > 0
    assert timings["decode_ms"] >= 0 and timings["inference_ms"] >= timings["prefill_ms"]


def test_worker_reports_its_timings_in_body_and_metrics(demo_server: str) -> None:
    request = urllib.request.Request(
        demo_server + "/v1/completions", method="POST",
        data=json.dumps({"prompt": [5, 6, 7, 8], "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"})
    body = json.loads(urllib.request.urlopen(request, timeout=60).read())
    timings = body["pdserve_timings"]
    assert timings["queue_ms"] >= 0 and timings["prefill_ms"] > 0
    assert timings["first_token_unix"] >= timings["arrival_unix"] > 1e9
    assert body["usage"]["completion_tokens"] == 2  # the OpenAI fields are unchanged
    metrics = urllib.request.urlopen(demo_server + "/metrics", timeout=10).read().decode()
    assert "vllm:request_queue_time_seconds_count" in metrics
    assert "vllm:request_prefill_time_seconds_count" in metrics
