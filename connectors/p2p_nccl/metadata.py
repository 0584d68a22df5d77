"""Per-step connector metadata: what the scheduler side tells the worker side."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.codec import MessageCodec
from engine_core.parallel.kv_layout import HeadSlice


@dataclass
class LoadSpec:
    """Consumer: receive ``block_ids`` (the request's blocks ``first_block...``) from a producer."""

    request_id: str
    transfer_id: str
    peer_address: str
    block_ids: list[int]
    first_block: int
    num_tokens: int
    grant: str  # the proxy's grant for this transfer, checked by the scheduler side
    # The KV heads of this rank's blocks the load fills (one route between tensor-parallel
    # layouts, ``kv_layout.plan_head_routes``); None: all of them.
    heads: HeadSlice | None = None


@dataclass
class SaveSpec:
    """Producer: this step computes the request's final prompt chunk; ``block_ids`` cover the
    ``prompt_len - 1`` tokens a consumer may need (it sends those the consumer lacks)."""

    request_id: str
    transfer_id: str
    peer_address: str
    block_ids: list[int]
    num_tokens: int
    # The KV heads of this rank's blocks the send moves (one route); None: all of them.
    heads: HeadSlice | None = None


@dataclass
class PeerNotice:
    """A transfer id to tell a peer about: a release (consumer needs nothing) or an abandon
    (producer will never send)."""

    transfer_id: str
    peer_address: str
    grant: str = ""  # a release carries the transfer's grant (P refuses one without)


@dataclass
class P2pConnectorMetadata:
    """Everything the worker side must do this step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    releases: list[PeerNotice] = field(default_factory=list)
    abandons: list[PeerNotice] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # consumer request ids no longer wanted

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.releases or self.abandons or self.cancels)


# One rank's share of a step, from rank 0 to the rank in its ``RankStep`` (opaque bytes to
# engine_core, whose codec cannot name connector types).
SHARE_CODEC = MessageCodec([P2pConnectorMetadata], max_bytes=64 << 20)
