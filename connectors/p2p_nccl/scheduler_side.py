"""Scheduler side of the P2P connector: pure decisions, no devices, sockets or threads.

Consumer (D): a new request with ``do_remote_prefill`` gets ``prompt_len - 1 - local_hit``
tokens from its producer (D computes the last prompt token itself to get logits); once
blocks exist, a ``LoadSpec`` goes to the worker. Producer (P): a request with
``do_remote_decode`` gets a ``SaveSpec`` in the step that computes its final prompt chunk,
and its blocks are held after it finishes until the worker reports the send done.

Either side moves KV only under the proxy's transfer grant (``kv_transfer_params.grant``,
``engine_core.cluster.grants``) naming this engine and the peer: P sends only to the D its
grant names, D pulls only from the P its grant names. A request whose grant is missing,
forged, expired or names other peers moves no KV: P computes and answers it, D computes the
prompt itself.

Between tensor-parallel layouts (``ranks`` given: this worker's layout and rank addresses)
each step's request-level plan is split into routes (``rank_split.split_step``) against the
peer's ranks from its ``kv_transfer_params.remote_ranks`` (a peer without them is one rank at
its address). A peer whose layout cannot be mapped onto this worker's, or whose ranks name
another rank-0 address than ``remote_kv_address``, is refused like a bad grant. With one
rank, ``build_connector_meta`` returns that rank's ``P2pConnectorMetadata``; with several,
the ``RankShares`` of all of them (rank 0's connector worker hands the others theirs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from connectors.p2p_nccl.metadata import LoadSpec, P2pConnectorMetadata, PeerNotice, SaveSpec
from connectors.p2p_nccl.rank_split import RankShares, RouteGrants, split_step
from engine_core.cluster.grants import GrantAuthority
from engine_core.cluster.trust import TrustRefusal
from engine_core.config import KVTransferConfig
from engine_core.kv_connector import ExternalMatch, FinishedTransfers
from engine_core.kv_transfer_params import KVTransferResult
from engine_core.parallel.kv_layout import PeerRanks, layout_mismatch
from engine_core.request import Request
from engine_core.sched.outputs import SchedulerOutput

logger = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _ProducerRequest:
    transfer_id: str
    peer_address: str
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    saved: bool = False
    num_send_blocks: int = 0


# The two directions a request's KV moves: pulled from a producer (its params'
# ``do_remote_prefill``) or pushed to a consumer (``do_remote_decode``).
_PULL, _PUSH = True, False


def _asks(request: Request, pull: bool) -> bool:
    """Whether the request's params ask to move its KV in this direction."""
    params = request.kv_transfer_params
    return params is not None and (params.do_remote_prefill if pull
                                   else params.do_remote_decode)


def _remote_params(request: Request, pull: bool) -> tuple[str, str, str | None] | None:
    """(transfer_id, remote_kv_address, grant) when the request asks to move KV in this
    direction and names the transfer and the peer."""
    params = request.kv_transfer_params
    if (params is None or not _asks(request, pull) or params.transfer_id is None
            or params.remote_kv_address is None):
        return None
    return params.transfer_id, params.remote_kv_address, params.grant


