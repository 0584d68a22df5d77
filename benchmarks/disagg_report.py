"""The disaggregation report (issue #7) in one go: launch, benchmark, summarise.

On two GPUs with dummy Qwen3-8B weights (the default):

    source .device/env.sh && python3 -m benchmarks.disagg_report --gpus 0,1 \\
        --results-dir results/disagg_report

It writes a config-only Qwen3-8B directory (word-level tokenizer over the whole
vocabulary), launches each topology once with ``pdserve launch`` (one colocated worker,
1P1D, two colocated replicas behind the proxy, caching on and off), runs ``bench serve``
for every experiment, and saves ``raw/<run>.json``, PNGs, ``summary.md`` (printed) and
``summary.json`` under ``--results-dir``. Finished runs are skipped when it is started again,
so ``--only EXPERIMENT`` pieces (or a rerun after an interruption) add up to one report;
``--summary-only`` rebuilds the summary from what is saved. ``--smoke`` runs everything at
tiny scale on CPU with the demo model.

Extra experiments run only when named in ``--only`` (benchmarks/disagg/plan.py describes
them): kv_offload, prefix_affinity, overflow_2k and goodput_2k_2p1d. goodput_2k_2p1d needs
three GPUs: 2P1D (prefills round robin over two P workers) against three colocated replicas
behind the proxy, at goodput_2k's rates with goodput_2k's prompts at each rate. On a 4-GPU
machine, with goodput_2k's runs in the same directory for the per-GPU comparison (give both
the same ``--rates-2k``, ``--point-seconds`` and ``--seed``):

    python3 -m benchmarks.disagg_report --gpus 0,1,2,3 --only goodput_2k,goodput_2k_2p1d \\
        --rates-2k 4,8,12,16 --point-seconds 15 --results-dir results/disagg_report/2p1d

Workers get the ``--gpus`` ids in order, one each (2P1D: P, P, D), so a topology needs as
many ids as it has workers. An experiment named in ``--only`` none of whose topologies fit
the given GPUs is refused before anything starts; a topology too big for them among others
that fit is left for a bigger machine and listed in the summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from benchmarks.disagg.cluster import ClusterSpec
from benchmarks.disagg.execute import ExecuteOptions, PlanOutcome, run_plan
from benchmarks.disagg.plan import (
    ALL_EXPERIMENTS,
    EXPERIMENTS,
    EXTRA_EXPERIMENTS,
    GPU_SCALE,
    SMOKE_SCALE,
    Scale,
    Sweep,
    TopologyPlan,
    build_plan,
)
from benchmarks.disagg.summary import build_summary, load_results, make_plots
from benchmarks.model_shapes import SHAPES, write_model_dir
from benchmarks.output import RESULTS_ROOT
from benchmarks.serve.config import parse_rates

logger = logging.getLogger("pdserve.report")
REPO_ROOT = Path(__file__).resolve().parent.parent


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model and devices")
    model.add_argument("--model", default=None,
                       help="checkpoint or config-only directory (default: --shape's, written "
                            "under --results-dir; the demo model with --smoke)")
    model.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b",
                       help="published shape for the config-only directory (dummy weights)")
    model.add_argument("--load-format", default=None,
                       help="engine --load-format (default: dummy for --shape, else auto)")
    model.add_argument("--dtype", default=None, help="engine --dtype (default: bfloat16 on GPU)")
    model.add_argument("--max-model-len", type=int, default=None,
                       help="engine --max-model-len (default 10240 on GPU: 8k prompts + 256)")
    model.add_argument("--served-model-name", default=None)
    model.add_argument("--gpus", default=None,
                       help="comma-separated GPU ids, one per worker, taken in order (default "
                            "0,1; none with --smoke; goodput_2k_2p1d needs three)")
    model.add_argument("--engine-args", default="",
                       help="more engine flags for every worker, e.g. '--max-num-seqs 128'")
    model.add_argument("--startup-timeout", type=float, default=900.0,
                       help="seconds for a topology to come up")
    run = parser.add_argument_group("what to run")
    run.add_argument("--smoke", action="store_true",
                     help="tiny counts on CPU with the demo model (checks the pipeline)")
    run.add_argument("--only", default=None,
                     help=f"comma-separated experiments (default {','.join(EXPERIMENTS)}); "
                          f"extras, run only when named: {','.join(EXTRA_EXPERIMENTS)} "
                          "(goodput_2k_2p1d: 2P1D vs three colocated replicas at goodput_2k's "
                          "points, three GPUs)")
    run.add_argument("--results-dir", default=None,
                     help="default results/disagg_report (smoke: a temp dir)")
    run.add_argument("--force", action="store_true", help="rerun runs that have results")
    run.add_argument("--summary-only", action="store_true",
                     help="rebuild summary and plots from saved results")
    run.add_argument("--time-budget", type=float, default=None,
                     help="seconds: start no topology or run that would end later (exit 3: "
                          "run the same command again to continue)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--slo-ttft-ms", type=float, default=None, help="default 1000")
    run.add_argument("--slo-tpot-ms", type=float, default=None, help="default 40")
    run.add_argument("--rates-2k", type=parse_rates, default=None,
                     help="goodput_2k sweep, also overflow_2k's and goodput_2k_2p1d's "
                          "(default 2,4,6,8,12,16)")
    run.add_argument("--rates-8k", type=parse_rates, default=None,
                     help="goodput_8k sweep (default 0.5,1,1.5,2,3)")
    run.add_argument("--prefill-overflow", type=int, default=None, metavar="N",
                     help="overflow_2k: the proxy's --prefill-overflow (default 8)")
    run.add_argument("--point-seconds", type=float, default=None,
                     help="seconds of traffic per sweep point (default 20)")
    run.add_argument("--low-load-prompts", type=int, default=None,
                     help="requests per ttft_overhead setup (default 60)")
    run.add_argument("--disable-tqdm", action="store_true")


def _scale(args: argparse.Namespace) -> Scale:
    scale = SMOKE_SCALE if args.smoke else GPU_SCALE
    changes: dict = {}
    if args.slo_ttft_ms is not None:
        changes["slo_ttft_ms"] = args.slo_ttft_ms
    if args.slo_tpot_ms is not None:
        changes["slo_tpot_ms"] = args.slo_tpot_ms
    if args.rates_2k:
        changes["sweep_2k"] = Sweep(scale.sweep_2k.input_len, scale.sweep_2k.output_len,
                                    args.rates_2k)
    if args.rates_8k:
        changes["sweep_8k"] = Sweep(scale.sweep_8k.input_len, scale.sweep_8k.output_len,
                                    args.rates_8k)
    if args.point_seconds is not None:
        changes["point_seconds"] = args.point_seconds
    if args.prefill_overflow is not None:
        changes["prefill_overflow"] = args.prefill_overflow
    if args.low_load_prompts is not None:
        changes["low_load_prompts"] = args.low_load_prompts
    return dataclasses.replace(scale, **changes)


def _model(args: argparse.Namespace, results_dir: Path) -> tuple[str, bool]:
    """(model directory, whether it is a config-only shape directory)."""
    if args.model:
        return args.model, False
    if args.smoke:
        from engine_core.demo_model import random_demo_model_path

        return str(random_demo_model_path()), False
    path = results_dir / f"model-{args.shape}"
    if not (path / "config.json").is_file():
        write_model_dir(args.shape, path, tokenizer="words")
    return str(path), True


def _engine_args(args: argparse.Namespace, shape_dir: bool) -> tuple[str, ...]:
    gpu = not args.smoke
    load_format = args.load_format or ("dummy" if shape_dir else None)
    dtype = args.dtype or ("bfloat16" if gpu else None)
    max_model_len = args.max_model_len or (10240 if gpu else 1024)
    out = ["--max-model-len", str(max_model_len)]
    if load_format:
        out += ["--load-format", load_format]
    if dtype:
        out += ["--dtype", dtype]
    return (*out, *shlex.split(args.engine_args))


def _run(command: list[str]) -> str | None:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30,
                              cwd=REPO_ROOT).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _commit() -> str | None:
    """HEAD, marked ``+dirty`` when tracked files differ from it (the code that ran is then
    not the commit's: a device copy of a working tree can carry an older .git)."""
    head = _run(["git", "rev-parse", "--short", "HEAD"])
    if head and _run(["git", "status", "--porcelain", "--untracked-files=no"]):
        return head + "+dirty"
    return head


def environment(spec: ClusterSpec, smoke: bool) -> dict:
    """Device, software and command of this report."""
    import torch

    gpus = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                 "--format=csv,noheader"])
    return {
        "date": datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "devices": gpus.splitlines() if gpus else [f"CPU: {platform.processor() or 'unknown'}"],
        "gpus_used": list(spec.gpus), "git_commit": _commit(),
        "model": spec.model, "served_model_name": spec.served_model_name,
        "engine_args": list(spec.engine_args), "smoke": smoke,
        "command": " ".join(shlex.quote(a) for a in ["python3", "-m", "benchmarks.disagg_report",
                                                     *sys.argv[1:]]),
    }


