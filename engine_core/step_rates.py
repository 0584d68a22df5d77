"""StepRates: the engine's measured prefill rates and decode step time.

A step is modelled as ``decode part + max(0, prefill tokens / prefill rate - base)``: the
decode part is what the step's decode rows cost (its fixed part ``base``, the weights read
once, plus every stream's context), the prefill rate is the marginal cost of prompt tokens,
and a prompt chunk's compute hides the weights' read it shares with the decodes (a chunk of
a few hundred tokens on an 8B model takes longer than that read). With ``base`` unmeasured
(0) the parts add. All come from each step's device time (``worker/step_clock.py``; a
step's host wall time is not its cost under async scheduling) as moving averages:

- a step of decodes alone measures the decode part (with one or two decodes, its fixed
  part; with more, its growth per decode row, which predicts the decode part of any batch:
  ``decode_part_s``);
- a step of prefill alone measures ``prefill_alone_tokens_per_s``: what a worker without
  decodes computes (whole prompts, batched);
- a mixed step whose prefill is the larger part measures ``prefill_tokens_per_s``, the
  marginal rate of prompt tokens beside decodes (when it runs well past the fixed part),
  and, with the fixed part measured, what mixed steps take beyond the model
  (``mixed_excess_s``), which shrinks the part a chunk hides and so the next mixed steps'
  prompt tokens. Without the fixed part measured the parts add and a mixed step whose
  decode part is the larger one measures that part.

The two prefill rates are kept apart because they differ by far more than noise: a mixed
step's chunk is small (the step target bounds it), and on an H200 its marginal rate is well
under half the rate of prompts alone. Each stands in for the other until it is measured.

Two users: the scheduler bounds a mixed step's prompt tokens by the worker's decode-step
target (``mixed_step_prefill_budget``), and the proxy predicts when a worker finishes a prefill
from the rates in its heartbeat (``prefill_rate_beside_decodes``; the lane plan of
``proxy/lanes.py`` runs a prefill lane at the rate of prefill alone).
"""

from __future__ import annotations

from dataclasses import dataclass

# A prefill measures the rate only past this many times the step's fixed part.
RATE_SPAN = 2.0


@dataclass
class StepRates:
    """Exponential moving averages over engine steps; 0 until a step of the kind ran."""

    weight: float = 0.2               # the newest step's share of each average
    min_prefill_tokens: int = 64      # a smaller prefill alone is dominated by fixed costs
    prefill_tokens_per_s: float = 0.0        # marginal, in mixed steps
    prefill_alone_tokens_per_s: float = 0.0  # in steps without decodes
    decode_step_s: float = 0.0
    # The decode step's fixed part (the weights read once): steps of at most this many
    # decodes alone measure it (the proxy's lane plan needs how a step grows with its batch).
    base_max_decodes: int = 2
    decode_base_s: float = 0.0
    decode_base_rows: float = 0.0  # the decode rows of the steps that measured it (1-2)
    # What each decode row adds, from steps of at least ``min_growth_rows`` decodes alone
    # over the fixed part's: the decode part of a batch that no step of decodes alone has
    # run (a worker that always has prompt tokens to compute runs none, and its average
    # above goes stale).
    min_growth_rows: int = 4
    decode_per_row_s: float = 0.0
    # What mixed steps take beyond the model's prediction (the chunk hides less of the
    # weights' read than modelled, attention over the prompt): budgets plan around it.
    mixed_excess_s: float = 0.0

    def observe(self, seconds: float, num_prefill_tokens: int, num_decodes: int) -> None:
        """One completed step: its wall time, its prompt tokens, its decode rows."""
        if seconds <= 0 or (num_prefill_tokens == 0 and num_decodes == 0):
            return
        if num_prefill_tokens == 0:
            self.decode_step_s = self._mix(self.decode_step_s, seconds)
            if num_decodes <= self.base_max_decodes:
                self.decode_base_s = self._mix(self.decode_base_s, seconds)
                self.decode_base_rows = self._mix(self.decode_base_rows, float(num_decodes))
            elif self.decode_base_s and num_decodes >= self.min_growth_rows:
                self.decode_per_row_s = self._mix(
                    self.decode_per_row_s,
                    max(0.0, seconds - self.decode_base_s) / (num_decodes - self.decode_base_rows))
            return
        if num_decodes == 0:
            if self._shows_rate(num_prefill_tokens, seconds):
                self.prefill_alone_tokens_per_s = self._mix(self.prefill_alone_tokens_per_s,
                                                            num_prefill_tokens / seconds)
            return
        if not (self.prefill_tokens_per_s or self.decode_step_s):
            # Nothing measured beside decodes yet (they ride along): tokens / seconds.
            if self._shows_rate(num_prefill_tokens, seconds):
                self.prefill_tokens_per_s = self._mix(self.prefill_tokens_per_s,
                                                      num_prefill_tokens / seconds)
            return
        predicted_prefill_s = (num_prefill_tokens / self.prefill_tokens_per_s
                               if self.prefill_tokens_per_s else None)
        decode = self.decode_part_s(num_decodes)
        base = min(self.decode_base_s, decode)
        if predicted_prefill_s is not None and decode:
            predicted = decode + max(0.0, predicted_prefill_s - base)
            self.mixed_excess_s = self._mix(self.mixed_excess_s, seconds - predicted)
        if predicted_prefill_s is None or (decode and predicted_prefill_s > decode):
            # The prefill is the larger part: measured, the decode part predicted (its
            # fixed part hidden under the prefill's compute).
            prefill_s = seconds - (decode - base)
            if self._shows_rate(num_prefill_tokens, prefill_s):
                self.prefill_tokens_per_s = self._mix(self.prefill_tokens_per_s,
                                                      num_prefill_tokens / prefill_s)
            return
        if base:  # the decode part comes from steps of decodes alone; the excess covers it
            return
        decode_s = seconds - predicted_prefill_s
        if decode_s > 0:
            self.decode_step_s = self._mix(self.decode_step_s, decode_s)

    def decode_part_s(self, num_decodes: int) -> float:
        """The decode part of a step of ``num_decodes`` decodes: the fixed part's step plus
        the growth of the rows beyond its own once both are measured, else the average of
        recent steps of decodes alone. The engine plans and reads its mixed steps with it,
        and its heartbeat reports it for the current batch (``extrapolated_step``)."""
        if self.decode_base_s and self.decode_per_row_s:
            return self.decode_base_s + self.decode_per_row_s * (num_decodes
                                                                 - self.decode_base_rows)
        return self.decode_step_s

    @property
    def rate_beside_decodes(self) -> float:
        """The marginal prefill rate of a mixed step; the rate of prefill alone until a
        mixed step has measured it (0: neither measured)."""
        return self.prefill_tokens_per_s or self.prefill_alone_tokens_per_s

    @property
    def _fixed_s(self) -> float:
        """The decode step's fixed part, never more than the step itself (0: unmeasured)."""
        return min(self.decode_base_s, self.decode_step_s)

    @property
    def hidden_s(self) -> float:
        """The part of the decode step a prompt chunk beside it hides: the fixed part, less
        what mixed steps have taken beyond the model."""
        return max(0.0, self._fixed_s - max(0.0, self.mixed_excess_s))

    def _shows_rate(self, num_prefill_tokens: int, prefill_s: float) -> bool:
        """Whether a prefill of this size and time measures the prefill rate: enough tokens,
        and a time well past the step's fixed part (a chunk that hides under the weights'
        read says nothing of its rate; counted, it would shrink the next chunks)."""
        return (num_prefill_tokens >= self.min_prefill_tokens
                and prefill_s > RATE_SPAN * self.decode_base_s)

    def _mix(self, average: float, sample: float) -> float:
        return sample if average == 0.0 else average + self.weight * (sample - average)


