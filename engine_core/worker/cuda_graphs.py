"""CUDA graphs of engine steps: decode-only and mixed, by token count, padded up to the next.

Why: a step of a small batch is hundreds of kernel launches, and launching them from
Python (Triton's launcher, torch dispatch) costs more host time than their GPU time: an
eager Qwen3-8B step of 16 decodes plus a 64-token prompt takes 22-37 ms against 7.3 ms for
the same batch's decode step from a graph (one H100). A replay is one launch.

Two kinds per size ``p`` (tokens): a *decode* graph (every sequence one token, the model's
fused decode path; up to ``max_num_seqs``) and a *mixed* graph (prefill chunks and decodes
in any proportion, up to ``p`` tokens in at most ``graph_seqs(p)`` sequences; the general
attention path). ``--cuda-graph-mode full_decode_only`` captures only the first kind, as
vLLM's mode of that name. A step with connector layer hooks replays a graph only up to
``HOOKED_GRAPH_MAX_TOKENS``, with every layer's hooks called around the replay.

Graph-safety rests on the Triton backend: it reads only device tensors and derives its
grids from shapes and from the captured lengths of its prefill and decode work lists
(``attention/prefill_tiles.py``, ``attention/decode_work.py``), never from host copies of
lengths. Padding appends empty sequences and tokens of no sequence (slot -1): they
write nothing and read nothing. The inputs live in ``StepInputs``' persistent buffers; a
replay only needs them refilled.

Graphs share one private memory pool, captured from the largest size down so the smaller
ones reuse its blocks; the KV cache is sized after reserving ``estimate_pool_bytes``.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("pdserve.cuda_graphs")

# Largest decode batch captured by default; bigger decode batches run eagerly (their launch
# cost is small next to their GPU time).
DEFAULT_MAX_CAPTURE_SIZE = 512
# Largest mixed step (tokens) captured by default. An eager Qwen3-8B step spends 20-48 ms of
# host time launching (one H100), which a 2048-token step's ~50 ms of GPU time covers; a
# small model stays host-bound longer, and ``--cuda-graph-sizes`` reaches further.
DEFAULT_MAX_MIXED_TOKENS = 2048
# Steps whose connector needs per-layer hooks (a prefill worker sending KV) replay a graph up
# to this many tokens, with every layer's hooks called around the replay instead of between
# layers: the sends of such a step then start after its last layer, not during it. Measured
# on one H100 with Qwen3-8B prefill-only steps: eagerly a step of 64,
# 256, 512 or 1024 tokens took 32-48 ms, all host time; from a graph 6.5, 8.1, 12.2-12.6 and
# 23.8 ms. The
# overlap given up is at most one step's KV (1024 tokens: ~150 MB, 1-3 ms at the
# connector's measured 50-150 GB/s; a request under 32 MiB, ~220 tokens, is one send after
# its last layer anyway). From ~2048 tokens the GPU's own time covers the host's, so larger
# hooked steps run eagerly and keep their sends overlapping later layers.
HOOKED_GRAPH_MAX_TOKENS = 1024
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


@dataclass(frozen=True)
class GraphSizes:
    """Token counts captured per kind: decode-only steps and mixed steps."""

    decode: list[int] = field(default_factory=list)
    mixed: list[int] = field(default_factory=list)

    @property
    def largest(self) -> int:
        return max(self.decode + self.mixed, default=0)

    def __bool__(self) -> bool:
        return bool(self.decode or self.mixed)


def capture_sizes(requested: tuple[int, ...], max_num_seqs: int, max_num_tokens: int,
                  mode: str = "full") -> GraphSizes:
    """The sizes to capture for ``--cuda-graph-sizes`` under the scheduler's limits.

    No value: decode graphs on the default schedule up to min(max_num_seqs, 512), mixed
    graphs up to min(max_num_batched_tokens, 2048). One value: both schedules up to it.
    Several: exactly those. Decode graphs hold at most ``max_num_seqs`` sequences; a mixed
    step has at least two tokens.
    """
    decode_limit = min(max_num_seqs, max_num_tokens)
    if len(requested) > 1:
        decode = sorted({s for s in requested if 1 <= s <= decode_limit})
        mixed = sorted({s for s in requested if 2 <= s <= max_num_tokens})
    else:
        decode_top = requested[0] if requested else DEFAULT_MAX_CAPTURE_SIZE
        mixed_top = requested[0] if requested else DEFAULT_MAX_MIXED_TOKENS
        decode = default_capture_sizes(min(decode_top, decode_limit))
        mixed = [s for s in default_capture_sizes(min(mixed_top, max_num_tokens)) if s >= 2]
    if mode == "full_decode_only":
        mixed = []
    return GraphSizes(decode, mixed)


def padded_size(num_tokens: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding ``num_tokens`` tokens, or None (run eagerly)."""
    index = bisect.bisect_left(sizes, num_tokens)
    return sizes[index] if index < len(sizes) else None


