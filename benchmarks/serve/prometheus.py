"""Read a server's ``/metrics``: counters for before/after deltas, histograms for quantiles.

Used by the report to get prefix-cache hit rates (``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries``) and the proxy's own overhead histogram.
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

# sample name -> value, summed over label sets (one model per server)
Samples = dict[str, float]


def parse_samples(text: str) -> Samples:
    """Every sample of a Prometheus text page, summed over labels except ``le``; samples
    with a ``mode`` label (the proxy's routes) are also kept per mode, as ``name{mode=X}``."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if "le" in sample.labels:
                name = f"{name}{{le={sample.labels['le']}}}"
            elif "mode" in sample.labels:
                by_mode = f"{name}{{mode={sample.labels['mode']}}}"
                samples[by_mode] = samples.get(by_mode, 0.0) + sample.value
            samples[name] = samples.get(name, 0.0) + sample.value
    return samples


def by_mode(samples: Mapping[str, float], name: str) -> dict[str, float]:
    """A counter's value per ``mode`` label (``parse_samples`` keeps them)."""
    out: dict[str, float] = {}
    for key, value in samples.items():
        for base in (name + "_total", name):
            prefix = base + "{mode="
            if key.startswith(prefix) and key.endswith("}"):
                out[key[len(prefix):-1]] = value
                break
    return out


def scrape(base_url: str, timeout_s: float = 10.0) -> Samples:
    """GET ``base_url/metrics`` and parse it."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout_s) as resp:
        return parse_samples(resp.read().decode())


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> Samples:
    """``after - before`` for every sample in ``after`` (counters and histogram buckets)."""
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def counter(samples: Mapping[str, float], name: str) -> float:
    """A counter's value, whether exposed as ``name`` or ``name_total``."""
    return samples.get(name + "_total", samples.get(name, 0.0))


def histogram_quantile(samples: Mapping[str, float], name: str, q: float) -> float | None:
    """Quantile ``q`` of histogram ``name`` by linear interpolation inside its buckets."""
    prefix = f"{name}_bucket{{le="
    buckets = sorted((float(key[len(prefix):-1]), value) for key, value in samples.items()
                     if key.startswith(prefix))
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            width = count - lower_count
            fraction = 0.0 if width <= 0 else (rank - lower_count) / width
            return lower_bound + (bound - lower_bound) * fraction
        lower_bound, lower_count = bound, count
    return lower_bound


def histogram_mean(samples: Mapping[str, float], name: str) -> float | None:
    """Sum over count of histogram ``name``, or None when empty."""
    count = samples.get(f"{name}_count", 0.0)
    return samples.get(f"{name}_sum", 0.0) / count if count > 0 else None
