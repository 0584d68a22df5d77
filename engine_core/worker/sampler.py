"""Batched sampling over a logits tensor: greedy, temperature, top-k, top-p, min-p, penalties.

Everything is one set of tensor ops over the whole batch; the only per-request work is
building the parameter tensors and drawing noise for requests that carry a seed. Seeded
noise is drawn from a generator keyed by (seed, output position), so a seeded request
samples the same tokens whatever it is batched with and even after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core.sampling_params import SamplingParams
from engine_core.sched.outputs import SampledLogprobs

_MASK = float("-inf")


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request at this step.

    ``token_ids`` is the runner's own list (prompt + output), not a copy: the prompt and
    output slices are only taken when penalties need them.
    """

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    eos_token_ids: tuple[int, ...]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class Sampler:
    """Turns the last-position logits of each request into one token id each."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]
                 ) -> tuple[list[int], list[SampledLogprobs | None]]:
        device = logits.device
        logits = logits.float()
        num_logprobs = [r.params.logprobs for r in rows]
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if any(n is not None for n in num_logprobs) else None)
        logits = self._apply_min_tokens(logits, rows)
        logits = self._apply_penalties(logits, rows)
        greedy = torch.tensor([r.params.is_greedy for r in rows], device=device)
        sampled = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            sampled = torch.where(greedy, sampled, self._sample_random(logits, rows))
        tokens = sampled.tolist()
        return tokens, self._logprobs(raw_logprobs, sampled, num_logprobs)

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        blocked_rows: list[int] = []
        blocked_tokens: list[int] = []
        for i, row in enumerate(rows):
            if row.num_output_tokens < row.params.min_tokens:
                stops = set(row.params.stop_token_ids)
                if not row.params.ignore_eos:
                    stops.update(row.eos_token_ids)
                blocked_rows.extend([i] * len(stops))
                blocked_tokens.extend(stops)
        if blocked_rows:
            logits = logits.clone()
            logits[blocked_rows, blocked_tokens] = _MASK
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        if not any(r.params.needs_penalties for r in rows):
            return logits
        device = logits.device
        num_rows, vocab = logits.shape
        counts = torch.zeros(num_rows, vocab, device=device)
        seen = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
        for i, row in enumerate(rows):
            if row.num_output_tokens:
                out = torch.tensor(row.output_token_ids, device=device)
                counts[i].index_add_(0, out, torch.ones_like(out, dtype=counts.dtype))
            if row.params.repetition_penalty != 1.0 and row.prompt_token_ids:
                seen[i, torch.tensor(row.prompt_token_ids, device=device)] = True
        seen |= counts > 0
        rep = torch.tensor([r.params.repetition_penalty for r in rows], device=device)[:, None]
        freq = torch.tensor([r.params.frequency_penalty for r in rows], device=device)[:, None]
        pres = torch.tensor([r.params.presence_penalty for r in rows], device=device)[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        return logits - freq * counts - pres * (counts > 0).float()

    @staticmethod
    def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        device = logits.device
        vocab = logits.shape[-1]
        temperature = torch.tensor(
            [1.0 if r.params.is_greedy else r.params.temperature for r in rows], device=device)
        logits = logits / temperature[:, None]
        top_k = torch.tensor([r.params.top_k or vocab for r in rows], device=device)
        top_p = torch.tensor([r.params.top_p for r in rows], device=device)
        if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=device)[None, :]
            drop = ranks >= top_k[:, None]
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always the first token).
            drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, _MASK)
            logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([r.params.min_p for r in rows], device=device)
        if bool((min_p > 0).any()):
            threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
        noise = torch.empty_like(probs).exponential_()
        for i, row in enumerate(rows):
            seed = row.params.seed
            if seed is not None and not row.params.is_greedy:
                generator = torch.Generator(device=device)
                generator.manual_seed(_step_seed(seed, row.num_output_tokens))
                noise[i].exponential_(generator=generator)
        # argmax(p / E) with E ~ Exp(1) draws from p (the exponential-race form of Gumbel-max).
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, sampled: torch.Tensor,
                  num_logprobs: list[int | None]) -> list[SampledLogprobs | None]:
        if raw is None:
            return [None] * len(num_logprobs)
        k = max(n for n in num_logprobs if n is not None)
        chosen = raw.gather(-1, sampled[:, None])
        ranks = (raw > chosen).sum(dim=-1) + 1
        top_values, top_ids = raw.topk(max(k, 1), dim=-1)
        chosen_l, ranks_l = chosen[:, 0].tolist(), ranks.tolist()
        top_values_l, top_ids_l, sampled_l = top_values.tolist(), top_ids.tolist(), sampled.tolist()
        result: list[SampledLogprobs | None] = []
        for i, n in enumerate(num_logprobs):
            if n is None:
                result.append(None)
                continue
            result.append(SampledLogprobs(sampled_l[i], chosen_l[i], ranks_l[i],
                                          top_ids_l[i][:n], top_values_l[i][:n]))
        return result


def _step_seed(seed: int, position: int) -> int:
    """A distinct, reproducible 63-bit seed per (request seed, output position)."""
    return (seed * 6364136223846793005 + position * 1442695040888963407 + 1) % (1 << 63)
