"""Messages between an API process and its engine-core process (ZMQ + msgpack)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine_core.codec import MessageCodec
from engine_core.kv_transfer_params import KVTransferParams, KVTransferResult


@dataclass
class AddRequest:
    """Start generating for a tokenized prompt."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    arrival_time: float
    kv_transfer_params: KVTransferParams | None = None
    # Output tokens sampled elsewhere that the client already has (a prefill worker's first
    # token, streamed by the proxy): the request continues after them, counting them as
    # output (max_tokens, min_tokens, penalties, seeded positions, stop checks).
    generated_token_ids: list[int] = field(default_factory=list)


@dataclass
class AbortRequests:
    """Stop these requests and free their blocks (client gone, stop string hit)."""

    request_ids: list[str]


@dataclass
class UtilityCall:
    """An out-of-band call: reset_prefix_cache, get_stats, check_health, shutdown."""

    call_id: int
    method: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class UtilityResult:
    call_id: int
    ok: bool
    result: Any = None
    error: str | None = None


@dataclass
class TokenLogprob:
    """Logprob of one generated token and its top alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class RequestTimings:
    """Engine-side timestamps (monotonic seconds) for per-request latency breakdowns.

    ``first_scheduled_time`` is when the scheduler first took the request (a decode worker
    parks it there to wait for remote KV); ``compute_start_time`` is when it first ran on
    this engine, after ``remote_kv_ready_time`` when its prompt KV came from a peer.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    compute_start_time: float | None = None
    remote_kv_ready_time: float | None = None


@dataclass
class EngineOutput:
    """New tokens of one request since the last output, and its end when finished."""

    request_id: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    finish_reason: str | None = None     # stop | length | abort | error
    stop_reason: int | str | None = None  # the stop token id, when one ended it
    new_logprobs: list[TokenLogprob] | None = None
    # With the first token of a request that asked for them: prompt positions 1.. (the
    # first position has none), each the prompt token's logprob and its alternatives.
    prompt_logprobs: list[TokenLogprob] | None = None
    kv_transfer_params: KVTransferResult | None = None  # a prefill worker's, when finished
    error: str | None = None
    error_param: str | None = None  # the request parameter an invalid request's error names
    timings: RequestTimings | None = None


# Upper bounds of vLLM's ``iteration_tokens_total`` buckets (tokens an engine step ran);
# ``EngineStats.iteration_token_counts`` has one more entry, for steps above the last.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class EngineStats:
    """Snapshot of scheduler and cache state for /metrics and heartbeats."""

    num_running: int
    num_waiting: int
    num_waiting_for_remote_kv: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_computed_prompt_tokens_total: int
    rejected_messages: int = 0
    connector: dict[str, float] = field(default_factory=dict)
    # KV offload (zero when off): blocks downloaded to / uploaded from host memory, and the
    # share of host slots holding a block.
    kv_offload_stored_blocks: int = 0
    kv_offload_loaded_blocks: int = 0
    kv_offload_usage: float = 0.0
    sleep_level: int = 0  # sleep mode: 0 awake, else the level it sleeps at
    # Steps by the tokens they ran, per ITERATION_TOKEN_BUCKETS bucket (not cumulative),
    # and the tokens' sum.
    iteration_token_counts: list[int] = field(default_factory=list)
    iteration_tokens_sum: int = 0
    # Placement inputs (engine_core/step_rates.py): prompt tokens still to compute (waiting
    # and partly prefilled requests; not those whose KV comes from a peer), the measured
    # prefill rates (mixed steps' marginal one, and that of steps without decodes), the
    # decode part of a step of the current decodes and the step's fixed part (0 until
    # measured), the decode-step target that bounds its mixed steps (0: none).
    num_prefill_tokens_queued: int = 0
    num_decoding: int = 0  # running requests past their prefill
    prefill_tokens_per_s: float = 0.0
    prefill_alone_tokens_per_s: float = 0.0  # the rate of steps without decodes
    decode_step_s: float = 0.0
    decode_step_target_s: float = 0.0
    decode_base_s: float = 0.0
    decode_hidden_s: float = 0.0  # the part of it a prompt chunk beside it hides
    decode_per_row_s: float = 0.0  # what each decode row adds to the fixed part


@dataclass
class EngineOutputs:
    """One batch of outputs pushed from the engine to the API process."""

    outputs: list[EngineOutput]
    stats: EngineStats | None = None


ENGINE_INPUT_CODEC = MessageCodec([AddRequest, AbortRequests, UtilityCall])
ENGINE_OUTPUT_CODEC = MessageCodec([EngineOutputs, UtilityResult])
