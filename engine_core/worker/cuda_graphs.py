"""CUDA graphs of decode-only steps: one graph per batch size, a batch padded up to the next.

Why: a decode step of a small model is hundreds of kernel launches whose host cost exceeds
their GPU time; a replay is one launch. Only decode-only steps are captured (one token per
sequence, shapes fixed by the batch size alone); prefill and mixed steps run eagerly.

Graph-safety rests on the Triton backend: its decode path reads only device tensors and
derives its grid from shapes (batch size, block-table width). Pad rows carry one token,
``seq_len`` 0 and slot -1, so they write nothing and read nothing. The inputs live in
``StepInputs``' persistent buffers; a replay only needs them refilled.

Graphs share one private memory pool, captured from the largest size down so the smaller
ones reuse its blocks; the KV cache is sized after reserving ``estimate_pool_bytes``.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger("pdserve.cuda_graphs")

# Largest batch captured by default; bigger decode batches run eagerly (their launch cost
# is small next to their GPU time).
DEFAULT_MAX_CAPTURE_SIZE = 512
# Private-pool slack over one eager step's peak: block rounding, smaller graphs' outputs.
_POOL_SLACK_FACTOR = 2
_POOL_SLACK_BYTES = 64 << 20


def default_capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, then steps of 8 to 64, 16 to 128, 32 to 256, 64 to 512, 128 beyond; the
    largest is ``max_size`` itself, so a full batch is never run eagerly."""
    sizes: list[int] = []
    for lo, hi, step in ((1, 4, 0), (8, 64, 8), (80, 128, 16), (160, 256, 32),
                         (320, 512, 64), (640, max(max_size, 640), 128)):
        candidates = [1, 2, 4] if step == 0 else range(lo, hi + 1, step)
        sizes.extend(s for s in candidates if s <= max_size)
    if max_size >= 1 and (not sizes or sizes[-1] != max_size):
        sizes.append(max_size)
    return sizes


def capture_sizes(requested: tuple[int, ...], max_num_seqs: int,
                  max_num_tokens: int) -> list[int]:
    """The batch sizes to capture for ``--cuda-graph-sizes`` under the scheduler's limits.

    No value: the default schedule up to min(max_num_seqs, 512). One value: the default
    schedule up to it. Several: exactly those (within the limits).
    """
    limit = min(max_num_seqs, max_num_tokens)
    if len(requested) > 1:
        return sorted({s for s in requested if 1 <= s <= limit})
    top = requested[0] if requested else DEFAULT_MAX_CAPTURE_SIZE
    return default_capture_sizes(min(top, limit))


def padded_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding ``num_reqs`` rows, or None (run eagerly)."""
    index = bisect.bisect_left(sizes, num_reqs)
    return sizes[index] if index < len(sizes) else None


def graphs_disabled_reason(device: torch.device, attention_backend: str,
                           enforce_eager: bool) -> str | None:
    """Why this engine runs every step eagerly, or None when it captures decode graphs."""
    if enforce_eager:
        return "--enforce-eager"
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if attention_backend != "triton":
        return f"the {attention_backend} attention backend reads host lists (not graph-safe)"
    return None


@dataclass
class CaptureStats:
    """What a capture produced, for the startup log and the tests."""

    sizes: list[int]
    seconds: float
    pool_bytes: int


class DecodeGraphs:
    """Captured decode graphs by batch size, each with its static output (hidden states)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sizes: list[int] = []
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self, sizes: list[int], prepare: Callable[[int], None],
                forward: Callable[[int], torch.Tensor]) -> CaptureStats:
        """Capture ``forward(size)`` for each size after ``prepare(size)`` filled pad rows.

        Each size first runs once eagerly (Triton compiles its kernels for the new grid,
        cuBLAS settles its choices) so that nothing but launches is recorded.
        """
        device = self.device
        torch.cuda.synchronize(device)
        # Reserved memory before and after, both without cached free blocks: the difference
        # is the graphs' private pool (empty_cache never releases it while they live).
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(device)
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Warm-up and capture on one side stream (cuBLAS sets up its per-stream state
        # during the warm-up, not inside the capture).
        stream = torch.cuda.Stream(device)
        for size in sorted(set(sizes), reverse=True):
            prepare(size)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                forward(size)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: connector threads may use CUDA while this thread captures.
            with torch.cuda.graph(graph, pool=pool, stream=stream,
                                  capture_error_mode="thread_local"):
                output = forward(size)
            self._graphs[size] = (graph, output)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        self.sizes = sorted(self._graphs)
        stats = CaptureStats(self.sizes, time.perf_counter() - start,
                             torch.cuda.memory_reserved(device) - reserved_before)
        logger.info("Captured %d decode CUDA graphs (batch sizes %s) in %.2f s, %.1f MiB",
                    len(stats.sizes), _ranges(stats.sizes), stats.seconds,
                    stats.pool_bytes / 2**20)
        return stats

    def size_for(self, num_reqs: int) -> int | None:
        return padded_size(num_reqs, self.sizes)

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of ``size`` on the current buffer contents; its output tensor."""
        graph, output = self._graphs[size]
        graph.replay()
        return output


def estimate_pool_bytes(prepare: Callable[[int], None], forward: Callable[[int], torch.Tensor],
                        size: int, device: torch.device) -> int:
    """Memory to reserve for the graphs' pool: one eager step of the largest size, with slack.

    A graph keeps every block its capture allocated; the smaller graphs, captured after
    it into the same pool, reuse those blocks and add only their outputs.
    """
    prepare(size)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    output = forward(size)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del output
    return int(_POOL_SLACK_FACTOR * peak + _POOL_SLACK_BYTES)


def _ranges(sizes: list[int]) -> str:
    if len(sizes) <= 6:
        return str(sizes)
    return f"[{sizes[0]}, {sizes[1]}, ..., {sizes[-2]}, {sizes[-1]}]"
