"""Malformed, misdirected and mistimed messages on the KV connector's control channel.

Real producer and consumer workers on loopback sockets, their data moving through
``FakeNcclTransport`` (NCCL's pair semantics on CPU) or the CPU transport. Each bad message
must be rejected (logged, counted) without killing the control thread, without failing
someone else's transfer, and without leaving bytes or transfers behind.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgpack
import pytest

from connectors.p2p_nccl.connector_worker import P2pConnectorWorker
from connectors.p2p_nccl.handshake import ControlClient
from connectors.p2p_nccl.loads import RECEIVING
from connectors.p2p_nccl.messages import (
    WIRE_VERSION,
    KVSendAbort,
    NcclHello,
    make_codec,
)
from connectors.p2p_nccl.metadata import LoadSpec, P2pConnectorMetadata
from engine_core.config import KVTransferConfig
from tests.connectors.fake_nccl import Fabric, FakeNcclTransport
from tests.connectors.kv_harness import free_port
from tests.connectors.worker_pair import (
    BLOCK_SHAPE,
    DST,
    LAYERS,
    WorkerPair,
    make_caches,
    wait_until,
)
from tests.kv_grants import transfer_grant


@pytest.fixture
def pair() -> Any:
    made: list[WorkerPair] = []

    def make(**kwargs: Any) -> WorkerPair:
        made.append(WorkerPair(**kwargs))
        return made[-1]

    yield make
    for p in made:
        p.shutdown()


def _raw(name: str, body: dict[Any, Any]) -> bytes:
    return msgpack.packb({"t": name, "v": WIRE_VERSION, "d": body}, use_bin_type=True)


def test_a_message_the_decoder_chokes_on_does_not_kill_the_control_thread(pair: Any) -> None:
    """An abort whose unknown field names mix types (int and str keys) made the decoder
    raise TypeError instead of MessageDecodeError; the control thread died with it and every
    later pull, header and abort to this worker went unread until the process restarted."""
    p = pair(nccl=False)
    client = ControlClient(p.p_addr, make_codec(), send_timeout_s=1.0)
    try:
        client._socket.send_multipart([_raw("KVSendAbort", {
            "transfer_id": "t", "producer_address": "127.0.0.1:1", "reason": "r", 1: 2, "x": 3})])
        assert wait_until(lambda: p.producer.stats()["control_messages_rejected"] == 1, 5.0)
        assert p.transfer("after")[0] == "ok"  # the control thread still serves
        assert p.idle()
    finally:
        client.close()


def test_an_abort_from_another_producer_does_not_fail_a_receiving_load(
        pair: Any, caplog: pytest.LogCaptureFixture) -> None:
    """While D receives T from P, a KVSendAbort naming T from another address arrives. It
    used to fail T and abort the *sender's named* pair, not P's: P's data calls were left
    posted on a pair whose receive buffer D then freed (on NCCL a write into freed GPU memory),
    and P's sender stalled until its deadline. Now it is rejected, logged and counted, and T
    lands; an abort from P itself still fails the load at once and drops P's pair."""
    p = pair()
    stranger = ControlClient(p.d_addr, make_codec(), send_timeout_s=1.0)
    try:
        p.ask("T")
        p.compute("T")
        assert wait_until(lambda: p.consumer.consumer_side._loads["T"].state == RECEIVING, 5.0)
        with caplog.at_level(logging.WARNING):
            stranger.send(KVSendAbort("T", f"127.0.0.1:{free_port()}", "not yours"))
            assert wait_until(lambda: p.consumer.stats()["messages_rejected"] == 1
                         or p.consumer.consumer_side._loads["T"].state != RECEIVING, 5.0)
        start = time.monotonic()
        assert p.outcome("T") == "ok"
        assert time.monotonic() - start < 2.0
        assert "rejected kv abort" in caplog.text
        assert wait_until(lambda: p.producer.stats()["transfers_sent"] == 1, 5.0)
        assert p.producer.stats()["sends_failed"] == 0
        # The real producer's abort of a receiving load still ends it (and its pair) at once.
        p.ask("U")
        p.consumer.consumer_side._loads["U"].state = RECEIVING  # as if U's header had been accepted
        p.consumer.consumer_side._loads["U"].producer_address = p.p_addr
        assert p.d_transport is not None
        p.d_transport.on_hello(NcclHello(p.p_addr, "e", b"u"))  # a pair to drop
        stranger.send(KVSendAbort("U", p.p_addr, "gave up"))
        assert p.outcome("U") == "failed"
        assert ("recv", p.p_addr) not in p.d_transport._pairs
    finally:
        stranger.close()


