"""Decode step time with a JSON-schema grammar against the same batch without one.

Qwen3-8B shapes with dummy weights (``benchmarks/model_shapes.py``, demo tokenizer: ids past
its 1000 entries decode to nothing, so the grammar allows only demo tokens). For each batch
size, B requests run to decode; the median of the steps in which all B decode is taken, with
every request unconstrained, then with every request under one JSON schema (the mask filled
on the host, copied once, applied in the sampler). Writes JSON where ``--out`` says.

    python3 -m benchmarks.structured_outputs --out /tmp/so.json              # GPU
    python3 -m benchmarks.structured_outputs --smoke --out /tmp/so-smoke.json  # CPU, tiny model
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.model_shapes import write_model_dir
from engine_core.llm import LLM
from engine_core.messages import AddRequest
from engine_core.sampling_params import SamplingParams
from engine_core.structured_outputs import StructuredOutputsParams

# A grammar that stays open for many tokens (an object holding a long list of strings).
SCHEMA = {"type": "object", "properties": {"notes": {"type": "array",
                                                     "items": {"type": "string"}}},
          "required": ["notes"]}
PROMPT = list(range(10, 42))  # 32 demo-token ids


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = Path(tempfile.mkdtemp(prefix="so-bench-"))
    overrides: dict[str, Any] = {}
    if args.smoke:
        overrides = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "vocab_size": 1024, "max_position_embeddings": 1024}
    write_model_dir(args.model, model_dir, **overrides)
    llm = LLM(str(model_dir), load_format="dummy", max_model_len=1024,
              max_num_seqs=max(args.batch_sizes), device=args.device,
              dtype="float32" if args.smoke else "bfloat16",
              enforce_eager=args.smoke)
    results = []
    for batch in args.batch_sizes:
        step_times(llm, batch, True, 4)  # compile the grammar, warm the path
        plain = statistics.median(step_times(llm, batch, False, args.steps))
        masked = statistics.median(step_times(llm, batch, True, args.steps))
        results.append({"batch": batch, "plain_step_ms": plain * 1e3,
                        "json_schema_step_ms": masked * 1e3,
                        "slowdown": masked / plain - 1.0})
        print(f"batch {batch:3d}: plain {plain * 1e3:8.3f} ms  json schema "
              f"{masked * 1e3:8.3f} ms  ({(masked / plain - 1) * 100:+.1f}%)", flush=True)
    llm.shutdown()
    return {"model": args.model if not args.smoke else "tiny", "device": args.device or "auto",
            "steps": args.steps, "schema": SCHEMA, "results": results}


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
    args = parser.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
