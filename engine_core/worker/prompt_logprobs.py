"""Prompt logprobs (vLLM's ``prompt_logprobs``) of the prompt positions a step computes.

Position ``p >= 1`` of a prompt scores prompt token ``p`` under the logits of position
``p - 1``; position 0 has none, and the last position's logits are the sampler's. Only the
rows of requests that asked go through the LM head, in slices of ``ROWS_PER_SLICE`` so a
long chunk never holds ``[chunk, vocab]`` logits at once; float32 log_softmax, top-k by
``torch.topk``, all of a step's rows packed into one float32 tensor read in one copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine_core.messages import TokenLogprob
from engine_core.sampling_params import SamplingParams
from engine_core.sched.outputs import PromptLogprobsChunk

ROWS_PER_SLICE = 1024


@dataclass
class PromptRows:
    """The rows of one step that give prompt logprobs, grouped by request in step order."""

    request_ids: list[str]
    first_positions: list[int]  # the prompt position each request's first row scores
    counts: list[int]  # rows of each request
    num_logprobs: list[int]  # top-k of each request
    hidden_rows: np.ndarray  # each row's index among the step's flattened tokens
    target_ids: np.ndarray  # the prompt token each row scores


class RequestTokens(Protocol):
    """What ``prompt_rows`` reads of one scheduled request (the runner's request state)."""

    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams


def prompt_rows(request_ids: Sequence[str], requests: Sequence[RequestTokens],
                starts: Sequence[int], num_new: Sequence[int]) -> PromptRows | None:
    """Rows scoring prompt tokens among a step's tokens (request i adds ``num_new[i]``
    tokens after ``starts[i]``); None when no scheduled request asked."""
    ids: list[str] = []
    firsts: list[int] = []
    counts: list[int] = []
    ks: list[int] = []
    rows: list[np.ndarray] = []
    targets: list[list[int]] = []
    offset = 0
    for request_id, request, start, n in zip(request_ids, requests, starts, num_new):
        k = request.sampling_params.prompt_logprobs
        end = min(start + n, request.num_prompt_tokens - 1)  # positions before a prompt token
        if k is not None and end > start:
            ids.append(request_id)
            firsts.append(start + 1)
            counts.append(end - start)
            ks.append(k)
            rows.append(np.arange(offset, offset + end - start, dtype=np.int64))
            targets.append(request.token_ids[start + 1:end + 1])
        offset += n
    if not ids:
        return None
    return PromptRows(ids, firsts, counts, ks, np.concatenate(rows),
                      np.fromiter((t for part in targets for t in part), dtype=np.int64))


@dataclass
class DevicePromptLogprobs:
    """A step's prompt logprobs packed on the device (``[rows, 2 + 2k]``: the prompt token's
    logprob, its rank, top values, top ids), and the queued copy to the host."""

    rows: PromptRows
    packed: torch.Tensor
    _host: torch.Tensor | None = None
    _copied: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        if self.packed.device.type != "cuda":
            return
        self._host = torch.empty(self.packed.shape, dtype=torch.float32, pin_memory=True)
        self._host.copy_(self.packed, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def read(self) -> dict[str, PromptLogprobsChunk]:
        """Each request's entries, in position order (waits for the step)."""
        packed = self.packed
        if self._host is not None:
            assert self._copied is not None
            self._copied.synchronize()
            packed = self._host
        values = packed.tolist()
        width = (packed.shape[1] - 2) // 2
        targets = self.rows.target_ids.tolist()
        out: dict[str, PromptLogprobsChunk] = {}
        first = 0
        rows = self.rows
        for request_id, position, count, k in zip(rows.request_ids, rows.first_positions,
                                                  rows.counts, rows.num_logprobs):
            out[request_id] = PromptLogprobsChunk(position, [
                TokenLogprob(targets[i], row[0], int(row[1]),
                             [int(t) for t in row[2 + width:2 + width + k]], row[2:2 + k])
                for i, row in zip(range(first, first + count), values[first:first + count])])
            first += count
        return out


def compute_prompt_logprobs(hidden: torch.Tensor,
                            compute_logits: Callable[[torch.Tensor], torch.Tensor],
                            rows: PromptRows) -> DevicePromptLogprobs:
    """Score ``rows`` of the step's hidden states and queue the copy to the host."""
    device = hidden.device
    index = torch.from_numpy(rows.hidden_rows).to(device, non_blocking=True)
    targets = torch.from_numpy(rows.target_ids).to(device, non_blocking=True)
    k = max(1, max(rows.num_logprobs))
    slices = []
    for first in range(0, index.shape[0], ROWS_PER_SLICE):
        last = first + ROWS_PER_SLICE
        logprobs = torch.log_softmax(compute_logits(hidden[index[first:last]]).float(), dim=-1)
        chosen = logprobs.gather(-1, targets[first:last, None])
        # vLLM's rank: tokens at least as likely as the prompt token, itself included.
        ranks = (logprobs >= chosen).sum(dim=-1, keepdim=True).float()
        top_values, top_ids = logprobs.topk(k, dim=-1)
        slices.append(torch.cat([chosen, ranks, top_values, top_ids.float()], dim=-1))
    result = DevicePromptLogprobs(rows, torch.cat(slices))
    result.start_copy()
    return result
