"""What an engine's ``StepRates`` read under a serving-like load (GPU; no cluster).

The lane planner and the placement predictions take the prefill rates from the heartbeat:
the marginal rate of mixed steps (``prefill_tokens_per_s``) and the rate of steps without
decodes (``prefill_alone_tokens_per_s``). This drives one engine of dummy weights with a
decode-step target the way a placed worker runs (``pdserve launch`` gives it ``tpot_headroom
x --slo-tpot-ms``) and prints what the rates read, next to rates timed here directly:

1. prompts alone: ``--alone`` prompts of ``--prompt`` tokens, one after another, timed as a
   whole (a prefill-lane worker's rate);
2. serving: a request of ``--prompt`` / ``--output`` tokens arrives every ``1 / --rate`` s of
   wall time for ``--seconds``; every second the rates are printed.

    python3 -m experiments.step_rates_probe --model qwen3-8b --target-ms 9 --rate 8
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.model_shapes import write_model_dir
from benchmarks.speed.driver import SMOKE_OVERRIDES, BenchConfig, Driver, build_engine


def rates_row(engine) -> dict[str, float]:
    """What the worker's heartbeat would carry now (``engine.get_stats()``)."""
    stats = engine.get_stats()
    return {"prefill_tokens_per_s": round(stats.prefill_tokens_per_s),
            "prefill_alone_tokens_per_s": round(stats.prefill_alone_tokens_per_s),
            "decode_step_ms": round(stats.decode_step_s * 1e3, 3),
            "decode_base_ms": round(stats.decode_base_s * 1e3, 3),
            "decode_per_row_us": round(stats.decode_per_row_s * 1e6, 2),
            "hidden_ms": round(stats.decode_hidden_s * 1e3, 3),
            "decoding": stats.num_decoding, "waiting": stats.num_waiting}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--target-ms", type=float, default=9.0)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--alone", type=int, default=8)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp())
    model_dir = write_model_dir(args.model, workdir / args.model,
                                **(SMOKE_OVERRIDES if args.smoke else {}))
    bench = BenchConfig(device=args.device, dtype="bfloat16", max_model_len=args.prompt + args.output
                        + 64, max_num_seqs=256, max_num_batched_tokens=8192,
                        gpu_memory_utilization=0.9, decode_step_target_s=args.target_ms / 1e3)
    engine, _ = build_engine(model_dir, bench)
    driver = Driver(engine, seed=0)
    result: dict[str, object] = {"args": vars(args)}

    driver.add(driver.random_prompt(args.prompt), 1)  # warm-up
    driver.run_to_completion()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.alone):
        driver.add(driver.random_prompt(args.prompt), 1)
        driver.run_to_completion()
    sync()
    timed = args.alone * args.prompt / (time.perf_counter() - t0)
    result["alone_timed_tokens_per_s"] = round(timed)
    result["after_alone"] = rates_row(engine)
    print(json.dumps({"alone_timed_tokens_per_s": round(timed), **rates_row(engine)}))

    # Each step's device time as the rates see it: mixed steps against the target.
    mixed_ms: list[float] = []
    observe = engine.scheduler.step_rates.observe

    def recording(seconds: float, num_prefill_tokens: int, num_decodes: int) -> None:
        if num_prefill_tokens and num_decodes:
            mixed_ms.append(seconds * 1e3)
        observe(seconds, num_prefill_tokens, num_decodes)

    engine.scheduler.step_rates.observe = recording  # type: ignore[method-assign]
    rows = []
    start = time.perf_counter()
    next_arrival, next_print = start, start + 1.0
    while (now := time.perf_counter()) < start + args.seconds:
        while next_arrival <= now:
            driver.add(driver.random_prompt(args.prompt), args.output)
            next_arrival += 1.0 / args.rate
        engine.step()
        if now >= next_print:
            window = sorted(mixed_ms)
            mixed_ms.clear()
            row = {"t": round(now - start, 1), **rates_row(engine),
                   "mixed_steps": len(window),
                   "mixed_ms_p50_p90_max": [round(window[int(q * (len(window) - 1))], 2)
                                            for q in (0.5, 0.9, 1.0)] if window else []}
            rows.append(row)
            print(json.dumps(row))
            next_print += 1.0
    result["serving"] = rows
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
