"""``pdserve bench serve ...``: the ``bench`` subcommand and its ``serve`` sub-subcommand."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

logger = logging.getLogger("pdserve.bench")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench``'s sub-subcommands (``serve`` only, as in ``vllm bench serve``)."""
    from benchmarks.serve.config import add_serve_arguments

    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    serve = sub.add_parser("serve", help="benchmark an OpenAI-compatible server online",
                           description="Benchmark an OpenAI-compatible server: TTFT, TPOT, ITL, "
                                       "E2EL, throughput and goodput (vLLM's definitions).")
    add_serve_arguments(serve)


def run_bench(args: argparse.Namespace) -> int:
    """Run ``pdserve bench serve``; print each run's table; save JSON and PNGs when asked."""
    from benchmarks.serve.config import config_from_args
    from benchmarks.serve.plots import plot_latency_cdfs, plot_slo_attainment
    from benchmarks.serve.report import format_settings, format_summary, save_results
    from benchmarks.serve.runner import BenchmarkError, run_benchmark

    try:
        config = config_from_args(args)
        print(format_settings(config), flush=True)
        results = run_benchmark(config)
    except (ValueError, BenchmarkError) as exc:
        logger.error("pdserve bench serve: %s", exc)
        return 1
    for result in results:
        print(format_summary(result, config.percentile_metrics), flush=True)
    if config.save_result:
        paths = save_results(results, config.result_dir, config.result_filename)
        for path in paths:
            print(f"saved {path}")
        if config.plot:
            stem = Path(str(paths[0])[:-5])
            written = [plot_latency_cdfs(results, stem.with_name(stem.name + "-cdf.png"))]
            if len(results) > 1:
                written.append(plot_slo_attainment(
                    results, stem.with_name(stem.name + "-slo.png")))
            for path in written:
                if path is not None:
                    print(f"saved {path}")
    return 0 if all(r["completed"] for r in results) else 2
