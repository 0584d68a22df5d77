"""Sampling once for the whole group: rank 0 samples and broadcasts the tokens, the other
ranks take them from the broadcast. The tokens stay on the device (no host sync), so a
rank's next step reads its pending inputs from them exactly as rank 0 does."""

from __future__ import annotations

import torch

from engine_core.parallel.group import TensorParallelGroup
from engine_core.worker.sampler import DeviceSamples, Sampler, SamplingRow


class BroadcastSampler:
    """Rank 0's sampler: sample as one rank does, then broadcast the token ids."""

    def __init__(self, sampler: Sampler, group: TensorParallelGroup) -> None:
        self.sampler = sampler
        self.group = group

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow],
               pending_tokens: torch.Tensor | None = None,
               grammar_bitmask: torch.Tensor | None = None) -> DeviceSamples:
        samples = self.sampler.sample(logits, rows, pending_tokens, grammar_bitmask)
        samples.token_ids = samples.token_ids.to(torch.int64).contiguous()
        self.group.broadcast(samples.token_ids, src=0)
        return samples


class FollowerSampler:
    """Ranks 1..N-1: the step's token ids from rank 0's broadcast (logprobs stay there)."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow],
               pending_tokens: torch.Tensor | None = None,
               grammar_bitmask: torch.Tensor | None = None) -> DeviceSamples:
        token_ids = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
        self.group.broadcast(token_ids, src=0)
        return DeviceSamples(token_ids, None, [None] * len(rows))


RankSampler = Sampler | BroadcastSampler | FollowerSampler


def rank_sampler(sampler: Sampler, group: TensorParallelGroup) -> RankSampler:
    """The sampler of this rank: the plain one alone, else broadcasting or following."""
    if not group.is_parallel:
        return sampler
    return BroadcastSampler(sampler, group) if group.rank == 0 else FollowerSampler(group)
