"""A load cancelled after its pull went out gives its receive-buffer bytes back promptly.

Defect: when D aborted a request whose load was REQUESTED (pull sent, no header yet), the
load kept its reservation until its deadline (``transfer_timeout_s``), so under client
disconnects other loads were pushed back for nothing and ``recv_buffer_bytes_in_use`` stayed
high. Now D releases P (a ``num_blocks=0`` pull after the pull cancels it) and frees the bytes
as soon as no data can land in them: at once on the CPU transport (a late header or data
message is refused), at P's answer on NCCL (an abort: P dropped the pull before any send).
A send P had already started still lands in the reserved bytes and frees them when done.

Real producer and consumer workers on loopback (``WorkerPair``), fake NCCL or CPU transport.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from connectors.p2p_nccl.connector_worker import P2pConnectorWorker
from connectors.p2p_nccl.handshake import ControlClient
from connectors.p2p_nccl.loads import REQUESTED
from connectors.p2p_nccl.messages import KVPullRequest, make_codec
from connectors.p2p_nccl.metadata import P2pConnectorMetadata
from tests.connectors.kv_harness import free_port
from tests.connectors.worker_pair import DST, WorkerPair, wait_until
from tests.kv_grants import transfer_grant

# Two layers of 16-token blocks, 4 KV heads of 32 dims, float32: one request's 3 blocks are
# 96 KiB; the buffer holds one such load, not two.
LAYERS, BLOCK_SHAPE = 2, (16, 4, 32)
LOAD_BYTES = LAYERS * 2 * len(DST) * 16 * 4 * 32 * 4
BUFFER = 150_000
TIMEOUT_S = 10.0  # the loads' deadline: every wait below is far shorter
PROMPT_S = 2.0


@pytest.fixture(params=[True, False], ids=["fake-nccl", "cpu-transport"])
def pair(request: pytest.FixtureRequest) -> Iterator[WorkerPair]:
    made = WorkerPair(nccl=request.param, timeout_s=TIMEOUT_S, kv_buffer_size=BUFFER,
                      layers=LAYERS, block_shape=BLOCK_SHAPE)
    yield made
    made.shutdown()


def _consumer(pair: WorkerPair) -> P2pConnectorWorker:
    assert pair.consumer is not None
    return pair.consumer


def _cancel(consumer: P2pConnectorWorker, request_id: str) -> None:
    """What the scheduler sends the step after the request was aborted on D."""
    consumer.start_load_kv(P2pConnectorMetadata(cancels=[request_id]))


def _wait_reported(consumer: P2pConnectorWorker, request_id: str, timeout_s: float) -> bool:
    """Drive ``land_loads`` as the engine loop does (its doorbell rings on P's answer) until
    the load is reported failed, which hands its blocks back to the scheduler."""
    reported: set[str] = set()

    def done() -> bool:
        reported.update(consumer.land_loads().failed_recving)
        return request_id in reported

    return wait_until(done, timeout_s)


def test_a_cancelled_requested_load_frees_its_bytes_and_the_next_load_proceeds(
        pair: WorkerPair) -> None:
    consumer = _consumer(pair)
    pair.ask("A")  # P's prefill has not reached the save: the pull waits there
    assert consumer.consumer_side._loads["A"].state == REQUESTED
    assert consumer.stats()["recv_buffer_bytes_in_use"] == LOAD_BYTES
    start = time.monotonic()
    _cancel(consumer, "A")
    if not pair.nccl:  # nothing can land in a REQUESTED load: freed in the same call
        assert consumer.stats()["recv_buffer_bytes_in_use"] == 0
    assert _wait_reported(consumer, "A", PROMPT_S), "the bytes waited for the deadline"
    assert consumer.stats()["recv_buffer_bytes_in_use"] == 0
    assert time.monotonic() - start < PROMPT_S
    # A load that needs the room now reserves it and sends its pull at once.
    pair.ask("B")
    assert consumer.consumer_side._loads["B"].state == REQUESTED
    assert consumer.stats()["loads_pushed_back"] == 0
    pair.compute("A", "B")  # P's save of A ends without a send; B is sent
    assert pair.outcome("B") == "ok"
    assert pair.idle()
    d, p = consumer.stats(), pair.producer.stats()
    assert d["transfers_received"] == 1 and d["transfers_failed"] == 0
    assert d["transfers_timed_out"] == 0 and d["messages_rejected"] == 0
    assert p["transfers_sent"] == 1 and p["sends_failed"] == 0 and p["messages_rejected"] == 0
    assert d["recv_buffer_bytes_in_use"] == 0 and d["loads_in_flight"] == 0
    assert p["sends_pending_pull"] == 0 and p["pull_requests_waiting"] == 0


def test_a_cancel_after_the_send_started_drops_the_late_data_safely(pair: WorkerPair) -> None:
    """P's send of A started before D's release reached it (held here before its header):
    P ignores the release and sends. CPU: D freed the bytes at once and refuses the header
    and the data (counted), nothing is written into A's old blocks. NCCL: D keeps the bytes
    until the data landed in them (refusing the header would leave P's sends unmatched on the
    pair), then frees them; the pair stays healthy."""
    gate, entered = threading.Event(), threading.Event()
    transport: Any = pair.producer.state.transport
    real_open = transport.open_pair

    def open_after_gate(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert gate.wait(10.0)
        return real_open(*args, **kwargs)

    transport.open_pair = open_after_gate
    try:
        _send_started_then_cancel(pair, gate, entered)
    finally:
        gate.set()


def _send_started_then_cancel(pair: WorkerPair, gate: threading.Event,
                              entered: threading.Event) -> None:
    consumer = _consumer(pair)
    pair.ask("A")
    pair.compute("A")
    # The sender thread took the job (a job still queued is dropped by the release, see
    # test_release_queued_send.py); its header is held at the gate.
    assert entered.wait(5.0)
    received = pair.producer.stats()["control_messages_received"]
    _cancel(consumer, "A")
    assert wait_until(lambda: pair.producer.stats()["control_messages_received"] == received + 1,
                      5.0)  # P saw the release while sending: it is not a rejection
    assert pair.producer.stats()["messages_rejected"] == 0
    if not pair.nccl:
        assert _wait_reported(consumer, "A", PROMPT_S)
        assert consumer.stats()["recv_buffer_bytes_in_use"] == 0
        # The scheduler freed A's blocks: another request's KV now lives there.
        for cache in pair.d_caches:
            cache[:, DST] = 7.0
    gate.set()
    if pair.nccl:
        assert _wait_reported(consumer, "A", PROMPT_S), "the landed data did not end the load"
    else:  # the header and its two data calls are refused, one by one
        assert wait_until(lambda: consumer.stats()["messages_rejected"] == 1 + LAYERS, 5.0)
        assert all(bool((cache[:, DST] == 7.0).all()) for cache in pair.d_caches)
    assert consumer.stats()["recv_buffer_bytes_in_use"] == 0
    assert consumer.stats()["messages_rejected"] == (0 if pair.nccl else 1 + LAYERS)
    assert pair.transfer("B")[0] == "ok"  # the pair (NCCL) was not aborted
    assert pair.idle()
    p = pair.producer.stats()
    assert p["sends_failed"] == 0 and p["transfers_sent"] == 2
    d = consumer.stats()
    assert d["transfers_received"] == 1 and d["transfers_failed"] == 0
    assert d["transfers_timed_out"] == 0


def test_a_release_from_another_consumer_does_not_cancel_the_pull(pair: WorkerPair) -> None:
    """Only the consumer that pulled may cancel its pull: a release naming another address
    (a stale or stray consumer) is rejected, logged and counted, and the pull is served."""
    consumer = _consumer(pair)
    stranger = ControlClient(pair.p_addr, make_codec(), send_timeout_s=1.0)
    try:
        pair.ask("A")
        pull = consumer.consumer_side._loads["A"].pull
        other = f"127.0.0.1:{free_port()}"  # granted too (a replacement D), but not the puller
        stranger.send(KVPullRequest("A", other, 0, 0, pull.num_layers, pull.dtype,
                                    list(pull.block_shape), 1.0, "other",
                                    grant=transfer_grant("A", pair.p_addr, other)))
        assert wait_until(lambda: pair.producer.stats()["messages_rejected"] == 1, 5.0)
        pair.compute("A")
        assert pair.outcome("A") == "ok"
        assert pair.idle()
    finally:
        stranger.close()


def test_a_release_behind_a_finished_send_leaves_nothing_on_the_producer(
        pair: WorkerPair) -> None:
    """P finished sending A (CPU: its messages are out; fake NCCL: D has not yet taken
    them) before D, which has not read the header yet, cancels the load. The release finds
    no waiting pull: it is dropped, not kept as one until ``orphan_ttl_s`` (which held the
    producer non-idle, its ``pull_requests_waiting`` gauge at 1, for a minute)."""
    consumer = _consumer(pair)  # its header handler is held at the gate
    gate = threading.Event()
    real_on_header = consumer.consumer_side.on_header

    def header_after_gate(header: Any) -> None:
        assert gate.wait(10.0)
        real_on_header(header)

    consumer.consumer_side.on_header = header_after_gate  # type: ignore[method-assign]
    try:
        _finished_send_then_cancel(pair, gate)
    finally:
        gate.set()


def _finished_send_then_cancel(pair: WorkerPair, gate: threading.Event) -> None:
    consumer = _consumer(pair)
    pair.ask("A")
    pair.compute("A")
    if not pair.nccl:  # the CPU send ends once its messages are queued
        assert wait_until(lambda: pair.producer.stats()["transfers_sent"] == 1, 5.0)
    else:  # its data calls are out, waiting for D to take them (not a queued job)
        assert wait_until(lambda: pair.producer.stats()["data_calls"] == LAYERS, 5.0)
    received = pair.producer.stats()["control_messages_received"]
    _cancel(consumer, "A")
    assert wait_until(lambda: pair.producer.stats()["control_messages_received"] == received + 1,
                      5.0)
    gate.set()
    assert _wait_reported(consumer, "A", PROMPT_S)
    assert pair.idle()  # the producer keeps no registration for A
    assert pair.producer.stats()["messages_rejected"] == 0
    assert pair.producer.stats()["pull_requests_waiting"] == 0
    assert pair.producer.stats()["releases_waiting"] == 0
    assert consumer.stats()["recv_buffer_bytes_in_use"] == 0
    assert pair.transfer("B")[0] == "ok"
    assert pair.idle()


def test_a_release_between_the_pulls_pop_and_the_send_leaves_nothing_waiting(
        pair: WorkerPair) -> None:
    """P pops the waiting pull when the prefill is saved and marks the send in flight a
    little later; a release arriving in between is stored (nothing matched it), and the
    send's end drops it, so P ends idle instead of holding a waiting pull for orphan_ttl_s."""
    producer, consumer = pair.producer, _consumer(pair)
    pair.ask("A")
    real_submit = producer.producer_side._submit

    def submit(job: Any) -> None:
        if job.abort_reason is None:
            received = producer.stats()["control_messages_received"]
            _cancel(consumer, "A")
            assert wait_until(
                lambda: producer.stats()["control_messages_received"] == received + 1, 5.0)
        real_submit(job)

    producer.producer_side._submit = submit
    try:
        pair.compute("A")
    finally:
        producer.producer_side._submit = real_submit
    assert _wait_reported(consumer, "A", 10.0)  # landed (NCCL) or failed (CPU): D is done
    assert wait_until(lambda: producer.stats()["pull_requests_waiting"] == 0
                      and producer.stats()["releases_waiting"] == 0, 5.0), producer.stats()
    assert wait_until(pair.idle, 5.0), (producer.stats(), consumer.stats())
