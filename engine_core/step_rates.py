"""StepRates: the engine's measured prefill rate and decode step time, for placement.

The proxy predicts when a worker would finish a prefill (its queued prompt tokens over its
prefill rate) and what TPOT its decodes see (its decode step time); both come from here in
the worker's heartbeat. Moving averages of step wall times: a step that carries at least
``min_prefill_tokens`` prompt tokens updates the rate (its decodes ride along, so the rate
is what a loaded worker gives), a step of decodes alone updates the step time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepRates:
    """Exponential moving averages over engine steps; 0 until a step of the kind ran."""

    weight: float = 0.2               # the newest step's share of each average
    min_prefill_tokens: int = 64      # smaller prefill steps are dominated by fixed costs
    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0

    def observe(self, seconds: float, num_prefill_tokens: int, num_decodes: int) -> None:
        """One completed step: its wall time, its prompt tokens, its decode rows."""
        if seconds <= 0:
            return
        if num_prefill_tokens >= self.min_prefill_tokens:
            self.prefill_tokens_per_s = self._mix(self.prefill_tokens_per_s,
                                                  num_prefill_tokens / seconds)
        elif num_prefill_tokens == 0 and num_decodes > 0:
            self.decode_step_s = self._mix(self.decode_step_s, seconds)

    def _mix(self, average: float, sample: float) -> float:
        return sample if average == 0.0 else average + self.weight * (sample - average)
