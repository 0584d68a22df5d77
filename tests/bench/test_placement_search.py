"""The placement sweep's rate search and summary (pure)."""

from __future__ import annotations

import pytest

from benchmarks.placement.search import PointResult, RateSearch, SloCell
from benchmarks.placement.workloads import SweepTopology, topologies_for
from benchmarks.placement_sweep import summarize

TIGHT = SloCell(1000.0, 15.0)
LOOSE = SloCell(1000.0, 40.0)


def synthetic_point(rate: float, tight_capacity: float, loose_capacity: float) -> PointResult:
    """Ten requests: all meet LOOSE below its capacity, TIGHT below its own; else none."""
    tpot = 0.010 if rate <= tight_capacity else (0.030 if rate <= loose_capacity else 0.080)
    return PointResult(rate, (0.1,) * 10, (tpot,) * 10, duration_s=10.0 / rate)


def run_search(search: RateSearch, tight: float, loose: float) -> list[float]:
    rates = []
    while (rate := search.next_rate()) is not None:
        rates.append(rate)
        search.record(synthetic_point(rate, tight, loose))
    return rates


def test_attainment_counts_failed_requests_as_missed() -> None:
    point = PointResult(4.0, (0.1, 0.1, None, 2.0), (0.01, 0.02, None, 0.01), duration_s=2.0)
    assert point.attainment(TIGHT) == 0.25   # only the first meets TPOT <= 15 ms
    assert point.attainment(LOOSE) == 0.5
    assert point.goodput(LOOSE) == 1.0


def test_search_grows_until_every_cell_fails_then_brackets_each() -> None:
    search = RateSearch([TIGHT, LOOSE], start_rate=1.0, max_rate=64.0, budget=20)
    rates = run_search(search, tight=5.0, loose=11.0)
    assert rates[:5] == [1.0, 2.0, 4.0, 8.0, 16.0]
    tight_low, tight_high = search.bracket(TIGHT)
    loose_low, loose_high = search.bracket(LOOSE)
    assert tight_low <= 5.0 < tight_high and tight_high / tight_low <= search.tolerance
    assert loose_low <= 11.0 < loose_high and loose_high / loose_low <= search.tolerance
    assert search.max_goodput(TIGHT)["rate"] == tight_low
    assert abs(search.max_goodput(LOOSE)["goodput"] - loose_low) < 1e-9


def test_search_stops_at_its_budget_and_at_max_rate() -> None:
    assert len(run_search(RateSearch([LOOSE], 1.0, 64.0, budget=3), 5.0, 11.0)) == 3
    # Nothing ever fails: growth stops at max_rate, which is then the answer.
    search = RateSearch([LOOSE], 1.0, 6.0, budget=20)
    assert run_search(search, 100.0, 100.0) == [1.0, 2.0, 4.0, 6.0]
    assert search.max_goodput(LOOSE)["rate"] == 6.0


def test_search_goes_below_a_failing_start() -> None:
    search = RateSearch([TIGHT], start_rate=8.0, max_rate=64.0, budget=6)
    run_search(search, tight=1.5, loose=100.0)
    low, _ = search.bracket(TIGHT)
    assert low is not None and low <= 1.5


def test_topologies_for_two_and_four_gpus() -> None:
    assert [t.name for t in topologies_for(2)] == ["colo2", "1p1d", "adaptive2"]
    assert [t.name for t in topologies_for(4)] == ["colo4", "1p3d", "2p2d", "3p1d",
                                                   "adaptive4"]
    assert all(t.num_workers == 4 for t in topologies_for(4))


def test_summary_ratios_against_best_static_and_replicas() -> None:
    from benchmarks.placement.workloads import SMOKE_WORKLOADS

    workload = SMOKE_WORKLOADS["2k"]
    cell = workload.cells()[1].name
    figures = {"colo2": {"2k": {cell: {"rate": 4.0}}}, "1p1d": {"2k": {cell: {"rate": 5.0}}},
               "adaptive2": {"2k": {cell: {"rate": 6.0}}}}
    topologies = [SweepTopology("colo2", colocated=2), SweepTopology("1p1d", 1, 1),
                  SweepTopology("adaptive2", workers=2)]
    _, ratios = summarize(figures, [workload], topologies)
    assert ratios[f"2k/{cell}"] == {
        "adaptive2": {"vs_best_static": 6.0 / 5.0, "vs_replicas": 1.5}}
    # With the cell's targets too: a column and ratios of its own.
    figures["adaptive2@cell"] = {"2k": {cell: {"rate": 10.0}}}
    table, ratios = summarize(figures, [workload], topologies)
    assert ratios[f"2k/{cell}"]["adaptive2@cell"] == {"vs_best_static": 2.0,
                                                      "vs_replicas": 2.5}
    assert "| adaptive2@cell / best static |" in table.splitlines()[0]
    assert "| 4 | 5 | 6 | 10 | 1.20x | 1.50x | 2.00x | 2.50x |" in table


