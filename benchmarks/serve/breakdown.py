"""Server-side latency breakdown of each request, from what pdserve puts in its responses.

Sources: the proxy's headers (``X-Pdserve-Queue-Ms``; ``X-Pdserve-Prefill-Timings`` = the
prefill worker's ``pdserve_timings``) and the ``pdserve_timings`` of the worker that
answered (decode worker, or a colocated one). Another OpenAI server sends none of these,
and the breakdown is simply empty.

Stages (milliseconds):
- ``proxy_queue``: proxy arrival to legs dispatched;
- ``prefill_queue`` / ``prefill_compute``: on P (or the colocated worker), arrival to first
  scheduled, and first compute to first token;
- ``kv_transfer``: P's first token to D's KV landed (wall clock), i.e. the transfer time
  not hidden behind P's compute; clamped at 0;
- ``decode_queue`` / ``first_decode_step``: on D, KV landed to first step, and that step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

STAGES = ("proxy_queue", "prefill_queue", "prefill_compute", "kv_transfer", "decode_queue",
          "first_decode_step")
QUEUE_HEADER = "X-Pdserve-Queue-Ms"
PREFILL_HEADER = "X-Pdserve-Prefill-Timings"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def request_stages(headers: Mapping[str, str], final: Mapping[str, Any] | None
                   ) -> dict[str, float]:
    """The stages one request's headers and final ``pdserve_timings`` reveal."""
    stages: dict[str, float | None] = {}
    queue = headers.get(QUEUE_HEADER)
    if queue is not None:
        try:
            stages["proxy_queue"] = float(queue)
        except ValueError:
            pass
    prefill: Mapping[str, Any] | None = None
    if headers.get(PREFILL_HEADER):
        try:
            parsed = json.loads(headers[PREFILL_HEADER])
            prefill = parsed if isinstance(parsed, dict) else None
        except ValueError:
            prefill = None
    final = final or {}
    remote = "kv_wait_ms" in final
    if prefill is None and not remote:
        prefill = final  # a colocated worker (or decode-only) computed the prompt itself
    if prefill:
        stages["prefill_queue"] = _number(prefill.get("queue_ms"))
        stages["prefill_compute"] = _number(prefill.get("prefill_ms"))
    if remote:
        stages["decode_queue"] = _number(final.get("decode_queue_ms"))
        stages["first_decode_step"] = _number(final.get("first_step_ms"))
        ready, done = _number(final.get("kv_ready_unix")), _number(
            (prefill or {}).get("first_token_unix"))
        if ready is not None and done is not None:
            stages["kv_transfer"] = max(0.0, (ready - done) * 1e3)
    return {k: v for k, v in stages.items() if v is not None}


def summarize_stages(per_request: Sequence[Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Mean and p99 (ms) and count of each stage over the requests that reported it."""
    summary = {}
    for stage in STAGES:
        values = [r[stage] for r in per_request if stage in r]
        if values:
            summary[stage] = {"mean_ms": float(np.mean(values)),
                              "p99_ms": float(np.percentile(values, 99)), "count": len(values)}
    return summary