def extrapolated_step(step_s: float, per_row_s: float, measured_rows: int, rows: int) -> float:
    """A worker's decode part at ``rows`` decodes from its heartbeat: the part it reported
    for its ``measured_rows`` (``StepRates.decode_part_s``) plus the growth of the rows
    beyond them (the proxy may know of streams the engine has not started yet)."""
    return step_s + per_row_s * max(0, rows - measured_rows)


def mixed_prefill_tokens(target_s: float, decode_step_s: float, prefill_tokens_per_s: float,
                         hidden_s: float = 0.0) -> float:
    """Prompt tokens a step with decodes can carry and still end within ``target_s``: the
    time its decode part leaves plus the part of it a chunk's compute hides
    (``StepRates.hidden_s``), at the prefill rate (0 when the decodes alone fill it)."""
    if target_s < decode_step_s:
        return 0.0
    return (target_s - decode_step_s + min(hidden_s, decode_step_s)) * prefill_tokens_per_s


def mixed_step_prefill_budget(target_s: float | None, rates: StepRates, block_size: int,
                              num_decodes: int) -> int | None:
    """The prompt tokens of a step with ``num_decodes`` decodes under ``target_s``:
    ``mixed_prefill_tokens`` in whole blocks, at least one so prefills always progress. None
    (unbounded) without a target or until a prefill rate is measured (an unbounded step
    measures it)."""
    rate = rates.rate_beside_decodes
    if target_s is None or not rate:
        return None
    tokens = int(mixed_prefill_tokens(target_s, rates.decode_part_s(num_decodes), rate,
                                      rates.hidden_s))
    return max(block_size, tokens - tokens % block_size)


def prefill_rate_beside_decodes(prefill_tokens_per_s: float, decode_step_s: float,
                                target_s: float, hidden_s: float = 0.0) -> float:
    """Prompt tokens per second a worker computes while it decodes: with a decode-step
    target, the share of each step its decodes leave (``mixed_prefill_tokens`` per step of
    ``target_s``); without one, its full rate (its prefill chunks then stall its streams)."""
    if not target_s or not decode_step_s:
        return prefill_tokens_per_s
    return mixed_prefill_tokens(target_s, decode_step_s, prefill_tokens_per_s,
                                hidden_s) / target_s
