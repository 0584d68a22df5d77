"""A request's lifetime state inside the engine: tokens, progress, status, block hashes."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_core.kv_transfer_params import KVTransferParams, KVTransferResult
from engine_core.messages import TokenLogprob
from engine_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine_core.grammar.matcher import SequenceGrammar


class RequestStatus(enum.IntEnum):
    """Where a request is; values past PREEMPTED are terminal."""

    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason for a terminal status."""
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler sees it.

    ``token_ids`` is prompt plus output so far; ``num_computed_tokens`` counts the tokens
    whose KV is in the paged cache or scheduled into it (advanced when a step is scheduled;
    prefix hits and remote loads count too). ``num_pending_tokens`` counts tokens already
    being sampled by scheduled steps whose results the scheduler has not seen yet (async
    scheduling; 0 between steps otherwise).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    kv_transfer_params: KVTransferParams | None = None
    kv_transfer_result: KVTransferResult | None = None  # the connector's, once finished
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    # Prompt tokens found in the local prefix cache or loaded from a remote worker when first
    # scheduled; reported to clients as usage.prompt_tokens_details.cached_tokens.
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    token_ids: list[int] = field(init=False)
    first_scheduled_time: float | None = None
    # First admitted to compute (after its remote KV landed, for a decode worker).
    compute_start_time: float | None = None
    remote_kv_ready_time: float | None = None
    first_token_time: float | None = None
    # The grammar its output must match (structured outputs); None when unconstrained.
    grammar: SequenceGrammar | None = None
    # Prompt logprobs computed so far (prompt_logprobs requests), sent with the first token.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
