"""Per-request server-side latency breakdown, from the engine's ``RequestTimings``.

A worker returns it to the client as ``pdserve_timings`` (final response body, or the
finishing SSE chunk of each choice) and observes it in histograms, so a benchmark can split
TTFT into queueing, prefill, KV transfer and the first decode step without extra requests.

Keys (milliseconds unless named ``*_unix``; a key is absent when it does not apply):

- ``queue_ms``: arrival to first taken by the scheduler (prefill queue on P or colocated;
  on D, the wait before it was parked for remote KV).
- ``prefill_ms``: first compute to first token, for a request that computed its prompt here.
- ``kv_wait_ms``: D only: parked to remote KV landed (spans P's queue, compute and the transfer).
- ``decode_queue_ms``: D only: KV landed to first compute step.
- ``first_step_ms``: D only: that first compute step to the first token.
- ``decode_ms``: first token to finished (the decode phase).
- ``inference_ms``: first compute step to finished (time running on the model).
- ``arrival_unix``, ``first_token_unix``, ``kv_ready_unix``: wall-clock stamps, so a client
  can line up two workers' events (exact on one host, NTP-close across hosts).
"""

from __future__ import annotations

from engine_core.messages import RequestTimings


def _ms(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start) * 1e3, 3)


def breakdown(timings: RequestTimings, now_monotonic: float, now_unix: float
              ) -> dict[str, float]:
    """The ``pdserve_timings`` dict; the engine's monotonic stamps map to wall clock here.

    The engine process and the API process share the host's monotonic clock, so the
    offset taken now converts every stamp.
    """
    offset = now_unix - now_monotonic
    remote = timings.remote_kv_ready_time is not None
    values: dict[str, float | None] = {
        "queue_ms": _ms(timings.arrival_time, timings.first_scheduled_time),
        "arrival_unix": round(timings.arrival_time + offset, 6),
    }
    if remote:
        values.update(
            kv_wait_ms=_ms(timings.first_scheduled_time, timings.remote_kv_ready_time),
            decode_queue_ms=_ms(timings.remote_kv_ready_time, timings.compute_start_time),
            first_step_ms=_ms(timings.compute_start_time, timings.first_token_time),
            kv_ready_unix=round(timings.remote_kv_ready_time + offset, 6))
    else:
        values["prefill_ms"] = _ms(timings.compute_start_time, timings.first_token_time)
    values["decode_ms"] = _ms(timings.first_token_time, timings.finished_time)
    values["inference_ms"] = _ms(timings.compute_start_time, timings.finished_time)
    if timings.first_token_time is not None:
        values["first_token_unix"] = round(timings.first_token_time + offset, 6)
    return {key: value for key, value in values.items() if value is not None}
