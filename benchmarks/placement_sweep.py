"""The placement sweep: maximum goodput of colocated replicas, every static xPyD split and the
adaptive default on the same GPUs, per workload and SLO cell, found by a rate search.

    source .device/env.sh && python3 -m benchmarks.placement_sweep --gpus 0,1 \\
        --out-dir /tmp/placement-sweep [--workloads 2k,8k,512x1024,mixed] [--budget 6] \\
        [--adaptive-targets default|cell|both] [--start-rates 2k=12,8k=3 --growth 1.3]

Each static topology is launched once (``pdserve launch``, dummy Qwen3-8B weights by
default) and serves every workload. The adaptive workers run with the proxy's default
targets (column ``adaptive<N>``) and, with ``--adaptive-targets cell`` or ``both``, once per
cell with the cell's targets as the operator would state them (``--slo-tpot-ms`` and
``--slo-ttft-ms``; column ``adaptive<N>@cell``). Each measured point is a fresh prompt set
at one Poisson rate for ``--point-seconds``. A cell's maximum goodput is the highest rate at which >= 90% of the
requests met TTFT and TPOT (benchmarks/placement/search.py). Output under ``--out-dir``:
``raw/<topology>__<workload>__<rate>.json`` (per-request TTFT/TPOT), ``summary.json`` and
``summary.md`` (the table, with adaptive against the best static layout and the replicas).
``--smoke`` runs the pipeline on CPU with the demo model at tiny sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.disagg.cluster import BENCH_LAUNCH_FLAGS, Cluster, ClusterSpec
from benchmarks.model_shapes import SHAPES, write_model_dir
from benchmarks.placement.observe import PointObserver
from benchmarks.placement.search import PointResult, RateSearch, SloCell
from benchmarks.placement.workloads import (
    ADAPTIVE_TARGETS,
    GPU_WORKLOADS,
    SMOKE_WORKLOADS,
    TPOT_CELLS_MS,
    SweepRun,
    SweepTopology,
    Workload,
    sweep_runs,
    topologies_for,
)
from benchmarks.serve.config import BenchConfig
from benchmarks.serve.runner import BenchmarkError, run_benchmark

logger = logging.getLogger("pdserve.placement_sweep")
REPO_ROOT = Path(__file__).resolve().parent.parent


class SweepCluster(Cluster):
    """A report ``Cluster`` launched with a sweep topology's worker counts."""

    def argv(self) -> list[str]:
        t, spec = self.topology, self.spec
        argv = [sys.executable, "-m", "deploy.launch", *t.launch_args(),
                "--port", str(self.port), "--model", spec.model,
                "--served-model-name", spec.served_model_name,
                "--log-dir", str(spec.log_dir / t.name), "--heartbeat-interval", "1",
                "--stop-timeout", str(spec.stop_timeout_s / 2),
                "--startup-timeout", str(spec.startup_timeout_s), *BENCH_LAUNCH_FLAGS,
                *spec.engine_args]
        if spec.gpus:
            argv += ["--gpus", ",".join(spec.gpus[:t.num_workers])]
        return argv


def measure(cluster: Cluster, workload: Workload, cells: tuple[SloCell, ...], rate: float,
            seconds: float, seed: int, tokenizer: Any, out: Path) -> PointResult:
    """Send ``rate`` req/s of ``workload`` for ``seconds``; save and return the point."""
    num = max(4, round(rate * seconds))
    dataset = dataclasses.replace(workload.dataset, num_prompts=num, seed=seed)
    config = BenchConfig(base_url=cluster.url, model=cluster.spec.served_model_name,
                         dataset=dataset, request_rates=(rate,), ignore_eos=True,
                         disable_tqdm=True, ready_check_timeout_s=0, num_warmups=2,
                         request_id_prefix=f"sweep-{cluster.topology.name}-{seed}-",
                         label=f"{cluster.topology.name}/{workload.name}", plot=False)
    with PointObserver(cluster.url) as seen:
        result = run_benchmark(config, tokenizer)[0]
    result.update(seen.record())
    failed = [None] * result["failed"]
    point = PointResult(rate, tuple(result["ttfts"]) + tuple(failed),
                        tuple(result["tpots"]) + tuple(failed), result["duration"])
    result["cells"] = {cell.name: point.attainment(cell) for cell in cells}
    out.write_text(json.dumps(result))
    logger.info("%s %s @ %.3g req/s: %s; placements %s", cluster.topology.name, workload.name,
                rate, ", ".join(f"{k} {v:.0%}" for k, v in result["cells"].items()),
                dict(sorted(result["placements"].items())) or "-")
    return point


