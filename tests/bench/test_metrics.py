"""TTFT, ITL, TPOT, E2EL, throughput, goodput and percentiles on synthetic timelines."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.serve.client import RequestOutput, StreamTimeline
from benchmarks.serve.metrics import (
    compute_metrics,
    meets_slos,
    percentile_key,
    request_tpot,
    summarize,
)


def _completion_chunk(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def _usage(completion: int, prompt: int = 10, cached: int = 0) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "prompt_tokens_details": {"cached_tokens": cached}}}


def _timeline(events: list[tuple[float, dict]], sent_at: float = 100.0,
              prompt_len: int = 7) -> RequestOutput:
    timeline = StreamTimeline(sent_at, prompt_len)
    for offset, data in events:
        timeline.feed(data, sent_at + offset)
    return timeline.finish({})


def test_completion_timeline() -> None:
    out = _timeline([(0.10, _completion_chunk("a")), (0.15, _completion_chunk(" b")),
                     (0.25, _completion_chunk(" c")), (0.30, _completion_chunk(" d", "length")),
                     (0.31, _usage(completion=4, prompt=12, cached=4))])
    assert out.success and out.error is None
    assert out.ttft == pytest.approx(0.10)
    assert out.itl == pytest.approx([0.05, 0.10, 0.05])
    assert out.latency == pytest.approx(0.30)  # the last chunk with choices, not the usage one
    assert out.output_tokens == 4 and out.prompt_len == 12 and out.cached_tokens == 4
    assert request_tpot(out) == pytest.approx((0.30 - 0.10) / 3)


def test_chat_role_chunk_is_not_the_first_token() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    content = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
    finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    out = _timeline([(0.01, role), (0.20, content), (0.26, content), (0.27, finish)])
    assert out.ttft == pytest.approx(0.20)
    assert out.itl == pytest.approx([0.06, 0.01])  # every chunk with choices after the first
    assert out.latency == pytest.approx(0.27)
    assert out.output_tokens == 2  # no usage: the content chunks


def test_chat_reasoning_chunks_are_tokens() -> None:
    """A reasoning model streams ``reasoning_content`` before any ``content``: its first
    reasoning chunk is the first token (vLLM's count), and reasoning text is generated text
    with its own ITL gaps; TTFT used to wait for the first content chunk."""
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}

    def reasoning(text: str) -> dict:
        return {"choices": [{"index": 0, "delta": {"reasoning_content": text}}]}

    content = {"choices": [{"index": 0, "delta": {"content": " ok"}}]}
    out = _timeline([(0.01, role), (0.10, reasoning("think")), (0.15, reasoning(" more")),
                     (0.30, content), (0.34, content)])
    assert out.success and out.ttft == pytest.approx(0.10)
    assert out.itl == pytest.approx([0.05, 0.15, 0.04])
    assert out.latency == pytest.approx(0.34)
    assert out.generated_text == "think more ok ok"
    assert out.output_tokens == 4  # no usage: every chunk that carried text
    # Reasoning only (say max_tokens ran out while thinking): still text, still timed.
    only = _timeline([(0.01, role), (0.20, reasoning("a")), (0.25, reasoning(" b"))])
    assert only.ttft == pytest.approx(0.20) and only.itl == pytest.approx([0.05])
    assert only.generated_text == "a b" and only.output_tokens == 2
    # Newer vLLM servers name the field ``reasoning``; one that sends both is counted once.
    both = {"choices": [{"index": 0, "delta": {"reasoning_content": "x", "reasoning": "x"}}]}
    renamed = {"choices": [{"index": 0, "delta": {"reasoning": " y"}}]}
    out = _timeline([(0.01, role), (0.05, both), (0.07, renamed)])
    assert out.ttft == pytest.approx(0.05) and out.generated_text == "x y"


def test_stream_error_event_fails_the_request() -> None:
    out = _timeline([(0.1, _completion_chunk("a")),
                     (0.2, {"error": {"message": "KV transfer failed", "code": 500}})])
    assert not out.success and "KV transfer failed" in out.error


def test_empty_stream_fails() -> None:
    out = _timeline([(0.1, _usage(completion=0))])
    assert not out.success and out.error


def _out(ttft: float, latency: float, tokens: int, prompt_len: int = 100,
         itl: list[float] | None = None) -> RequestOutput:
    return RequestOutput(success=True, prompt_len=prompt_len, output_tokens=tokens, ttft=ttft,
                         latency=latency, itl=itl or [])


def test_compute_metrics_definitions() -> None:
    outputs = [_out(0.1, 1.1, 11, itl=[0.1] * 10), _out(0.3, 0.3, 1),
               _out(0.2, 2.2, 5, prompt_len=50, itl=[0.5] * 4),
               RequestOutput(success=False, prompt_len=100, error="HTTP 500: boom")]
    result = compute_metrics(outputs, duration_s=4.0,
                             percentile_metrics=("ttft", "tpot", "itl", "e2el"),
                             percentiles=(50, 99, 99.9),
                             goodput_slos={"ttft": 250.0, "tpot": 150.0})
    assert result["completed"] == 3 and result["failed"] == 1
    assert result["total_input_tokens"] == 250 and result["total_output_tokens"] == 17
    assert result["request_throughput"] == pytest.approx(3 / 4)
    assert result["output_throughput"] == pytest.approx(17 / 4)
    assert result["total_token_throughput"] == pytest.approx((250 + 17) / 4)
    ttfts_ms = np.array([100.0, 300.0, 200.0])
    assert result["mean_ttft_ms"] == pytest.approx(ttfts_ms.mean())
    assert result["median_ttft_ms"] == pytest.approx(200.0)
    assert result["std_ttft_ms"] == pytest.approx(ttfts_ms.std())
    assert result["p99_ttft_ms"] == pytest.approx(np.percentile(ttfts_ms, 99))
    assert result["p99.9_ttft_ms"] == pytest.approx(np.percentile(ttfts_ms, 99.9))
    # TPOT only for requests with more than one output token: 100 ms and 500 ms.
    assert result["mean_tpot_ms"] == pytest.approx(300.0)
    assert result["median_tpot_ms"] == pytest.approx(300.0)
    # ITL pools every gap of every request: 10 x 100 ms and 4 x 500 ms.
    assert result["mean_itl_ms"] == pytest.approx((10 * 100 + 4 * 500) / 14)
    assert result["mean_e2el_ms"] == pytest.approx(1200.0)
    # Goodput: request 1 (ttft 100, tpot 100) and request 2 (ttft 300 > 250: no) and
    # request 3 (tpot 500 > 150: no); the one-token request has TPOT 0 but misses TTFT.
    assert result["request_goodput"] == pytest.approx(1 / 4)
    assert result["slo_attainment"] == pytest.approx(1 / 4)


def test_one_token_request_counts_tpot_zero_for_goodput() -> None:
    one_token = _out(0.1, 0.1, 1)
    assert request_tpot(one_token) is None
    assert meets_slos(one_token, {"ttft": 100.0, "tpot": 0.0})
    assert not meets_slos(one_token, {"e2el": 99.0})


def test_summary_of_nothing_is_none_and_percentile_keys() -> None:
    assert summarize([], [99]) == {"mean": None, "median": None, "std": None, "p99": None}
    assert percentile_key(99) == "p99" and percentile_key(99.9) == "p99.9"
    assert percentile_key(50.0) == "p50"


def test_only_selected_metrics_are_reported() -> None:
    result = compute_metrics([_out(0.1, 0.5, 3)], 1.0, ("ttft",), (99,))
    assert "mean_ttft_ms" in result and "mean_tpot_ms" not in result
    assert "request_goodput" not in result
