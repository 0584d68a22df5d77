"""The Triton GEMV's launch shapes (``kernels/gemv.py``), by weight shape.

Pure Python, no Triton: ``layers/linear.py`` reads ``TUNED_TILINGS`` to decide which weights
take the GEMV, on machines where Triton is not even imported.
"""

from __future__ import annotations

from typing import NamedTuple


class GemvTiling(NamedTuple):
    """A launch shape: output columns and K chunk per program, warps, pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Tilings by weight shape, from a sweep of 20 tilings timed in CUDA graphs on an H200 over
# distinct copies of each weight (experiments/decode_kernels.py, one row).
# Narrow column blocks keep enough programs in flight to stream a matrix of few rows at
# full bandwidth (a 1024-column matrix still gets 64 programs); wide matrices (a fused
# gate/up is 6x wider than deep) stream best with 64 columns a program, and 4096 columns
# or more with 32 (Qwen3-8B qkv: 16.7 -> 14.9 us; gate/up 49.5 us with cuBLAS -> 48.4).
# Deep matrices of many rows (Qwen3-8B's down projection, 4096 x 12288) stream best with
# 512-wide K chunks: one row, distinct copies, 26.47 -> 25.37 us on an H200 and 38.13 ->
# 36.67 on an H100 (experiments/decode_kernels.py --parts gemv).
NARROW_TILING = GemvTiling(16, 256, 2, 4)
MEDIUM_TILING = GemvTiling(32, 256, 4, 4)
DEEP_TILING = GemvTiling(32, 512, 4, 4)
WIDE_TILING = GemvTiling(64, 128, 4, 4)


# Shapes whose sweep's best beats the rules below by more than 3% and whose decode step
# gains from it (H200, one row, distinct copies of each weight,
# `experiments/decode_kernels.py --parts gemv --rows 1`; us before -> after). The rules fit
# Qwen3-8B's shapes; one TP=2 rank's shards of the larger models stream up to 31% faster
# with these (the step of one such rank at batch 1: Qwen3-32B 9.99 -> 9.15 ms, Llama-3.1-70B
# 19.21 -> 17.92 ms).
TUNED_TILINGS: dict[tuple[int, int], GemvTiling] = {
    (25600, 5120): GemvTiling(64, 256, 4, 3),   # Qwen3-32B TP=2 gate/up: 68.15 -> 63.63
    (5120, 12800): GemvTiling(32, 256, 4, 4),   # Qwen3-32B TP=2 down: 43.08 -> 36.88
    (8192, 4096): GemvTiling(64, 256, 4, 4),    # Llama-3.1-70B TP=2 o: 23.21 -> 17.19
    (28672, 8192): GemvTiling(64, 256, 4, 3),   # Llama-3.1-70B TP=2 gate/up: 120.07 -> 108.53
    (8192, 14336): GemvTiling(64, 256, 4, 4),   # Llama-3.1-70B TP=2 down: 72.17 -> 55.05
}


def choose_tiling(n: int, k: int) -> GemvTiling:
    """The tiling for a weight ``[n, k]`` (shapes only: a CUDA graph records one for good):
    the measured one for a tuned shape, else by the shape's proportions."""
    if (n, k) in TUNED_TILINGS:
        return TUNED_TILINGS[(n, k)]
    if n >= 5 * k:
        return WIDE_TILING
    if n >= 4096:
        return DEEP_TILING if k >= 2 * n else MEDIUM_TILING
    return NARROW_TILING