def sweep_topology(cluster: Cluster, run: SweepRun, args: argparse.Namespace,
                   tokenizer: Any, raw: Path) -> dict[str, Any]:
    """Every workload's rate search on one running topology."""
    figures: dict[str, Any] = {}
    for w_index, workload in enumerate(run.workloads):
        cells = workload.cells(run.tpot_cells)
        start = args.start_rates.get(workload.name, workload.start_rate)
        search = RateSearch(cells, start, max(workload.max_rate, start), args.budget,
                            growth=args.growth)
        while (rate := search.next_rate()) is not None:
            seed = args.seed + 1000 * w_index + len(search.points)
            path = raw / f"{cluster.topology.name}__{workload.name}__{rate:.4g}.json"
            search.record(measure(cluster, workload, cells, rate, args.point_seconds, seed,
                                  tokenizer, path))
        figures[workload.name] = {cell.name: search.max_goodput(cell) for cell in cells}
    return figures


def summarize(figures: dict[str, dict[str, Any]], workloads: list[Workload],
              topologies: list[SweepTopology],
              tpot_cells: tuple[float, ...] = TPOT_CELLS_MS) -> tuple[str, dict[str, Any]]:
    """The markdown table and the ratios: each adaptive column (default targets, and the
    cell's targets: ``<name>@cell``) against the best static layout and the colocated
    replicas, per cell (max goodput = the highest passing rate)."""
    static = [t.name for t in topologies if not t.workers and t.name in figures]
    adaptive = [n for t in topologies if t.workers for n in (t.name, f"{t.name}@cell")
                if n in figures]
    colo = next((t.name for t in topologies if t.colocated and t.name in figures), None)
    names = static + adaptive
    lines = ["| workload | SLO cell | " + " | ".join(names) + "".join(
        f" | {a} / best static | {a} / replicas" for a in adaptive) + " |",
        "|" + "---|" * (len(names) + 2 + 2 * len(adaptive))]
    ratios: dict[str, Any] = {}
    for workload in workloads:
        for cell in workload.cells(tpot_cells):
            rates = {n: (figures[n].get(workload.name, {}).get(cell.name) or {}).get("rate")
                     for n in names}
            best = max((rates[n] or 0.0 for n in static), default=0.0)
            row = ratios[f"{workload.name}/{cell.name}"] = {}
            text = ""
            for name in adaptive:
                own = rates[name] or 0.0
                vs_best = own / best if best > 0 else None
                vs_colo = own / rates[colo] if colo and rates.get(colo) else None
                row[name] = {"vs_best_static": vs_best, "vs_replicas": vs_colo}
                text += f" | {_ratio(vs_best)} | {_ratio(vs_colo)}"
            cells = " | ".join("-" if r is None else f"{r:.3g}" for r in rates.values())
            lines.append(f"| {workload.name} | TTFT<={cell.ttft_ms:g} TPOT<={cell.tpot_ms:g} "
                         f"| {cells}{text} |")
    return "\n".join(lines) + "\n", ratios


def merge_summaries(out_dirs: list[Path]) -> tuple[str, dict[str, Any]]:
    """One table from the ``summary.json`` of sweeps run in parts (a GPU call each)."""
    figures: dict[str, Any] = {}
    for out_dir in out_dirs:
        for label, by_workload in json.loads((out_dir / "summary.json").read_text())[
                "figures"].items():
            for workload, cells in by_workload.items():
                figures.setdefault(label, {}).setdefault(workload, {}).update(cells)
    names = {w for by_workload in figures.values() for w in by_workload}
    workloads = [w for name, w in GPU_WORKLOADS.items() if name in names]
    tpots = sorted({float(cell.rsplit("_tpot", 1)[1]) for by_workload in figures.values()
                    for cells in by_workload.values() for cell in cells})
    sizes = sorted({t.num_workers for n in range(2, 9) for t in topologies_for(n)
                    if t.name in figures})
    topologies = [t for n in sizes for t in topologies_for(n)]
    return summarize(figures, workloads, topologies, tuple(tpots))


