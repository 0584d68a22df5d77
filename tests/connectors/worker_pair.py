"""A producer and a consumer connector worker on loopback, for the control-channel tests.

Real ``P2pConnectorWorker`` objects with real sockets; their data moves through
``FakeNcclTransport`` (NCCL's pair semantics on CPU) or the CPU transport. One request's KV
is P's blocks ``SRC`` into D's blocks ``DST``; ``ask`` / ``compute`` / ``outcome`` drive it
step by step, ``transfer`` end to end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from connectors.p2p_nccl.connector_worker import P2pConnectorWorker
from connectors.p2p_nccl.metadata import LoadSpec, P2pConnectorMetadata, SaveSpec
from deploy.launch import free_ports
from engine_core.config import KVTransferConfig
from engine_core.errors import KVTransferError
from engine_core.worker.kv_cache import KVCacheShape, allocate_kv_caches
from tests.connectors.fake_nccl import Fabric, FakeNcclTransport
from tests.kv_grants import transfer_grant

LAYERS, NUM_BLOCKS, BLOCK_SHAPE = 2, 16, (4, 2, 4)  # block size, KV heads, head dim
SRC, DST = [1, 5, 7], [2, 3, 9]  # a request's blocks on the producer, on the consumer


def make_caches(seed: int, layers: int = LAYERS,
                block_shape: tuple[int, int, int] = BLOCK_SHAPE) -> list[torch.Tensor]:
    """Float32 KV caches of ``layers`` layers filled with seeded random values."""
    caches = allocate_kv_caches(KVCacheShape(layers, NUM_BLOCKS, *block_shape, torch.float32),
                                "cpu")
    gen = torch.Generator().manual_seed(seed)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return caches


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return False


def start_worker(worker: P2pConnectorWorker, caches: list[torch.Tensor],
                 attempts: int = 100) -> None:
    """Register the caches and bind; the port a stopped worker just closed may take a moment
    to free (ZMQ closes sockets on its own thread)."""
    for _ in range(attempts):
        try:
            worker.register_kv_caches(caches)
            return
        except KVTransferError:
            time.sleep(0.05)
    raise AssertionError("kv port never became free")


class WorkerPair:
    """A producer and a consumer worker on loopback (fake NCCL by default, else CPU);
    ``kv_buffer_size`` (the consumer's, bytes), ``min_call_bytes`` (the producer's), and the
    caches' layer count and block shape may be given."""

    def __init__(self, timeout_s: float = 4.0, nccl: bool = True,
                 kv_buffer_size: float | None = None, min_call_bytes: int = 0,
                 layers: int = LAYERS,
                 block_shape: tuple[int, int, int] = BLOCK_SHAPE,
                 orphan_ttl_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.nccl = nccl
        self.kv_buffer_size = kv_buffer_size
        self.min_call_bytes = min_call_bytes
        self.orphan_ttl_s = orphan_ttl_s
        self.layers, self.block_shape = layers, block_shape
        self.fabric = Fabric()
        self.p_caches = make_caches(1, layers, block_shape)
        # A port free a moment ago may be taken before the bind (another process's outgoing
        # connection gets it): such a pick is dropped for a new one.
        for attempt in range(3):
            self.p_port, self.d_port = free_ports(2)
            self.p_addr, self.d_addr = f"127.0.0.1:{self.p_port}", f"127.0.0.1:{self.d_port}"
            self.p_transport = self._transport(self.p_addr)
            self.producer = self._worker("kv_producer", self.p_port, self.p_transport)
            try:
                start_worker(self.producer, self.p_caches, attempts=20 if attempt < 2 else 100)
                break
            except AssertionError:
                self.producer.shutdown()
                if attempt == 2:
                    raise
        self.consumer: P2pConnectorWorker | None = None
        self.restart_consumer()

    def _transport(self, address: str) -> FakeNcclTransport | None:
        return FakeNcclTransport(self.fabric, address) if self.nccl else None

    def _worker(self, role: str, port: int, transport: Any) -> P2pConnectorWorker:
        extra: dict[str, Any] = {}
        if self.kv_buffer_size is not None:
            extra["kv_buffer_size"] = self.kv_buffer_size
        if self.orphan_ttl_s is not None:
            extra["orphan_ttl_s"] = self.orphan_ttl_s
        config = KVTransferConfig(kv_role=role, kv_port=port, transfer_timeout_s=self.timeout_s,
                                  min_call_bytes=self.min_call_bytes, **extra)
        return P2pConnectorWorker(config, "cpu", transport=transport)

    def restart_consumer(self) -> None:
        """Stop the consumer (if any) and start a new one at the same address."""
        if self.consumer is not None:
            self.consumer.shutdown()
        self.d_transport = self._transport(self.d_addr)
        self.consumer = self._worker("kv_consumer", self.d_port, self.d_transport)
        self.d_caches = make_caches(2, self.layers, self.block_shape)
        start_worker(self.consumer, self.d_caches)

    def _consumer(self) -> P2pConnectorWorker:
        assert self.consumer is not None
        return self.consumer

    def ask(self, transfer_id: str) -> None:
        """The consumer's load of P blocks SRC into D blocks DST: it reserves the bytes and
        sends its pull; returns once the producer holds the pull."""
        waiting = self._registered()
        self.ask_served(transfer_id)
        assert wait_until(lambda: self._registered() == waiting + 1, 5.0)

    def _registered(self) -> float:
        """Pulls and releases the producer keeps for prefills not saved yet (a cancel that
        is still on its way turns a waiting pull into a waiting release: the sum holds)."""
        stats = self.producer.stats()
        return stats["pull_requests_waiting"] + stats["releases_waiting"]

    def ask_served(self, transfer_id: str) -> None:
        """The consumer's load, as ``ask``, of a transfer the producer already computed (its
        pull is served at once, never waits)."""
        self._consumer().start_load_kv(P2pConnectorMetadata(loads=[LoadSpec(
            transfer_id, transfer_id, self.p_addr, DST, first_block=0, num_tokens=12,
            grant=transfer_grant(transfer_id, self.p_addr, self.d_addr))]))

    def compute(self, *transfer_ids: str) -> None:
        """The producer step that computes these requests (their saves, in this order)."""
        saves = [SaveSpec(tid, tid, self.d_addr, SRC, num_tokens=12) for tid in transfer_ids]
        self.producer.bind_step(P2pConnectorMetadata(saves=saves), None)
        for layer, cache in enumerate(self.p_caches):
            self.producer.after_layer(layer, cache)
        self.producer.wait_for_save()

    def outcome(self, transfer_id: str) -> str:
        """Wait until the consumer's load landed ("ok", bytes checked) or failed."""
        consumer = self._consumer()
        outcome: list[str] = []

        def resolved() -> bool:
            finished = consumer.land_loads()
            if transfer_id in finished.recving | finished.failed_recving:
                outcome.append("ok" if transfer_id in finished.recving else "failed")
            return bool(outcome)

        assert wait_until(resolved, self.timeout_s + 5.0), "the load never resolved"
        if outcome[0] == "ok":
            for p_cache, d_cache in zip(self.p_caches, self.d_caches):
                assert torch.equal(d_cache[:, DST], p_cache[:, SRC])
        return outcome[0]

    def transfer(self, transfer_id: str) -> tuple[str, float]:
        """One request's KV end to end: its outcome and seconds."""
        start = time.monotonic()
        self.ask(transfer_id)
        self.compute(transfer_id)
        return self.outcome(transfer_id), time.monotonic() - start

    def producer_idle(self) -> bool:
        """Wait until the producer reported every send and holds nothing."""
        def drained() -> bool:
            self.producer.get_finished()  # hands the finished sends over, as the engine does
            return self.producer.is_idle()

        return wait_until(drained, 10.0)

    def idle(self) -> bool:
        """Both workers hold nothing (the producer's finished sends handed over)."""
        consumer = self._consumer()

        def drained() -> bool:
            self.producer.get_finished()
            consumer.get_finished()
            return self.producer.is_idle() and consumer.is_idle()

        return wait_until(drained, 10.0)

    def shutdown(self) -> None:
        if self.consumer is not None:
            self.consumer.shutdown()
        self.producer.shutdown()
