"""What ``LLM.generate`` returns, in vLLM's shape: a ``RequestOutput`` per prompt holding
one ``CompletionOutput`` per sampled sequence, so vLLM scripts read results unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.output_processor import LogprobEntry
from engine_core.prompt_logprobs import PromptLogprobs


@dataclass
class RequestMetrics:
    """Per-request timings in seconds (monotonic clock)."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated sequence: its text, token ids, and why it ended."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[LogprobEntry] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The finished result of one prompt (``prompt`` is None for a token-id prompt)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # vLLM's: None at the first prompt position, then token id -> Logprob (prompt_logprobs).
    prompt_logprobs: PromptLogprobs | None = None
