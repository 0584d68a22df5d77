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

from connectors.cpu_transport import CpuTransport
from connectors.p2p_nccl.connector_worker import P2pConnectorWorker
from connectors.p2p_nccl.handshake import ControlClient, ControlServer
from connectors.p2p_nccl.messages import (
    CONTROL_CODEC,
    WIRE_VERSION,
    KVLayerData,
    KVPullRequest,
    KVSendAbort,
    KVSendHeader,
    check_pull,
    make_codec,
)
from connectors.p2p_nccl.metadata import P2pConnectorMetadata, SaveSpec
from engine_core.config import KVTransferConfig
from engine_core.errors import MessageDecodeError
from tests.connectors.kv_harness import free_port
from tests.connectors.worker_pair import (
    BLOCK_SHAPE,
    LAYERS,
    WorkerPair,
    make_caches,
    start_worker,
    wait_until,
)
from tests.kv_grants import transfer_grant


def _pull(transfer_id: str, address: str, epoch: str, num_blocks: int = 3,
          producer: str = "") -> KVPullRequest:
    """A pull from the consumer at ``address``, granted from ``producer``."""
    return KVPullRequest(transfer_id=transfer_id, consumer_address=address, first_block=0,
                         num_blocks=num_blocks, num_layers=LAYERS, dtype="float32",
                         block_shape=list(BLOCK_SHAPE), timeout_s=5.0, consumer_epoch=epoch,
                         grant=transfer_grant(transfer_id, producer or "h:1", address))


def _envelope(fields: dict[str, Any]) -> bytes:
    """A pull as a peer would encode it, with these fields."""
    return msgpack.packb({"t": "KVPullRequest", "v": WIRE_VERSION, "d": fields}, use_bin_type=True)


def test_restarted_consumer_is_served_at_once_on_a_new_pair() -> None:
    """D restarted at its address: P drops the pair at the new process's first pull and
    re-handshakes before its next send. (Before: P kept sending on the old communicator, the
    new D had no pair to receive on, and the transfer failed at its deadline.)"""
    cluster = WorkerPair(timeout_s=4.0)
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
    cluster = WorkerPair(timeout_s=4.0)
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
        caches = make_caches(3)
        start_worker(producer, caches)
        own = producer.address
        producer.producer_side.on_pull(_pull("old", consumer, "epoch-1", producer=own))
        assert transport.aborted == []  # first contact: nothing to drop
        producer.producer_side.on_pull(_pull("new", consumer, "epoch-2", producer=own))
        assert transport.aborted == [consumer]
        producer.producer_side.on_pull(_pull("new-release", consumer, "epoch-2", num_blocks=0,
                                             producer=own))
        producer.producer_side.on_pull(_pull("tool", consumer, "", producer=own))  # no epoch: not a restart
        assert transport.aborted == [consumer]
        assert producer.stats()["consumer_restarts"] == 1
        saves = [SaveSpec(tid, tid, consumer, [4, 6, 8], num_tokens=12) for tid in ("old", "new")]
        producer.bind_step(P2pConnectorMetadata(saves=saves), None)
        for layer, cache in enumerate(caches):
            producer.after_layer(layer, cache)
        producer.wait_for_save()
        assert arrived.wait(5.0)
        assert wait_until(lambda: producer.stats()["sends_failed"] == 1
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
        CONTROL_CODEC.decode(_envelope({**fields, "consumer_epoch": 5}))
    # Pulls without the field (tools, older consumers) still decode: no epoch said.
    assert CONTROL_CODEC.decode(_envelope(fields)).consumer_epoch == ""

    port = free_port()
    producer = P2pConnectorWorker(KVTransferConfig(kv_role="kv_producer", kv_port=port), "cpu",
                                  transport=_RecordingTransport())
    client = ControlClient(f"127.0.0.1:{port}", codec)
    try:
        start_worker(producer, make_caches(4))
        client.send(_pull("bad", "127.0.0.1:1", "x" * 100, num_blocks=0, producer=producer.address))
        client.send(_pull("good", "127.0.0.1:1", "e1", producer=producer.address))
        assert wait_until(lambda: producer.stats()["pull_requests_waiting"] == 1, 5.0)
        assert producer.stats()["messages_rejected"] == 1
    finally:
        client.close()
        producer.shutdown()
