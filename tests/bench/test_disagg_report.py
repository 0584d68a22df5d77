"""The disaggregation report's plan, launch command lines, time budget and summary (no processes)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import disagg_report
from benchmarks.disagg.cluster import Cluster, ClusterError, ClusterSpec
from benchmarks.disagg.execute import ExecuteOptions, PlanOutcome, run_plan, transfer_failures
from benchmarks.disagg.plan import (
    ALL_EXPERIMENTS,
    COLO1,
    COLO2,
    COLO3,
    EXPERIMENTS,
    GPU_SCALE,
    PD,
    PD2P1D,
    PD_NOCACHE,
    PROXY,
    SMOKE_SCALE,
    build_plan,
)
from benchmarks.disagg.summary import build_summary


def _runs_by_name(scale=GPU_SCALE) -> dict:
    return {run.name: (item.topology, run) for item in build_plan(scale) for run in item.runs}


def test_plan_launches_each_topology_once_in_order() -> None:
    plan = build_plan(GPU_SCALE)
    assert [p.topology.name for p in plan] == ["colo1", "colo1_nocache", "pd", "pd_handoff",
                                               "pd_nocache", "colo2"]
    names = [run.name for item in plan for run in item.runs]
    assert len(names) == len(set(names))
    assert {run.experiment for item in plan for run in item.runs} == set(EXPERIMENTS)
    assert [p.topology.name for p in build_plan(GPU_SCALE, ("proxy_overhead",))] == ["colo1"]
    extra = build_plan(GPU_SCALE, ("kv_offload", "proxy_overhead"))
    assert [p.topology.name for p in extra] == ["colo1", "colo1_smallkv", "colo1_offload"]
    off, on = (item.runs[0] for item in extra[1:])
    assert off.dataset == on.dataset and off.dataset.name == "prefix_repetition"
    assert extra[1].topology.kv_cache_bytes == extra[2].topology.kv_cache_bytes == 6 << 30
    assert (extra[1].topology.kv_offload_gib, extra[2].topology.kv_offload_gib) == (0, 16)
    affinity = build_plan(GPU_SCALE, ("prefix_affinity",))
    assert [(p.topology.name, p.topology.colocated, p.topology.routing) for p in affinity] == [
        ("colo2_smallkv", 2, "round_robin"), ("colo2_affinity", 2, "prefix_affinity")]
    rr, aff = (item.runs[0] for item in affinity)
    assert rr.dataset == aff.dataset and rr.target == aff.target == "proxy"
    assert rr.dataset.seed != off.dataset.seed  # not the kv_offload run's prompts
    assert affinity[0].topology.kv_cache_bytes == affinity[1].topology.kv_cache_bytes == 6 << 30


def test_compared_runs_share_prompts_and_same_server_runs_do_not() -> None:
    runs = _runs_by_name()
    direct, proxied, pd, handoff = (runs[f"ttft_overhead__{n}"][1]
                                    for n in ("colocated_direct", "colocated_proxy", "pd",
                                              "pd_handoff"))
    assert direct.dataset == pd.dataset == handoff.dataset
    assert direct.target == "colocated" and pd.target == handoff.target == PROXY
    assert runs["ttft_overhead__pd_handoff"][0].first_token_from_prefill
    assert not runs["ttft_overhead__pd"][0].first_token_from_prefill
    assert proxied.dataset.seed != direct.dataset.seed  # same server as direct: fresh prompts
    assert direct.dataset.random_input_len == 2048 and direct.dataset.random_output_len == 128
    assert direct.rate == 1.0
    for rate in GPU_SCALE.sweep_8k.rates:
        tag = f"{rate:g}"
        (t1, a), (t2, b) = runs[f"goodput_8k__pd__r{tag}"], runs[f"goodput_8k__colo2__r{tag}"]
        assert (t1, t2) == (PD, COLO2) and a.dataset == b.dataset and a.rate == rate
        assert a.dataset.random_input_len == 8192
    seeds = [runs[f"goodput_2k__pd__r{r:g}"][1].dataset.seed for r in GPU_SCALE.sweep_2k.rates]
    assert len(set(seeds)) == len(seeds)
    on, off = runs["prefix_cache__pd_on"], runs["prefix_cache__pd_off"]
    assert (on[0], off[0]) == (PD, PD_NOCACHE) and on[1].dataset == off[1].dataset
    assert on[1].dataset.name == "prefix_repetition"
    direct, proxied = runs["proxy_overhead__direct"][1], runs["proxy_overhead__proxy"][1]
    assert proxied.rate == 200.0 and direct.dataset == proxied.dataset
    assert proxied.dataset.random_input_len < 16  # below one block: no prefix hits
    topology, mixed = runs["proxy_overhead__interleaved"]
    assert topology == COLO1 and mixed.target == "colocated" and mixed.interleave == PROXY
    assert mixed.dataset == direct.dataset and mixed.rate == 200.0
    assert runs["proxy_overhead__direct"][0] == COLO1


def test_sweep_point_sizes() -> None:
    assert GPU_SCALE.point_prompts(0.5) == GPU_SCALE.min_point_prompts
    assert GPU_SCALE.point_prompts(4) == 80
    assert GPU_SCALE.point_prompts(1000) == GPU_SCALE.max_point_prompts


def test_launch_argv(tmp_path: Path) -> None:
    spec = ClusterSpec(model="/m", served_model_name="m", engine_args=("--dtype", "bfloat16"),
                       gpus=("3", "5"), log_dir=tmp_path)
    argv = Cluster(spec, PD_NOCACHE, port=1234).argv()
    assert argv[1:3] == ["-m", "deploy.launch"]
    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert (flag("--prefill"), flag("--decode"), flag("--colocated")) == ("1", "1", "0")
    assert flag("--gpus") == "3,5" and flag("--port") == "1234"
    assert "--no-enable-prefix-caching" in argv and argv[-2:] == ["--gpus", "3,5"]
    assert Cluster(spec, COLO1).argv()[-1] == "3"
    with pytest.raises(ClusterError, match="needs 2 GPUs"):
        Cluster(ClusterSpec("/m", "m", gpus=("0",)), COLO2).argv()
    cpu = Cluster(ClusterSpec("/m", "m"), COLO2).argv()
    assert "--gpus" not in cpu and "--enable-prefix-caching" in cpu
    assert "--kv-cache-memory-bytes" not in cpu and "--kv-offloading-size" not in cpu
    offload = Cluster(spec, replace(COLO1, kv_cache_bytes=1 << 30, kv_offload_gib=2.5)).argv()
    assert flag_of(offload, "--kv-cache-memory-bytes") == str(1 << 30)
    assert flag_of(offload, "--kv-offloading-size") == "2.5"
    assert "--routing" not in offload
    routed = Cluster(spec, replace(COLO2, routing="prefix_affinity")).argv()
    assert flag_of(routed, "--routing") == "prefix_affinity"


def flag_of(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def last_flag_of(argv: list[str], name: str) -> str:
    """The value the launcher's parser keeps: the last of a repeated flag."""
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]