def test_a_failing_send_report_does_not_stop_the_sender_thread() -> None:
    """The sender thread reports each finished job (``on_done``: counters, the finished-sending
    set, the doorbell). An exception there escaped ``_process`` and ended the thread: every
    later job to that consumer stayed queued and its blocks held until the process restarted."""
    from connectors.cpu_transport import CpuTransport
    from connectors.p2p_nccl.sender import PeerSender, SendJob

    reported: list[str] = []

    def on_done(job: SendJob) -> None:
        reported.append(job.transfer_id)
        if job.transfer_id == "first":
            raise RuntimeError("report failed")

    sender = PeerSender(f"127.0.0.1:{free_port()}", "127.0.0.1:1", "epoch", make_codec(),
                        CpuTransport(), on_done, send_timeout_s=0.2)
    sender.start()
    try:
        jobs = [SendJob(transfer_id=tid, request_id=None, peer_address=sender.peer_address,
                        first_block=0, num_blocks=0, num_layers=0, dtype="", block_shape=[],
                        deadline=time.monotonic() + 5.0, abort_reason="test")
                for tid in ("first", "second")]
        for job in jobs:
            sender.submit(job)
        assert jobs[1].done.wait(5.0)
        assert reported == ["first", "second"]
    finally:
        sender.stop()


def test_a_header_whose_receives_cannot_be_posted_fails_the_load_at_once() -> None:
    """NCCL path: a header arrives while the consumer has no pair with its producer (its
    hello lost, or the pair dropped after a failure), so posting the receives raises. The
    exception escaped to the control thread's catch-all: the load stayed RECEIVING with
    nothing posted until its deadline. Now it fails at once, logged and counted."""
    from connectors.p2p_nccl.handshake import ControlServer
    from connectors.p2p_nccl.messages import KVSendHeader

    p_addr, d_port = f"127.0.0.1:{free_port()}", free_port()
    pulls: list[Any] = []
    producer = ControlServer(p_addr, make_codec(), lambda message, frames: pulls.append(message))
    producer.start()
    consumer = P2pConnectorWorker(
        KVTransferConfig(kv_role="kv_consumer", kv_port=d_port, transfer_timeout_s=30.0),
        "cpu", transport=FakeNcclTransport(Fabric(), f"127.0.0.1:{d_port}"))
    consumer.register_kv_caches(make_caches(2))
    client = ControlClient(consumer.address, make_codec(), send_timeout_s=1.0)
    try:
        consumer.start_load_kv(P2pConnectorMetadata(loads=[LoadSpec(
            "T", "T", p_addr, DST, first_block=0, num_tokens=12,
            grant=transfer_grant("T", p_addr, consumer.address))]))
        assert wait_until(lambda: len(pulls) == 1, 5.0)
        pull = pulls[0]
        client.send(KVSendHeader("T", p_addr, "e", 1, pull.first_block, pull.num_blocks,
                                 pull.num_layers, pull.dtype, pull.block_shape, 1))
        failed: set[str] = set()
        assert wait_until(lambda: bool(failed.update(consumer.land_loads().failed_recving) or failed),
                     3.0), "the load waited for its deadline"
        assert failed == {"T"}
        assert consumer.stats()["messages_rejected"] == 1
        assert consumer.stats()["recv_buffer_bytes_in_use"] == 0 and consumer.is_idle()
    finally:
        client.close()
        consumer.shutdown()
        producer.stop()