def test_sweep_runs_launch_adaptive_once_per_cell_and_ttft_target() -> None:
    from benchmarks.placement.workloads import GPU_WORKLOADS, sweep_runs

    workloads = [GPU_WORKLOADS["2k"], GPU_WORKLOADS["8k"]]
    topologies = topologies_for(2)
    runs = sweep_runs(topologies, workloads, (10.0, 15.0), "both")
    assert [r.label for r in runs] == ["colo2", "1p1d", "adaptive2"] + ["adaptive2@cell"] * 4
    assert all(r.workloads == tuple(workloads) and r.tpot_cells == (10.0, 15.0)
               for r in runs[:3])
    run = runs[4]
    assert run.topology.name == "adaptive2-ttft1000-tpot15"
    assert run.topology.launch_args()[-4:] == ["--slo-ttft-ms", "1000", "--slo-tpot-ms", "15"]
    assert [w.name for w in run.workloads] == ["2k"] and run.tpot_cells == (15.0,)
    assert [w.name for w in runs[-1].workloads] == ["8k"]
    cell_only = sweep_runs(topologies, workloads, (15.0,), "cell")
    assert [r.topology.name for r in cell_only] == [
        "colo2", "1p1d", "adaptive2-ttft1000-tpot15", "adaptive2-ttft2000-tpot15"]
    assert [r.label for r in sweep_runs(topologies, workloads, (15.0,), "default")] == [
        "colo2", "1p1d", "adaptive2"]


def test_an_adaptive_cell_run_bounds_its_workers_steps_to_the_cell(tmp_path) -> None:
    """The sweep's ``@cell`` launch command, as launch builds its children: every placed
    worker gets the cell's TPOT target less the placement headroom as its step target."""
    import argparse

    import deploy.launch as launch
    from benchmarks.disagg.cluster import ClusterSpec
    from benchmarks.placement.workloads import GPU_WORKLOADS, sweep_runs
    from benchmarks.placement_sweep import SweepCluster
    from deploy.cli import build_parser
    from proxy.placement import PlacementConfig

    run = sweep_runs(topologies_for(2), [GPU_WORKLOADS["2k"]], (15.0,), "cell")[-1]
    argv = SweepCluster(ClusterSpec("/m", "m", log_dir=tmp_path), run.topology).argv()
    assert argv[1:3] == ["-m", "deploy.launch"]
    parser = argparse.ArgumentParser()
    launch.add_launch_arguments(parser)
    args = parser.parse_args(argv[3:])
    _, workers, _ = launch.build_children(args, launch.engine_argv(args), tmp_path)
    planned_ms = PlacementConfig(slo_tpot_s=0.015).decode_step_target_s * 1e3
    assert [build_parser().parse_args(w.argv[3:]).decode_step_target_ms for w in workers] == [
        pytest.approx(planned_ms)] * 2


def test_merge_summaries_of_a_sweep_run_in_parts(tmp_path) -> None:
    import json

    from benchmarks.placement_sweep import merge_summaries

    cell = "ttft1000_tpot15"
    parts = {"static": {"colo2": {"2k": {cell: {"rate": 15.0}}},
                        "1p1d": {"2k": {cell: {"rate": 18.0}}}},
             "adaptive": {"adaptive2@cell": {"2k": {cell: {"rate": 19.5}}}}}
    for name, figures in parts.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"figures": figures}))
    table, ratios = merge_summaries([tmp_path / "static", tmp_path / "adaptive"])
    assert ratios == {f"2k/{cell}": {"adaptive2@cell": {"vs_best_static": 19.5 / 18.0,
                                                         "vs_replicas": 1.3}}}
    assert "| 2k | TTFT<=1000 TPOT<=15 | 15 | 18 | 19.5 | 1.08x | 1.30x |" in table