def test_the_specs_kv_cache_size_yields_to_engine_args_and_the_topology() -> None:
    """The smoke's small KV cache is every worker's default: --engine-args override it, and a
    topology's own size (kv_offload's small cache) overrides both."""
    spec = ClusterSpec("/m", "m", kv_cache_bytes=SMOKE_SCALE.kv_cache_bytes)
    assert SMOKE_SCALE.kv_cache_bytes == 8 << 20 and GPU_SCALE.kv_cache_bytes is None
    assert last_flag_of(Cluster(spec, PD).argv(), "--kv-cache-memory-bytes") == str(8 << 20)
    user = replace(spec, engine_args=("--kv-cache-memory-bytes", "4096"))
    assert last_flag_of(Cluster(user, PD).argv(), "--kv-cache-memory-bytes") == "4096"
    small = replace(COLO1, kv_cache_bytes=12345)
    assert last_flag_of(Cluster(user, small).argv(), "--kv-cache-memory-bytes") == "12345"


def test_time_budget_leaves_runs_for_the_next_invocation(tmp_path: Path) -> None:
    plan = build_plan(SMOKE_SCALE, ("ttft_overhead",))
    options = ExecuteOptions(results_dir=tmp_path, spec=ClusterSpec("/m", "m"),
                             tokenizer_path="/no/tokenizer", scale=SMOKE_SCALE,
                             deadline=time.monotonic())
    outcome = run_plan(plan, options)
    assert outcome.problems == []
    assert sorted(outcome.left) == ["ttft_overhead__colocated_direct",
                                    "ttft_overhead__colocated_proxy", "ttft_overhead__pd",
                                    "ttft_overhead__pd_handoff"]


def test_topologies_needing_more_gpus_wait_for_a_bigger_machine(tmp_path: Path) -> None:
    """On one GPU the colocated pieces run and the two-worker ones are listed, not failed."""
    plan = build_plan(SMOKE_SCALE, ("proxy_overhead", "prefix_cache"))
    options = ExecuteOptions(results_dir=tmp_path, spec=ClusterSpec("/m", "m", gpus=("0",)),
                             tokenizer_path="/no/tokenizer", scale=SMOKE_SCALE,
                             deadline=time.monotonic())
    outcome = run_plan(plan, options)
    assert outcome.problems == []
    assert sorted(outcome.need_gpus) == ["prefix_cache__pd_off", "prefix_cache__pd_on"]
    assert sorted(outcome.left) == ["prefix_cache__colo1_off", "prefix_cache__colo1_on",
                                    "proxy_overhead__direct", "proxy_overhead__interleaved",
                                    "proxy_overhead__proxy"]


