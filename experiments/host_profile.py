"""Where the host's time goes in engine steps that run eagerly (mixed prefill + decode).

Why: a step that is not replayed from a CUDA graph launches every kernel from Python, and
when that costs more than the GPU's work the GPU waits. This runs ``--steps`` mixed steps
(a decoding batch plus one new short prompt arriving before each step, as in
``engine_speed``'s ``mixed`` part) under ``cProfile`` and writes the functions that take
the host's time, by own time and by cumulative time, plus the wall time of each step.

    python3 -m experiments.host_profile --model qwen3-8b --out /tmp/host_profile.json
    python3 -m experiments.host_profile --smoke --out /tmp/hp.json   # tiny shapes, any device
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.model_shapes import write_model_dir
from benchmarks.speed.driver import SMOKE_OVERRIDES, BenchConfig, Driver, build_engine


def top_functions(stats: pstats.Stats, key: str, count: int) -> list[dict[str, Any]]:
    """The ``count`` functions with the most ``key`` time ('tottime' or 'cumtime')."""
    rows = []
    for (path, line, name), (_, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(path).name}:{line}({name})", "calls": calls,
                     "tottime_s": own, "cumtime_s": cum})
    rows.sort(key=lambda r: r["tottime_s" if key == "tottime" else "cumtime_s"], reverse=True)
    return rows[:count]


def profile_mixed_steps(driver: Driver, batch: int, context: int, prompt_len: int,
                        steps: int, warmup: int, top: int) -> dict[str, Any]:
    """Profile ``steps`` mixed steps after ``warmup`` untimed ones."""
    engine = driver.engine
    ids, _ = driver.start_decoding(batch, context, 4 * (steps + warmup) + 64, 64)

    def arrive() -> None:
        driver.add(driver.random_prompt(prompt_len), 1)

    driver.timed_steps(warmup, arrive)
    profiler = cProfile.Profile()
    step_ms = []
    device = torch.device(engine.device)
    for _ in range(steps):
        arrive()
        t0 = time.perf_counter()
        profiler.enable()
        engine.step()
        profiler.disable()
        step_ms.append((time.perf_counter() - t0) * 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    driver.drain(ids)
    stats = pstats.Stats(profiler)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return {"batch": batch, "context": context, "prompt_len": prompt_len, "steps": steps,
            "step_ms_median": statistics.median(step_ms), "raw_step_ms": step_ms,
            "top_tottime": top_functions(stats, "tottime", top),
            "top_cumtime": top_functions(stats, "cumtime", top),
            "pstats_text": text.getvalue()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--cuda-graph-mode", default="full_decode_only",
                        help="the engine flag; the default leaves mixed steps eager (the path "
                             "steps with connector layer hooks take), full replays them")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few steps")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.context, args.prompt_len, args.steps, args.warmup = 2, 32, 8, 3, 1
        if args.device == "cpu":
            args.dtype = "float32"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-host-profile-"))
    model_dir = write_model_dir(args.model, workdir / args.model,
                                **(SMOKE_OVERRIDES if args.smoke else {}))
    bench = BenchConfig(device=args.device, dtype=args.dtype, max_model_len=4096,
                        max_num_seqs=max(64, args.batch + 2), max_num_batched_tokens=2048,
                        gpu_memory_utilization=0.85, triton_gemv_max_rows=None,
                        async_scheduling=True, cuda_graph_mode=args.cuda_graph_mode)
    engine, startup_s = build_engine(model_dir, bench, args.enforce_eager)
    try:
        result = profile_mixed_steps(Driver(engine, 0), args.batch, args.context,
                                     args.prompt_len, args.steps, args.warmup, args.top)
    finally:
        engine.shutdown()
    result.update({"model": args.model, "device": args.device, "startup_s": startup_s,
                   "enforce_eager": args.enforce_eager, "cuda_graph_mode": args.cuda_graph_mode})
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(result["pstats_text"])
    print(f"mixed step median {result['step_ms_median']:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
