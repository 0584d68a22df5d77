"""A consumer process restarted at the same kv address, on the NCCL code path, on CPU.

The producer keeps a pair (NCCL communicator) per consumer address and sends ``NcclHello``
only when it has none. A new consumer process at the same address has no pair: unless the
producer learns that the process behind the address changed, it keeps sending on the old
communicator, whose other rank is gone, and the transfer stalls until its deadline. These
tests drive real connector workers over real sockets with ``FakeNcclTransport`` (NCCL's pair
semantics without CUDA); the two-GPU test of the same case is in test_p2p_nccl_gpu.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack
import pytest
import torch

from connectors.cpu_transport import CpuTransport
from connectors.p2p_nccl.handshake import ControlClient, ControlServer
from connectors.p2p_nccl.messages import (
    WIRE_VERSION,
    KVLayerData,
    KVPullRequest,
    KVSendAbort,
    KVSendHeader,
    check_pull,
    make_codec,
)
from connectors.p2p_nccl.metadata import LoadSpec, P2pConnectorMetadata, SaveSpec
from connectors.p2p_nccl.worker_side import P2pConnectorWorker
from engine_core.config import KVTransferConfig
from engine_core.errors import KVTransferError, MessageDecodeError
from engine_core.worker.kv_cache import KVCacheShape, allocate_kv_caches
from tests.connectors.fake_nccl import Fabric, FakeNcclTransport
from tests.connectors.kv_harness import free_port

LAYERS, NUM_BLOCKS, BLOCK_SHAPE = 2, 16, (4, 2, 4)  # block size, KV heads, head dim
SRC, DST = [1, 5, 7], [2, 3, 9]  # a request's blocks on the producer, on the consumer


def _caches(seed: int) -> list[torch.Tensor]:
    caches = allocate_kv_caches(KVCacheShape(LAYERS, NUM_BLOCKS, *BLOCK_SHAPE, torch.float32), "cpu")
    gen = torch.Generator().manual_seed(seed)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return caches


def _start(worker: P2pConnectorWorker, caches: list[torch.Tensor]) -> None:
    """Register the caches and bind; the port a stopped worker just closed may take a moment
    to free (ZMQ closes sockets on its own thread)."""
    for _ in range(100):
        try:
            worker.register_kv_caches(caches)
            return
        except KVTransferError:
            time.sleep(0.05)
    raise AssertionError("kv port never became free")


def _pull(transfer_id: str, address: str, epoch: str, num_blocks: int = 3) -> KVPullRequest:
    return KVPullRequest(transfer_id=transfer_id, consumer_address=address, first_block=0,
                         num_blocks=num_blocks, num_layers=LAYERS, dtype="float32",
                         block_shape=list(BLOCK_SHAPE), timeout_s=5.0, consumer_epoch=epoch)


def _envelope(fields: dict[str, Any]) -> bytes:
    """A pull as a peer would encode it, with these fields."""
    return msgpack.packb({"t": "KVPullRequest", "v": WIRE_VERSION, "d": fields}, use_bin_type=True)


def _wait(condition: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return False


class _Cluster:
    """A producer and a consumer worker on loopback, their data moving on one fabric."""

    def __init__(self, timeout_s: float) -> None:
        self.fabric = Fabric()
        self.timeout_s = timeout_s
        self.p_port, self.d_port = free_port(), free_port()
        self.p_addr, self.d_addr = f"127.0.0.1:{self.p_port}", f"127.0.0.1:{self.d_port}"
        self.p_transport = FakeNcclTransport(self.fabric, self.p_addr)
        self.producer = self._worker("kv_producer", self.p_port, self.p_transport)
        self.p_caches = _caches(1)
        _start(self.producer, self.p_caches)
        self.consumer: P2pConnectorWorker | None = None
        self.restart_consumer()

    def _worker(self, role: str, port: int, transport: FakeNcclTransport) -> P2pConnectorWorker:
        config = KVTransferConfig(kv_role=role, kv_port=port, transfer_timeout_s=self.timeout_s,
                                  min_call_bytes=0)
        return P2pConnectorWorker(config, "cpu", transport=transport)

    def restart_consumer(self) -> None:
        """Stop the consumer (if any) and start a new one at the same address."""
        if self.consumer is not None:
            self.consumer.shutdown()
        self.consumer = self._worker("kv_consumer", self.d_port,
                                     FakeNcclTransport(self.fabric, self.d_addr))
        self.d_caches = _caches(2)
        _start(self.consumer, self.d_caches)

    def ask(self, transfer_id: str) -> None:
        """The consumer's load of P blocks SRC into D blocks DST: it reserves the bytes and
        sends its pull; returns once the producer holds the pull."""
        assert self.consumer is not None
        waiting = self.producer.stats()["pull_requests_waiting"]
        self.consumer.start_load_kv(P2pConnectorMetadata(loads=[LoadSpec(
            transfer_id, transfer_id, self.p_addr, DST, first_block=0, num_tokens=12)]))
        assert _wait(lambda: self.producer.stats()["pull_requests_waiting"] == waiting + 1, 5.0)

    def compute(self, *transfer_ids: str) -> None:
        """The producer step that computes these requests (their saves, in this order)."""
        saves = [SaveSpec(tid, tid, self.d_addr, SRC, num_tokens=12) for tid in transfer_ids]
        self.producer.bind_step(P2pConnectorMetadata(saves=saves), None)
        for layer, cache in enumerate(self.p_caches):
            self.producer.after_layer(layer, cache)
        self.producer.wait_for_save()

    def outcome(self, transfer_id: str) -> str:
        """Wait until the consumer's load landed ("ok", bytes checked) or failed."""
        consumer = self.consumer
        assert consumer is not None
        outcome: list[str] = []

        def resolved() -> bool:
            finished = consumer.land_loads()
            if transfer_id in finished.recving | finished.failed_recving:
                outcome.append("ok" if transfer_id in finished.recving else "failed")
            return bool(outcome)

        assert _wait(resolved, self.timeout_s + 5.0), "the load never resolved"
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

        return _wait(drained, 10.0)

    def shutdown(self) -> None:
        if self.consumer is not None:
            self.consumer.shutdown()
        self.producer.shutdown()