def test_layer_data_for_no_transfer_is_logged_counted_and_harmless(
        pair: Any, caplog: pytest.LogCaptureFixture) -> None:
    """CPU transport: a data frame for a transfer nobody receives (finished, unknown, or a
    replay) was counted but never logged, against the rule for internal sockets. It is now
    logged too, and a transfer after it lands untouched."""
    from connectors.p2p_nccl.messages import KVLayerData

    p = pair(nccl=False)
    client = ControlClient(p.d_addr, make_codec(), send_timeout_s=1.0)
    try:
        with caplog.at_level(logging.WARNING):
            client.send(KVLayerData("ghost", "e", 1, 0, 4), [b"abcd"])
            assert wait_until(lambda: p.consumer.stats()["messages_rejected"] == 1, 5.0)
        assert "rejected kv layer data" in caplog.text and "ghost" in caplog.text
        assert p.transfer("real")[0] == "ok"
        assert p.idle()
    finally:
        client.close()


@pytest.mark.parametrize("nccl", [True, False])
def test_malformed_hellos_are_rejected_before_any_pair_is_touched(
        pair: Any, caplog: pytest.LogCaptureFixture, nccl: bool) -> None:
    """An NcclHello replaces the pair with its address and starts a communicator join; its
    fields went unchecked (any address, an empty epoch, a unique id of any length), and on
    the CPU transport it raised inside the handler. Each is now a logged, counted rejection,
    and a transfer after them lands untouched."""
    p = pair(nccl=nccl)
    client = ControlClient(p.d_addr, make_codec(), send_timeout_s=1.0)
    good_id = bytes(128)
    bad = [NcclHello("x y:1", "e", good_id), NcclHello(p.p_addr, "", good_id),
           NcclHello(p.p_addr, "e", b"short")]
    expected = len(bad) + (0 if nccl else 1)
    try:
        with caplog.at_level(logging.WARNING):
            for hello in bad + ([] if nccl else [NcclHello(p.p_addr, "e", good_id)]):
                client.send(hello)
            assert wait_until(lambda: p.consumer.stats()["messages_rejected"] == expected, 5.0)
        assert caplog.text.count("rejected kv hello") == expected
        assert p.transfer("after")[0] == "ok"
        assert p.idle()
    finally:
        client.close()


def test_pulls_waiting_for_their_prefill_are_capped(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Pulls that arrive before their prefill are kept until it runs (or orphan_ttl_s); a
    flood of pulls for transfers this producer never runs grew that map without bound. Past
    the cap a pull is rejected (logged, counted) and its consumer told at once."""
    from connectors.p2p_nccl import producer as producer_module
    from connectors.p2p_nccl.messages import KVPullRequest

    monkeypatch.setattr(producer_module, "MAX_WAITING_PULLS", 3)
    port = free_port()
    producer = P2pConnectorWorker(KVTransferConfig(kv_role="kv_producer", kv_port=port), "cpu")
    producer.register_kv_caches(make_caches(1))
    client = ControlClient(f"127.0.0.1:{port}", make_codec(), send_timeout_s=1.0)
    try:
        with caplog.at_level(logging.WARNING):
            for i in range(5):
                consumer = f"127.0.0.1:{free_port()}"
                client.send(KVPullRequest(
                    f"t{i}", consumer, 0, 1, LAYERS, "float32", list(BLOCK_SHAPE), 1.0,
                    grant=transfer_grant(f"t{i}", producer.address, consumer)))
            assert wait_until(lambda: producer.stats()["messages_rejected"] == 2, 5.0)
        assert producer.stats()["pull_requests_waiting"] == 3
        assert caplog.text.count("pulls already wait for their prefill") == 2
    finally:
        client.close()
        producer.shutdown()
