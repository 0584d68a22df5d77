"""Plain values that flow scheduler -> runner -> scheduler each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine_core.messages import TokenLogprob
from engine_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine_core.request import Request
    from engine_core.sched.kv_cache_manager import HostCopies


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """A request the runner already holds: its new blocks and progress."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    """One step's decision: which requests run and how many tokens each contributes."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must forget (finished, aborted or preempted since the last step).
    finished_req_ids: set[str] = field(default_factory=set)
    # The connector's own metadata for its worker side: opaque to the engine core, whose
    # NullConnector puts None here.
    kv_connector_metadata: Any = None
    # KV offload copies the runner queues before this step.
    host_copies: HostCopies | None = None
    # The constrained requests that sample in this step: their masks are filled once the
    # step before is collected (``Scheduler.grammar_masks``), after the launch.
    grammar_request_ids: set[str] = field(default_factory=set)
    # The scheduler's own request objects (the runner never reads them): the update of this
    # step lands only on these, never on a newer request that reuses a finished one's id.
    scheduled_requests: dict[str, Request] = field(default_factory=dict, repr=False)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class PromptLogprobsChunk:
    """The prompt logprobs one step computed for a request: positions ``first_position``
    onwards (a prompt's position 0 has none)."""

    first_position: int
    entries: list[TokenLogprob]


@dataclass
class ModelRunnerOutput:
    """What the runner hands back: one sampled token per request that completed its prompt."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request: the sampled token's logprob and top alternatives, when asked for.
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # Per request asking for them: the logprobs of the prompt positions this step computed.
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)

    @staticmethod
    def empty() -> ModelRunnerOutput:
        return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
