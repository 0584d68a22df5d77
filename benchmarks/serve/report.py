"""The end-of-run summary table (vLLM's layout) and the JSON result files."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.output import RESULTS_ROOT
from benchmarks.serve.breakdown import STAGES
from benchmarks.serve.config import BenchConfig, DatasetConfig
from benchmarks.serve.metrics import percentile_key

WIDTH = 50
_TITLES = {"ttft": ("Time to First Token", "TTFT"),
           "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl": ("Inter-token Latency", "ITL"),
           "e2el": ("End-to-end Latency", "E2EL")}


def _row(name: str, value: Any, fmt: str = "{:<10.2f}") -> str:
    text = "n/a" if value is None else (fmt.format(value) if isinstance(value, float)
                                        else str(value))
    return f"{name:<40} {text}"


def _dataset_text(dataset: DatasetConfig) -> str:
    """The dataset and the lengths that shape its prompts."""
    if dataset.name == "sharegpt":
        output = (f"output {dataset.sharegpt_output_len} tokens" if dataset.sharegpt_output_len
                  else "output lengths from the file")
        return f"sharegpt {dataset.path}, {output}"
    if dataset.name == "prefix_repetition":
        return (f"prefix_repetition, {dataset.num_prefixes} prefixes of {dataset.prefix_len} "
                f"tokens + {dataset.suffix_len} of their own, output {dataset.prefix_output_len} tokens")
    if dataset.name == "lognormal":
        return (f"lognormal, median input {dataset.random_input_len} tokens (at most "
                f"{dataset.lognormal_max_input_len}), median output {dataset.random_output_len}, "
                f"sigma {dataset.lognormal_sigma:g}")
    spread = f" +-{dataset.random_range_ratio:.0%}" if dataset.random_range_ratio else ""
    prefix = (f" after a shared {dataset.random_prefix_len}-token prefix"
              if dataset.random_prefix_len else "")
    return (f"{dataset.name}, input {dataset.random_input_len}{spread} tokens{prefix}, "
            f"output {dataset.random_output_len}{spread} tokens")


def format_settings(config: BenchConfig) -> str:
    """What a run will do, printed before it starts: every default the user did not set is
    visible (a 1,000-prompt default against a CPU server is the user's call to change)."""
    model = config.served_model_name or config.model or "the server's first (GET /v1/models)"
    rates = ", ".join("inf (all at once)" if math.isinf(r) else f"{r:g}"
                      for r in config.request_rates)
    concurrency = config.max_concurrency or "unlimited"
    lines = [f"pdserve bench serve: {config.url}" + (
                 f" and {config.interleave_base_url.rstrip('/')}{config.endpoint}"
                 if config.interleave_base_url else ""),
             f"  model: {model}" + (f", tokenizer {config.tokenizer}" if config.tokenizer else ""),
             f"  dataset: {_dataset_text(config.dataset)}, seed {config.dataset.seed}",
             f"  num prompts: {config.dataset.num_prompts} per rate, "
             f"{config.num_warmups} warm-up",
             f"  request rate: {rates} req/s, burstiness {config.burstiness:g}, "
             f"max concurrency {concurrency}"]
    return "\n".join(lines)


def format_summary(result: dict[str, Any], percentile_metrics: Sequence[str]) -> str:
    """The human-readable table of one run."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=WIDTH, c="=")]
    if result.get("label"):
        lines.append(_row("Label:", result["label"]))
    lines += [
        _row("Request rate (req/s):", result["request_rate"]),
        _row("Successful requests:", result["completed"]),
        _row("Failed requests:", result["failed"]),
        _row("Benchmark duration (s):", result["duration"]),
        _row("Total input tokens:", result["total_input_tokens"]),
        _row("Total generated tokens:", result["total_output_tokens"]),
        _row("Request throughput (req/s):", result["request_throughput"]),
    ]
    if "request_goodput" in result:
        slos = " ".join(f"{k}<={v:g}ms" for k, v in result["goodput_slos_ms"].items())
        lines += [_row("Request goodput (req/s):", result["request_goodput"]),
                  _row(f"SLO attainment ({slos}):", result["slo_attainment"], "{:<10.3f}")]
    lines += [_row("Output token throughput (tok/s):", result["output_throughput"]),
              _row("Total token throughput (tok/s):", result["total_token_throughput"])]
    if "prefix_cache_hit_rate" in result:
        lines.append(_row("Prefix cache hit rate (usage):", result["prefix_cache_hit_rate"],
                          "{:<10.3f}"))
    for metric in percentile_metrics:
        title, short = _TITLES[metric]
        lines.append("{s:{c}^{n}}".format(s=title, n=WIDTH, c="-"))
        lines.append(_row(f"Mean {short} (ms):", result.get(f"mean_{metric}_ms")))
        lines.append(_row(f"Median {short} (ms):", result.get(f"median_{metric}_ms")))
        for p in result.get("percentiles", []):
            key = percentile_key(p)
            lines.append(_row(f"{key.upper()} {short} (ms):", result.get(f"{key}_{metric}_ms")))
    breakdown = result.get("server_breakdown") or {}
    if breakdown:
        lines.append("{s:{c}^{n}}".format(s="Server-side breakdown (ms)", n=WIDTH, c="-"))
        lines.append(f"{'stage':<20} {'mean':>9} {'p99':>9} {'n':>7}")
        for stage in STAGES:
            if stage in breakdown:
                s = breakdown[stage]
                lines.append(f"{stage:<20} {s['mean_ms']:>9.2f} {s['p99_ms']:>9.2f} "
                             f"{s['count']:>7}")
    if result.get("errors"):
        lines.append("{s:{c}^{n}}".format(s="Errors", n=WIDTH, c="-"))
        lines += [f"{e['count']:>6} x {e['error']}" for e in result["errors"]]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def default_filename(result: dict[str, Any]) -> str:
    """vLLM's pattern: ``{backend}-{rate}qps[-concurrency{c}]-{model}-{date}.json``."""
    model = re.sub(r"[^A-Za-z0-9._-]", "_", str(result["model_id"]).rstrip("/").split("/")[-1])
    concurrency = (f"-concurrency{result['max_concurrency']}"
                   if result.get("max_concurrency") else "")
    return f"{result['backend']}-{result['request_rate']}qps{concurrency}-{model}-{result['date']}.json"


def result_paths(results: Sequence[dict[str, Any]], result_dir: str | None,
                 filename: str | None) -> list[Path]:
    """Where each run's JSON goes; a sweep with one ``filename`` gets ``-RATEqps`` suffixes."""
    directory = Path(result_dir) if result_dir else RESULTS_ROOT / "serve"
    if filename is None:
        return [directory / default_filename(r) for r in results]
    if len(results) == 1:
        return [directory / filename]
    stem = filename[:-5] if filename.endswith(".json") else filename
    return [directory / f"{stem}-{r['request_rate']}qps.json" for r in results]


def save_results(results: Sequence[dict[str, Any]], result_dir: str | None,
                 filename: str | None) -> list[Path]:
    """Write each run's JSON; return the paths."""
    paths = result_paths(results, result_dir, filename)
    for result, path in zip(results, paths):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
    return paths


def timestamp() -> str:
    """A file-name-safe time stamp."""
    return datetime.now().strftime("%Y%m%d-%H%M%S")