H100 = "NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04"
H200 = "NVIDIA H200, 143771 MiB, 580.159.04"


def _where(*devices: str, date: str = "2026-11-25T20:00:00") -> dict:
    return {"date": date, "devices": list(devices), "gpus_used": ["0", "1"],
            "git_commit": "abc1234", "torch": "2.11"}


@pytest.mark.parametrize("saved, here, reused", [
    ((H200,), (H100, H100), False),  # the 2026-11-25 handoff stage: H200 runs beside H100s
    ((H200,), (H200, H200), True),  # one card or two of the same model: comparable
    (None, (H100,), False),  # saved before provenance was kept: cannot be shown comparable
])
def test_resume_reuses_only_runs_from_the_same_device_model(tmp_path: Path, saved, here,
                                                            reused) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    result = {"label": "colocated"}
    if saved is not None:
        result["provenance"] = _where(*saved)
    (raw / "ttft_overhead__colocated_direct.json").write_text(json.dumps(result))
    (raw / "ttft_overhead__pd.json").write_text("{not json")  # unreadable: run again
    plan = build_plan(SMOKE_SCALE, ("ttft_overhead",))
    options = ExecuteOptions(results_dir=tmp_path, spec=ClusterSpec("/m", "m"),
                             tokenizer_path="/no/tokenizer", scale=SMOKE_SCALE,
                             deadline=time.monotonic(), provenance=_where(*here))
    outcome = run_plan(plan, options)
    expected = {"ttft_overhead__colocated_proxy", "ttft_overhead__pd",
                "ttft_overhead__pd_handoff"} | (set() if reused else
                                                {"ttft_overhead__colocated_direct"})
    assert outcome.problems == [] and set(outcome.left) == expected


def test_summary_compares_no_runs_across_device_models() -> None:
    """An experiment left half redone on another GPU model keeps its newest model's runs."""
    new, old = _where(H100, H100, date="2026-11-25T20:49:44"), _where(H200, H200,
                                                                       date="2026-11-24T07:02:07")
    results = {
        "ttft_overhead__colocated_direct": {**_result("colocated", 1, p50_ttft_ms=60.0),
                                            "provenance": new},
        "ttft_overhead__pd_handoff": {**_result("handoff", 1, p50_ttft_ms=61.0),
                                      "provenance": new},
        "ttft_overhead__pd": {**_result("1P1D", 1, p50_ttft_ms=63.0), "provenance": old},
        "goodput_2k__pd__r2": {**_result("1P1D", 2, request_goodput=2.0), "provenance": old},
    }
    markdown, figures = build_summary(results, ["# report"])
    section = figures["ttft_overhead"]
    assert set(section) == {"handoff_vs_direct"}
    assert section["handoff_vs_direct"]["p50_ms"] == pytest.approx(1.0)
    assert figures["set_aside"] == ["ttft_overhead__pd"]
    assert "1P1D minus colocated" not in markdown
    assert "runs from other devices" in markdown and "`ttft_overhead__pd`" in markdown
    assert "goodput_2k" in figures  # another experiment, all on one model: kept


def _result(label: str, rate: float, **values: float) -> dict:
    base = {"label": label, "request_rate": rate, "completed": 10, "failed": 0,
            "num_prompts": 10, "total_input_tokens": 20480, "output_lens": [128] * 10,
            "goodput_slos_ms": {"ttft": 1000.0, "tpot": 40.0}, "server_breakdown": {},
            "request_throughput": rate}
    for metric in ("ttft", "tpot", "e2el"):
        for stat in ("p50", "p99", "mean"):
            base.setdefault(f"{stat}_{metric}_ms", 1.0)
    return {**base, **values}


