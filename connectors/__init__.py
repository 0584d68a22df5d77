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
    """
    kv_transfer = config.kv_transfer
    if kv_transfer is None:
        return NullConnectorScheduler(), NullConnectorWorker()
    from connectors.p2p_nccl.connector_worker import P2pConnectorWorker
    from connectors.p2p_nccl.scheduler_side import P2pConnectorScheduler

    return (P2pConnectorScheduler(kv_transfer, config.cache.block_size),
            P2pConnectorWorker(kv_transfer, device))
