"""The goodput sections of the report: sweeps scored at the report's SLOs, their ratios and
bounds, the TPOT sensitivity, 2P1D per GPU and the prefill-overflow variants.

Goodput is scored at the report's SLOs (``slos_ms``): a run saved under other SLOs (a summary
rebuilt with ``--summary-only --slo-tpot-ms``) is scored again from its per-request TTFT and
TPOT, as ``bench serve`` scores them. Each sweep also gets the goodput ratio at the TTFT SLO
and a range of TPOT SLOs (``TPOT_SLO_SWEEP_MS``): where disaggregation pays depends on how
tight the TPOT SLO is (1P1D keeps decode steps free of prefill chunks; two colocated replicas
have twice the prefill capacity).

goodput_2k_2p1d (2P1D against three colocated replicas, three GPUs each, at goodput_2k's
points) gets the same tables, and each sweep's max goodput per GPU beside goodput_2k's 1P1D
and two replicas (two GPUs) where those ran on the same device model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from benchmarks.disagg.cells import (
    ATTAINMENT_TARGET,
    GOALS,
    Results,
    device_models,
    fmt,
    goal_verdict,
)
from benchmarks.disagg.plan import COLO2, COLO3, PD, PD2P1D, Topology
from benchmarks.serve.metrics import within_slos

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


def sweep(results: Results, experiment: str, topology: str) -> list[Mapping[str, Any]]:
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
        rows.append(f"| {tpot:g} | {fmt(best_a, 2)} | {fmt(best_b, 2)} | "
                    f"{_BOUND_MARKS[kind]}{fmt(ratio, 2)}x |")
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
    pd = sweep(results, experiment, a_side.key)
    colo = sweep(results, experiment, b_side.key)
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
        return (f"{fmt(r.get('request_goodput'), 2)} | {fmt(r.get('slo_attainment'), 2)} | "
                f"{fmt(r['p99_ttft_ms'])} | {fmt(r['p99_tpot_ms'])}")

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
               f"{goal_verdict(section['goodput_ratio'], goal, False)})")
    lines += ["", f"Max goodput{only_shared}: {a_side.label} {fmt(fig_a['max_goodput'], 2)} "
              f"req/s, {b_side.label} {fmt(fig_b['max_goodput'], 2)} req/s, ratio "
              f"**{fmt(section['goodput_ratio'], 2)}x**"
              f"{_bound_note(section['goodput_ratio_bound'], a_side.label, b_side.label)}"
              f"{verdict}. Highest rate with >= {ATTAINMENT_TARGET:.0%} SLO attainment: "
              f"{a_side.label} {fmt(fig_a['rate_at_90pct_slo'], 2)}, {b_side.label} "
              f"{fmt(fig_b['rate_at_90pct_slo'], 2)} req/s. {a_side.label} p99 TPOT lower at "
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
    sweeps = {side: _scored(sweep(results, experiment, side.key), slos_ms)[0]
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
        cells.append(f"{side.label} {fmt(fig['max_goodput'], 2)}/{side.gpus} = "
                     f"{'>= ' if fig['peak_at_top_rate'] else ''}**{fmt(per_gpu, 2)}**")
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
        text += (f" Per GPU, {a.label} gets **{_BOUND_MARKS[kind]}{fmt(ratio, 2)}x** "
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
        sweep(results, "goodput_2k", name), slos_ms)[0]} for name in ("pd", "colo2")}
    lines = ["## Prefill overflow: 1P1D whose D prefills once P is full (random 2k, "
             "goodput_2k's prompts)", "",
             "| variant | rate | goodput | attain. | p99 TTFT | p99 TPOT | D alone (of routes) | 1P1D goodput "
             "| 2x colocated goodput |", "|---|---|---|---|---|---|---|---|---|"]
    section: dict[str, Any] = {}
    for variant in variants:
        runs, _ = _scored(sweep(results, "overflow_2k", variant), slos_ms)
        for r in runs:
            rate = float(r["request_rate"])
            pd, colo = base["pd"].get(rate), base["colo2"].get(rate)
            routes = r.get("scraped", {}).get("proxy", {}).get("routes") or {}
            alone = (f"{routes.get('prefill_overflow', 0) / sum(routes.values()):.0%}"
                     if routes else "n/a")
            lines.append(
                f"| {variant} | {rate:g} | {fmt(r.get('request_goodput'), 2)} | "
                f"{fmt(r.get('slo_attainment'), 2)} | {fmt(r['p99_ttft_ms'])} | "
                f"{fmt(r['p99_tpot_ms'])} | {alone} | "
                f"{fmt(pd.get('request_goodput') if pd else None, 2)} | "
                f"{fmt(colo.get('request_goodput') if colo else None, 2)} |")
        mine = _sweep_figures(runs)
        notes = []
        for name, label, whose in (("pd", "1P1D", "1P1D's"),
                                   ("colo2", "two replicas", "two replicas'")):
            ours, theirs = (_shared_rates(runs, list(base[name].values())) if base[name]
                            else (runs, []))
            ratio, kind = _ratio(_sweep_figures(ours), _sweep_figures(theirs))
            mine[f"ratio_to_{name}"], mine[f"ratio_to_{name}_bound"] = ratio, kind
            notes.append(f"{fmt(ratio, 2)}x {whose}{_bound_note(kind, variant, label)}"
                         if ratio is not None else f"no {label} run to compare with")
        section[variant] = mine
        lines += ["", f"{variant}: max goodput {fmt(mine['max_goodput'], 2)} req/s, "
                  f"{' and '.join(notes)} (over the rates both ran).", ""]
    figures["overflow_2k"] = section
    return lines