def test_summary_figures() -> None:
    results = {
        "ttft_overhead__colocated_direct": _result("colocated", 1, p50_ttft_ms=100.0,
                                                   p99_ttft_ms=120.0),
        "ttft_overhead__pd": _result("1P1D", 1, p50_ttft_ms=102.5, p99_ttft_ms=135.0),
        "ttft_overhead__pd_handoff": _result("1P1D", 1, p50_ttft_ms=101.0, p99_ttft_ms=118.0),
        "goodput_2k__pd__r2": _result("1P1D", 2, request_goodput=2.0, slo_attainment=1.0,
                                      p99_tpot_ms=20.0),
        "goodput_2k__pd__r4": _result("1P1D", 4, request_goodput=3.6, slo_attainment=0.9,
                                      p99_tpot_ms=30.0),
        "goodput_2k__colo2__r2": _result("2x", 2, request_goodput=2.0, slo_attainment=1.0,
                                         p99_tpot_ms=35.0),
        "goodput_2k__colo2__r4": _result("2x", 4, request_goodput=2.0, slo_attainment=0.5,
                                         p99_tpot_ms=80.0),
    }
    markdown, figures = build_summary(results, ["# report"])
    overhead = figures["ttft_overhead"]["vs_direct"]
    assert overhead == pytest.approx({"p50_ms": 2.5, "p99_ms": 15.0})
    handoff = figures["ttft_overhead"]["handoff_vs_direct"]
    assert handoff == pytest.approx({"p50_ms": 1.0, "p99_ms": -2.0})
    assert "1P1D with P's first token minus colocated hit directly: p50 **1.00 ms**" in markdown
    assert "missed by 5.00" in markdown  # p99 goal 10 ms
    g = figures["goodput_2k"]
    # 1P1D's best is its top rate, SLOs still met: it never saturated, the ratio is a bound.
    assert g["pd"] == {"max_goodput": 3.6, "rate_at_90pct_slo": 4.0, "peak_at_top_rate": True}
    assert g["colo2"] == {"max_goodput": 2.0, "rate_at_90pct_slo": 2.0,
                          "peak_at_top_rate": False}
    assert g["goodput_ratio"] == pytest.approx(1.8)
    assert g["goodput_ratio_bound"] == "lower bound"
    assert "ratio **1.80x** (lower bound: 1P1D still met 90% of the SLOs" in markdown
    assert g["pd_lower_p99_tpot_points"] == 2 and g["points_compared"] == 2
    assert "goodput_8k" not in figures


def test_proxy_goal_is_judged_on_the_interleaved_run() -> None:
    base = _result("direct", 200, p50_ttft_ms=20.0, p99_ttft_ms=30.0, p50_e2el_ms=25.0)
    other = _result("proxy", 200, p50_ttft_ms=20.4, p99_ttft_ms=31.5, p50_e2el_ms=25.5)
    mixed = _result("interleaved", 200, interleaved={"base": base, "interleaved": other})
    separate = {"proxy_overhead__direct": _result("direct", 200, p50_ttft_ms=30.0),
                "proxy_overhead__proxy": _result("proxy", 200, p50_ttft_ms=22.0)}
    markdown, figures = build_summary({**separate, "proxy_overhead__interleaved": mixed},
                                      ["# report"])
    section = figures["proxy_overhead"]
    assert section["interleaved"]["ttft_p50_added_ms"] == pytest.approx(0.4)
    assert section["ttft_p50_added_ms"] == pytest.approx(-8.0)  # separate runs: drift
    assert "**0.40 ms** (goal <= 1: met)" in markdown
    assert markdown.count("goal <= 1") == 1  # no verdict on the separate runs then
    markdown, figures = build_summary(separate, ["# report"])
    assert "interleaved" not in figures["proxy_overhead"] and "goal <= 1: met" in markdown


def test_transfer_failures_name_the_worker_and_counter() -> None:
    before = {"http://d": {"pdserve:kv_transfer_transfers_failed_total": 2.0,
                           "pdserve:kv_transfer_transfers_received_total": 5.0}}
    same = {"http://d": {"pdserve:kv_transfer_transfers_failed_total": 2.0,
                         "pdserve:kv_transfer_transfers_received_total": 9.0}}
    assert transfer_failures(before, same) == []
    worse = {"http://d": {"pdserve:kv_transfer_transfers_failed_total": 3.0},
             "http://p": {"pdserve:kv_transfer_sends_failed_total": 1.0}}
    assert transfer_failures(before, worse) == [
        "http://d: pdserve:kv_transfer_transfers_failed +1",
        "http://p: pdserve:kv_transfer_sends_failed +1"]


def _scored_run(label: str, rate: float, ttfts: list[float], tpots: list[float]) -> dict:
    return _result(label, rate, completed=len(ttfts), num_prompts=len(ttfts), duration=10.0,
                   ttfts=ttfts, tpots=tpots, request_goodput=len(ttfts) / 10.0,
                   slo_attainment=1.0)


def test_rescore_counts_requests_meeting_both_slos() -> None:
    from benchmarks.disagg.goodput import rescore

    run = _scored_run("1P1D", 2, [0.1, 0.2, 1.5, 0.3], [0.012, 0.030, 0.010, 0.009])
    assert rescore(run, {"ttft": 1000.0, "tpot": 40.0}) is run  # its own SLOs
    tight = rescore(run, {"ttft": 1000.0, "tpot": 15.0})
    assert tight is not None
    assert tight["slo_attainment"] == pytest.approx(2 / 4)  # 1.5 s TTFT, 30 ms TPOT fail
    assert tight["request_goodput"] == pytest.approx(2 / 10.0)
    with_failed = rescore({**run, "failed": 4}, {"ttft": 1000.0, "tpot": 15.0})
    assert with_failed is not None and with_failed["slo_attainment"] == pytest.approx(2 / 8)
    assert rescore({**run, "tpots": run["tpots"][:3]}, {"ttft": 1000.0, "tpot": 15.0}) is None
    assert rescore(run, {"ttft": 1000.0, "e2el": 5000.0}) is None


