"""A release for a transfer whose send is queued behind another send is never sent.

Defect: P runs one sender thread per consumer. When D released a transfer (its request
ended there, ``num_blocks=0`` pull) whose send job was already queued behind another job to
the same consumer, P still sent it in full when its turn came: wasted bandwidth, P's blocks
held until then, and on NCCL D's receive-buffer bytes reserved until the data landed. Now a
job the sender thread has not taken is dropped: reported at once (its blocks go back), and
answered with a ``KVSendAbort`` so D frees the bytes. A job the thread already took still
runs in full (the release crossed it). Each job is sent entirely or not at all.

Real producer and consumer workers on loopback (``WorkerPair``), fake NCCL or CPU transport;
P's sender is held inside the first transfer's data call until the test lets it go.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from connectors.cpu_transport import CpuTransport
from connectors.p2p_nccl.connector_worker import P2pConnectorWorker
from connectors.p2p_nccl.handshake import ControlClient, ControlServer
from connectors.p2p_nccl.loads import REQUESTED
from connectors.p2p_nccl.messages import KVSendAbort, KVSendHeader, make_codec
from connectors.p2p_nccl.metadata import P2pConnectorMetadata
from connectors.p2p_nccl.sender import PeerSender, SendJob
from tests.connectors.kv_harness import free_port
from tests.connectors.worker_pair import DST, SRC, WorkerPair, wait_until
from tests.kv_grants import transfer_grant

TIMEOUT_S = 10.0  # the transfers' deadline: every wait below is far shorter


@pytest.fixture(params=[True, False], ids=["fake-nccl", "cpu-transport"])
def pair(request: pytest.FixtureRequest) -> Iterator[WorkerPair]:
    made = WorkerPair(nccl=request.param, timeout_s=TIMEOUT_S)
    yield made
    made.shutdown()


class _Held:
    """P's data calls, by transfer id; the first call of ``hold`` waits for ``gate``."""

    def __init__(self, pair: WorkerPair, hold: str) -> None:
        self.calls: list[str] = []
        self.entered, self.gate = threading.Event(), threading.Event()
        transport: Any = pair.producer.state.transport
        real_send_call = transport.send_call

        def send_call(client: Any, header: KVSendHeader, *args: Any) -> Any:
            self.calls.append(header.transfer_id)
            if header.transfer_id == hold:
                self.entered.set()
                assert self.gate.wait(10.0)
            return real_send_call(client, header, *args)

        transport.send_call = send_call


class _Seen:
    """Headers and aborts that reached D's handlers (whether or not a load took them)."""

    def __init__(self, consumer: P2pConnectorWorker) -> None:
        self.headers: list[str] = []
        self.aborts: list[tuple[str, str]] = []
        real_header, real_abort = consumer.consumer_side.on_header, consumer.consumer_side.on_abort

        def on_header(header: KVSendHeader) -> None:
            self.headers.append(header.transfer_id)
            real_header(header)

        def on_abort(abort: KVSendAbort) -> None:
            self.aborts.append((abort.transfer_id, abort.reason))
            real_abort(abort)

        consumer.consumer_side.on_header = on_header  # type: ignore[method-assign]
        consumer.consumer_side.on_abort = on_abort  # type: ignore[method-assign]


def _consumer(pair: WorkerPair) -> P2pConnectorWorker:
    assert pair.consumer is not None
    return pair.consumer


def _resolve(consumer: P2pConnectorWorker, request_ids: set[str]) -> dict[str, str]:
    """Drive ``land_loads`` as the engine loop does until each load is reported: "ok" or
    "failed" by request id."""
    outcomes: dict[str, str] = {}

    def done() -> bool:
        landed = consumer.land_loads()
        outcomes.update(dict.fromkeys(landed.recving, "ok"))
        outcomes.update(dict.fromkeys(landed.failed_recving, "failed"))
        return request_ids <= set(outcomes)

    assert wait_until(done, TIMEOUT_S), outcomes
    return outcomes


def _landed_intact(pair: WorkerPair) -> bool:
    return all(torch.equal(d[:, DST], p[:, SRC]) for p, d in zip(pair.p_caches, pair.d_caches))


def _release_from(pair: WorkerPair, transfer_id: str, consumer_address: str) -> None:
    """A release of ``transfer_id`` naming ``consumer_address``, sent on a socket of its own;
    returns once P's control thread took it."""
    producer = pair.producer
    pull = _consumer(pair).consumer_side.make_pull(
        transfer_id, transfer_grant(transfer_id, pair.p_addr, consumer_address), 0, 0)
    pull.consumer_address = consumer_address
    received = producer.stats()["control_messages_received"]
    client = ControlClient(pair.p_addr, make_codec(), send_timeout_s=1.0)
    try:
        client.send(pull)
        assert wait_until(
            lambda: producer.stats()["control_messages_received"] == received + 1, 5.0)
    finally:
        client.close()


