"""KV transfer connectors: the P2P connector (NCCL on GPU, ZMQ bytes on CPU).

``create_connector`` is the only entry the engine wiring needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_core.kv_connector import (
    ConnectorScheduler,
    ConnectorWorker,
    NullConnectorScheduler,
    NullConnectorWorker,
)

if TYPE_CHECKING:
    from engine_core.config import EngineConfig


def create_connector(config: EngineConfig, device: str) -> tuple[ConnectorScheduler, ConnectorWorker]:
    """The (scheduler side, worker side) pair for this engine; the null pair when colocated.

    The worker side binds its control socket when the runner calls ``register_kv_caches``.
    A tensor-parallel engine gets rank 0's pair (``p2p_nccl/rank_group.py``).
    """
    kv_transfer = config.kv_transfer
    if kv_transfer is None:
        return NullConnectorScheduler(), NullConnectorWorker()
    from connectors.p2p_nccl.connector_worker import P2pConnectorWorker
    from connectors.p2p_nccl.rank_group import RankZeroConnectorWorker, worker_ranks
    from connectors.p2p_nccl.scheduler_side import P2pConnectorScheduler

    ranks = worker_ranks(config, device)
    worker: ConnectorWorker = P2pConnectorWorker(kv_transfer, device, ranks=ranks)
    size = config.parallel.tensor_parallel_size
    if size > 1:  # rank 0's: ranks 1..N-1 run theirs (``rank_group.rank_connector``)
        worker = RankZeroConnectorWorker(worker, size)
    return P2pConnectorScheduler(kv_transfer, config.cache.block_size, ranks), worker