def test_summary_scores_goodput_at_the_report_slos_and_by_tpot_slo() -> None:
    """Runs saved at TPOT <= 40 ms, summarised at 15 ms: 1P1D's steady 12 ms TPOT still
    meets it, the colocated replicas' 30 ms does not; at 40 ms both do."""
    results = {
        "goodput_8k__pd__r1": _scored_run("1P1D", 1, [0.3] * 10, [0.012] * 10),
        "goodput_8k__colo2__r1": _scored_run("2x", 1, [0.2] * 10, [0.030] * 10),
    }
    markdown, figures = build_summary(results, ["# report"], {"ttft": 1000.0, "tpot": 15.0})
    g = figures["goodput_8k"]
    assert g["pd"]["max_goodput"] == pytest.approx(1.0)
    assert g["colo2"]["max_goodput"] == pytest.approx(0.0)
    assert "TPOT <= 15 ms" in markdown
    by_tpot = g["by_tpot_slo"]
    assert by_tpot["40"]["ratio"] == pytest.approx(1.0)
    assert by_tpot["40"]["ratio_bound"] == "unresolved"  # one rate each, both met
    assert by_tpot["10"]["pd"] == pytest.approx(0.0)
    assert "| 15 | 1.00 | 0.00 |" in markdown


def test_summary_only_keeps_the_runs_environment(tmp_path: Path) -> None:
    from benchmarks.disagg_report import main

    (tmp_path / "raw").mkdir()
    env = {"date": "2026-11-25T22:08:50", "devices": ["NVIDIA H100 80GB HBM3, 81559 MiB"],
           "gpus_used": ["0", "1"], "model": "m", "served_model_name": "m",
           "engine_args": [], "python": "3.12", "torch": "2.11", "cuda": "13.0",
           "git_commit": "abc1234", "command": "python3 -m benchmarks.disagg_report ...",
           "smoke": False}
    (tmp_path / "env.json").write_text(json.dumps(env))
    run = _scored_run("1P1D", 1, [0.3] * 10, [0.012] * 10)
    (tmp_path / "raw" / "goodput_8k__pd__r1.json").write_text(json.dumps(run))
    assert main(["--summary-only", "--results-dir", str(tmp_path), "--slo-tpot-ms", "15",
                 "--model", str(tmp_path)]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "NVIDIA H100 80GB HBM3" in summary and "commit abc1234" in summary
    assert "summary rebuilt by:" in summary and "TPOT <= 15 ms" in summary
    assert json.loads((tmp_path / "env.json").read_text())["devices"] == env["devices"]


def test_overflow_plan_reuses_goodput_2k_prompts_and_sets_the_proxy_flag(tmp_path: Path) -> None:
    scale = replace(GPU_SCALE, prefill_overflow=6)
    plan = build_plan(scale, ("overflow_2k",))
    assert [(p.topology.name, p.topology.prefill, p.topology.decode,
             p.topology.prefill_overflow) for p in plan] == [("pd_overflow6", 1, 1, 6)]
    runs = _runs_by_name()
    for run in plan[0].runs:
        twin = runs[run.name.replace("overflow_2k__pd_overflow6", "goodput_2k__pd")][1]
        assert run.dataset == twin.dataset and run.rate == twin.rate and run.target == PROXY
    assert [run.rate for run in plan[0].runs] == list(scale.sweep_2k.rates)
    argv = Cluster(ClusterSpec("/m", "m", log_dir=tmp_path), plan[0].topology).argv()
    assert flag_of(argv, "--prefill-overflow") == "6"
    assert "--prefill-overflow" not in Cluster(ClusterSpec("/m", "m", log_dir=tmp_path),
                                               PD).argv()
    assert "overflow_2k" not in {r.experiment for p in build_plan(GPU_SCALE) for r in p.runs}


def test_rescore_lets_a_one_token_request_meet_a_tpot_slo() -> None:
    """bench serve and vLLM count a request of one output token (no TPOT) as TPOT 0."""
    from benchmarks.disagg.goodput import rescore

    run = _scored_run("1P1D", 2, [0.1, 0.2, 0.3], [None, 0.030, 0.010])  # type: ignore[list-item]
    scored = rescore(run, {"ttft": 1000.0, "tpot": 15.0})
    assert scored is not None and scored["slo_attainment"] == pytest.approx(2 / 3)


def test_goodput_ratio_only_over_the_rates_both_sweeps_ran() -> None:
    """A sweep cut short is compared at the rates the other also ran, and the summary says
    so; the replicas' sweep that still met its SLOs at the top rate makes the ratio an upper
    bound."""
    results = {
        "goodput_2k__pd__r4": _result("1P1D", 4, request_goodput=4.0, slo_attainment=1.0),
        "goodput_2k__pd__r8": _result("1P1D", 8, request_goodput=5.0, slo_attainment=0.5),
        "goodput_2k__colo2__r4": _result("2x", 4, request_goodput=4.0, slo_attainment=1.0),
        "goodput_2k__colo2__r8": _result("2x", 8, request_goodput=8.0, slo_attainment=1.0),
        "goodput_2k__colo2__r16": _result("2x", 16, request_goodput=12.0,
                                          slo_attainment=0.6),
    }
    markdown, figures = build_summary(results, ["# report"])
    g = figures["goodput_2k"]
    assert g["colo2"]["max_goodput"] == 8.0  # not 12: 1P1D never ran 16 req/s
    assert g["goodput_ratio"] == pytest.approx(5.0 / 8.0)
    assert g["goodput_ratio_bound"] == "upper bound"
    assert "Max goodput (over the 2 rates both ran)" in markdown


def test_summary_sets_overflow_beside_1p1d_and_two_replicas() -> None:
    results = {
        "goodput_2k__pd__r20": _result("1P1D", 20, request_goodput=15.0, slo_attainment=1.0),
        "goodput_2k__pd__r24": _result("1P1D", 24, request_goodput=6.0, slo_attainment=0.3),
        "goodput_2k__colo2__r24": _result("2x", 24, request_goodput=19.0, slo_attainment=1.0),
        "overflow_2k__pd_overflow8__r20": _result("of", 20, request_goodput=16.0,
                                                  slo_attainment=1.0),
        "overflow_2k__pd_overflow8__r24": _result(
            "of", 24, request_goodput=19.0, slo_attainment=0.95,
            scraped={"proxy": {"routes": {"pd": 300.0, "prefill_overflow": 100.0}}}),
    }
    markdown, figures = build_summary(results, ["# report"])
    section = figures["overflow_2k"]["pd_overflow8"]
    assert section["max_goodput"] == 19.0 and section["rate_at_90pct_slo"] == 24.0
    assert section["ratio_to_pd"] == pytest.approx(19.0 / 15.0)
    assert section["ratio_to_colo2"] == pytest.approx(1.0)
    assert "| pd_overflow8 | 24 | 19.00 | 0.95 | 1.0 | 1.0 | 25% | 6.00 | 19.00 |" in markdown
    assert "| pd_overflow8 | 20 | 16.00 | 1.00 | 1.0 | 1.0 | n/a | 15.00 | n/a |" in markdown


def test_2p1d_plan_reuses_goodput_2k_points_on_three_gpus(tmp_path: Path) -> None:
    """goodput_2k_2p1d: 2P1D and three replicas (3 workers each) at goodput_2k's rates, each
    rate with goodput_2k's prompts (its seed and count), whatever the rates, seed and point
    length; only when named; --gpus ids go to the workers in order, P, P, D."""
    assert "goodput_2k_2p1d" in ALL_EXPERIMENTS and "goodput_2k_2p1d" not in EXPERIMENTS
    assert "goodput_2k_2p1d" not in {r.experiment for p in build_plan(GPU_SCALE) for r in p.runs}
    custom = replace(GPU_SCALE, sweep_2k=replace(GPU_SCALE.sweep_2k, rates=(4, 8, 12, 16)),
                     point_seconds=15.0)
    for scale, seed in ((GPU_SCALE, 0), (custom, 3), (SMOKE_SCALE, 0)):
        plan = build_plan(scale, ("goodput_2k_2p1d",), seed)
        assert [(p.topology, p.topology.num_workers) for p in plan] == [(PD2P1D, 3), (COLO3, 3)]
        assert (PD2P1D.prefill, PD2P1D.decode, PD2P1D.colocated) == (2, 1, 0)
        assert (COLO3.prefill, COLO3.decode, COLO3.colocated) == (0, 0, 3)
        assert PD2P1D.routing == COLO3.routing == "round_robin"
        base = {run.name: run for item in build_plan(scale, ("goodput_2k",), seed)
                for run in item.runs}
        for item, label in zip(plan, ("2P1D", "3x colocated (round robin)")):
            assert [run.rate for run in item.runs] == list(scale.sweep_2k.rates)
            for run in item.runs:
                twin = base[f"goodput_2k__pd__r{run.rate:g}"]
                assert run.name == f"goodput_2k_2p1d__{item.topology.name}__r{run.rate:g}"
                assert run.dataset == twin.dataset and run.rate == twin.rate
                assert run.target == PROXY and run.variant == label
                assert run.experiment == "goodput_2k_2p1d"
        assert len({run.dataset.seed for run in plan[0].runs}) == len(scale.sweep_2k.rates)
    spec = ClusterSpec("/m", "m", gpus=("0", "1", "2", "3"), log_dir=tmp_path)
    pd = Cluster(spec, PD2P1D).argv()
    assert (flag_of(pd, "--prefill"), flag_of(pd, "--decode"), flag_of(pd, "--colocated"),
            flag_of(pd, "--gpus")) == ("2", "1", "0", "0,1,2")
    assert "--routing" not in pd  # round robin: the proxy's default
    colo = Cluster(spec, COLO3).argv()
    assert (flag_of(colo, "--prefill"), flag_of(colo, "--decode"), flag_of(colo, "--colocated"),
            flag_of(colo, "--gpus")) == ("0", "0", "3", "0,1,2")
    with pytest.raises(ClusterError, match="pd2p1d needs 3 GPUs"):
        Cluster(replace(spec, gpus=("0", "1")), PD2P1D).argv()


def _no_runs(*_: object) -> PlanOutcome:
    raise AssertionError("nothing may start")


@pytest.mark.parametrize("argv", [
    ["--gpus", "0,1", "--only", "goodput_2k_2p1d"],
    ["--only", "goodput_2k_2p1d"],  # the default --gpus 0,1
    ["--gpus", "0,1", "--only", "goodput_2k,goodput_2k_2p1d"],
])
def test_too_few_gpus_for_2p1d_is_refused_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        argv: list[str]) -> None:
    monkeypatch.setattr(disagg_report, "run_plan", _no_runs)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        disagg_report.main([*argv, "--results-dir", str(out), "--model", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--gpus 0,1 gives 2 GPUs: goodput_2k_2p1d needs 3 GPUs, one per worker " \
           "(pd2p1d: 3 workers, colo3: 3 workers)" in err
    assert "Pass at least 3 GPU ids, e.g. --gpus 0,1,2" in err
    assert not out.exists()  # no summary, no logs: refused up front


def test_enough_gpus_run_2p1d_and_a_default_report_still_defers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    planned = []

    def record(plan, options) -> PlanOutcome:
        planned.extend(plan)
        assert options.spec.gpus == ("0", "1", "2", "3")
        return PlanOutcome([], [])

    monkeypatch.setattr(disagg_report, "run_plan", record)
    assert disagg_report.main(["--gpus", "0,1,2,3", "--only", "goodput_2k_2p1d",
                               "--results-dir", str(tmp_path), "--model", str(tmp_path)]) == 0
    assert [p.topology for p in planned] == [PD2P1D, COLO3]
    # Not named (the default report) or partly fitting: the big topologies wait, as before.
    refusal, short = disagg_report.gpu_shortfall(GPU_SCALE, EXPERIMENTS, False, 0, ("0",))
    assert refusal is None and [p.topology.name for p in short] == [
        "pd", "pd_handoff", "pd_nocache", "colo2"]
    refusal, short = disagg_report.gpu_shortfall(GPU_SCALE, ("prefix_cache",), True, 0, ("0",))
    assert refusal is None and [p.topology.name for p in short] == ["pd", "pd_nocache"]
    assert disagg_report.gpu_shortfall(GPU_SCALE, ("goodput_2k_2p1d",), True, 0, ()) == (None, [])


def _twin_sweeps(runs: dict[str, dict[float, tuple[float, float]]], **extra: object) -> dict:
    """Synthetic results: {experiment__topology: {rate: (goodput, attainment)}}."""
    return {f"{prefix}__r{rate:g}": _result(prefix, rate, request_goodput=good,
                                            slo_attainment=attained, seed=200 + index,
                                            **extra)
            for prefix, points in runs.items()
            for index, (rate, (good, attained)) in enumerate(sorted(points.items()))}


_THREE_GPU = {"goodput_2k_2p1d__pd2p1d": {4: (4.0, 1.0), 8: (7.8, 1.0), 12: (9.0, 0.8)},
              "goodput_2k_2p1d__colo3": {4: (4.0, 1.0), 8: (6.0, 0.7), 12: (5.0, 0.4)}}
_TWO_GPU = {"goodput_2k__pd": {4: (3.9, 1.0), 8: (5.0, 0.6), 12: (4.0, 0.3), 16: (3.0, 0.1)},
            "goodput_2k__colo2": {4: (4.0, 1.0), 8: (4.5, 0.5), 12: (4.0, 0.3)}}


def test_summary_sets_2p1d_beside_three_replicas_and_per_gpu_beside_goodput_2k() -> None:
    markdown, figures = build_summary(_twin_sweeps({**_THREE_GPU, **_TWO_GPU}), ["# report"])
    section = figures["goodput_2k_2p1d"]
    assert section["pd2p1d"] == {"max_goodput": 9.0, "rate_at_90pct_slo": 8.0,
                                 "peak_at_top_rate": False}
    assert section["colo3"]["max_goodput"] == 6.0
    assert section["goodput_ratio"] == pytest.approx(1.5)
    assert section["goodput_ratio_bound"] is None and section["points_compared"] == 3
    assert "## Goodput on three GPUs: 2P1D vs three colocated replicas" in markdown
    assert ("| rate | 2P1D goodput | attain. | p99 TTFT | p99 TPOT | 3x colocated goodput |"
            in markdown)
    assert "| 8 | 7.80 | 1.00 | 1.0 | 1.0 | 6.00 | 0.70 | 1.0 | 1.0 |" in markdown
    assert "Max goodput: 2P1D 9.00 req/s, 3x colocated 6.00 req/s, ratio **1.50x**." in markdown
    per_gpu = section["per_gpu"]
    # Over the rates all four ran (4, 8, 12: not 1P1D's 16).
    assert {k: per_gpu[k]["per_gpu"] for k in ("pd2p1d", "colo3", "pd", "colo2")} == \
        pytest.approx({"pd2p1d": 3.0, "colo3": 2.0, "pd": 2.5, "colo2": 2.25})
    assert per_gpu["pd2p1d"]["gpus"] == 3 and per_gpu["pd"]["gpus"] == 2
    assert per_gpu["pd2p1d_per_gpu_over_pd"]["ratio"] == pytest.approx(1.2)
    assert ("Max goodput per GPU (req/s per GPU, over the 3 rates all 4 sweeps ran; 1P1D and 2x colocated: "
            "goodput_2k's runs): 2P1D "
            "9.00/3 = **3.00**, 3x colocated 6.00/3 = **2.00**, 1P1D 5.00/2 = **2.50**, 2x "
            "colocated 4.50/2 = **2.25**. Per GPU, 2P1D gets **1.20x** 1P1D's." in markdown)
    assert figures["goodput_2k"]["pd"]["max_goodput"] == 5.0  # its own section unchanged


def test_2p1d_summary_without_goodput_2k_and_with_bounds() -> None:
    """Without goodput_2k's runs the per-GPU line has the 2P1D pair only and says how to add
    the rest; a sweep still within its SLOs at the top rate gets the upper-bound notes."""
    unsaturated = {**_THREE_GPU, "goodput_2k_2p1d__colo3": {4: (4.0, 1.0), 8: (7.9, 0.95),
                                                            12: (11.5, 0.92)}}
    markdown, figures = build_summary(_twin_sweeps(unsaturated), ["# report"])
    section = figures["goodput_2k_2p1d"]
    assert section["goodput_ratio"] == pytest.approx(9.0 / 11.5)
    assert section["goodput_ratio_bound"] == "upper bound"
    assert ("ratio **0.78x** (upper bound: 3x colocated still met 90% of the SLOs at the "
            "sweep's top rate" in markdown)
    per_gpu = section["per_gpu"]
    assert set(per_gpu) == {"pd2p1d", "colo3"}
    assert "3x colocated 11.50/3 = >= **3.83**" in markdown
    assert "goodput_2k has no runs here: run `--only goodput_2k`" in markdown
    assert "goodput_2k" not in figures and "Per GPU, 2P1D gets" not in markdown


def test_2p1d_per_gpu_only_against_goodput_2k_from_the_same_devices_and_prompts() -> None:
    results = _twin_sweeps(_THREE_GPU, provenance=_where(H200, H200, H200, H200))
    other = _twin_sweeps(_TWO_GPU, provenance=_where(H100, H100))
    markdown, figures = build_summary({**results, **other}, ["# report"])
    assert set(figures["goodput_2k_2p1d"]["per_gpu"]) == {"pd2p1d", "colo3"}
    assert "goodput_2k's runs were made on other GPU models" in markdown
    shifted = _twin_sweeps(_TWO_GPU)
    shifted["goodput_2k__pd__r8"]["seed"] = 7  # another --seed: other prompts at 8 req/s
    markdown, figures = build_summary({**_twin_sweeps(_THREE_GPU), **shifted}, ["# report"])
    assert "pd" in figures["goodput_2k_2p1d"]["per_gpu"]
    assert "Some sweeps sent other prompts at a rate than the others" in markdown
    markdown, _ = build_summary({**_twin_sweeps(_THREE_GPU), **_twin_sweeps(_TWO_GPU)},
                                ["# report"])
    assert "other prompts" not in markdown


def test_2p1d_summary_scores_by_tpot_slo() -> None:
    results = {
        "goodput_2k_2p1d__pd2p1d__r4": _scored_run("2P1D", 4, [0.3] * 10, [0.012] * 10),
        "goodput_2k_2p1d__colo3__r4": _scored_run("3x", 4, [0.2] * 10, [0.030] * 10),
    }
    markdown, figures = build_summary(results, ["# report"], {"ttft": 1000.0, "tpot": 15.0})
    by_tpot = figures["goodput_2k_2p1d"]["by_tpot_slo"]
    assert by_tpot["15"] == {"pd2p1d": pytest.approx(1.0), "colo3": 0.0, "ratio": None,
                             "ratio_bound": None}
    assert by_tpot["40"]["ratio"] == pytest.approx(1.0)
    assert "| TPOT SLO ms | 2P1D | 3x colocated | ratio |" in markdown
