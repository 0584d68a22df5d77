"""The placement simulator: predicted maximum goodput of replicas, the xPyD splits and the
adaptive policy, per workload and SLO cell, from the model in ``sim_cluster.py``.

    python3 -m benchmarks.placement.simulate --workers 2 [--workloads 2k,8k] [--seconds 30]

Each point draws the sweep's workload (``workloads.py``: lengths as the benchmark draws
them) at one Poisson rate for ``--seconds``, serves it to the end and scores every cell;
the rate search is the sweep's (``search.py``). ``adaptive`` runs the real policy with the
default targets; ``adaptive@cell`` with each cell's targets (``--slo-tpot-ms`` = the cell's
TPOT, ``--slo-ttft-ms`` = its TTFT). A model: its figures are predictions, not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

import numpy as np

from benchmarks.placement.search import PointResult, RateSearch, SloCell
from benchmarks.placement.sim_cluster import GPU_MODELS, GpuModel, SimCluster, SimRequest
from benchmarks.placement.workloads import GPU_WORKLOADS, TPOT_CELLS_MS, Workload
from proxy.placement import PlacementConfig

ClusterFactory = Callable[[SloCell], SimCluster]


def draw_requests(workload: Workload, rate: float, seconds: float,
                  seed: int) -> list[SimRequest]:
    """Poisson arrivals at ``rate`` for ``seconds`` with the workload's lengths."""
    rng = np.random.default_rng(seed)
    num = max(4, round(rate * seconds))
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num))
    data = workload.dataset
    if data.name == "lognormal":
        inputs = np.clip(rng.lognormal(np.log(data.random_input_len), data.lognormal_sigma,
                                       num), 16, data.lognormal_max_input_len).astype(int)
        outputs = np.clip(rng.lognormal(np.log(data.random_output_len), data.lognormal_sigma,
                                        num), 8, None).astype(int)
    else:
        inputs = np.full(num, data.random_input_len)
        outputs = np.full(num, data.random_output_len)
    return [SimRequest(float(a), int(i), int(o))
            for a, i, o in zip(arrivals, inputs, outputs, strict=True)]


# Seconds of each point's traffic served before its scored part: the sweep measures a
# cluster that has been serving (its points follow each other on one running cluster).
WARMUP_S = 15.0


def run_point(make: ClusterFactory, cell: SloCell | None, workload: Workload, rate: float,
              seconds: float, seed: int, warmup_s: float = WARMUP_S,
              ) -> tuple[PointResult, SimCluster]:
    """One rate: the requests served after ``warmup_s``, as the sweep scores them."""
    cluster = make(cell or workload.cells()[0])
    drawn = cluster.run(draw_requests(workload, rate, seconds + warmup_s, seed))
    served = [r for r in drawn if r.arrival >= warmup_s] or drawn
    duration = max(r.finish or 0.0 for r in served) - served[0].arrival
    return PointResult(rate, tuple(r.ttft for r in served), tuple(r.tpot for r in served),
                       duration), cluster


def max_goodput(make: ClusterFactory, workload: Workload, cells: tuple[SloCell, ...],
                seconds: float, seed: int, budget: int, per_cell: bool) -> dict[str, float | None]:
    """Each cell's highest passing rate. ``per_cell``: a separate search with the cluster
    made for each cell (the adaptive policy at the cell's targets)."""
    out: dict[str, float | None] = {}
    groups = [(cell,) for cell in cells] if per_cell else [cells]
    for group in groups:
        search = RateSearch(group, workload.start_rate, workload.max_rate * 2, budget,
                            tolerance=1.04)
        while (rate := search.next_rate()) is not None:
            point, _ = run_point(make, group[0] if per_cell else None, workload, rate,
                                 seconds, seed + len(search.points))
            search.record(point)
        out.update({cell.name: search.max_goodput(cell)["rate"] for cell in group})
    return out


def layouts(num_workers: int, gpu: GpuModel,
            base: PlacementConfig) -> dict[str, tuple[ClusterFactory, bool]]:
    """Name -> (cluster per cell, whether the cluster depends on the cell)."""
    def at_cell(cell: SloCell) -> PlacementConfig:
        return dataclasses.replace(base, slo_ttft_s=cell.ttft_ms / 1e3,
                                   slo_tpot_s=cell.tpot_ms / 1e3)

    out: dict[str, tuple[ClusterFactory, bool]] = {
        f"colo{num_workers}": (lambda _c: SimCluster("replicas", num_workers, gpu), False)}
    for p in range(1, num_workers):
        out[f"{p}p{num_workers - p}d"] = (
            lambda _c, p=p: SimCluster("pd", num_workers, gpu, num_prefill=p), False)
    out["adaptive"] = (lambda _c: SimCluster("adaptive", num_workers, gpu, base), False)
    out["adaptive@cell"] = (lambda c: SimCluster("adaptive", num_workers, gpu, at_cell(c)),
                            True)
    return out


def ttft_p99_at(make: ClusterFactory, cell: SloCell, workload: Workload, rate: float,
                seconds: float, seed: int) -> float:
    """TTFT p99 (ms) at ``rate``."""
    point, _ = run_point(make, cell, workload, rate, seconds, seed)
    ttfts = [t for t in point.ttfts if t is not None]
    return float(np.percentile(ttfts, 99)) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.placement.simulate",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workloads", default="2k,8k,512x1024,mixed")
    parser.add_argument("--layouts", default=None, help="comma-separated (default all)")
    parser.add_argument("--tpot-cells", type=lambda t: tuple(float(x) for x in t.split(",")),
                        default=TPOT_CELLS_MS)
    parser.add_argument("--seconds", type=float, default=30.0, help="arrivals per point")
    parser.add_argument("--budget", type=int, default=12, help="points per rate search")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu", choices=sorted(GPU_MODELS), default="h100",
                        help="the card's model (sim_cluster.GPU_MODELS)")
    args = parser.parse_args(argv)
    gpu, base = GPU_MODELS[args.gpu], PlacementConfig()
    chosen = layouts(args.workers, gpu, base)
    if args.layouts:
        chosen = {k: v for k, v in chosen.items() if k in args.layouts.split(",")}
    print("Simulated (a model, not a measurement): max rate (req/s) with >= 90% in SLO; "
          "last column: TTFT p99 ms at half of replicas' max rate (loosest cell)\n")
    print("| workload | layout | " + " | ".join(f"TPOT<={t:g}" for t in args.tpot_cells)
          + " | TTFT p99 @ half |")
    print("|---|---|" + "---|" * (len(args.tpot_cells) + 1))
    for name in args.workloads.split(","):
        workload = GPU_WORKLOADS[name]
        cells = workload.cells(args.tpot_cells)
        results = {layout: max_goodput(make, workload, cells, args.seconds, args.seed,
                                       args.budget, per_cell)
                   for layout, (make, per_cell) in chosen.items()}
        colo = results.get(f"colo{args.workers}", {})
        half = (colo.get(cells[-1].name) or 0.0) / 2
        for layout, figures in results.items():
            tail = (f"{ttft_p99_at(chosen[layout][0], cells[-1], workload, half, args.seconds, args.seed + 99):.0f}"
                    if half else "-")
            row = " | ".join("-" if figures[c.name] is None else f"{figures[c.name]:.3g}"
                             for c in cells)
            print(f"| {name} | {layout} | {row} | {tail} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