def _rates(text: str) -> dict[str, float]:
    """``2k=12,8k=3`` -> {"2k": 12.0, "8k": 3.0}."""
    try:
        return {name: float(rate) for name, rate in
                (item.split("=", 1) for item in text.split(",") if item)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected name=rate,...: {text!r}") from None


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=30,
                              cwd=REPO_ROOT).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", default=None, help="GPU ids, one per worker (default 0,1)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--model", default=None, help="checkpoint (default: --shape, dummy)")
    parser.add_argument("--workloads", default=None,
                        help=f"comma-separated, of {','.join(GPU_WORKLOADS)} (default all)")
    parser.add_argument("--topologies", default=None,
                        help="comma-separated names (default: every layout that fits)")
    parser.add_argument("--budget", type=int, default=6, help="points per rate search")
    parser.add_argument("--tpot-cells", type=lambda t: tuple(float(x) for x in t.split(",")),
                        default=TPOT_CELLS_MS, help="TPOT targets (ms) of the SLO cells")
    parser.add_argument("--adaptive-args", default="",
                        help="more launch flags for the adaptive topology, e.g. "
                             "'--slo-tpot-ms 15' (the operator's targets)")
    parser.add_argument("--adaptive-targets", choices=ADAPTIVE_TARGETS, default="both",
                        help="adaptive with the proxy's default targets, with each cell's "
                             "targets (one launch per cell and TTFT target), or both")
    parser.add_argument("--start-rates", type=_rates, default={},
                        help="where each workload's search starts, e.g. 2k=12,8k=3 "
                             "(default: the workload's own)")
    parser.add_argument("--growth", type=float, default=2.0,
                        help="rate factor while every measured rate passes")
    parser.add_argument("--point-seconds", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-args", default="", help="more flags for every worker")
    parser.add_argument("--out-dir", default=None,
                        help="where results go (default: a new temp dir)")
    parser.add_argument("--smoke", action="store_true", help="CPU, demo model, tiny sizes")
    parser.add_argument("--merge", nargs="+", type=Path, default=None, metavar="OUT_DIR",
                        help="print one table from the --out-dir of sweeps run in parts; "
                             "runs nothing")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.placement_sweep",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.merge:
        print(merge_summaries(args.merge)[0], flush=True)
        return 0
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    table = SMOKE_WORKLOADS if args.smoke else GPU_WORKLOADS
    chosen = args.workloads.split(",") if args.workloads else list(table)
    unknown = sorted(set(chosen) - set(table))
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; choose from {sorted(table)}")
    workloads = [table[name] for name in chosen]
    gpus = tuple(g for g in (args.gpus if args.gpus is not None
                             else ("" if args.smoke else "0,1")).split(",") if g)
    topologies = topologies_for(max(len(gpus), 2))
    topologies = [dataclasses.replace(t, extra_args=tuple(shlex.split(args.adaptive_args)))
                  if t.workers else t for t in topologies]
    if args.topologies:
        topologies = [t for t in topologies if t.name in args.topologies.split(",")]
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="pdserve-placement-sweep-"))
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    engine_args = shlex.split(args.engine_args)
    if args.model or args.smoke:
        from engine_core.demo_model import random_demo_model_path

        model = args.model or str(random_demo_model_path())
    else:
        model = str(out / f"model-{args.shape}")
        write_model_dir(args.shape, Path(model), tokenizer="words")
        engine_args = ["--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len",
                       "10240", *engine_args]
    spec = ClusterSpec(model=model, served_model_name="sweep-model",
                       engine_args=tuple(engine_args), gpus=gpus, log_dir=out / "logs")
    from benchmarks.serve.datasets import load_tokenizer

    tokenizer = load_tokenizer(model)
    env = {"date": datetime.now().isoformat(timespec="seconds"),
           "commit": _git("rev-parse", "--short", "HEAD"),
           "devices": _devices(), "gpus": list(gpus), "model": model,
           "command": " ".join(["python3 -m benchmarks.placement_sweep",
                                *map(shlex.quote, sys.argv[1:])])}
    figures: dict[str, Any] = {}
    problems = []
    for run in sweep_runs(topologies, workloads, args.tpot_cells, args.adaptive_targets):
        try:
            with SweepCluster(spec, run.topology) as cluster:  # type: ignore[arg-type]
                for name, cells in sweep_topology(cluster, run, args, tokenizer, raw).items():
                    figures.setdefault(run.label, {}).setdefault(name, {}).update(cells)
        except (BenchmarkError, RuntimeError) as exc:
            problems.append(f"{run.topology.name}: {exc}")
            logger.error("%s failed: %s", run.topology.name, exc)
    markdown, ratios = summarize(figures, workloads, topologies, args.tpot_cells)
    header = (f"# Placement sweep\n\n- {env['date']}, commit {env['commit']}, "
              f"{'; '.join(env['devices'])}, GPUs {','.join(gpus) or 'none'}\n"
              f"- `{env['command']}`\n- cells: max rate (req/s) with >= 90% of requests "
              "within TTFT and TPOT\n\n")
    text = header + markdown + "".join(f"\n- problem: {p}" for p in problems)
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(
        {"environment": env, "figures": figures, "ratios": ratios, "problems": problems},
        indent=2))
    print(text, flush=True)
    print(f"results in {out}", flush=True)
    return 1 if problems else 0


def _devices() -> list[str]:
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        text = ""
    return text.splitlines() if text else ["CPU"]


if __name__ == "__main__":
    sys.exit(main())
