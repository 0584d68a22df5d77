"""Where a decode step's GPU time goes: per-kernel times of eager decode steps.

Why: a decode step of a dense model should be a handful of weight-streaming GEMVs; every
extra small kernel costs a few microseconds whether or not it is graphed. This drives an
``EngineCore`` of dummy weights to a pure-decode batch, profiles a few eager steps with
``torch.profiler`` and prints each kernel's calls and GPU time per step (the kernels a graph
replays are the same ones).

    python3 -m experiments.profile_decode --model qwen3-8b --batch 1 --context 1024
    python3 -m experiments.profile_decode --model qwen3-0.6b --out /tmp/profile.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.model_shapes import config_override, write_model_dir
from benchmarks.speed.driver import BenchConfig, Driver, build_engine
from benchmarks.speed.limits import sync


def profile_case(model: str, batch: int, context: int, steps: int,
                 device: str, graphs: bool = False,
                 overrides: dict[str, Any] | None = None,
                 trace: str | None = None) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-profile-"))
    model_dir = write_model_dir(model, workdir / model, **(overrides or {}))
    bench = BenchConfig(device=device, dtype="bfloat16", max_model_len=context + 512,
                        max_num_seqs=max(batch, 8), max_num_batched_tokens=8192,
                        gpu_memory_utilization=0.9)
    engine, _ = build_engine(model_dir, bench, enforce_eager=not graphs)
    try:
        driver = Driver(engine, seed=0)
        ids = [driver.add(driver.random_prompt(context), 64 + steps) for _ in range(batch)]
        while not driver.all_decoding(batch):
            engine.step()
        for _ in range(3):
            engine.step()
        sync(torch.device(engine.device))
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
            sync(torch.device(engine.device))
        driver.drain(ids)
    finally:
        engine.shutdown()
    if trace:
        prof.export_chrome_trace(trace)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        entry = kernels[event.name[:110]]
        entry[0] += 1
        entry[1] += event.device_time_total if hasattr(event, "device_time_total") \
            else event.cuda_time_total
    timeline = gpu_timeline(prof, steps)
    rows = sorted(({"kernel": name, "calls_per_step": calls / steps,
                    "us_per_step": total / steps, "us_per_call": total / max(calls, 1)}
                   for name, (calls, total) in kernels.items()),
                  key=lambda r: -r["us_per_step"])
    return {"model": model, "batch": batch, "context": context, "steps": steps,
            "graphs": graphs, "timeline": timeline,
            "kernels_per_step": sum(r["calls_per_step"] for r in rows),
            "gpu_us_per_step": sum(r["us_per_step"] for r in rows), "kernels": rows}


def gpu_timeline(prof: Any, steps: int) -> dict[str, Any]:
    """The GPU's busy and idle time over the profiled steps, from its events (kernels,
    copies, memsets) in start order: where the GPU waits between two of them, with the
    names on either side (per step: the host's share that async scheduling does not hide,
    and the gaps at graph and copy boundaries)."""
    events = sorted(((e.time_range.start, e.time_range.end, e.name)
                     for e in prof.events()
                     if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA),
                    key=lambda t: t[0])
    if not events:
        return {}
    gaps: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    busy = 0.0
    end = events[0][1]
    prev = events[0][2]
    busy += events[0][1] - events[0][0]
    for start, stop, name in events[1:]:
        if start > end:
            entry = gaps[(prev[:60], name[:60])]
            entry[0] += 1
            entry[1] += start - end
        busy += stop - max(start, end) if stop > end else 0.0
        if stop >= end:
            end, prev = stop, name
    span = end - events[0][0]
    top = sorted(gaps.items(), key=lambda kv: -kv[1][1])[:12]
    return {"span_us_per_step": span / steps, "busy_us_per_step": busy / steps,
            "idle_us_per_step": (span - busy) / steps,
            "gaps": [{"after": a, "before": b, "per_step": n / steps, "us_per_step": t / steps}
                     for (a, b), (n, t) in top]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="shape name (repeatable)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--graphs", action="store_true",
                        help="CUDA graphs as the engine runs them (default: eager steps)")
    parser.add_argument("--override", action="append", default=[], type=config_override,
                        metavar="KEY=JSON", help="replace a config key of every --model")
    parser.add_argument("--out", default=None)
    parser.add_argument("--trace", default=None,
                        help="write the first model's Chrome trace (host and GPU) here")
    args = parser.parse_args(argv)
    results = [profile_case(m, args.batch, args.context, args.steps, args.device, args.graphs,
                            dict(args.override), args.trace if i == 0 else None)
               for i, m in enumerate(args.model or ["qwen3-8b"])]
    for case in results:
        print(f"== {case['model']} b{case['batch']} ctx{case['context']}: "
              f"{case['kernels_per_step']:.0f} kernels, {case['gpu_us_per_step']:.0f} us GPU/step")
        line = case["timeline"]
        if line:
            print(f"   GPU span {line['span_us_per_step']:.1f} us/step, busy "
                  f"{line['busy_us_per_step']:.1f}, idle {line['idle_us_per_step']:.1f}; gaps:")
            for gap in line["gaps"]:
                print(f"   {gap['us_per_step']:7.2f} us/step ({gap['per_step']:.1f}x) "
                      f"{gap['after']} -> {gap['before']}")
        for row in case["kernels"][:25]:
            print(f"{row['us_per_step']:9.1f} us {row['calls_per_step']:6.1f} x "
                  f"{row['us_per_call']:7.2f} us  {row['kernel']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
