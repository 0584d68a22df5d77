"""Benchmark metrics from per-request outputs, with ``vllm bench serve``'s definitions.

- TTFT, ITL, E2EL: as measured by ``client.StreamTimeline``; ITL pools every gap of every
  successful request.
- TPOT of a request: (E2EL - TTFT) / (output tokens - 1), for requests with more than one
  output token.
- Throughputs divide by the run's duration: completed requests, output tokens, and input
  plus output tokens of the completed requests.
- Goodput: completed requests meeting every given SLO (ms), per second; a request with at
  most one output token counts TPOT 0. ``slo_attainment`` is the same count over all sent
  requests (failures miss the SLO), the y axis of an attainment-vs-rate plot.
- Per metric: mean, median, std (population) and the chosen percentiles (linear
  interpolation), in ms; ``None`` when no request contributed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks.serve.client import RequestOutput

MAX_ERROR_KINDS = 10


def percentile_key(p: float) -> str:
    """``99`` -> ``p99``, ``99.9`` -> ``p99.9`` (vLLM's result keys)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize(values_s: Sequence[float], percentiles: Iterable[float]) -> dict[str, float | None]:
    """mean, median, std and percentiles of seconds, in milliseconds."""
    keys = ["mean", "median", "std", *map(percentile_key, percentiles)]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=float) * 1e3
    out: dict[str, float | None] = {"mean": float(ms.mean()), "median": float(np.median(ms)),
                                    "std": float(ms.std())}
    for p in percentiles:
        out[percentile_key(p)] = float(np.percentile(ms, p))
    return out


def request_tpot(output: RequestOutput) -> float | None:
    """(E2EL - TTFT) / (output tokens - 1), or None for at most one output token."""
    if output.output_tokens <= 1 or output.latency is None or output.ttft is None:
        return None
    return (output.latency - output.ttft) / (output.output_tokens - 1)


def within_slos(values_s: Mapping[str, float | None], slos_ms: Mapping[str, float]) -> bool:
    """Whether a request's values (seconds, by SLO name) meet every SLO (ms); a value it
    lacks meets none. Shared by runs and by summaries scoring saved runs again."""
    return all((value := values_s.get(name)) is not None and value * 1e3 <= slo
               for name, slo in slos_ms.items())


def meets_slos(output: RequestOutput, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO (TPOT 0 when undefined)."""
    return within_slos({"ttft": output.ttft, "tpot": request_tpot(output) or 0.0,
                        "e2el": output.latency}, slos_ms)


def summarize_errors(outputs: Iterable[RequestOutput]) -> list[dict[str, Any]]:
    """The most frequent error texts of failed requests, with counts."""
    counts = Counter((o.error or "unknown error")[:300] for o in outputs if not o.success)
    return [{"error": text, "count": n} for text, n in counts.most_common(MAX_ERROR_KINDS)]


def compute_metrics(outputs: Sequence[RequestOutput], duration_s: float,
                    percentile_metrics: Sequence[str], percentiles: Sequence[float],
                    goodput_slos: dict[str, float] | None = None) -> dict[str, Any]:
    """The flat result dict (vLLM's keys) of one run."""
    done = [o for o in outputs if o.success]
    ttfts = [o.ttft for o in done]
    tpots = [t for t in map(request_tpot, done) if t is not None]
    itls = [gap for o in done for gap in o.itl]
    e2els = [o.latency for o in done]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_tokens for o in done)
    duration_s = max(duration_s, 1e-9)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    cached = [o.cached_tokens for o in done if o.cached_tokens is not None]
    if cached:
        result["total_cached_tokens"] = sum(cached)
        result["prefix_cache_hit_rate"] = sum(cached) / max(total_input, 1)
    if goodput_slos:
        good = sum(meets_slos(o, goodput_slos) for o in done)
        result["request_goodput"] = good / duration_s
        result["slo_attainment"] = good / max(len(outputs), 1)
    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for metric in percentile_metrics:
        for stat, value in summarize(series[metric], percentiles).items():
            result[f"{stat}_{metric}_ms"] = value
    return result
