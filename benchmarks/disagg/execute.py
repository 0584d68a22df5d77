"""Run a report plan: launch each topology once, run its benchmarks, save one JSON per run.

A run whose JSON already exists is skipped (unless ``force``), so an interrupted report
resumes where it stopped and a long report can be run in pieces; but only a run made on the
same kind of device: one saved on another GPU model is run again, since the summary compares
runs with each other (an H100's colocated run against an H200's 1P1D run is no overhead).
Around each run the workers' and the proxy's ``/metrics`` are scraped, and the deltas that
the summary needs (prefix-cache counters, the proxy's own overhead histogram) are stored
with the result.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.disagg.cells import device_models
from benchmarks.disagg.cluster import Cluster, ClusterError, ClusterSpec
from benchmarks.disagg.plan import PROXY, BenchRun, Scale, TopologyPlan
from benchmarks.serve import prometheus
from benchmarks.serve.config import METRICS, BenchConfig
from benchmarks.serve.datasets import load_tokenizer
from benchmarks.serve.runner import BenchmarkError, run_benchmark

logger = logging.getLogger("pdserve.report")

PERCENTILES = (50.0, 90.0, 99.0)
STARTUP_ESTIMATE_S = 120.0
WARMUP_SEED_OFFSET = 7919
WARMUP_OUTPUT_LEN = 16
PROXY_HISTOGRAMS = {"overhead": "pdserve:proxy_overhead_seconds",
                    "queue": "pdserve:proxy_queue_time_seconds"}
# Connector counters that mean a request's KV did not move as the topology says: a failed or
# late load is recomputed on D (or fails), a failed send leaves D waiting.
TRANSFER_FAILURES = ("pdserve:kv_transfer_transfers_failed", "pdserve:kv_transfer_transfers_timed_out",
                     "pdserve:kv_transfer_sends_failed")


class UnhealthyTopology(BenchmarkError):
    """The topology broke during a run (warm-up included): its figures are not saved."""


def transfer_failures(before: dict[str, prometheus.Samples],
                      after: dict[str, prometheus.Samples]) -> list[str]:
    """Each worker's connector failures between two scrapes, as messages."""
    out = []
    for url, samples in after.items():
        d = prometheus.delta(before.get(url, {}), samples)
        for name in TRANSFER_FAILURES:
            count = prometheus.counter(d, name)
            if count > 0:
                out.append(f"{url}: {name} +{count:g}")
    return out


@dataclass(frozen=True)
class ExecuteOptions:
    """Everything ``run_plan`` needs besides the plan."""

    results_dir: Path
    spec: ClusterSpec
    tokenizer_path: str
    scale: Scale
    force: bool = False
    disable_tqdm: bool = False
    deadline: float | None = None  # time.monotonic() by which the last run must be done
    provenance: dict[str, Any] | None = None  # stored with each run: where and when it ran

    @property
    def raw_dir(self) -> Path:
        return self.results_dir / "raw"


def _scrape_all(cluster: Cluster) -> dict[str, prometheus.Samples]:
    pages = {}
    for url in [cluster.url, *cluster.worker_urls()]:
        try:
            pages[url] = prometheus.scrape(url)
        except Exception as exc:  # metrics are extra information; the run still counts
            logger.warning("could not scrape %s/metrics: %s", url, exc)
    return pages


def scraped_deltas(cluster: Cluster, before: dict[str, prometheus.Samples],
                   after: dict[str, prometheus.Samples]) -> dict[str, Any]:
    """Per worker prefix-cache counters and the proxy's histograms, over one run."""
    out: dict[str, Any] = {"workers": [], "proxy": {}}
    for worker in cluster.workers:
        url = f"http://{worker['http_address']}"
        if url not in before or url not in after:
            continue
        d = prometheus.delta(before[url], after[url])
        out["workers"].append({
            "role": worker["role"], "http_address": worker["http_address"],
            "prefix_cache_queries": prometheus.counter(d, "vllm:prefix_cache_queries"),
            "prefix_cache_hits": prometheus.counter(d, "vllm:prefix_cache_hits"),
            "requests_finished": prometheus.counter(d, "vllm:request_success"),
            "kv_offload_loaded_blocks": prometheus.counter(d, "pdserve:kv_offload_loaded_blocks"),
            "kv_offload_stored_blocks": prometheus.counter(d, "pdserve:kv_offload_stored_blocks")})
    if cluster.url in before and cluster.url in after:
        d = prometheus.delta(before[cluster.url], after[cluster.url])
        for key, name in PROXY_HISTOGRAMS.items():
            stats = {"mean_ms": prometheus.histogram_mean(d, name)}
            for q in (0.5, 0.99):
                stats[f"p{int(q * 100)}_ms"] = prometheus.histogram_quantile(d, name, q)
            out["proxy"][key] = {k: (None if v is None else v * 1e3) for k, v in stats.items()}
        routes = prometheus.by_mode(d, "pdserve:proxy_routing_decisions")
        out["proxy"]["routes"] = {mode: n for mode, n in routes.items() if n > 0}
    return out


def bench_config(run: BenchRun, url: str, options: ExecuteOptions,
                 interleave_url: str | None = None) -> BenchConfig:
    """The ``bench serve`` settings of one run."""
    scale = options.scale
    return BenchConfig(
        base_url=url, interleave_base_url=interleave_url,
        model=options.spec.served_model_name, tokenizer=options.tokenizer_path,
        dataset=run.dataset, request_rates=(run.rate,),
        goodput={"ttft": scale.slo_ttft_ms, "tpot": scale.slo_tpot_ms}, ignore_eos=True,
        percentile_metrics=METRICS, metric_percentiles=PERCENTILES,
        num_warmups=0, request_id_prefix=f"{run.name}-", label=run.variant,
        metadata={"experiment": run.experiment, "run": run.name, "target": run.target},
        disable_tqdm=options.disable_tqdm)


