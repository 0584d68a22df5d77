"""Packed token bitmasks: filled on the host per step, applied to the logits on the device.

Bit ``t % 32`` of word ``t // 32`` of a row is 1 when token ``t`` is allowed (xgrammar's
layout). The scheduler picks one matcher per constrained request that samples in a step
(``StepMasks``); ``BitmaskFiller`` fills their int32 rows with one batched xgrammar call on
a thread of its own, straight into the rows of the runner's pinned staging buffer in the
step's sampling order (unconstrained rows all ones); the runner copies the block to the
device without blocking (``worker/grammar_mask.py``) and the sampler applies it in place
before anything else touches the logits.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from engine_core.kernels import triton_available

_MASK = float("-inf")


def num_words(vocab_size: int) -> int:
    """int32 words per bitmask row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


# Threads of the batched fill: it runs while the device computes the step's forward.
FILL_THREADS = 8


@dataclass
class StepMasks:
    """Which matcher fills which row of a step's masks (the step's other rows are all ones:
    unconstrained, or a request whose dropped token needs no mask)."""

    matchers: list[Any]
    rows: list[int]
    num_rows: int


class FillJob:
    """A step's masks filling on the filler's thread; ``wait`` returns once they are in."""

    def __init__(self, future: Future[float]) -> None:
        self._future = future

    def wait(self) -> float:
        """Block until the masks are filled; the seconds the fill itself took."""
        return self._future.result()


class BitmaskFiller:
    """Fills the next-token masks of a step's matchers (xgrammar ``GrammarMatcher``s) with one
    batched call over ``max_threads`` threads, made with the first constrained step.

    ``start`` runs that call on a thread of its own and returns at once, so the engine's
    thread returns the step's outputs and schedules the next step while the masks fill:
    xgrammar releases the GIL for the whole call. The fill is always the one batched call
    (even for one mask): between two native calls the thread would need the GIL back, which
    a busy engine thread yields only every switch interval (5 ms).
    """

    def __init__(self, max_threads: int = FILL_THREADS) -> None:
        import xgrammar as xgr

        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-fill")

    def start(self, masks: StepMasks, out: torch.Tensor) -> FillJob:
        """Fill ``masks`` into ``out`` on the filler's thread; ``out`` is its until ``wait``."""
        if len(masks.rows) < masks.num_rows:  # here: a torch op on the thread would hold the GIL
            out[:masks.num_rows].fill_(-1)
        started = threading.Event()

        def run() -> float:
            started.set()
            begin = time.perf_counter()
            self._batch.batch_fill_next_token_bitmask(masks.matchers, out, indices=masks.rows)
            return time.perf_counter() - begin

        job = FillJob(self._thread.submit(run))
        # Block until the thread runs: it then holds the GIL only until the native call,
        # instead of waiting for this thread's next switch interval to get it.
        started.wait()
        return job

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set every token the mask forbids to -inf in ``logits`` (in place; returned for
    chaining). One Triton kernel on CUDA (``kernels/bitmask.py``); on CPU, and on CUDA
    without Triton, a few fixed-shape torch ops (rows x words x 32 bits, cut to the
    vocabulary)."""
    if logits.is_cuda and triton_available():
        from engine_core.kernels.bitmask import apply_bitmask_inplace

        apply_bitmask_inplace(logits, bitmask)
        return logits
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    forbidden = ((bitmask[:, :, None] >> shifts) & 1) == 0
    logits.masked_fill_(forbidden.reshape(bitmask.shape[0], -1)[:, :logits.shape[-1]], _MASK)
    return logits