def test_a_release_of_a_queued_send_skips_it_and_frees_both_sides(pair: WorkerPair) -> None:
    producer, consumer = pair.producer, _consumer(pair)
    held, seen = _Held(pair, hold="A"), _Seen(consumer)
    try:
        pair.ask("A")
        pair.ask("B")
        pair.compute("A", "B")  # A's send holds the sender in its first data call; B queues
        assert held.entered.wait(5.0)
        assert consumer.consumer_side._loads["B"].state == REQUESTED
        received = producer.stats()["control_messages_received"]
        consumer.start_load_kv(P2pConnectorMetadata(cancels=["B"]))  # B ended on D: release
        assert wait_until(
            lambda: producer.stats()["control_messages_received"] == received + 1, 5.0)
        # P handed B's blocks back at once, while A still holds the sender thread.
        assert producer.get_finished().sending == {"B"}
        assert producer.stats()["sends_in_flight"] == 1
    finally:
        held.gate.set()
    assert _resolve(consumer, {"A", "B"}) == {"A": "ok", "B": "failed"}
    assert _landed_intact(pair)  # A landed bit for bit
    # D got P's answer for B and freed its bytes; B's header and data never left P.
    assert wait_until(lambda: ("B", "transfer released") in seen.aborts, 5.0), seen.aborts
    assert seen.aborts == [("B", "transfer released")]
    assert "B" not in held.calls and set(held.calls) == {"A"}
    assert seen.headers == ["A"]
    assert consumer.consumer_side.recv_buffer.holders() == []
    assert pair.idle()
    p, d = producer.stats(), consumer.stats()
    assert p["transfers_sent"] == 1 and p["sends_failed"] == 0 and p["messages_rejected"] == 0
    assert d["transfers_received"] == 1 and d["transfers_failed"] == 0
    assert d["transfers_timed_out"] == 0 and d["messages_rejected"] == 0
    assert d["recv_buffer_bytes_in_use"] == 0
    # The pair still works (nothing of B was posted on it).
    assert pair.transfer("C")[0] == "ok"
    assert pair.idle()


def test_a_release_after_the_send_started_does_not_stop_it(pair: WorkerPair) -> None:
    """The sender thread took A (its header is out, a data call is running) when D's
    release of A arrives: A is sent in full and lands intact, nothing is aborted."""
    producer, consumer = pair.producer, _consumer(pair)
    held, seen = _Held(pair, hold="A"), _Seen(consumer)
    try:
        pair.ask("A")
        pair.compute("A")
        assert held.entered.wait(5.0)
        _release_from(pair, "A", pair.d_addr)
        assert producer.get_finished().sending == set()  # A's blocks are still being sent
        assert producer.stats()["sends_in_flight"] == 1
        assert producer.stats()["messages_rejected"] == 0
    finally:
        held.gate.set()
    assert _resolve(consumer, {"A"}) == {"A": "ok"}
    assert _landed_intact(pair)
    assert seen.headers == ["A"] and seen.aborts == []
    assert pair.idle()
    p = producer.stats()
    assert p["transfers_sent"] == 1 and p["sends_failed"] == 0 and p["messages_rejected"] == 0
    assert consumer.stats()["messages_rejected"] == 0


def test_a_release_of_a_queued_send_from_another_consumer_is_refused(pair: WorkerPair) -> None:
    """Only the consumer that pulled may release: a release of queued B naming another
    address is refused (logged, counted) and B is sent and lands."""
    producer, consumer = pair.producer, _consumer(pair)
    held, seen = _Held(pair, hold="A"), _Seen(consumer)
    try:
        pair.ask("A")
        pair.ask("B")
        pair.compute("A", "B")
        assert held.entered.wait(5.0)
        _release_from(pair, "B", f"127.0.0.1:{free_port()}")
        assert producer.stats()["messages_rejected"] == 1
        assert producer.get_finished().sending == set()
    finally:
        held.gate.set()
    assert _resolve(consumer, {"A", "B"}) == {"A": "ok", "B": "ok"}
    assert _landed_intact(pair)
    assert seen.headers == ["A", "B"] and seen.aborts == []
    assert pair.idle()
    assert producer.stats()["transfers_sent"] == 2


# ---- the sender alone: a job is sent entirely or not at all ----------------------------


def _job(transfer_id: str, peer: str, layers: int = 2) -> SendJob:
    source = torch.arange(8, dtype=torch.float32)
    return SendJob(transfer_id=transfer_id, request_id=transfer_id, peer_address=peer,
                   first_block=0, num_blocks=1, num_layers=layers, dtype="float32",
                   block_shape=[1, 1, 4], deadline=time.monotonic() + TIMEOUT_S,
                   call_source=lambda first, end: (source, None))


def test_releases_racing_the_sender_thread_never_half_send_a_job() -> None:
    """Releases from another thread while the sender runs the same jobs: every job is either
    released (no message of it sent, reported once) or sent whole (its header and every
    data call), never reported twice; ``release`` answers which."""
    peer = f"127.0.0.1:{free_port()}"
    got: list[tuple[str, str]] = []
    lock = threading.Lock()

    def record(message: Any, frames: Any) -> None:
        with lock:
            got.append((type(message).__name__, message.transfer_id))

    server = ControlServer(peer, make_codec(), record)
    server.start()
    reports: list[SendJob] = []
    sender = PeerSender(peer, "127.0.0.1:1", "epoch", make_codec(), CpuTransport(),
                        reports.append, send_timeout_s=2.0)
    sender.start()
    try:
        jobs = [_job(f"t{i}", peer) for i in range(300)]
        for job in jobs:
            sender.submit(job)
        assert wait_until(lambda: jobs[0].started, 5.0)  # the thread runs; release from the end
        released = {job.transfer_id for job in reversed(jobs)
                    if sender.release(job, "transfer released")}
        assert all(job.done.wait(10.0) for job in jobs)
        assert sorted(job.transfer_id for job in reports) == sorted(j.transfer_id for j in jobs)
        assert released and len(released) < len(jobs)  # both outcomes happened
        assert wait_until(lambda: len(got) == 3 * (len(jobs) - len(released)), 5.0)
        for job in jobs:
            assert job.released == (job.transfer_id in released) != job.started
            sent = [kind for kind, tid in got if tid == job.transfer_id]
            if job.released:
                assert sent == [] and job.error == "transfer released"
            else:
                assert sent == ["KVSendHeader", "KVLayerData", "KVLayerData"]
                assert job.error is None
        assert not sender.release(jobs[0], "again") and not sender.release(jobs[-1], "again")
    finally:
        sender.stop()
        server.stop()