def warm_up(run: BenchRun, url: str, options: ExecuteOptions, tokenizer: Any) -> None:
    """Prompts of the run's shape (other seed, short outputs) one at a time, then at once.

    One at a time compiles the kernels and captures the graphs a lone request uses (the
    low-load experiment's case), the burst those of a batch; results are dropped.
    """
    count = options.scale.warmups
    if count <= 0:
        return
    data = replace(run.dataset, seed=run.dataset.seed + WARMUP_SEED_OFFSET,
                   random_output_len=min(run.dataset.random_output_len, WARMUP_OUTPUT_LEN),
                   prefix_output_len=min(run.dataset.prefix_output_len, WARMUP_OUTPUT_LEN))
    for num_prompts, concurrency in ((max(1, count // 2), 1), (count, None)):
        config = replace(bench_config(run, url, options),
                         dataset=replace(data, num_prompts=num_prompts),
                         request_rates=(math.inf,), max_concurrency=concurrency,
                         request_id_prefix=f"{run.name}-warm-", disable_tqdm=True)
        run_benchmark(config, tokenizer)
        data = replace(data, seed=data.seed + 1)


def _target_url(cluster: Cluster, target: str) -> str:
    if target == PROXY:
        return cluster.url
    urls = cluster.worker_urls(target)
    if not urls:
        raise BenchmarkError(f"{cluster.topology.name} has no {target} worker")
    return urls[0]


def _execute_run(cluster: Cluster, run: BenchRun, options: ExecuteOptions,
                 tokenizer: Any) -> Path:
    url = _target_url(cluster, run.target)
    other = None if run.interleave is None else _target_url(cluster, run.interleave)
    logger.info("run %s: %s at %s req/s on %s%s", run.name, run.variant, run.rate, url,
                f" and {other}" if other else "")
    start = _scrape_all(cluster)
    warm_up(run, url, options, tokenizer)
    before = _scrape_all(cluster)
    (result,) = run_benchmark(bench_config(run, url, options, other), tokenizer)
    after = _scrape_all(cluster)
    problems = cluster.problems() + transfer_failures(start, after)
    if problems:
        raise UnhealthyTopology(f"{cluster.topology.name} broke during {run.name}: "
                                + "; ".join(problems))
    result["topology"] = cluster.topology.name
    if options.provenance is not None:
        result["provenance"] = options.provenance
    result["scraped"] = scraped_deltas(cluster, before, after)
    path = options.raw_dir / f"{run.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    logger.info("run %s: %d ok, %d failed, p50 TTFT %.1f ms -> %s", run.name,
                result["completed"], result["failed"], result["p50_ttft_ms"] or float("nan"),
                path)
    return path


@dataclass
class PlanOutcome:
    """What ``run_plan`` did: failures, the runs left for lack of time, and the runs whose
    topology needs more GPUs than were given (for a later invocation on a bigger machine)."""

    problems: list[str]
    left: list[str]
    need_gpus: list[str] = field(default_factory=list)


def _fits(options: ExecuteOptions, seconds: float) -> bool:
    return options.deadline is None or time.monotonic() + seconds <= options.deadline


def _done(path: Path, models: frozenset[str]) -> bool:
    """True when ``path`` holds a run made on ``models`` (an unreadable one is not done)."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and device_models(saved.get("provenance")) == models


def _pending(item: TopologyPlan, options: ExecuteOptions) -> list[BenchRun]:
    """The runs of ``item`` still to make here: all with ``force``; else those without a
    saved result from this kind of device (one from another is replaced, and logged)."""
    if options.force:
        return list(item.runs)
    models = device_models(options.provenance)
    pending = []
    for run in item.runs:
        path = options.raw_dir / f"{run.name}.json"
        if not _done(path, models):
            if path.is_file():
                logger.info("%s: saved on other devices (or unreadable); run again here",
                            run.name)
            pending.append(run)
    return pending


def run_plan(plan: list[TopologyPlan], options: ExecuteOptions) -> PlanOutcome:
    """Run every pending run of the plan that fits before the deadline."""
    tokenizer = None
    outcome = PlanOutcome([], [])
    for item in plan:
        pending = _pending(item, options)
        if not pending:
            logger.info("%s: every run already has results; skipped", item.topology.name)
            continue
        gpus = options.spec.gpus
        if gpus and item.topology.num_workers > len(gpus):
            logger.info("%s needs %d GPUs, %d given: its runs wait for a bigger machine",
                        item.topology.name, item.topology.num_workers, len(gpus))
            outcome.need_gpus += [r.name for r in pending]
            continue
        if not _fits(options, STARTUP_ESTIMATE_S + pending[0].estimated_seconds):
            outcome.left += [r.name for r in pending]
            continue
        tokenizer = tokenizer or load_tokenizer(options.tokenizer_path)
        try:
            with Cluster(options.spec, item.topology) as cluster:
                for index, run in enumerate(pending):
                    if not _fits(options, run.estimated_seconds):
                        outcome.left += [r.name for r in pending[index:]]
                        break
                    try:
                        _execute_run(cluster, run, options, tokenizer)
                    except UnhealthyTopology as exc:  # its other runs would measure it broken
                        outcome.problems.append(f"{run.name}: {exc}")
                        logger.error("%s; its remaining runs are not run", exc)
                        break
                    except BenchmarkError as exc:
                        outcome.problems.append(f"{run.name}: {exc}")
                        logger.error("run %s failed: %s", run.name, exc)
        except ClusterError as exc:
            outcome.problems.append(f"{item.topology.name}: {exc}")
            logger.error("%s", exc)
    return outcome