def provenance(env: dict) -> dict:
    """What each run stores of the environment: a report assembled over several invocations
    (``--only`` pieces, machines of different sizes) still says where each figure came from."""
    return {key: env[key] for key in ("date", "devices", "gpus_used", "git_commit", "torch")}


def _where(result: dict | None) -> str:
    """A raw run's provenance as list-item text (empty for runs saved before it was kept)."""
    where = (result or {}).get("provenance")
    if not where:
        return ""
    devices = "; ".join(where.get("devices") or [])
    return (f": {where.get('date')}, commit {where.get('git_commit')}, GPUs "
            f"{','.join(where.get('gpus_used') or []) or 'none'} of {devices}")


def _header(env: dict, scale: Scale) -> list[str]:
    lines = ["# pdserve disaggregation report", "",
             f"- date: {env['date']}; devices: {'; '.join(env['devices'])}; GPUs used: "
             f"{','.join(env['gpus_used']) or 'none (CPU)'}",
             f"- model: `{env['model']}` ({env['served_model_name']}); engine flags: "
             f"`{' '.join(env['engine_args'])}`",
             f"- software: python {env['python']}, torch {env['torch']} (CUDA {env['cuda']}), "
             f"commit {env['git_commit']}",
             f"- command: `{env['command']}`",
             *([f"- summary rebuilt by: `{env['summary_command']}`"]
               if env.get("summary_command") else []),
             f"- SLOs: TTFT <= {scale.slo_ttft_ms:g} ms, TPOT <= {scale.slo_tpot_ms:g} ms; "
             "every request uses ignore_eos; percentiles are of per-request values", ""]
    if env["smoke"]:
        lines += ["> Smoke run on CPU with the demo model and tiny counts: it checks the "
                  "pipeline; the numbers mean nothing.", ""]
    return lines