def graphs_disabled_reason(device: torch.device, attention_backend: str,
                           enforce_eager: bool) -> str | None:
    """Why this engine runs every step eagerly, or None when it captures graphs."""
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

    sizes: GraphSizes
    seconds: float
    pool_bytes: int

    @property
    def count(self) -> int:
        return len(self.sizes.decode) + len(self.sizes.mixed)


class StepGraphs:
    """Captured graphs by (kind, size), each with its static output (hidden states)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sizes = GraphSizes()
        self._graphs: dict[tuple[bool, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self, sizes: GraphSizes, prepare: Callable[[int], None],
                forward: Callable[[int, bool], torch.Tensor]) -> CaptureStats:
        """Capture ``forward(size, mixed)`` for each size of each kind after
        ``prepare(size)`` filled the buffers with padding.

        Each graph first runs once eagerly (Triton compiles its kernels for the new grid,
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
        # Largest first (a mixed graph before the decode graph of its size: it holds more).
        order = sorted([(size, True) for size in set(sizes.mixed)]
                       + [(size, False) for size in set(sizes.decode)], reverse=True)
        for size, mixed in order:
            prepare(size)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                forward(size, mixed)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: connector threads may use CUDA while this thread captures.
            with torch.cuda.graph(graph, pool=pool, stream=stream,
                                  capture_error_mode="thread_local"):
                output = forward(size, mixed)
            self._graphs[(mixed, size)] = (graph, output)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        self.sizes = GraphSizes(sorted(s for m, s in self._graphs if not m),
                                sorted(s for m, s in self._graphs if m))
        stats = CaptureStats(self.sizes, time.perf_counter() - start,
                             torch.cuda.memory_reserved(device) - reserved_before)
        logger.info("Captured %d CUDA graphs (decode batch sizes %s; mixed steps of %s "
                    "tokens) in %.2f s, %.1f MiB", stats.count, _ranges(self.sizes.decode),
                    _ranges(self.sizes.mixed), stats.seconds, stats.pool_bytes / 2**20)
        return stats

    def size_for(self, num_tokens: int, mixed: bool) -> int | None:
        return padded_size(num_tokens, self.sizes.mixed if mixed else self.sizes.decode)

    def replay(self, size: int, mixed: bool) -> torch.Tensor:
        """Run the graph of ``size`` on the current buffer contents; its output tensor."""
        graph, output = self._graphs[(mixed, size)]
        graph.replay()
        return output


def estimate_pool_bytes(prepare: Callable[[int], None],
                        forward: Callable[[int, bool], torch.Tensor],
                        sizes: GraphSizes, device: torch.device) -> int:
    """Memory to reserve for the graphs' pool: the larger of one eager step of the largest
    size of each kind, with slack.

    A graph keeps every block its capture allocated; the smaller graphs, captured after
    it into the same pool, reuse those blocks and add only their outputs.
    """
    peak = 0
    for mixed, kind_sizes in ((False, sizes.decode), (True, sizes.mixed)):
        if not kind_sizes:
            continue
        prepare(max(kind_sizes))
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        output = forward(max(kind_sizes), mixed)
        torch.cuda.synchronize(device)
        peak = max(peak, torch.cuda.max_memory_allocated(device) - base)
        del output
    return int(_POOL_SLACK_FACTOR * peak + _POOL_SLACK_BYTES)


def _ranges(sizes: list[int]) -> str:
    if len(sizes) <= 6:
        return str(sizes)
    return f"[{sizes[0]}, {sizes[1]}, ..., {sizes[-2]}, {sizes[-1]}]"