def test_restarted_consumer_is_served_at_once_on_a_new_pair() -> None:
    """D restarted at its address: P drops the pair at the new process's first pull and
    re-handshakes before its next send. (Before: P kept sending on the old communicator, the
    new D had no pair to receive on, and the transfer failed at its deadline.)"""
    cluster = _Cluster(timeout_s=4.0)
    try:
        assert cluster.transfer("before")[0] == "ok"
        assert cluster.p_transport.hellos_sent == 1
        cluster.restart_consumer()
        outcome, elapsed = cluster.transfer("after")
        assert outcome == "ok" and elapsed < 2.0, (outcome, elapsed)
        assert cluster.p_transport.hellos_sent == 2
        assert cluster.transfer("again")[0] == "ok"
        assert cluster.p_transport.hellos_sent == 2  # the new pair is kept
        assert cluster.producer_idle()
        stats = cluster.producer.stats()
        assert stats["consumer_restarts"] == 1
        assert stats["sends_failed"] == 0 and stats["transfers_sent"] == 3
    finally:
        cluster.shutdown()


def test_old_process_requests_do_not_stall_the_new_one() -> None:
    """The old D had asked for a transfer P computes only after D restarted. P fails that
    send at once (its consumer is gone) instead of sending its header to the new D, which
    would reject it and abort its new pair, leaving P's data calls to stall until their
    deadline, and the new D's transfer behind them with it."""
    cluster = _Cluster(timeout_s=4.0)
    try:
        assert cluster.transfer("before")[0] == "ok"
        cluster.ask("orphan")
        cluster.restart_consumer()
        start = time.monotonic()
        cluster.ask("after")
        cluster.compute("orphan", "after")
        outcome = cluster.outcome("after")
        assert outcome == "ok" and time.monotonic() - start < 2.0, outcome
        assert cluster.producer_idle()
        stats = cluster.producer.stats()
        assert stats["consumer_restarts"] == 1
        assert stats["sends_failed"] == 1 and stats["transfers_sent"] == 2
    finally:
        cluster.shutdown()