def gpu_shortfall(scale: Scale, experiments: tuple[str, ...], named: bool, seed: int,
                  gpus: tuple[str, ...]) -> tuple[str | None, list[TopologyPlan]]:
    """Whether the plan fits ``gpus`` (one per worker; empty: CPU, anything fits): the text
    refusing the invocation when an experiment named in ``--only`` (``named``) has no
    topology that fits (None when each has one), and the topologies too big for them."""
    if not gpus:
        return None, []
    refusals = []
    for experiment in experiments:
        plan = build_plan(scale, (experiment,), seed)
        if named and plan and all(p.topology.num_workers > len(gpus) for p in plan):
            sizes = ", ".join(f"{p.topology.name}: {p.topology.num_workers} workers"
                              for p in plan)
            need = min(p.topology.num_workers for p in plan)
            refusals.append(f"{experiment} needs {need} GPUs, one per worker ({sizes})")
    short = [p for p in build_plan(scale, experiments, seed)
             if p.topology.num_workers > len(gpus)]
    if not refusals:
        return None, short
    need = max(p.topology.num_workers for p in short)
    return (f"--gpus {','.join(gpus)} gives {len(gpus)} GPUs: {'; '.join(refusals)}. Pass "
            f"at least {need} GPU ids, e.g. --gpus {','.join(str(i) for i in range(need))}, "
            "or leave those experiments out of --only."), short


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.disagg_report",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    experiments = (EXPERIMENTS if args.only is None
                   else tuple(e.strip() for e in args.only.split(",") if e.strip()))
    unknown = sorted(set(experiments) - set(ALL_EXPERIMENTS))
    if unknown:
        parser.error(f"--only: unknown {unknown}; choose from {ALL_EXPERIMENTS}")
    gpus = args.gpus if args.gpus is not None else ("" if args.smoke else "0,1")
    gpu_ids = tuple(g.strip() for g in gpus.split(",") if g.strip())
    scale = _scale(args)
    if not args.summary_only:
        # Before anything starts: a run that cannot get a GPU per worker is not begun.
        refusal, short = gpu_shortfall(scale, experiments, args.only is not None, args.seed,
                                       gpu_ids)
        if refusal:
            parser.error(refusal)
        for item in short:
            logger.warning("%s needs %d GPUs, --gpus gives %d: its runs are left for a "
                           "bigger machine", item.topology.name, item.topology.num_workers,
                           len(gpu_ids))
    results_dir = Path(args.results_dir or (Path(tempfile.gettempdir()) / "pdserve-report-smoke"
                                            if args.smoke else RESULTS_ROOT / "disagg_report"))
    results_dir.mkdir(parents=True, exist_ok=True)
    model, shape_dir = _model(args, results_dir)
    served = args.served_model_name or ("pdserve-demo-random" if args.smoke
                                        else Path(model).name)
    spec = ClusterSpec(model=model, served_model_name=served,
                       engine_args=_engine_args(args, shape_dir), gpus=gpu_ids,
                       log_dir=results_dir / "logs", startup_timeout_s=args.startup_timeout,
                       kv_cache_bytes=scale.kv_cache_bytes)
    outcome = PlanOutcome([], [])
    env = environment(spec, args.smoke)
    env_path = results_dir / "env.json"
    if args.summary_only and env_path.is_file():
        # The runs' machine, not this one: only the summary is made here.
        env = {**json.loads(env_path.read_text()), "summary_command": env["command"]}
    if not args.summary_only:
        plan = build_plan(scale, experiments, args.seed)
        deadline = None if args.time_budget is None else time.monotonic() + args.time_budget
        options = ExecuteOptions(results_dir=results_dir, spec=spec, tokenizer_path=model,
                                 scale=scale, force=args.force, disable_tqdm=args.disable_tqdm,
                                 deadline=deadline, provenance=provenance(env))
        outcome = run_plan(plan, options)
    problems = outcome.problems
    env_path.write_text(json.dumps(env, indent=2))
    results = load_results(results_dir / "raw")
    markdown, figures = build_summary(results, _header(env, scale),
                                      {"ttft": scale.slo_ttft_ms, "tpot": scale.slo_tpot_ms})
    plots = make_plots(results, results_dir)
    markdown += "\n## Files\n\n" + "\n".join(
        [f"- `{p.relative_to(results_dir)}`" for p in plots]
        + [f"- `{p.relative_to(results_dir)}`{_where(results.get(p.stem))}"
           for p in sorted((results_dir / "raw").glob("*.json"))]) + "\n"
    if problems:
        markdown += "\n## Problems\n\n" + "\n".join(f"- {p}" for p in problems) + "\n"
    if outcome.left:
        markdown += (f"\n## Not run yet (time budget)\n\n{len(outcome.left)} runs left: "
                     f"{', '.join(outcome.left)}. Run the same command again to continue.\n")
    if outcome.need_gpus:
        markdown += (f"\n## Not run yet (more GPUs needed)\n\n{len(outcome.need_gpus)} runs "
                     f"need more GPUs than `--gpus {','.join(spec.gpus)}`: "
                     f"{', '.join(outcome.need_gpus)}. Run again with enough GPUs and the "
                     "same `--results-dir` to add them.\n")
    (results_dir / "summary.md").write_text(markdown)
    (results_dir / "summary.json").write_text(json.dumps(
        {"environment": env, "figures": figures, "problems": problems, "left": outcome.left,
         "need_gpus": outcome.need_gpus}, indent=2))
    print(markdown, flush=True)
    print(f"results in {results_dir}", flush=True)
    return 1 if problems else (3 if outcome.left or outcome.need_gpus else 0)


if __name__ == "__main__":
    sys.exit(main())
