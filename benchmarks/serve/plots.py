"""PNG plots of benchmark results; matplotlib is optional (``pip install 'pdserve[bench]'``).

Every function returns the written path, or None (with a log line) when matplotlib is
missing, so a benchmark never fails for want of a plotting library.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("pdserve.bench")

_CDF_PANELS = (("ttfts", "TTFT (ms)"), ("tpots", "TPOT (ms)"), ("e2els", "E2EL (ms)"),
               ("itls", "ITL (ms)"))


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plots (pip install 'pdserve[bench]')")
        return None
    return plt


def run_name(result: Mapping[str, Any]) -> str:
    """Legend text of one run."""
    rate = result.get("request_rate")
    label = result.get("label")
    return f"{label} @ {rate} req/s" if label else f"{rate} req/s"


def _values_ms(result: Mapping[str, Any], key: str) -> list[float]:
    values = result.get(key) or []
    if key == "itls":
        values = [gap for request in values for gap in request]
    return sorted(v * 1e3 for v in values if v is not None)


def plot_latency_cdfs(results: Sequence[Mapping[str, Any]], path: Path,
                      title: str | None = None) -> Path | None:
    """Empirical CDFs of TTFT, TPOT, E2EL (and ITL when kept), one line per run."""
    plt = _pyplot()
    if plt is None:
        return None
    panels = [(k, name) for k, name in _CDF_PANELS if any(r.get(k) for r in results)]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.5 * max(1, len(panels)), 3.6),
                             squeeze=False)
    for ax, (key, name) in zip(axes[0], panels):
        for result in results:
            values = _values_ms(result, key)
            if values:
                ranks = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ranks, where="post", label=run_name(result))
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_vs_rate(series: Mapping[str, Sequence[tuple[float, float]]], ylabel: str, path: Path,
                 title: str | None = None, hline: float | None = None) -> Path | None:
    """One line per series of (request rate, value) points: SLO attainment, goodput, ..."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for name, points in series.items():
        points = sorted(points)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    if hline is not None:
        ax.axhline(hline, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_slo_attainment(results: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """SLO attainment against request rate, one line per label (needs ``--goodput``)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for result in results:
        if "slo_attainment" in result and result["request_rate"] != "inf":
            series.setdefault(result.get("label") or "run", []).append(
                (float(result["request_rate"]), result["slo_attainment"]))
    if not series:
        return None
    slos = " ".join(f"{k}<={v:g}ms" for k, v in results[0].get("goodput_slos_ms", {}).items())
    return plot_vs_rate(series, "SLO attainment", path, title=slos, hline=0.9)
