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
    """Turns the last-position logits of each request into one token id each.

    Every decision about which passes to run is taken from the host-side parameters, and
    parameter tensors reach the device by non-blocking copies from pinned memory, so the
    step's only host sync is reading the sampled tokens (logprobs add one more read).
    """

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]
                 ) -> tuple[list[int], list[SampledLogprobs | None]]:
        logits = logits.float()
        num_logprobs = [r.params.logprobs for r in rows]
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if any(n is not None for n in num_logprobs) else None)
        logits = self._apply_min_tokens(logits, rows)
        logits = self._apply_penalties(logits, rows)
        greedy = [r.params.is_greedy for r in rows]
        if all(greedy):
            sampled = logits.argmax(dim=-1)
        elif not any(greedy):
            sampled = self._sample_random(logits, rows)
        else:
            sampled = torch.where(_to_device(greedy, torch.bool, logits.device),
                                  logits.argmax(dim=-1), self._sample_random(logits, rows))
        tokens = sampled.tolist()
        return tokens, self._logprobs(raw_logprobs, sampled, tokens, num_logprobs)

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
            index = _to_device([blocked_rows, blocked_tokens], torch.long, logits.device)
            logits[index[0], index[1]] = _MASK
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        if not any(r.params.needs_penalties for r in rows):
            return logits
        device = logits.device
        num_rows, vocab = logits.shape
        # (row, token) pairs of every output token, and of prompt tokens where repetition
        # penalty applies, gathered on the host and sent in one copy each.
        out_rows: list[int] = []
        out_tokens: list[int] = []
        prompt_rows: list[int] = []
        prompt_tokens: list[int] = []
        for i, row in enumerate(rows):
            if not row.params.needs_penalties:
                continue
            output = row.output_token_ids
            out_rows.extend([i] * len(output))
            out_tokens.extend(output)
            if row.params.repetition_penalty != 1.0:
                prompt = row.prompt_token_ids
                prompt_rows.extend([i] * len(prompt))
                prompt_tokens.extend(prompt)
        counts = torch.zeros(num_rows, vocab, device=device)
        if out_rows:
            index = _to_device([out_rows, out_tokens], torch.long, device)
            counts.index_put_((index[0], index[1]), torch.ones(len(out_rows), device=device),
                              accumulate=True)
        seen = counts > 0
        if prompt_rows:
            index = _to_device([prompt_rows, prompt_tokens], torch.long, device)
            seen[index[0], index[1]] = True
        params = _to_device([[r.params.repetition_penalty for r in rows],
                             [r.params.frequency_penalty for r in rows],
                             [r.params.presence_penalty for r in rows]], torch.float32, device)
        rep, freq, pres = params[0, :, None], params[1, :, None], params[2, :, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        return logits - freq * counts - pres * (counts > 0).float()

    @staticmethod
    def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        device = logits.device
        vocab = logits.shape[-1]
        temperatures = [1.0 if r.params.is_greedy else r.params.temperature for r in rows]
        top_ks = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
        top_ps = [r.params.top_p for r in rows]
        min_ps = [r.params.min_p for r in rows]
        params = _to_device([temperatures, top_ks, top_ps, min_ps], torch.float32, device)
        logits = logits / params[0, :, None]
        if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
            top_k, top_p = params[1, :, None], params[2, :, None]
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=device)[None, :]
            drop = ranks >= top_k
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always the first token).
            drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
            sorted_logits = sorted_logits.masked_fill(drop, _MASK)
            logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if any(p > 0 for p in min_ps):
            threshold = probs.max(dim=-1, keepdim=True).values * params[3, :, None]
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
    def _logprobs(raw: torch.Tensor | None, sampled: torch.Tensor, sampled_l: list[int],
                  num_logprobs: list[int | None]) -> list[SampledLogprobs | None]:
        if raw is None:
            return [None] * len(num_logprobs)
        k = max(n for n in num_logprobs if n is not None)
        chosen = raw.gather(-1, sampled[:, None])
        ranks = (raw > chosen).sum(dim=-1) + 1
        top_values, top_ids = raw.topk(max(k, 1), dim=-1)
        # One read back: values, rank and ids side by side (ids < 2**24 are exact in float32).
        packed = torch.cat([chosen, ranks[:, None].float(), top_values,
                            top_ids.float()], dim=-1).tolist()
        width = top_values.shape[1]
        chosen_l = [p[0] for p in packed]
        ranks_l = [int(p[1]) for p in packed]
        top_values_l = [p[2:2 + width] for p in packed]
        top_ids_l = [[int(t) for t in p[2 + width:]] for p in packed]
        result: list[SampledLogprobs | None] = []
        for i, n in enumerate(num_logprobs):
            if n is None:
                result.append(None)
                continue
            result.append(SampledLogprobs(sampled_l[i], chosen_l[i], ranks_l[i],
                                          top_ids_l[i][:n], top_values_l[i][:n]))
        return result


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without a blocking copy (pinned staging on CUDA)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    staged = torch.tensor(values, dtype=dtype, pin_memory=True)
    return staged.to(device, non_blocking=True)


def _step_seed(seed: int, position: int) -> int:
    """A distinct, reproducible 63-bit seed per (request seed, output position)."""
    return (seed * 6364136223846793005 + position * 1442695040888963407 + 1) % (1 << 63)
