"""Messages from the engine (rank 0) to the other tensor-parallel ranks, on ZMQ through the
project's codec (never pickle)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine_core.codec import MessageCodec
from engine_core.config import EngineConfig
from engine_core.kv_connector import FinishedTransfers
from engine_core.sched.kv_cache_manager import HostCopies
from engine_core.sched.outputs import CachedRequestData, NewRequestData, SchedulerOutput


@dataclass
class RankInit:
    """The first message a rank receives: the engine's configuration with its own rank;
    with a KV connector, the ``module:function`` that builds the rank's connector worker
    and the address of rank 0's report socket."""

    config: EngineConfig
    connector_factory: str | None = None
    report_address: str | None = None


@dataclass
class RankStep:
    """One scheduler step as every rank runs it: the scheduler output less what only rank 0
    reads (the scheduler's own request objects), with this rank's share of the connector
    metadata in the connector's codec (None: nothing for this rank)."""

    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str] = field(default_factory=list)
    host_copies: HostCopies | None = None
    connector_share: bytes | None = None

    @classmethod
    def of(cls, output: SchedulerOutput, connector_share: bytes | None = None) -> RankStep:
        return cls(output.scheduled_new_reqs, output.scheduled_cached_reqs,
                   output.num_scheduled_tokens, output.total_num_scheduled_tokens,
                   sorted(output.finished_req_ids), output.host_copies or None,
                   connector_share)

    def scheduler_output(self, connector_metadata: Any = None) -> SchedulerOutput:
        return SchedulerOutput(self.new_reqs, self.cached_reqs, self.num_scheduled_tokens,
                               self.total_num_scheduled_tokens, set(self.finished_req_ids),
                               host_copies=self.host_copies,
                               kv_connector_metadata=connector_metadata)


@dataclass
class RankReport:
    """Rank 1..N-1 -> rank 0: the transfers the rank's connector worker ended since its
    last report (its part of each request; rank 0 combines the ranks'), its connector's
    gauges and counters now (the worker's /metrics sum the ranks') and whether it holds no
    transfer state (rank 0 keeps stepping, so deadlines expire, while any rank does)."""

    rank: int
    sending: list[str] = field(default_factory=list)
    recving: list[str] = field(default_factory=list)
    failed_recving: list[str] = field(default_factory=list)
    connector_stats: dict[str, float] = field(default_factory=dict)
    idle: bool = True

    @classmethod
    def of(cls, rank: int, finished: FinishedTransfers, connector_stats: dict[str, float],
           idle: bool) -> RankReport:
        return cls(rank, sorted(finished.sending), sorted(finished.recving),
                   sorted(finished.failed_recving), connector_stats, idle)

    def finished(self) -> FinishedTransfers:
        return FinishedTransfers(set(self.sending), set(self.recving),
                                 set(self.failed_recving))


@dataclass
class RankStop:
    """The engine is shutting down: the rank leaves the group and exits."""


RANK_CODEC = MessageCodec([RankInit, RankStep, RankStop, RankReport], max_bytes=256 << 20)
