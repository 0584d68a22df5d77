"""Encode and decode time of the engine's internal messages (the engine encodes a step's
outputs, the API process decodes them, per step).

Why: the API server decodes every engine step's outputs on its event loop; at 75 running
requests a step's batch took 10.6 ms (dev machine) while the type hints were worked out per
value, and an H100 decode worker's loop stalled for seconds under load. Runs on CPU:

    python3 -m experiments.codec_decode [--outputs 75] [--prompt-tokens 2048] [--reps 200]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any

from engine_core.messages import (
    ENGINE_INPUT_CODEC,
    ENGINE_OUTPUT_CODEC,
    AddRequest,
    EngineOutput,
    EngineOutputs,
)
from engine_core.sampling_params import SamplingParams


def _ms_per_call(fn: Callable[[Any], Any], arg: Any, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn(arg)
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--outputs", type=int, default=75, help="requests in one step's batch")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    batch = EngineOutputs(outputs=[
        EngineOutput(request_id=f"cmpl-{i:032x}#0", new_token_ids=[1234],
                     num_prompt_tokens=args.prompt_tokens, num_cached_tokens=0)
        for i in range(args.outputs)])
    outputs = ENGINE_OUTPUT_CODEC.encode(batch)
    add = ENGINE_INPUT_CODEC.encode(AddRequest(
        request_id="cmpl-0#0", prompt_token_ids=list(range(args.prompt_tokens)),
        sampling_params=SamplingParams(max_tokens=256).to_dict(), arrival_time=0.0))
    result = {
        "machine": platform.processor() or platform.machine(),
        "engine_outputs_encode_ms": _ms_per_call(ENGINE_OUTPUT_CODEC.encode, batch, args.reps),
        "engine_outputs_decode_ms": _ms_per_call(ENGINE_OUTPUT_CODEC.decode, outputs, args.reps),
        "add_request_decode_ms": _ms_per_call(ENGINE_INPUT_CODEC.decode, add, args.reps),
        "outputs": args.outputs, "prompt_tokens": args.prompt_tokens,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
