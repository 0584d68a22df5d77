"""The report's markdown summary, key figures and plots, from the saved per-run JSON.

Differences of percentiles (1P1D p99 minus colocated p99) compare two distributions; they
are not percentiles of per-request differences. "Max goodput" is the highest goodput seen
over a sweep; "rate at 90% SLO" is the highest swept rate at which at least 90% of the
requests met both SLOs.

Goodput is scored at the report's SLOs (``slos_ms``): a run saved under other SLOs (a summary
rebuilt with ``--summary-only --slo-tpot-ms``) is scored again from its per-request TTFT and
TPOT, as ``bench serve`` scores them. Each sweep also gets the goodput ratio at the TTFT SLO
and a range of TPOT SLOs (``TPOT_SLO_SWEEP_MS``): where disaggregation pays depends on how
tight the TPOT SLO is (1P1D keeps decode steps free of prefill chunks; two colocated replicas
have twice the prefill capacity).

goodput_2k_2p1d (2P1D against three colocated replicas, three GPUs each, at goodput_2k's
points) gets the same tables, and each sweep's max goodput per GPU beside goodput_2k's 1P1D
and two replicas (two GPUs) where those ran on the same device model.

Only runs made on one device model are compared: where an experiment's runs come from
different GPU models (a report resumed on another machine and stopped by its time budget),
the runs of other models than its newest run's are set aside and listed.
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.disagg.plan import COLO2, COLO3, PD, PD2P1D, Topology
from benchmarks.serve.breakdown import STAGES
from benchmarks.serve.metrics import within_slos
from benchmarks.serve.plots import plot_latency_cdfs, plot_vs_rate

Results = Mapping[str, Mapping[str, Any]]  # run name -> bench result
GOALS = {"ttft_overhead_p50_ms": 3.0, "ttft_overhead_p99_ms": 10.0, "goodput_ratio": 1.5,
         "proxy_overhead_p50_ms": 1.0}
ATTAINMENT_TARGET = 0.9
TPOT_SLO_SWEEP_MS = (10.0, 15.0, 20.0, 40.0)


@dataclass(frozen=True)
class Side:
    """One sweep of a goodput comparison: its topology (run names
    ``<experiment>__<topology>__r<rate>``, its figures' key, its GPUs) and legend."""

    topology: Topology
    label: str

    @property
    def key(self) -> str:
        return self.topology.name

    @property
    def gpus(self) -> int:
        return self.topology.num_workers


_TWO_GPU_SIDES = (Side(PD, "1P1D"), Side(COLO2, "2x colocated"))
GOODPUT_SIDES = {"goodput_2k": _TWO_GPU_SIDES, "goodput_8k": _TWO_GPU_SIDES,
                 "goodput_2k_2p1d": (Side(PD2P1D, "2P1D"), Side(COLO3, "3x colocated"))}
_BOUND_MARKS = {None: "", "upper bound": "<= ", "lower bound": ">= ", "unresolved": "~"}


def device_models(provenance: Mapping[str, Any] | None) -> frozenset[str]:
    """The device models a run's provenance names (``nvidia-smi``'s name column; a CPU's
    line as it is): what decides whether two runs may be compared. Counts, memory and driver
    are left out, so a one-GPU and a two-GPU machine of the same card agree."""
    devices = (provenance or {}).get("devices") or []
    return frozenset(str(d).split(",")[0].strip() for d in devices)


def comparable(results: Results) -> tuple[dict[str, Mapping[str, Any]], list[str]]:
    """``results`` less the runs whose experiment's newest run (by provenance date) was made
    on other device models; the names set aside."""
    newest: dict[str, tuple[str, frozenset[str]]] = {}
    for name, result in results.items():
        where = result.get("provenance") or {}
        experiment, date = name.split("__")[0], str(where.get("date") or "")
        if experiment not in newest or date > newest[experiment][0]:
            newest[experiment] = (date, device_models(where))
    kept, aside = {}, []
    for name, result in results.items():
        if device_models(result.get("provenance")) == newest[name.split("__")[0]][1]:
            kept[name] = result
        else:
            aside.append(name)
    return kept, aside


def load_results(raw_dir: Path) -> dict[str, dict[str, Any]]:
    """Every saved run, by name."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(raw_dir.glob("*.json"))}


def _f(value: Any, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _verdict(value: float | None, goal: float, lower_is_better: bool = True) -> str:
    if value is None:
        return "not measured"
    met = value <= goal if lower_is_better else value >= goal
    if met:
        return "met"
    gap = value - goal if lower_is_better else goal - value
    return f"missed by {gap:.2f}"


def _breakdown_table(results: Results, names: list[str]) -> list[str]:
    present = [n for n in names if results.get(n, {}).get("server_breakdown")]
    if not present:
        return []
    lines = ["", "Server-side breakdown, mean / p99 (ms):", "",
             "| stage | " + " | ".join(results[n]["label"] for n in present) + " |",
             "|---|" + "---|" * len(present)]
    for stage in STAGES:
        cells = []
        for name in present:
            s = results[name]["server_breakdown"].get(stage)
            cells.append("" if s is None else f"{s['mean_ms']:.2f} / {s['p99_ms']:.2f}")
        if any(cells):
            lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    return lines


def _latency_rows(results: Results, names: list[str]) -> list[str]:
    lines = ["| setup | p50 TTFT | p99 TTFT | mean TTFT | p50 TPOT | p99 TPOT | ok | failed |",
             "|---|---|---|---|---|---|---|---|"]
    for name in names:
        r = results.get(name)
        if r is None:
            continue
        lines.append(f"| {r['label']} | {_f(r['p50_ttft_ms'])} | {_f(r['p99_ttft_ms'])} | "
                     f"{_f(r['mean_ttft_ms'])} | {_f(r['p50_tpot_ms'])} | "
                     f"{_f(r['p99_tpot_ms'])} | {r['completed']} | {r['failed']} |")
    return lines


# The 1P1D variants of the TTFT experiment: (run, figures key prefix, legend).
_PD_VARIANTS = (("ttft_overhead__pd", "", "1P1D"),
                ("ttft_overhead__pd_handoff", "handoff_", "1P1D with P's first token"))


def ttft_overhead(results: Results, figures: dict[str, Any]) -> list[str]:
    names = ["ttft_overhead__colocated_direct", "ttft_overhead__colocated_proxy",
             *(run for run, _, _ in _PD_VARIANTS)]
    if not any(n in results for n in names):
        return []
    first = next(results[n] for n in names if n in results)
    lines = ["## 1. TTFT overhead of disaggregation at low load", "",
             f"random {first['total_input_tokens'] // max(first['completed'], 1)}-token prompts, "
             f"{first['output_lens'][0] if first['output_lens'] else '?'} output tokens, "
             f"Poisson {first['request_rate']} req/s, {first['num_prompts']} requests per setup "
             "(1P1D and the direct colocated run send the same prompts).", ""]
    lines += _latency_rows(results, names)
    section: dict[str, Any] = {}
    for (run, prefix, legend), (base, what) in itertools.product(
            _PD_VARIANTS, (("ttft_overhead__colocated_direct", "colocated hit directly"),
                           ("ttft_overhead__colocated_proxy", "colocated through the proxy"))):
        pd = results.get(run)
        if pd is None or base not in results:
            continue
        p50 = _diff(pd["p50_ttft_ms"], results[base]["p50_ttft_ms"])
        p99 = _diff(pd["p99_ttft_ms"], results[base]["p99_ttft_ms"])
        key = prefix + ("vs_direct" if base.endswith("direct") else "vs_proxy")
        section[key] = {"p50_ms": p50, "p99_ms": p99}
        lines += ["", f"{legend} minus {what}: p50 **{_f(p50, 2)} ms** "
                  f"(goal <= {GOALS['ttft_overhead_p50_ms']:g}: "
                  f"{_verdict(p50, GOALS['ttft_overhead_p50_ms'])}), p99 **{_f(p99, 2)} ms** "
                  f"(goal <= {GOALS['ttft_overhead_p99_ms']:g}: "
                  f"{_verdict(p99, GOALS['ttft_overhead_p99_ms'])})."]
    figures["ttft_overhead"] = section
    lines += _breakdown_table(results, names)
    return lines + [""]


def rescore(run: Mapping[str, Any], slos_ms: Mapping[str, float]) -> Mapping[str, Any] | None:
    """``run`` with ``request_goodput`` and ``slo_attainment`` at ``slos_ms`` (TTFT and/or
    TPOT, ms), from its per-request ``ttfts`` and ``tpots`` as ``bench serve`` counts them
    (good requests over the run's duration, and over every request sent); the run itself
    when it was scored at these SLOs. None when it cannot be: other SLO kinds, or per-request
    lists that do not pair up (a request of one output token has no TPOT in the list)."""
    if dict(run.get("goodput_slos_ms") or {}) == dict(slos_ms):
        return run
    ttfts, tpots, done = run.get("ttfts"), run.get("tpots"), run.get("completed")
    if (set(slos_ms) - {"ttft", "tpot"} or ttfts is None or tpots is None
            or not len(ttfts) == len(tpots) == done or not run.get("duration")):
        return None
    # A request of one output token has no TPOT: it meets a TPOT SLO (bench serve and
    # vLLM count it as 0).
    good = sum(within_slos({"ttft": ttft, "tpot": 0.0 if tpot is None else tpot}, slos_ms)
               for ttft, tpot in zip(ttfts, tpots))
    sent = done + (run.get("failed") or 0)
    return {**run, "goodput_slos_ms": dict(slos_ms), "request_goodput": good / run["duration"],
            "slo_attainment": good / max(sent, 1)}


def _sweep(results: Results, experiment: str, topology: str) -> list[Mapping[str, Any]]:
    runs = [r for n, r in results.items() if n.startswith(f"{experiment}__{topology}__r")]
    return sorted(runs, key=lambda r: float(r["request_rate"]))


def _scored(runs: list[Mapping[str, Any]], slos_ms: Mapping[str, float] | None
            ) -> tuple[list[Mapping[str, Any]], int]:
    """``runs`` scored at ``slos_ms`` (None: as saved), and how many could not be."""
    if slos_ms is None:
        return runs, 0
    scored = [rescore(r, slos_ms) for r in runs]
    return [s if s is not None else r for s, r in zip(scored, runs)], scored.count(None)


def _tpot_sensitivity(sides: tuple[Side, Side], a_runs: list[Mapping[str, Any]],
                      b_runs: list[Mapping[str, Any]], ttft_ms: float
                      ) -> tuple[list[str], dict[str, Any]]:
    """Max goodput of both sweeps, and their ratio, at the TTFT SLO and each of
    ``TPOT_SLO_SWEEP_MS``: lines and figures (empty where the runs cannot be rescored)."""
    rows, figures = [], {}
    for tpot in TPOT_SLO_SWEEP_MS:
        slos = {"ttft": ttft_ms, "tpot": tpot}
        a = [rescore(r, slos) for r in a_runs]
        b = [rescore(r, slos) for r in b_runs]
        if not a or not b or None in a or None in b:
            return [], {}
        fig_a, fig_b = _sweep_figures(a), _sweep_figures(b)
        ratio, kind = _ratio(fig_a, fig_b)
        best_a, best_b = fig_a["max_goodput"], fig_b["max_goodput"]
        figures[f"{tpot:g}"] = {sides[0].key: best_a, sides[1].key: best_b, "ratio": ratio,
                                "ratio_bound": kind}
        rows.append(f"| {tpot:g} | {_f(best_a, 2)} | {_f(best_b, 2)} | "
                    f"{_BOUND_MARKS[kind]}{_f(ratio, 2)}x |")
    lines = ["", f"Max goodput by TPOT SLO (TTFT <= {ttft_ms:g} ms, the same runs scored "
             "again; <= / >= : a sweep that never saturated bounds the ratio):", "",
             f"| TPOT SLO ms | {sides[0].label} | {sides[1].label} | ratio |",
             "|---|---|---|---|", *rows]
    return lines, figures


def _sweep_figures(runs: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The sweep's best goodput, the highest rate meeting the attainment target, and whether
    the best is at the sweep's top rate with the target still met (``peak_at_top_rate``):
    then the sweep never saturated and the true peak is at least the figure."""
    runs = sorted(runs, key=lambda r: float(r["request_rate"]))
    good = [r for r in runs if r.get("slo_attainment", 0) >= ATTAINMENT_TARGET]
    best = max(runs, key=lambda r: r.get("request_goodput", 0.0), default=None)
    return {"max_goodput": None if best is None else best.get("request_goodput", 0.0),
            "rate_at_90pct_slo": max((float(r["request_rate"]) for r in good), default=None),
            "peak_at_top_rate": bool(runs) and best is runs[-1] and best in good}


def _ratio(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[float | None, str | None]:
    """``a``'s max goodput over ``b``'s (``_sweep_figures``), and what kind of figure it is:
    None when both peaks were reached, else "upper bound" (``b`` never saturated), "lower
    bound" (``a`` never did) or "unresolved" (neither did)."""
    if a["max_goodput"] is None or not b["max_goodput"]:
        return None, None
    kind = {(False, False): None, (False, True): "upper bound", (True, False): "lower bound",
            (True, True): "unresolved"}[(a["peak_at_top_rate"], b["peak_at_top_rate"])]
    return a["max_goodput"] / b["max_goodput"], kind


def _bound_note(kind: str | None, a_name: str, b_name: str) -> str:
    if kind is None:
        return ""
    unsaturated = {"upper bound": b_name, "lower bound": a_name,
                   "unresolved": f"{a_name} and {b_name}"}[kind]
    return (f" ({kind}: {unsaturated} still met {ATTAINMENT_TARGET:.0%} of the SLOs at the "
            "sweep's top rate, so its peak is at least its figure)")


def _shared_rates(*sweeps: list[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """Each sweep cut to the rates every one of them ran: a maximum over rates only one ran
    (a sweep cut short) is no basis for a ratio."""
    shared = set.intersection(*({float(r["request_rate"]) for r in runs} for runs in sweeps))
    return [[r for r in runs if float(r["request_rate"]) in shared] for runs in sweeps]


def _goodput_pair(results: Results, experiment: str, sides: tuple[Side, Side], title: str,
                  slos_ms: Mapping[str, float] | None, goal: float | None = None
                  ) -> tuple[list[str], dict[str, Any]]:
    """Two sweeps of ``experiment`` side by side at each rate, both sweeps' max goodput
    (over the rates both ran) and their ratio, and the ratio by TPOT SLO: lines (none
    without runs) and figures. ``goal``: the ratio's goal, judged in the text."""
    a_side, b_side = sides
    pd = _sweep(results, experiment, a_side.key)
    colo = _sweep(results, experiment, b_side.key)
    if not pd and not colo:
        return [], {}
    (pd, unscored_pd), (colo, unscored_colo) = _scored(pd, slos_ms), _scored(colo, slos_ms)
    sample = (pd or colo)[0]
    slos = " and ".join(f"{k.upper()} <= {v:g} ms" for k, v in sample["goodput_slos_ms"].items())
    input_len = sample["total_input_tokens"] // max(sample["completed"], 1)
    output_len = sample["output_lens"][0] if sample["output_lens"] else "?"
    lines = [f"## {title}: random {input_len}/{output_len}, Poisson ({slos})", "",
             f"| rate | {a_side.label} goodput | attain. | p99 TTFT | p99 TPOT | "
             f"{b_side.label} goodput | attain. | p99 TTFT | p99 TPOT |",
             "|---|---|---|---|---|---|---|---|---|"]
    by_rate: dict[float, dict[str, Mapping[str, Any]]] = {}
    for topology, runs in (("a", pd), ("b", colo)):
        for r in runs:
            by_rate.setdefault(float(r["request_rate"]), {})[topology] = r

    def cells(r: Mapping[str, Any] | None) -> str:
        if r is None:
            return " | | | "
        return (f"{_f(r.get('request_goodput'), 2)} | {_f(r.get('slo_attainment'), 2)} | "
                f"{_f(r['p99_ttft_ms'])} | {_f(r['p99_tpot_ms'])}")

    lower_tpot = 0
    for rate in sorted(by_rate):
        row = by_rate[rate]
        lines.append(f"| {rate:g} | {cells(row.get('a'))} | {cells(row.get('b'))} |")
        a, b = row.get("a"), row.get("b")
        if a and b and a["p99_tpot_ms"] is not None and b["p99_tpot_ms"] is not None:
            lower_tpot += a["p99_tpot_ms"] < b["p99_tpot_ms"]
    shared_pd, shared_colo = _shared_rates(pd, colo) if pd and colo else (pd, colo)
    fig_a, fig_b = _sweep_figures(shared_pd), _sweep_figures(shared_colo)
    section = {a_side.key: fig_a, b_side.key: fig_b,
               f"{a_side.key}_lower_p99_tpot_points": lower_tpot,
               "points_compared": sum(1 for v in by_rate.values() if len(v) == 2)}
    section["goodput_ratio"], section["goodput_ratio_bound"] = _ratio(fig_a, fig_b)
    only_shared = (f" (over the {section['points_compared']} rates both ran)"
                   if len(shared_pd) != len(pd) or len(shared_colo) != len(colo) else "")
    verdict = ("" if goal is None else f" (goal >= {goal:g}x: "
               f"{_verdict(section['goodput_ratio'], goal, False)})")
    lines += ["", f"Max goodput{only_shared}: {a_side.label} {_f(fig_a['max_goodput'], 2)} "
              f"req/s, {b_side.label} {_f(fig_b['max_goodput'], 2)} req/s, ratio "
              f"**{_f(section['goodput_ratio'], 2)}x**"
              f"{_bound_note(section['goodput_ratio_bound'], a_side.label, b_side.label)}"
              f"{verdict}. Highest rate with >= {ATTAINMENT_TARGET:.0%} SLO attainment: "
              f"{a_side.label} {_f(fig_a['rate_at_90pct_slo'], 2)}, {b_side.label} "
              f"{_f(fig_b['rate_at_90pct_slo'], 2)} req/s. {a_side.label} p99 TPOT lower at "
              f"{lower_tpot} of {section['points_compared']} rates."]
    if unscored_pd or unscored_colo:
        lines += ["", f"{unscored_pd + unscored_colo} runs could not be scored at these SLOs "
                  "(their per-request lists do not pair up): they keep the SLOs they were run "
                  "with."]
    ttft_ms = sample["goodput_slos_ms"].get("ttft")
    if ttft_ms is not None:
        more, by_tpot = _tpot_sensitivity(sides, shared_pd, shared_colo, ttft_ms)
        lines += more
        if by_tpot:
            section["by_tpot_slo"] = by_tpot
    return lines, section


def goodput(results: Results, figures: dict[str, Any], experiment: str,
            slos_ms: Mapping[str, float] | None = None) -> list[str]:
    """goodput_2k / goodput_8k: 1P1D against two colocated replicas."""
    lines, section = _goodput_pair(results, experiment, GOODPUT_SIDES[experiment],
                                   "2. Goodput at SLO", slos_ms, GOALS["goodput_ratio"])
    if not lines:
        return []
    figures[experiment] = section
    return lines + [""]


def goodput_2p1d(results: Results, figures: dict[str, Any],
                 slos_ms: Mapping[str, float] | None = None) -> list[str]:
    """goodput_2k_2p1d: 2P1D against three colocated replicas (three GPUs each) at
    goodput_2k's points, and every sweep's goodput per GPU beside goodput_2k's (two GPUs)."""
    experiment = "goodput_2k_2p1d"
    lines, section = _goodput_pair(
        results, experiment, GOODPUT_SIDES[experiment],
        "Goodput on three GPUs: 2P1D vs three colocated replicas (goodput_2k's prompts)",
        slos_ms)
    if not lines:
        return []
    more, section["per_gpu"] = _per_gpu(results, slos_ms)
    figures[experiment] = section
    return lines + ["", *more, ""]


def _per_gpu(results: Results, slos_ms: Mapping[str, float] | None
             ) -> tuple[list[str], dict[str, Any]]:
    """goodput_2k_2p1d's and goodput_2k's max goodput per GPU, over the rates every sweep
    ran, and 2P1D's per GPU over 1P1D's: one paragraph and figures (only the 2P1D pair's
    where goodput_2k has no runs, or has them from other GPU models)."""
    three, two = GOODPUT_SIDES["goodput_2k_2p1d"], GOODPUT_SIDES["goodput_2k"]
    sweeps = {side: _scored(_sweep(results, experiment, side.key), slos_ms)[0]
              for experiment, sides in (("goodput_2k_2p1d", three), ("goodput_2k", two))
              for side in sides}
    sweeps = {side: runs for side, runs in sweeps.items() if runs}
    models = {device_models(r.get("provenance")) for runs in sweeps.values() for r in runs}
    note = ""
    if not any(side in sweeps for side in two):
        note = (" goodput_2k has no runs here: run `--only goodput_2k` (two GPUs) with the "
                "same `--results-dir`, `--rates-2k`, `--point-seconds` and `--seed` to set "
                "1P1D and two replicas beside these.")
    elif len(models) > 1:
        note = (" goodput_2k's runs were made on other GPU models than these, so they are "
                "not compared: run both experiments on one machine.")
    if note:
        sweeps = {side: runs for side, runs in sweeps.items() if side in three}
    shared = dict(zip(sweeps, _shared_rates(*sweeps.values())))
    rates = len(next(iter(shared.values())))
    # One (seed, count) per rate when every sweep sent the same prompts at each rate.
    if len({(r.get("seed"), r.get("num_prompts")) for runs in shared.values()
            for r in runs}) > rates:
        note += (" Some sweeps sent other prompts at a rate than the others (another `--seed` "
                 "or `--point-seconds`): they did not serve the same requests.")
    figures: dict[str, Any] = {}
    cells = []
    for side, runs in shared.items():
        fig = _sweep_figures(runs)
        per_gpu = None if fig["max_goodput"] is None else fig["max_goodput"] / side.gpus
        figures[side.key] = {**fig, "gpus": side.gpus, "per_gpu": per_gpu}
        cells.append(f"{side.label} {_f(fig['max_goodput'], 2)}/{side.gpus} = "
                     f"{'>= ' if fig['peak_at_top_rate'] else ''}**{_f(per_gpu, 2)}**")
    which = {1: "its sweep", 2: "both sweeps"}.get(len(shared), f"all {len(shared)} sweeps")
    if not rates:
        return ["Max goodput per GPU: no rate that every sweep ran." + note], figures
    whose = "; 1P1D and 2x colocated: goodput_2k's runs" if len(shared) > 2 else ""
    text = f"Max goodput per GPU (req/s per GPU, over the {rates} rates {which} ran{whose}): "
    text += ", ".join(cells) + "."
    if any(f["peak_at_top_rate"] for f in figures.values()):
        text += (f" >= : that sweep still met {ATTAINMENT_TARGET:.0%} of the SLOs at the top "
                 "rate, so its peak per GPU is at least the figure.")
    a, b = three[0], two[0]
    if a.key in figures and b.key in figures:
        ratio, kind = _ratio(figures[a.key], figures[b.key])
        ratio = None if ratio is None else ratio * b.gpus / a.gpus
        figures[f"{a.key}_per_gpu_over_{b.key}"] = {"ratio": ratio, "ratio_bound": kind}
        text += (f" Per GPU, {a.label} gets **{_BOUND_MARKS[kind]}{_f(ratio, 2)}x** "
                 f"{b.label}'s{_bound_note(kind, a.label, b.label)}.")
    return [text + note], figures


def prefill_overflow(results: Results, figures: dict[str, Any],
                     slos_ms: Mapping[str, float] | None = None) -> list[str]:
    """overflow_2k: 1P1D with the proxy's --prefill-overflow at goodput_2k's points (same
    prompts), beside goodput_2k's 1P1D and two replicas where they ran."""
    variants = sorted({n.split("__")[1] for n in results if n.startswith("overflow_2k__")})
    if not variants:
        return []
    base = {name: {float(r["request_rate"]): r for r in _scored(
        _sweep(results, "goodput_2k", name), slos_ms)[0]} for name in ("pd", "colo2")}
    lines = ["## Prefill overflow: 1P1D whose D prefills once P is full (random 2k, "
             "goodput_2k's prompts)", "",
             "| variant | rate | goodput | attain. | p99 TTFT | p99 TPOT | D alone (of routes) | 1P1D goodput "
             "| 2x colocated goodput |", "|---|---|---|---|---|---|---|---|---|"]
    section: dict[str, Any] = {}
    for variant in variants:
        runs, _ = _scored(_sweep(results, "overflow_2k", variant), slos_ms)
        for r in runs:
            rate = float(r["request_rate"])
            pd, colo = base["pd"].get(rate), base["colo2"].get(rate)
            routes = r.get("scraped", {}).get("proxy", {}).get("routes") or {}
            alone = (f"{routes.get('prefill_overflow', 0) / sum(routes.values()):.0%}"
                     if routes else "n/a")
            lines.append(
                f"| {variant} | {rate:g} | {_f(r.get('request_goodput'), 2)} | "
                f"{_f(r.get('slo_attainment'), 2)} | {_f(r['p99_ttft_ms'])} | "
                f"{_f(r['p99_tpot_ms'])} | {alone} | "
                f"{_f(pd.get('request_goodput') if pd else None, 2)} | "
                f"{_f(colo.get('request_goodput') if colo else None, 2)} |")
        mine = _sweep_figures(runs)
        notes = []
        for name, label, whose in (("pd", "1P1D", "1P1D's"),
                                   ("colo2", "two replicas", "two replicas'")):
            ours, theirs = (_shared_rates(runs, list(base[name].values())) if base[name]
                            else (runs, []))
            ratio, kind = _ratio(_sweep_figures(ours), _sweep_figures(theirs))
            mine[f"ratio_to_{name}"], mine[f"ratio_to_{name}_bound"] = ratio, kind
            notes.append(f"{_f(ratio, 2)}x {whose}{_bound_note(kind, variant, label)}"
                         if ratio is not None else f"no {label} run to compare with")
        section[variant] = mine
        lines += ["", f"{variant}: max goodput {_f(mine['max_goodput'], 2)} req/s, "
                  f"{' and '.join(notes)} (over the rates both ran).", ""]
    figures["overflow_2k"] = section
    return lines


def _hit_rates(result: Mapping[str, Any]) -> str:
    parts = []
    for w in result.get("scraped", {}).get("workers", []):
        if w["prefix_cache_queries"] > 0:
            parts.append(f"{w['role']} {w['prefix_cache_hits'] / w['prefix_cache_queries']:.1%}")
    return ", ".join(parts) or "n/a"


def _latency_cells(result: Mapping[str, Any]) -> str:
    """The p50/p99/mean TTFT and p50 E2EL cells of a table row (ms)."""
    return (f"{_f(result['p50_ttft_ms'])} | {_f(result['p99_ttft_ms'])} | "
            f"{_f(result['mean_ttft_ms'])} | {_f(result['p50_e2el_ms'])} |")


def _ttft(result: Mapping[str, Any]) -> dict[str, Any]:
    """A run's p50/p99/mean TTFT (ms), as the sections' figures record them."""
    return {key: result[key] for key in ("p50_ttft_ms", "p99_ttft_ms", "mean_ttft_ms")}


def prefix_cache(results: Results, figures: dict[str, Any]) -> list[str]:
    names = ["prefix_cache__colo1_on", "prefix_cache__colo1_off", "prefix_cache__pd_on",
             "prefix_cache__pd_off"]
    present = [n for n in names if n in results]
    if not present:
        return []
    lines = ["## 3. Prefix caching on the prefix_repetition workload", "",
             "| setup | hit rate (engine counters) | cached tokens / prompt tokens | p50 TTFT | "
             "p99 TTFT | mean TTFT | p50 E2EL |", "|---|---|---|---|---|---|---|"]
    section = {}
    for name in present:
        r = results[name]
        section[name.split("__")[1]] = {"p50_ttft_ms": r["p50_ttft_ms"],
                                        "usage_hit_rate": r.get("prefix_cache_hit_rate"),
                                        "workers": r.get("scraped", {}).get("workers", [])}
        lines.append(f"| {r['label']} | {_hit_rates(r)} | "
                     f"{_f(r.get('prefix_cache_hit_rate'), 3)} | {_latency_cells(r)}")
    lines += ["", "Engine counters are `vllm:prefix_cache_hits / vllm:prefix_cache_queries` "
              "(tokens) over the run, per worker; on 1P1D the decode worker's usage reports "
              "only its own local hits, so the prefill worker's counter is the one to read."]
    figures["prefix_cache"] = section
    return lines + [""]


def _span(result: dict[str, Any]) -> str:
    """Range of the median TTFT over each tenth of a run (requests in arrival order)."""
    ttfts = result.get("ttfts") or []
    tenth = len(ttfts) // 10
    if tenth == 0:
        return "n/a"
    medians = [statistics.median(ttfts[i * tenth:(i + 1) * tenth]) * 1e3 for i in range(10)]
    return f"{min(medians):.1f}-{max(medians):.1f}"


def proxy_overhead(results: Results, figures: dict[str, Any]) -> list[str]:
    direct, proxied, mixed = (results.get(f"proxy_overhead__{k}")
                              for k in ("direct", "proxy", "interleaved"))
    if direct is None and proxied is None and mixed is None:
        return []
    goal = GOALS["proxy_overhead_p50_ms"]
    lines = ["## 4. Proxy overhead", "",
             "| target | achieved req/s | p50 TTFT | p99 TTFT | p50 E2EL | p99 E2EL | failed |",
             "|---|---|---|---|---|---|---|"]
    rows = [(r["label"], r) for r in (direct, proxied) if r is not None]
    if mixed is not None and "interleaved" in mixed:
        rows += [(f"{name}, interleaved", mixed["interleaved"][key])
                 for name, key in (("direct", "base"), ("through the proxy", "interleaved"))]
    for label, r in rows:
        lines.append(f"| {label} | {_f(r['request_throughput'])} | "
                     f"{_f(r['p50_ttft_ms'], 2)} | {_f(r['p99_ttft_ms'], 2)} | "
                     f"{_f(r['p50_e2el_ms'], 2)} | {_f(r['p99_e2el_ms'], 2)} | "
                     f"{r['failed']} |")
    section: dict[str, Any] = {}
    if mixed is not None and "interleaved" in mixed:
        base, other = mixed["interleaved"]["base"], mixed["interleaved"]["interleaved"]
        added = {"ttft_p50_added_ms": _diff(other["p50_ttft_ms"], base["p50_ttft_ms"]),
                 "ttft_p99_added_ms": _diff(other["p99_ttft_ms"], base["p99_ttft_ms"]),
                 "e2el_p50_added_ms": _diff(other["p50_e2el_ms"], base["p50_e2el_ms"])}
        section["interleaved"] = added
        lines += ["", f"Added by the proxy, interleaved A/B (one run at "
                  f"{mixed['request_rate']} req/s, even requests to the worker, odd ones "
                  f"through the proxy): p50 TTFT **{_f(added['ttft_p50_added_ms'], 2)} ms** "
                  f"(goal <= {goal:g}: {_verdict(added['ttft_p50_added_ms'], goal)}), p99 TTFT "
                  f"{_f(added['ttft_p99_added_ms'], 2)} ms, p50 E2EL "
                  f"{_f(added['e2el_p50_added_ms'], 2)} ms."]
    if direct is not None and proxied is not None:
        section["ttft_p50_added_ms"] = _diff(proxied["p50_ttft_ms"], direct["p50_ttft_ms"])
        section["ttft_p99_added_ms"] = _diff(proxied["p99_ttft_ms"], direct["p99_ttft_ms"])
        section["e2el_p50_added_ms"] = _diff(proxied["p50_e2el_ms"], direct["p50_e2el_ms"])
        verdict = "" if "interleaved" in section else (
            f" (goal <= {goal:g}: {_verdict(section['ttft_p50_added_ms'], goal)})")
        lines += ["", f"Separate runs (the same prompts, direct then through the proxy, offered "
                  f"{proxied['request_rate']} req/s): p50 TTFT "
                  f"{_f(section['ttft_p50_added_ms'], 2)} ms{verdict}, p99 TTFT "
                  f"{_f(section['ttft_p99_added_ms'], 2)} ms, p50 E2EL "
                  f"{_f(section['e2el_p50_added_ms'], 2)} ms. This difference also carries the "
                  "worker's drift between the runs: the p50 TTFT of each tenth of a run spans "
                  f"{_span(direct)} ms direct and {_span(proxied)} ms through the proxy."]
    owns = [(r or {}).get("scraped", {}).get("proxy", {}).get("overhead") for r in (mixed, proxied)]
    own = next((o for o in owns if o), None)
    if own:
        section["own_overhead_ms"] = own
        lines += [f"The proxy's own time per request (`pdserve:proxy_overhead_seconds`: a "
                  f"request's total time in the proxy minus its time waiting on workers, "
                  f"bucket-interpolated): mean {_f(own['mean_ms'], 3)} ms, p50 "
                  f"{_f(own['p50_ms'], 3)} ms, p99 {_f(own['p99_ms'], 3)} ms."]
    figures["proxy_overhead"] = section
    return lines + [""]


def kv_offload(results: Results, figures: dict[str, Any]) -> list[str]:
    present = [n for n in ("kv_offload__off", "kv_offload__on") if n in results]
    if not present:
        return []
    lines = ["## KV offload to host memory under a small device KV cache", "",
             "| setup | hit rate (engine counters) | blocks from host | blocks to host | "
             "p50 TTFT | p99 TTFT | mean TTFT | p50 E2EL |", "|---|---|---|---|---|---|---|---|"]
    section = {}
    for name in present:
        r = results[name]
        workers = r.get("scraped", {}).get("workers", [])
        loaded = sum(w.get("kv_offload_loaded_blocks", 0.0) for w in workers)
        stored = sum(w.get("kv_offload_stored_blocks", 0.0) for w in workers)
        section[name.split("__")[1]] = {**_ttft(r), "loaded_blocks": loaded,
                                        "stored_blocks": stored, "workers": workers}
        lines.append(f"| {r['label']} | {_hit_rates(r)} | {loaded:.0f} | {stored:.0f} | "
                     f"{_latency_cells(r)}")
    lines += ["", "Hits count prefix tokens found on the device or in host memory; blocks from "
              "host are the hits that host memory served (`pdserve:kv_offload_loaded_blocks`)."]
    figures["kv_offload"] = section
    return lines + [""]


def prefix_affinity(results: Results, figures: dict[str, Any]) -> list[str]:
    names = ("prefix_affinity__round_robin", "prefix_affinity__prefix_affinity")
    present = [n for n in names if n in results]
    if not present:
        return []
    lines = ["## Prefix-affinity routing: two colocated workers with small KV caches", "",
             "| routing | hit rate per worker | hit tokens | requests per worker | p50 TTFT | "
             "p99 TTFT | mean TTFT | p50 E2EL |", "|---|---|---|---|---|---|---|---|"]
    section = {}
    for name in present:
        r = results[name]
        workers = r.get("scraped", {}).get("workers", [])
        hits = sum(w.get("prefix_cache_hits", 0.0) for w in workers)
        served = ", ".join(f"{w.get('requests_finished', 0.0):.0f}" for w in workers)
        section[name.split("__")[1]] = {**_ttft(r), "hit_tokens": hits, "workers": workers}
        lines.append(f"| {r['label']} | {_hit_rates(r)} | {hits:.0f} | {served} | "
                     f"{_latency_cells(r)}")
    lines += ["", "Same prompts both ways; hits are the engines' prefix-cache hit tokens "
              "(`vllm:prefix_cache_hits`) over the run."]
    figures["prefix_affinity"] = section
    return lines + [""]


def build_summary(results: Results, header: list[str],
                  slos_ms: Mapping[str, float] | None = None) -> tuple[str, dict[str, Any]]:
    """The markdown report and its key figures; goodput at ``slos_ms`` (None: each run's
    own)."""
    figures: dict[str, Any] = {}
    sections: list[Callable[[Results, dict[str, Any]], list[str]]] = [
        ttft_overhead, lambda r, f: goodput(r, f, "goodput_2k", slos_ms),
        lambda r, f: goodput(r, f, "goodput_8k", slos_ms),
        lambda r, f: prefill_overflow(r, f, slos_ms), lambda r, f: goodput_2p1d(r, f, slos_ms),
        prefix_cache, proxy_overhead,
        kv_offload, prefix_affinity]
    results, aside = comparable(results)
    lines = list(header)
    for section in sections:
        lines += section(results, figures)
    if len(lines) == len(header):
        lines.append("No results yet.")
    if aside:
        figures["set_aside"] = aside
        lines += ["## Set aside: runs from other devices", "",
                  "Made on other GPU models than the newest run of their experiment, so not "
                  "compared with it (run the report again on one machine to replace them): "
                  + ", ".join(f"`{n}`" for n in sorted(aside)) + ".", ""]
    return "\n".join(lines) + "\n", figures


def make_plots(results: Results, out_dir: Path) -> list[Path]:
    """The report's PNGs (none without matplotlib)."""
    written: list[Path | None] = []

    def runs(*names: str) -> list[Mapping[str, Any]]:
        return [results[n] for n in names if n in results]

    low = runs("ttft_overhead__colocated_direct", "ttft_overhead__colocated_proxy",
               *(run for run, _, _ in _PD_VARIANTS))
    if low:
        written.append(plot_latency_cdfs(low, out_dir / "ttft_overhead_cdf.png",
                                         "Low load: colocated vs 1P1D"))
    for experiment, sides in GOODPUT_SIDES.items():
        sweeps = {side.label: _sweep(results, experiment, side.key) for side in sides}
        if not any(sweeps.values()):
            continue
        for key, ylabel, suffix in (("slo_attainment", "SLO attainment", "slo_attainment"),
                                    ("request_goodput", "goodput (req/s)", "goodput"),
                                    ("p99_tpot_ms", "p99 TPOT (ms)", "p99_tpot"),
                                    ("p99_ttft_ms", "p99 TTFT (ms)", "p99_ttft")):
            series = {label: [(float(r["request_rate"]), r[key]) for r in runs_
                              if r.get(key) is not None]
                      for label, runs_ in sweeps.items() if runs_}
            written.append(plot_vs_rate(
                series, ylabel, out_dir / f"{experiment}_{suffix}.png", title=experiment,
                hline=ATTAINMENT_TARGET if key == "slo_attainment" else None))
    prefix = runs("prefix_cache__colo1_on", "prefix_cache__colo1_off", "prefix_cache__pd_on",
                  "prefix_cache__pd_off")
    if prefix:
        written.append(plot_latency_cdfs(prefix, out_dir / "prefix_cache_cdf.png",
                                         "prefix_repetition: caching on/off"))
    offload = runs("kv_offload__off", "kv_offload__on")
    if offload:
        written.append(plot_latency_cdfs(offload, out_dir / "kv_offload_cdf.png",
                                         "Small device KV cache: offload off/on"))
    affinity = runs("prefix_affinity__round_robin", "prefix_affinity__prefix_affinity")
    if affinity:
        written.append(plot_latency_cdfs(affinity, out_dir / "prefix_affinity_cdf.png",
                                         "Two workers, small KV caches: routing"))
    proxy = runs("proxy_overhead__direct", "proxy_overhead__proxy")
    if proxy:
        written.append(plot_latency_cdfs(proxy, out_dir / "proxy_overhead_cdf.png",
                                         "Worker direct vs through the proxy"))
    return [p for p in written if p is not None]
