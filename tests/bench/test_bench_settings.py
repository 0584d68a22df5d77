"""``pdserve bench serve`` aims at ``pdserve launch``'s proxy by default and prints what it
will run before it starts: URL, model, dataset, prompt count and rate."""

from __future__ import annotations

import math

import pytest

from benchmarks.serve.cli import run_bench
from benchmarks.serve.config import config_from_args
from benchmarks.serve.report import format_settings
from deploy.cli import build_parser
from deploy.launch import free_port


def _bench(*argv: str):
    return build_parser().parse_args(["bench", "serve", *argv])


def test_the_default_target_is_launchs_proxy() -> None:
    launch = build_parser().parse_args(["launch"])
    assert config_from_args(_bench()).base_url == f"http://127.0.0.1:{launch.port}"


def test_the_settings_show_every_default() -> None:
    text = format_settings(config_from_args(_bench()))
    assert text.splitlines()[0] == "pdserve bench serve: http://127.0.0.1:10001/v1/completions"
    assert "model: the server's first (GET /v1/models)" in text
    assert "dataset: random, input 1024 tokens, output 128 tokens, seed 0" in text
    assert "num prompts: 1000 per rate" in text
    assert "request rate: inf (all at once) req/s" in text


def test_the_settings_show_what_was_given() -> None:
    config = config_from_args(_bench(
        "--base-url", "http://h:9/", "--endpoint", "/v1/chat/completions", "--model", "m",
        "--tokenizer", "/tok", "--dataset-name", "prefix_repetition", "--num-prompts", "7",
        "--request-rate", "2,4", "--max-concurrency", "3"))
    assert config.request_rates == (2.0, 4.0) and not math.isinf(config.request_rates[0])
    text = format_settings(config)
    assert text.splitlines()[0] == "pdserve bench serve: http://h:9/v1/chat/completions"
    assert "model: m, tokenizer /tok" in text
    assert "prefix_repetition, 10 prefixes of 256 tokens" in text
    assert "num prompts: 7 per rate" in text
    assert "request rate: 2, 4 req/s" in text and "max concurrency 3" in text


def test_run_bench_prints_its_settings_before_it_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing listens: the run fails, after the settings were printed."""
    port = free_port()
    assert run_bench(_bench("--port", str(port), "--ready-check-timeout-sec", "0")) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"pdserve bench serve: http://127.0.0.1:{port}/v1/completions\n"), out
    assert "num prompts: 1000 per rate" in out
