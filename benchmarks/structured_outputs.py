"""Decode step time with a JSON-schema grammar against the same batch without one.

Qwen3-8B shapes with dummy weights (``benchmarks/model_shapes.py``). The tokenizer is
``--tokenizer bytes`` (default): a synthetic byte-level vocabulary of the model's 151,936 ids,
so masks and grammar advances cost what they cost with a real vocabulary; ``demo`` (1,000
entries, 150,936 empty ids) makes every advance scan those ids (xgrammar's special tokens)
and most masks trivial. For each batch size, B requests run to decode; the median of the
steps in which all B decode is taken, with every request unconstrained, then with every
request under one JSON schema (the masks filled on a host thread while the step's forward
runs, copied once, applied in the sampler). Writes JSON where ``--out`` says.

``--breakdown`` runs each case once more with timers and reports, per case, medians in ms
of: the step (wall); the device's parts: the forward, the mask copy, the sampling (the
apply included), how long the device sat between the step's logits and its sampling work
(``device_wait``: the host still busy, when positive), and the step less those
(``device_idle``: the device waiting for the host anywhere); the host's parts on the
engine's thread: ``schedule``, ``launch`` (inputs and the forward's queueing),
``collect`` (mostly waiting for the step before's tokens), ``update`` (the grammars advance
there), ``fill_wait`` (waiting for the masks before queueing the sampling) and
``sample_queue`` (queueing the copy and the sampling), and ``host`` (the step less
``collect`` and ``fill_wait``: the engine thread's own work, which must stay under the
device's step); the mask ``fill`` on its thread (until the thread has the GIL back); the apply alone on ``[batch, vocab]``
logits, and how many masked steps kept async scheduling's overlap.
``--no-async-scheduling`` measures one-step-at-a-time stepping for comparison.

    python3 -m benchmarks.structured_outputs --out /tmp/so.json              # GPU
    python3 -m benchmarks.structured_outputs --breakdown --out /tmp/so.json  # GPU, attributed
    python3 -m benchmarks.structured_outputs --smoke --breakdown --out /tmp/so-smoke.json  # CPU

``benchmarks/grammar_host_path.py`` times the host's share alone (advance, fill, scheduled
steps with a scripted runner) on any CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.model_shapes import write_model_dir
from engine_core.grammar.bitmask import apply_bitmask, num_words
from engine_core.llm import LLM
from engine_core.messages import AddRequest
from engine_core.sampling_params import SamplingParams
from engine_core.structured_outputs import StructuredOutputsParams
from engine_core.worker.forward_timer import ForwardTimer
from engine_core.worker.grammar_mask import SampleTimer

# A grammar that stays open for many tokens: an object holding a list of at least 8
# strings. Random logits over a full vocabulary pick a quote about once in 100 tokens; without
# the minimum, a quarter of the requests would close an empty list within 10 steps.
SCHEMA = {"type": "object", "properties": {"notes": {"type": "array",
                                                     "items": {"type": "string"},
                                                     "minItems": 8}},
          "required": ["notes"]}
PROMPT = list(range(10, 42))  # 32 token ids (byte pieces of either tokenizer)


def step_times(llm: LLM, batch: int, constrained: bool, num_steps: int) -> list[float]:
    """Seconds of each engine step in which all ``batch`` requests decode."""
    engine = llm.engine
    params = SamplingParams(temperature=1.0, max_tokens=num_steps + 8, ignore_eos=True,
                            structured_outputs=(StructuredOutputsParams(json=SCHEMA)
                                                if constrained else None))
    ids = [f"{'so' if constrained else 'plain'}-{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(AddRequest(request_id, PROMPT, params.to_dict(), time.monotonic()))
    times: list[float] = []
    while engine.has_work():
        decoding = (len(engine.scheduler.running) == batch and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running))
        started = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - started)
        if len(times) >= num_steps:
            engine.abort_requests(ids)
    while engine.has_work():
        engine.step()
    return times


# Engine-thread phases the breakdown times: (attribute path, name).
HOST_PHASES = (("scheduler.schedule", "schedule_ms"), ("runner.launch", "launch_ms"),
               ("runner.collect", "collect_ms"), ("scheduler.update_from_output", "update_ms"),
               ("masked_sampling.finish", "finish_ms"))


def _time_calls(owner: Any, name: str, into: list[float]) -> None:
    """Time every call of ``owner.name`` into ``into`` (ms), until the attribute is deleted."""
    method = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            into.append((time.perf_counter() - started) * 1e3)

    setattr(owner, name, timed)


def breakdown(llm: LLM, batch: int, constrained: bool, num_steps: int) -> dict[str, Any]:
    """One more run of a case with timers: medians in ms (see the module docstring) and the
    masked steps that overlapped the step before."""
    engine = llm.engine
    runner = engine.runner
    runner.forward_timer = ForwardTimer(runner.device)
    runner.sample_timer = SampleTimer(runner.device)
    before = (engine.masked_steps.total, engine.masked_steps.overlapped)
    owners = {"scheduler": engine.scheduler, "runner": runner,
              "masked_sampling": engine.masked_sampling}
    host: dict[str, list[float]] = {key: [] for _, key in HOST_PHASES}
    for path, key in HOST_PHASES:
        owner_name, name = path.split(".")
        _time_calls(owners[owner_name], name, host[key])
    try:
        steps = step_times(llm, batch, constrained, num_steps)
        forwards = runner.forward_timer.collect()
        samples = [t for t in runner.sample_timer.collect() if t.masked == constrained]
    finally:
        runner.forward_timer = runner.sample_timer = None
        for path, _ in HOST_PHASES:  # the classes' methods again
            owner_name, name = path.split(".")
            delattr(owners[owner_name], name)

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    # Only the steps where all requests decode are in ``steps``; the phases are medians of
    # every call (the few prefill and tail steps barely move them).
    parts: dict[str, float | None] = {
        "step_ms": median([t * 1e3 for t in steps]),
        "forward_ms": median([f.ms for f in forwards]),
        "copy_ms": median([t.copy_ms for t in samples]),
        "sample_ms": median([t.sample_ms for t in samples]),
        "device_wait_ms": median([t.device_wait_ms for t in samples])}
    busy = [parts[k] for k in ("forward_ms", "copy_ms", "sample_ms")]
    # What the device did not spend on the step's own work: waits for the host, anywhere.
    parts["device_idle_ms"] = (None if parts["step_ms"] is None or None in busy
                               else parts["step_ms"] - sum(busy))  # type: ignore[arg-type]
    parts.update({key: median(values) for key, values in host.items() if key != "finish_ms"})
    fill_wait = median([t.fill_wait_ms for t in samples]) if constrained else 0.0
    parts["fill_wait_ms"] = fill_wait
    finish = median(host["finish_ms"])
    parts["sample_queue_ms"] = (None if finish is None or fill_wait is None
                                else max(0.0, finish - fill_wait))
    if not constrained:  # plain steps queue their sampling inside the launch
        parts["sample_queue_ms"] = None
    waits = [parts["collect_ms"], fill_wait]
    parts["host_ms"] = (None if parts["step_ms"] is None or None in waits
                        else parts["step_ms"] - sum(waits))  # type: ignore[arg-type]
    parts["fill_ms"] = median([t.fill_ms for t in samples]) if constrained else None
    return {**parts, "masked_steps": engine.masked_steps.total - before[0],
            "masked_steps_overlapped": engine.masked_steps.overlapped - before[1]}


def apply_ms(batch: int, vocab: int, device: str, repeats: int = 50) -> float:
    """Median time of the mask apply alone on ``[batch, vocab]`` float32 logits."""
    logits = torch.randn(batch, vocab, device=device)
    mask = torch.randint(-2**31, 2**31, (batch, num_words(vocab)), dtype=torch.int64,
                         device=device).to(torch.int32)
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            apply_bitmask(logits, mask)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            apply_bitmask(logits, mask)
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def _print_breakdown(batch: int, name: str, parts: dict[str, Any]) -> None:
    shown = "  ".join(f"{key[:-3] if key.endswith('_ms') else key} "
                      + (f"{value:.3f}" if isinstance(value, float) else str(value))
                      for key, value in parts.items() if value is not None)
    print(f"  batch {batch:3d} {name:11s} {shown}", flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = Path(tempfile.mkdtemp(prefix="so-bench-"))
    overrides: dict[str, Any] = {}
    if args.smoke:
        overrides = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "vocab_size": 1024, "max_position_embeddings": 1024}
    write_model_dir(args.model, model_dir, args.tokenizer, **overrides)
    llm = LLM(str(model_dir), load_format="dummy", max_model_len=1024,
              max_num_seqs=max(args.batch_sizes), device=args.device,
              dtype="float32" if args.smoke else "bfloat16",
              enforce_eager=args.smoke, async_scheduling=args.async_scheduling)
    results = []
    for batch in args.batch_sizes:
        step_times(llm, batch, True, 4)  # compile the grammar, warm the path
        plain = statistics.median(step_times(llm, batch, False, args.steps))
        masked = statistics.median(step_times(llm, batch, True, args.steps))
        result: dict[str, Any] = {"batch": batch, "plain_step_ms": plain * 1e3,
                                  "json_schema_step_ms": masked * 1e3,
                                  "slowdown": masked / plain - 1.0}
        print(f"batch {batch:3d}: plain {plain * 1e3:8.3f} ms  json schema "
              f"{masked * 1e3:8.3f} ms  ({(masked / plain - 1) * 100:+.1f}%)", flush=True)
        if args.breakdown:
            result["breakdown"] = {
                "plain": breakdown(llm, batch, False, args.steps),
                "json_schema": breakdown(llm, batch, True, args.steps),
                "apply_alone_ms": apply_ms(batch, llm.engine.vocab_size, llm.engine.device)}
            for name in ("plain", "json_schema"):
                _print_breakdown(batch, name, result["breakdown"][name])
            print(f"  batch {batch:3d} apply alone {result['breakdown']['apply_alone_ms']:.3f} ms",
                  flush=True)
        results.append(result)
    llm.shutdown()
    return {"model": args.model if not args.smoke else "tiny", "device": args.device or "auto",
            "tokenizer": args.tokenizer,
            "steps": args.steps, "async_scheduling": args.async_scheduling, "schema": SCHEMA,
            "results": results}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--model", default="qwen3-8b", help="a shape of model_shapes.py")
    parser.add_argument("--batch-sizes", type=lambda t: [int(x) for x in t.split(",")],
                        default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=50, help="timed steps per case")
    parser.add_argument("--device", default=None, help="default: cuda when available")
    parser.add_argument("--smoke", action="store_true", help="a tiny model (runs on CPU)")
    parser.add_argument("--tokenizer", choices=("bytes", "demo"), default="bytes",
                        help="bytes: synthetic pieces for every vocabulary id; demo: 1,000 "
                        "entries (the rest of the ids empty)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the forward, mask fill, copy and sampling per case")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=True, help="the engine's async scheduling (default: on)")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
