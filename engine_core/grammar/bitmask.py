"""Packed token bitmasks: filled on the host per step, applied to the logits on the device.

Bit ``t % 32`` of word ``t // 32`` of a row is 1 when token ``t`` is allowed (xgrammar's
layout). The scheduler fills one int32 row per constrained request that samples in a step,
with one batched xgrammar call, straight into the rows of the runner's pinned staging
buffer in the step's sampling order (unconstrained rows all ones); the runner copies the
block to the device without blocking (``worker/grammar_mask.py``) and the sampler applies
it in place before anything else touches the logits.
"""

from __future__ import annotations

from typing import Any

import torch

from engine_core.kernels import triton_available

_MASK = float("-inf")


def num_words(vocab_size: int) -> int:
    """int32 words per bitmask row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


# Threads of the batched fill: it runs while the device computes the step's forward.
FILL_THREADS = 8
# Up to this many masks are filled one by one on the calling thread: waking the pool costs
# more than a few fills (a mask over a 151,936-token vocabulary takes 0.1-0.3 ms).
SERIAL_FILL_MAX = 4


class BitmaskFiller:
    """Fills the next-token masks of a step's matchers (xgrammar ``GrammarMatcher``s): one
    batched, multi-threaded call, or a few single fills; one per scheduler, made with its
    first grammar."""

    def __init__(self, max_threads: int = FILL_THREADS) -> None:
        import xgrammar as xgr

        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)

    def fill(self, matchers: list[Any], rows: list[int], out: torch.Tensor) -> None:
        """Write the mask of ``matchers[i]`` into row ``rows[i]`` of ``out`` (host int32
        ``[N, num_words]``); the other rows are left as they are."""
        if len(matchers) <= SERIAL_FILL_MAX:
            for matcher, row in zip(matchers, rows):
                matcher.fill_next_token_bitmask(out, row)
            return
        self._batch.batch_fill_next_token_bitmask(matchers, out, indices=rows)


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
