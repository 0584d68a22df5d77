"""The timed cases: decode, mixed and prefill steps, and offline throughput."""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.speed.driver import Driver
from benchmarks.speed.limits import prefill_flops, stats_ms
from engine_core.models.spec import ModelSpec


def decode_case(driver: Driver, batch: int, context: int, steps: int, warmup: int,
                weight_bytes: int, kv_token_bytes: int, bandwidth: float | None) -> dict[str, Any]:
    engine = driver.engine
    budget = engine.config.scheduler.max_num_batched_tokens
    # Requests prefilled first decode while the rest prefill: none may finish before the end.
    prefill_steps_bound = 2 * (batch * context // budget + 2)
    new_tokens = warmup + steps + 2 + prefill_steps_bound
    block_size = engine.config.cache.block_size
    need = batch * -(-(context + new_tokens) // block_size)
    result: dict[str, Any] = {"batch": batch, "context": context, "timed_steps": steps}
    if need > engine.num_blocks or batch > engine.config.scheduler.max_num_seqs:
        result["skipped"] = (f"needs {need} KV blocks and {batch} sequences; the engine has "
                             f"{engine.num_blocks} blocks, max_num_seqs "
                             f"{engine.config.scheduler.max_num_seqs}")
        return result
    ids, prefill_steps = driver.start_decoding(batch, context, new_tokens, prefill_steps_bound)
    driver.timed_steps(warmup)
    # A decode step attends to every token of its request, the new one included.
    attended_at_start = sum(r.num_tokens_with_pending for r in engine.scheduler.running)
    step_ms, samples = driver.timed_steps(steps)
    driver.drain(ids)
    forward_ms = [s.ms for s in samples]
    attended = attended_at_start + batch * (steps - 1) / 2  # mean over the timed steps
    kv_bytes = attended * kv_token_bytes
    result.update({
        "mean_context": attended / batch,
        "prefill_steps": prefill_steps,
        "step_ms": stats_ms(step_ms),
        "forward_ms": stats_ms(forward_ms),
        "host_ms_median": statistics.median(step_ms) - statistics.median(forward_ms),
        "graphed_steps": sum(s.graphed for s in samples),
        "padded_batch": samples[-1].num_tokens if samples else None,
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "tokens_per_s": batch / (statistics.median(step_ms) / 1e3),
        "raw_step_ms": step_ms,
        "raw_forward_ms": forward_ms,
    })
    if bandwidth:
        roofline_ms = (weight_bytes + kv_bytes) / bandwidth * 1e3
        result["roofline_ms"] = roofline_ms
        result["step_over_roofline"] = statistics.median(step_ms) / roofline_ms
        result["forward_over_roofline"] = statistics.median(forward_ms) / roofline_ms
    return result


def mixed_case(driver: Driver, batch: int, context: int, prompt_len: int, steps: int,
               warmup: int) -> dict[str, Any]:
    """``batch`` sequences decoding while, before every step, one prompt of ``prompt_len``
    tokens arrives (one output token, so it leaves after its prefill): each timed step is a
    mixed prefill + decode step. Timed like ``decode_case``; then as many decode-only steps
    of the same batch for comparison."""
    engine = driver.engine
    block_size = engine.config.cache.block_size
    budget = engine.config.scheduler.max_num_batched_tokens
    prefill_steps_bound = 2 * (batch * context // budget + 2)
    new_tokens = 2 * (warmup + steps) + 4 + prefill_steps_bound
    need = (batch * -(-(context + new_tokens) // block_size)
            + 2 * -(-(prompt_len + 1) // block_size))
    result: dict[str, Any] = {"batch": batch, "context": context, "prompt_len": prompt_len,
                              "timed_steps": steps}
    if (need > engine.num_blocks or batch + 1 > engine.config.scheduler.max_num_seqs
            or batch + prompt_len > budget):
        result["skipped"] = (f"needs {need} KV blocks, {batch + 1} sequences and "
                             f"{batch + prompt_len} tokens a step")
        return result
    ids, prefill_steps = driver.start_decoding(batch, context, new_tokens, prefill_steps_bound)

    def arrive() -> None:
        driver.add(driver.random_prompt(prompt_len), 1)

    driver.timed_steps(warmup, arrive)
    step_ms, samples = driver.timed_steps(steps, arrive)
    mixed = [s for s in samples if s.num_tokens > batch]  # the forwards that held a prompt
    while len(engine.scheduler.running) > batch or engine.scheduler.waiting:
        engine.step()  # the last prompts leave
    driver.timed_steps(warmup)
    decode_ms, decode_samples = driver.timed_steps(steps)
    driver.drain(ids)
    result.update({
        "prefill_steps": prefill_steps,
        "step_ms": stats_ms(step_ms),
        "forward_ms": stats_ms([s.ms for s in mixed]) if mixed else None,
        "mixed_forwards": len(mixed),
        "graphed_steps": sum(s.graphed for s in samples),
        "decode_only_step_ms": stats_ms(decode_ms),
        "decode_only_graphed_steps": sum(s.graphed for s in decode_samples),
        "raw_step_ms": step_ms,
        "raw_decode_only_step_ms": decode_ms,
    })
    return result


def prefill_case(driver: Driver, length: int, reps: int, spec: ModelSpec,
                 matmul_rate: float | None) -> dict[str, Any]:
    engine = driver.engine
    result: dict[str, Any] = {"tokens": length, "reps": reps}
    if length >= engine.max_model_len or length > engine.config.scheduler.max_num_batched_tokens:
        result["skipped"] = (f"needs max_model_len > {length} and max_num_batched_tokens >= "
                             f"{length}")
        return result
    step_ms: list[float] = []
    forward_ms: list[float] = []
    for rep in range(reps + 1):  # the first is a warm-up
        request_id = driver.add(driver.random_prompt(length), 1)
        elapsed, samples = driver.timed_first_output(request_id)
        driver.run_to_completion()
        if rep:
            step_ms.append(elapsed)
            forward_ms += [s.ms for s in samples]
    flops = prefill_flops(spec, length)
    result.update({"step_ms": stats_ms(step_ms), "forward_ms": stats_ms(forward_ms),
                   "flops": flops, "raw_step_ms": step_ms, "raw_forward_ms": forward_ms})
    step_s = statistics.median(step_ms) / 1e3
    result["achieved_flops_per_s"] = flops["total"] / step_s
    result["forward_flops_per_s"] = flops["total"] / (statistics.median(forward_ms) / 1e3)
    if matmul_rate:
        result["fraction_of_matmul_rate"] = result["achieved_flops_per_s"] / matmul_rate
        result["forward_fraction_of_matmul_rate"] = result["forward_flops_per_s"] / matmul_rate
    return result


def throughput_run(driver: Driver, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    for prompt in prompts:
        driver.add(prompt, output_len)
    steps, tokens = driver.run_to_completion()
    elapsed = time.perf_counter() - t0
    return {"prompts": len(prompts), "output_tokens": tokens, "steps": steps,
            "elapsed_s": elapsed, "output_tokens_per_s": tokens / elapsed,
            "total_tokens_per_s": (tokens + sum(map(len, prompts))) / elapsed}
