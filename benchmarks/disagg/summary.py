"""The report's markdown summary, key figures and plots, from the saved per-run JSON.

Differences of percentiles (1P1D p99 minus colocated p99) compare two distributions; they
are not percentiles of per-request differences. "Max goodput" is the highest goodput seen
over a sweep; "rate at 90% SLO" is the highest swept rate at which at least 90% of the
requests met both SLOs.

The goodput sections are in ``benchmarks/disagg/goodput.py``.

Only runs made on one device model are compared: where an experiment's runs come from
different GPU models (a report resumed on another machine and stopped by its time budget),
the runs of other models than its newest run's are set aside and listed.
"""
from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from benchmarks.disagg.cells import (
    ATTAINMENT_TARGET,
    GOALS,
    Results,
    device_models,
    difference,
    fmt,
    goal_verdict,
)
from benchmarks.disagg.goodput import GOODPUT_SIDES, goodput, goodput_2p1d, prefill_overflow, sweep
from benchmarks.serve.breakdown import STAGES
from benchmarks.serve.plots import plot_latency_cdfs, plot_vs_rate


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
        lines.append(f"| {r['label']} | {fmt(r['p50_ttft_ms'])} | {fmt(r['p99_ttft_ms'])} | "
                     f"{fmt(r['mean_ttft_ms'])} | {fmt(r['p50_tpot_ms'])} | "
                     f"{fmt(r['p99_tpot_ms'])} | {r['completed']} | {r['failed']} |")
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
        p50 = difference(pd["p50_ttft_ms"], results[base]["p50_ttft_ms"])
        p99 = difference(pd["p99_ttft_ms"], results[base]["p99_ttft_ms"])
        key = prefix + ("vs_direct" if base.endswith("direct") else "vs_proxy")
        section[key] = {"p50_ms": p50, "p99_ms": p99}
        lines += ["", f"{legend} minus {what}: p50 **{fmt(p50, 2)} ms** "
                  f"(goal <= {GOALS['ttft_overhead_p50_ms']:g}: "
                  f"{goal_verdict(p50, GOALS['ttft_overhead_p50_ms'])}), p99 **{fmt(p99, 2)} ms** "
                  f"(goal <= {GOALS['ttft_overhead_p99_ms']:g}: "
                  f"{goal_verdict(p99, GOALS['ttft_overhead_p99_ms'])})."]
    figures["ttft_overhead"] = section
    lines += _breakdown_table(results, names)
    return lines + [""]


def _hit_rates(result: Mapping[str, Any]) -> str:
    parts = []
    for w in result.get("scraped", {}).get("workers", []):
        if w["prefix_cache_queries"] > 0:
            parts.append(f"{w['role']} {w['prefix_cache_hits'] / w['prefix_cache_queries']:.1%}")
    return ", ".join(parts) or "n/a"


def _latency_cells(result: Mapping[str, Any]) -> str:
    """The p50/p99/mean TTFT and p50 E2EL cells of a table row (ms)."""
    return (f"{fmt(result['p50_ttft_ms'])} | {fmt(result['p99_ttft_ms'])} | "
            f"{fmt(result['mean_ttft_ms'])} | {fmt(result['p50_e2el_ms'])} |")


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
                     f"{fmt(r.get('prefix_cache_hit_rate'), 3)} | {_latency_cells(r)}")
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
        lines.append(f"| {label} | {fmt(r['request_throughput'])} | "
                     f"{fmt(r['p50_ttft_ms'], 2)} | {fmt(r['p99_ttft_ms'], 2)} | "
                     f"{fmt(r['p50_e2el_ms'], 2)} | {fmt(r['p99_e2el_ms'], 2)} | "
                     f"{r['failed']} |")
    section: dict[str, Any] = {}
    if mixed is not None and "interleaved" in mixed:
        base, other = mixed["interleaved"]["base"], mixed["interleaved"]["interleaved"]
        added = {"ttft_p50_added_ms": difference(other["p50_ttft_ms"], base["p50_ttft_ms"]),
                 "ttft_p99_added_ms": difference(other["p99_ttft_ms"], base["p99_ttft_ms"]),
                 "e2el_p50_added_ms": difference(other["p50_e2el_ms"], base["p50_e2el_ms"])}
        section["interleaved"] = added
        lines += ["", f"Added by the proxy, interleaved A/B (one run at "
                  f"{mixed['request_rate']} req/s, even requests to the worker, odd ones "
                  f"through the proxy): p50 TTFT **{fmt(added['ttft_p50_added_ms'], 2)} ms** "
                  f"(goal <= {goal:g}: {goal_verdict(added['ttft_p50_added_ms'], goal)}), p99 TTFT "
                  f"{fmt(added['ttft_p99_added_ms'], 2)} ms, p50 E2EL "
                  f"{fmt(added['e2el_p50_added_ms'], 2)} ms."]
    if direct is not None and proxied is not None:
        section["ttft_p50_added_ms"] = difference(proxied["p50_ttft_ms"], direct["p50_ttft_ms"])
        section["ttft_p99_added_ms"] = difference(proxied["p99_ttft_ms"], direct["p99_ttft_ms"])
        section["e2el_p50_added_ms"] = difference(proxied["p50_e2el_ms"], direct["p50_e2el_ms"])
        verdict = "" if "interleaved" in section else (
            f" (goal <= {goal:g}: {goal_verdict(section['ttft_p50_added_ms'], goal)})")
        lines += ["", f"Separate runs (the same prompts, direct then through the proxy, offered "
                  f"{proxied['request_rate']} req/s): p50 TTFT "
                  f"{fmt(section['ttft_p50_added_ms'], 2)} ms{verdict}, p99 TTFT "
                  f"{fmt(section['ttft_p99_added_ms'], 2)} ms, p50 E2EL "
                  f"{fmt(section['e2el_p50_added_ms'], 2)} ms. This difference also carries the "
                  "worker's drift between the runs: the p50 TTFT of each tenth of a run spans "
                  f"{_span(direct)} ms direct and {_span(proxied)} ms through the proxy."]
    owns = [(r or {}).get("scraped", {}).get("proxy", {}).get("overhead") for r in (mixed, proxied)]
    own = next((o for o in owns if o), None)
    if own:
        section["own_overhead_ms"] = own
        lines += [f"The proxy's own time per request (`pdserve:proxy_overhead_seconds`: a "
                  f"request's total time in the proxy minus its time waiting on workers, "
                  f"bucket-interpolated): mean {fmt(own['mean_ms'], 3)} ms, p50 "
                  f"{fmt(own['p50_ms'], 3)} ms, p99 {fmt(own['p99_ms'], 3)} ms."]
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
        sweeps = {side.label: sweep(results, experiment, side.key) for side in sides}
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

