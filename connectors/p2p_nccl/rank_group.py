"""The P2P connector of a tensor-parallel worker: one connector worker per rank, rank r at
``kv_port + r``, each moving only the KV heads its rank holds.

Rank 0's scheduler side plans whole requests and splits each step into the ranks' shares
(``scheduler_side.py`` with ``rank_split.split_step``). ``RankZeroConnectorWorker`` is what
rank 0's engine sees: its own ``P2pConnectorWorker`` for its share, the other ranks' shares
encoded for their ``RankStep`` (``SHARE_CODEC``), and their reports combined with its own
(``RankReportCombiner``), so a request is reported once every rank it involves ended. Ranks
1..N-1 build theirs with ``rank_connector`` (named in ``RankInit``, resolved by import in the
rank's process, since engine_core imports no connector).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import torch

from connectors.p2p_nccl.connector_worker import P2pConnectorWorker
from connectors.p2p_nccl.metadata import SHARE_CODEC, P2pConnectorMetadata
from connectors.p2p_nccl.rank_split import RankShares
from engine_core.attention.metadata import AttentionMetadata
from engine_core.config import EngineConfig, KVTransferConfig
from engine_core.doorbell import Doorbell
from engine_core.errors import ConfigError
from engine_core.kv_connector import FinishedTransfers
from engine_core.parallel.kv_layout import KVLayout, PeerRanks
from engine_core.parallel.rank_reports import RankReportCombiner
from engine_core.worker.kv_cache import kv_cache_dtype
from engine_core.worker.loader import read_model_spec, resolve_dtype

RANK_FACTORY = "connectors.p2p_nccl.rank_group:rank_connector"


def rank_kv_config(config: KVTransferConfig, rank: int) -> KVTransferConfig:
    """Rank ``rank``'s connector config: the worker's, at ``kv_port + rank``."""
    port = config.kv_port + rank
    if port >= 65536:
        raise ConfigError(f"kv_port {config.kv_port} + rank {rank} is past 65535")
    return replace(config, kv_port=port)


def worker_ranks(config: EngineConfig, device: str) -> PeerRanks | None:
    """This worker's KV layout and rank addresses, from its checkpoint's shape and its
    cache config (the rules its engine sizes the cache by); None when ``config.model`` is no
    checkpoint directory (synthetic caches: whole blocks, rank 0 to rank 0)."""
    kv = config.kv_transfer
    if kv is None or not Path(config.model.model).is_dir():
        return None
    spec = read_model_spec(config.model.model)
    dtype = kv_cache_dtype(config.cache, resolve_dtype(config.model.dtype, spec.torch_dtype,
                                                       device))
    size = config.parallel.tensor_parallel_size
    layout = KVLayout.of_rank(size, 0, spec.num_key_value_heads, spec.head_dim,
                              config.cache.block_size, str(dtype).removeprefix("torch."),
                              spec.num_hidden_layers)
    addresses = tuple(f"{kv.kv_ip}:{rank_kv_config(kv, rank).kv_port}" for rank in range(size))
    return PeerRanks(layout, addresses)


def rank_connector(config: EngineConfig, device: str) -> P2pConnectorWorker:
    """Rank ``config.parallel.rank``'s connector worker (``RankInit.connector_factory``);
    its ``decode_share`` reads what ``RankZeroConnectorWorker.rank_shares`` encoded."""
    if config.kv_transfer is None:
        raise ConfigError("a rank connector needs --kv-transfer-config")
    return P2pConnectorWorker(rank_kv_config(config.kv_transfer, config.parallel.rank), device)


class RankZeroConnectorWorker:
    """Rank 0's connector worker of N ranks: its own worker for its share, the others'
    shares handed out, everyone's reports combined (``RankZeroConnector``)."""

    def __init__(self, own: P2pConnectorWorker, num_ranks: int) -> None:
        self.own = own
        self._num_ranks = num_ranks
        self._combiner = RankReportCombiner()
        self._lock = threading.Lock()  # guards _inbox (the report thread adds to it)
        self._inbox: list[tuple[int, FinishedTransfers | None]] = []  # None: rank lost
        self._rank_stats: dict[int, dict[str, float]] = {}  # each other rank's latest
        self._busy_ranks: set[int] = set()  # other ranks whose last report was not idle
        self._lost: set[int] = set()
        # Sends that ended on every rank, combined in ``land_loads``: reported by the next
        # ``get_finished`` (the engine applies only loads before its scheduling pass).
        self._sends_ended: set[str] = set()

    # ---- RankZeroConnector --------------------------------------------------------------

    @property
    def rank_factory(self) -> str:
        return RANK_FACTORY

    def rank_shares(self, metadata: RankShares | None) -> list[bytes | None]:
        """Ranks 1..N-1's shares (None where empty); expects each request's ranks."""
        if metadata is None:
            return [None] * (self._num_ranks - 1)
        for request_id, ranks in metadata.load_ranks.items():
            self._combiner.expect_load(request_id, ranks - self._lost)
        for request_id, ranks in metadata.save_ranks.items():
            self._combiner.expect_send(request_id, ranks - self._lost)
        return [None if share.is_empty else SHARE_CODEC.encode(share)
                for share in metadata.per_rank[1:]]

    def add_rank_report(self, rank: int, report: FinishedTransfers,
                        stats: dict[str, float], idle: bool) -> None:
        with self._lock:
            self._inbox.append((rank, report))
            self._rank_stats[rank] = stats
            if idle:
                self._busy_ranks.discard(rank)
            else:
                self._busy_ranks.add(rank)
        self.own.doorbell().ring()

    def rank_lost(self, rank: int) -> None:
        with self._lock:
            self._inbox.append((rank, None))
            self._rank_stats.pop(rank, None)  # its buffers and transfers are gone with it
            self._busy_ranks.discard(rank)
        self.own.doorbell().ring()

    # ---- ConnectorWorker ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.own.register_kv_caches(kv_caches)

    def release_kv_caches(self) -> None:
        self.own.release_kv_caches()

    def land_loads(self) -> FinishedTransfers:
        """Rank 0's landed loads and every rank's reports since, combined: the loads now,
        the sends with the next ``get_finished``."""
        done = self._combine(self.own.land_loads())
        self._sends_ended |= done.sending
        done.sending = set()
        return done

    def start_load_kv(self, metadata: RankShares | None) -> None:
        self.own.start_load_kv(_own_share(metadata))

    def bind_step(self, metadata: RankShares | None,
                  attn_metadata: AttentionMetadata | None) -> None:
        self.own.bind_step(_own_share(metadata), attn_metadata)

    def needs_layer_hooks(self, metadata: RankShares | None) -> bool:
        return self.own.needs_layer_hooks(_own_share(metadata))

    def before_layer(self, layer_idx: int) -> None:
        self.own.before_layer(layer_idx)

    def after_layer(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        self.own.after_layer(layer_idx, kv_cache)

    def wait_for_save(self) -> None:
        self.own.wait_for_save()

    def get_finished(self) -> FinishedTransfers:
        """Rank 0's finished transfers and every rank's reports since, combined."""
        done = self._combine(self.own.get_finished())
        done.sending |= self._sends_ended
        self._sends_ended = set()
        return done

    def stats(self) -> dict[str, float]:
        """The worker's gauges and counters: every rank's summed (the others' as they last
        reported them), plus the requests some rank has not reported ended."""
        total = dict(self.own.stats())
        with self._lock:
            others = list(self._rank_stats.values())
        for stats in others:
            for name, value in stats.items():
                total[name] = total.get(name, 0.0) + value
        total["rank_reports_pending"] = float(self._combiner.pending)
        return total

    def is_idle(self) -> bool:
        """Every rank idle (the others as they last reported) and no request waiting on
        another rank's report."""
        with self._lock:
            waiting = bool(self._inbox or self._busy_ranks)
        return (not waiting and not self._sends_ended and self._combiner.pending == 0
                and self.own.is_idle())

    def doorbell(self) -> Doorbell:
        return self.own.doorbell()

    def peer_ranks(self) -> PeerRanks | None:
        return self.own.peer_ranks()

    def shutdown(self) -> None:
        self.own.shutdown()

    # ---- helpers ------------------------------------------------------------------------

    def _combine(self, own: FinishedTransfers) -> FinishedTransfers:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        done = self._combiner.add(0, own)
        for rank, report in inbox:
            if rank in self._lost:
                continue
            if report is None:
                self._lost.add(rank)
                ended = self._combiner.drop_rank(rank)
            else:
                ended = self._combiner.add(rank, report)
            done.sending |= ended.sending
            done.recving |= ended.recving
            done.failed_recving |= ended.failed_recving
        return done


def _own_share(metadata: RankShares | None) -> P2pConnectorMetadata | None:
    return None if metadata is None else metadata.per_rank[0]
