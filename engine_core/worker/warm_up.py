"""Startup warm-up: scripted steps through the runner before the first request.

Why: Triton compiles a kernel variant the first time a step needs it (about a second each
on an H200). Graph capture compiles the decode and mixed paths at the captured sizes, but
steps that run eagerly (connector layer hooks, steps beyond the graphs) take other shapes;
without this, the first eager paged prefill and mixed prefill + decode step compile while
serving, and every request queued behind them waits (hundreds of ms of TTFT on a fresh
machine). A sampled request rides along so that the
sampler's non-greedy path has run too. The steps use blocks of the still-empty cache and
leave no runner state behind; a GPU test asserts that a varied workload compiles nothing
after it. The engine runs these steps with graphs paused (``ModelRunner.graphs_paused``).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_core.sampling_params import SamplingParams
from engine_core.sched.outputs import CachedRequestData, NewRequestData, SchedulerOutput

WARM_UP_PREFIX = "__warm-up-"


@dataclass(frozen=True)
class WarmUpLimits:
    """What a warm-up step may use: the engine's batch limits and cache size."""

    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


def _params(sampled: bool) -> SamplingParams:
    if sampled:
        return SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=0, max_tokens=4)
    return SamplingParams(temperature=0.0, max_tokens=4)


def warm_up_steps(limits: WarmUpLimits) -> list[SchedulerOutput]:
    """Three steps: a prefill of several sequences (one crossing a block boundary, one
    sampled), then those sequences decoding beside a new prefill (a mixed step), then an
    empty step that finishes them all. Fewer sequences when the limits allow fewer."""
    bs = limits.block_size
    first_len = max(1, min(bs + 1, limits.max_num_batched_tokens - 2, limits.max_model_len - 3))
    lengths = [first_len, 2][:max(1, min(2, limits.max_num_seqs))]
    if sum(lengths) > limits.max_num_batched_tokens:
        lengths = lengths[:1]
    mixed_new = 3 if (limits.max_num_seqs > len(lengths)
                      and len(lengths) + 3 <= limits.max_num_batched_tokens
                      and limits.max_model_len > 3) else 0
    blocks_needed = [-(-(n + 1) // bs) for n in lengths] + ([-(-mixed_new // bs)] if mixed_new else [])
    if sum(blocks_needed) > limits.num_blocks:
        return []
    next_block = 0

    def take(count: int) -> list[int]:
        nonlocal next_block
        ids = list(range(next_block, next_block + count))
        next_block += count
        return ids

    ids = [f"{WARM_UP_PREFIX}{i}" for i in range(len(lengths) + 1)]
    first = [NewRequestData(ids[i], [0] * n, n, _params(sampled=i == 1), take(-(-n // bs)), 0)
             for i, n in enumerate(lengths)]
    steps = [SchedulerOutput(first, [], {r.request_id: len(r.token_ids) for r in first},
                             sum(lengths))]
    # Decode one token each; a sequence whose next position starts a new block gets one.
    cached = [CachedRequestData(ids[i], take(1) if n % bs == 0 else [], n)
              for i, n in enumerate(lengths)]
    scheduled = {r.request_id: 1 for r in cached}
    new: list[NewRequestData] = []
    if mixed_new:
        new = [NewRequestData(ids[-1], [0] * mixed_new, mixed_new, _params(sampled=False),
                              take(blocks_needed[-1]), 0)]
        scheduled[ids[-1]] = mixed_new
    steps.append(SchedulerOutput(new, cached, scheduled, sum(scheduled.values())))
    steps.append(SchedulerOutput([], [], {}, 0, finished_req_ids=set(scheduled)))
    return steps