class _RecordingTransport(CpuTransport):
    """The CPU data plane, recording which peers' pairs the worker aborted."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.aborted: list[str] = []

    def abort(self, peer_address: str) -> None:
        self.aborted.append(peer_address)


def test_new_consumer_epoch_drops_the_pair_and_the_old_process_jobs() -> None:
    """A pull naming a new consumer epoch for a known address aborts the address's pairs
    once; a send asked for by the old process is failed before it touches the pair or sends a
    header (the new process would reject the header and abort its fresh pair); a send asked
    for by the new process goes out."""
    transport = _RecordingTransport()
    producer = P2pConnectorWorker(KVTransferConfig(kv_role="kv_producer", kv_port=free_port()),
                                  "cpu", transport=transport)
    consumer = f"127.0.0.1:{free_port()}"
    got: list[Any] = []
    arrived = threading.Event()

    def collect(message: Any, frames: list[Any]) -> None:
        got.append(message)
        if sum(isinstance(m, (KVSendAbort, KVLayerData)) for m in got) >= 2:
            arrived.set()

    server = ControlServer(consumer, make_codec(), collect)
    server.start()
    try:
        caches = _caches(3)
        _start(producer, caches)
        producer._on_pull(_pull("old", consumer, "epoch-1"))
        assert transport.aborted == []  # first contact: nothing to drop
        producer._on_pull(_pull("new", consumer, "epoch-2"))
        assert transport.aborted == [consumer]
        producer._on_pull(_pull("new-release", consumer, "epoch-2", num_blocks=0))
        producer._on_pull(_pull("tool", consumer, ""))  # no epoch said: not a restart
        assert transport.aborted == [consumer]
        assert producer.stats()["consumer_restarts"] == 1
        saves = [SaveSpec(tid, tid, consumer, [4, 6, 8], num_tokens=12) for tid in ("old", "new")]
        producer.bind_step(P2pConnectorMetadata(saves=saves), None)
        for layer, cache in enumerate(caches):
            producer.after_layer(layer, cache)
        producer.wait_for_save()
        assert arrived.wait(5.0)
        assert _wait(lambda: producer.stats()["sends_failed"] == 1
                     and producer.stats()["transfers_sent"] == 1, 5.0)
        headers = [m.transfer_id for m in got if isinstance(m, KVSendHeader)]
        aborts = [(m.transfer_id, m.reason) for m in got if isinstance(m, KVSendAbort)]
        assert headers == ["new"]
        assert [tid for tid, _ in aborts] == ["old"] and "restarted" in aborts[0][1]
        assert transport.aborted == [consumer]  # the failed job posted nothing to abort
    finally:
        producer.shutdown()
        server.stop()


def test_consumer_epoch_is_validated() -> None:
    """The new wire field: an epoch of the wrong type is a decode error, one too long or with
    odd characters fails the pull's check; the producer counts the pull and carries on."""
    codec = make_codec()
    pull = _pull("t", "127.0.0.1:1", "a" * 32)
    assert codec.decode(codec.encode(pull)) == pull
    assert check_pull(pull, LAYERS, "float32", list(BLOCK_SHAPE)) is None
    assert check_pull(_pull("t", "127.0.0.1:1", ""), LAYERS, "float32", list(BLOCK_SHAPE)) is None
    assert "epoch" in check_pull(_pull("t", "127.0.0.1:1", "a" * 65), LAYERS, "float32",
                                 list(BLOCK_SHAPE))
    assert "epoch" in check_pull(_pull("t", "127.0.0.1:1", "a\nb"), LAYERS, "float32",
                                 list(BLOCK_SHAPE))
    fields = {name: value for name, value in vars(pull).items() if name != "consumer_epoch"}
    with pytest.raises(MessageDecodeError):
        codec.decode(_envelope({**fields, "consumer_epoch": 5}))
    # Pulls without the field (tools, older consumers) still decode: no epoch said.
    assert codec.decode(_envelope(fields)).consumer_epoch == ""

    port = free_port()
    producer = P2pConnectorWorker(KVTransferConfig(kv_role="kv_producer", kv_port=port), "cpu",
                                  transport=_RecordingTransport())
    client = ControlClient(f"127.0.0.1:{port}", codec)
    try:
        _start(producer, _caches(4))
        client.send(_pull("bad", "127.0.0.1:1", "x" * 100, num_blocks=0))
        client.send(_pull("good", "127.0.0.1:1", "e1"))
        assert _wait(lambda: producer.stats()["pull_requests_waiting"] == 1, 5.0)
        assert producer.stats()["messages_rejected"] == 1
    finally:
        client.close()
        producer.shutdown()
