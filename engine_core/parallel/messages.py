"""Messages from the engine (rank 0) to the other tensor-parallel ranks, on ZMQ through the
project's codec (never pickle)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.codec import MessageCodec
from engine_core.config import EngineConfig
from engine_core.sched.kv_cache_manager import HostCopies
from engine_core.sched.outputs import CachedRequestData, NewRequestData, SchedulerOutput


@dataclass
class RankInit:
    """The first message a rank receives: the engine's configuration with its own rank."""

    config: EngineConfig


@dataclass
class RankStep:
    """One scheduler step as every rank runs it: the scheduler output less what only rank 0
    reads (connector metadata, the scheduler's own request objects)."""

    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str] = field(default_factory=list)
    host_copies: HostCopies | None = None

    @classmethod
    def of(cls, output: SchedulerOutput) -> RankStep:
        return cls(output.scheduled_new_reqs, output.scheduled_cached_reqs,
                   output.num_scheduled_tokens, output.total_num_scheduled_tokens,
                   sorted(output.finished_req_ids), output.host_copies or None)

    def scheduler_output(self) -> SchedulerOutput:
        return SchedulerOutput(self.new_reqs, self.cached_reqs, self.num_scheduled_tokens,
                               self.total_num_scheduled_tokens, set(self.finished_req_ids),
                               host_copies=self.host_copies)


@dataclass
class RankStop:
    """The engine is shutting down: the rank leaves the group and exits."""


RANK_CODEC = MessageCodec([RankInit, RankStep, RankStop], max_bytes=256 << 20)