class P2pConnectorScheduler:
    """Decides which requests load remote KV (consumer) and which send it (producer)."""

    def __init__(self, config: KVTransferConfig, block_size: int,
                 ranks: PeerRanks | None = None) -> None:
        self._config = config
        self._block_size = block_size
        self._own_address = f"{config.kv_ip}:{config.kv_port}"
        self._ranks = ranks
        # Peer rank-0 address -> its ranks, from the params of the requests that name it.
        self._peers: dict[str, PeerRanks] = {}
        # consumer
        self._new_loads: dict[str, LoadSpec] = {}
        self._loading: dict[str, LoadSpec] = {}
        self._loaded: set[str] = set()  # loaded or failed once: later schedules compute locally
        self._releases: list[PeerNotice] = []
        self._cancels: list[str] = []
        # producer
        self._producing: dict[str, _ProducerRequest] = {}
        self._holding: dict[str, str] = {}  # request id -> transfer id, blocks held for a send
        self._transfer_owner: dict[str, str] = {}  # transfer id -> the producer request sending it
        self._sent_early: set[str] = set()
        self._abandons: list[PeerNotice] = []
        self._invalid_params = 0
        self._grants = GrantAuthority(config.cluster_secret)
        # (request id, pull) -> its checked (transfer id, peer, grant) or None (refused): a
        # grant is checked once, when the request is first seen, however long it then waits.
        self._checked: dict[tuple[str, bool], tuple[str, str, str] | None] = {}

    # ---- ConnectorScheduler -------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalMatch:
        """Consumer: prompt tokens after the local hit, minus the last one; producer: 0."""
        if self._config.is_consumer and request.request_id not in self._loaded:
            remote = self._granted(request, _PULL)
            if remote is not None:
                num_external = max(0, request.num_prompt_tokens - 1 - num_computed_tokens)
                if num_external == 0:
                    # The local cache holds everything: tell P to drop what it keeps for us.
                    self._loaded.add(request.request_id)
                    self._releases.append(PeerNotice(*remote))
                    return ExternalMatch(0, False)
                return ExternalMatch(num_external, True)
            if _asks(request, _PULL):
                self._invalid_params += 1
        if self._config.is_producer:
            remote = self._granted(request, _PUSH)
            if remote is None and _asks(request, _PUSH):
                self._invalid_params += 1
            if remote is not None:
                state = self._producing.get(request.request_id)
                owner = self._transfer_owner.get(remote[0], request.request_id)
                if owner != request.request_id:
                    # One transfer id, one send: the worker keys its pending sends by it,
                    # so a second request would take the first one's place and leave its
                    # blocks held for good. This one is computed and answered, not sent.
                    self._invalid_params += 1
                    logger.warning("request %s: transfer id %r is in use by request %s; "
                                   "its KV will not be sent", request.request_id, remote[0],
                                   owner)
                elif state is None:
                    self._producing[request.request_id] = _ProducerRequest(
                        remote[0], remote[1], request.num_prompt_tokens)
                    self._transfer_owner[remote[0]] = request.request_id
                else:  # rescheduled after preemption: its blocks come anew
                    state.block_ids = []
        return ExternalMatch(0, False)

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_local_computed_tokens: int, num_external_tokens: int) -> None:
        """Remember which of the request's blocks the producer must fill."""
        if num_external_tokens <= 0 or not self._config.is_consumer:
            return
        remote = self._granted(request, _PULL)
        if remote is None:
            return
        first_block = num_local_computed_tokens // self._block_size
        end_block = _cdiv(num_local_computed_tokens + num_external_tokens, self._block_size)
        self._new_loads[request.request_id] = LoadSpec(
            request_id=request.request_id, transfer_id=remote[0], peer_address=remote[1],
            block_ids=list(block_ids[first_block:end_block]), first_block=first_block,
            num_tokens=num_external_tokens, grant=remote[2])

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> P2pConnectorMetadata | RankShares:
        """Loads to start, saves due this step, notices for peers, cancelled loads: one
        rank's metadata, or every rank's share of it (``RankShares``) for several ranks."""
        meta = self._plan(scheduler_output)
        if self._ranks is None:
            return meta
        shares = split_step(meta, self._ranks.layout, self._peers,
                            RouteGrants(self._ranks.addresses, self._grants.for_route))
        return shares.per_rank[0] if self._ranks.layout.tp_size == 1 else shares

    def _plan(self, scheduler_output: SchedulerOutput) -> P2pConnectorMetadata:
        """The request-level plan, against each peer's rank 0."""
        meta = P2pConnectorMetadata(loads=list(self._new_loads.values()), releases=self._releases,
                                    abandons=self._abandons, cancels=self._cancels)
        self._loading.update(self._new_loads)
        self._new_loads = {}
        self._releases, self._abandons, self._cancels = [], [], []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._producing.get(new.request_id)
            if state is not None:
                state.block_ids = list(new.block_ids)
                self._maybe_save(new.request_id, state, new.num_computed_tokens,
                                 scheduled.get(new.request_id, 0), meta)
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self._producing.get(cached.request_id)
            if state is not None:
                state.block_ids.extend(cached.new_block_ids)
                self._maybe_save(cached.request_id, state, cached.num_computed_tokens,
                                 scheduled.get(cached.request_id, 0), meta)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, KVTransferResult | None]:
        """Producer: hold the blocks while a send is due or running; consumer: cancel a
        running load and hold the blocks until the worker reports it ended (its receives
        scatter into them as they land), or tell the producer to drop what it keeps when no
        load was ever asked for (a request aborted while queued, or finished by the token it
        continues from)."""
        request_id = request.request_id
        asked = request_id in self._loaded
        self._loaded.discard(request_id)
        unsent = self._new_loads.pop(request_id, None)
        loading = False
        if unsent is not None:  # the worker never saw this load: P only needs the release
            self._releases.append(PeerNotice(unsent.transfer_id, unsent.peer_address,
                                             unsent.grant))
        elif self._loading.pop(request_id, None) is not None:
            self._cancels.append(request_id)  # the worker releases P if its pull is unsent
            loading = True
        elif not asked and self._config.is_consumer:
            remote = self._granted(request, _PULL)
            if remote is not None:
                self._releases.append(PeerNotice(*remote))
        for pull in (_PULL, _PUSH):
            self._checked.pop((request_id, pull), None)
        state = self._producing.pop(request_id, None)
        if state is None:
            return loading, None
        result = KVTransferResult(state.transfer_id, self._own_address, state.num_send_blocks)
        sent = request_id in self._sent_early
        self._sent_early.discard(request_id)
        if not state.saved:
            self._abandons.append(PeerNotice(state.transfer_id, state.peer_address))
            self._transfer_owner.pop(state.transfer_id, None)
            return False, result
        hold = state.num_send_blocks > 0 and not sent
        if hold:
            self._holding[request_id] = state.transfer_id
        else:
            self._transfer_owner.pop(state.transfer_id, None)
        return hold, result

    def pins_blocks(self, request: Request) -> bool:
        """A producer request whose save is scheduled but whose send is not done: the worker
        side gathers those block ids later (when D's pull arrives), so freeing them by a
        preemption would send whatever request the blocks went to next."""
        state = self._producing.get(request.request_id)
        return (state is not None and state.saved and state.num_send_blocks > 0
                and request.request_id not in self._sent_early)

    def update_finished(self, finished: FinishedTransfers) -> None:
        """Forget finished loads; release held producer blocks whose send is done."""
        for request_id in finished.recving | finished.failed_recving:
            if self._loading.pop(request_id, None) is not None:
                self._loaded.add(request_id)
        for request_id in finished.sending:
            if request_id in self._holding:
                self._transfer_owner.pop(self._holding.pop(request_id), None)
            elif request_id in self._producing:
                self._sent_early.add(request_id)

    def stats(self) -> dict[str, float]:
        """Gauges of the scheduler side (all zero when idle)."""
        return {
            "loads_pending": float(len(self._new_loads) + len(self._loading)),
            "producer_requests": float(len(self._producing)),
            "held_requests": float(len(self._holding)),
            "invalid_transfer_params": float(self._invalid_params),
            "transfer_grants_refused": float(self._grants.refusals.total),
        }

    def is_idle(self) -> bool:
        """True when no request state is kept (tests assert this after every run)."""
        return not (self._new_loads or self._loading or self._producing or self._holding
                    or self._transfer_owner or self._checked
                    or self._sent_early or self._loaded or self._releases or self._abandons
                    or self._cancels)

    # ---- helpers ------------------------------------------------------------------------

    def _granted(self, request: Request, pull: bool) -> tuple[str, str, str] | None:
        """(transfer_id, peer kv address, grant) when the request moves KV in this direction
        and its grant names this engine and that peer; None otherwise (checked once per
        request). D's pulls carry the grant on, so P checks them against it too."""
        key = (request.request_id, pull)
        if key in self._checked:
            return self._checked[key]
        remote = _remote_params(request, pull)
        if remote is None:
            return None
        transfer_id, peer, token = remote
        producer, consumer = ((peer, self._own_address) if pull
                              else (self._own_address, peer))
        try:
            self._grants.verify(token, transfer_id=transfer_id, producer=producer,
                                consumer=consumer, peer=peer)
            granted: tuple[str, str, str] | None = (transfer_id, peer, str(token))
        except TrustRefusal:  # counted and logged once per peer by the authority
            granted = None
        if granted is not None and not self._learn_peer(request, peer, pull):
            granted = None
        self._checked[key] = granted
        return granted

    def _learn_peer(self, request: Request, peer: str, pull: bool) -> bool:
        """Record the peer's ranks from the request's params; False (logged, counted as
        invalid params by the caller's refusal) when they cannot serve this transfer."""
        params = request.kv_transfer_params
        ranks = params.remote_ranks if params is not None else None
        if ranks is None or self._ranks is None:
            return True
        reason = None
        if ranks.address != peer:
            reason = f"remote_ranks name {ranks.address}, not {peer}"
        else:
            producer, consumer = ((ranks.layout, self._ranks.layout) if pull
                                  else (self._ranks.layout, ranks.layout))
            reason = layout_mismatch(producer, consumer)
        if reason is not None:
            logger.warning("request %s moves no KV: peer %s: %s", request.request_id, peer,
                           reason)
            return False
        self._peers[peer] = ranks
        return True

    def _maybe_save(self, request_id: str, state: _ProducerRequest, num_computed: int,
                    num_scheduled: int, meta: P2pConnectorMetadata) -> None:
        if state.saved or num_computed + num_scheduled < state.num_prompt_tokens:
            return
        state.saved = True
        num_blocks = _cdiv(state.num_prompt_tokens - 1, self._block_size)
        if num_blocks == 0 or len(state.block_ids) < num_blocks:
            # A 1-token prompt: nothing to send; drop a consumer's release if one arrives.
            meta.abandons.append(PeerNotice(state.transfer_id, state.peer_address))
            return
        state.num_send_blocks = num_blocks
        meta.saves.append(SaveSpec(request_id=request_id, transfer_id=state.transfer_id,
                                   peer_address=state.peer_address,
                                   block_ids=state.block_ids[:num_blocks],
                                   num_tokens=state.num_prompt_tokens - 1))
