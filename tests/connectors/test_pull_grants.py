"""P serves a pull only under the proxy's grant naming this P and the pull's receiver as D.

The attack: a peer that can speak on P's control socket replays D's pull with itself as the
receiver (``consumer_address``), to have another user's KV sent to it. Real producer and
consumer workers on loopback over the CPU transport (``WorkerPair``), a recording socket
standing for the attacker.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from connectors.p2p_nccl.handshake import ControlClient, ControlServer
from connectors.p2p_nccl.messages import KVPullRequest, make_codec
from engine_core.server.metrics import CONNECTOR_COUNTERS
from tests.connectors.kv_harness import free_port
from tests.connectors.worker_pair import DST, WorkerPair, wait_until
from tests.kv_grants import transfer_grant


class _Attacker:
    """A control socket that records every message and data byte it is sent."""

    def __init__(self) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.messages: list[Any] = []
        self.data_bytes = 0
        self.server = ControlServer(self.address, make_codec(), self._record)
        self.server.start()

    def _record(self, message: Any, frames: list[Any]) -> None:
        self.messages.append(message)
        self.data_bytes += sum(len(frame.buffer) for frame in frames)


@pytest.fixture
def pair() -> Iterator[WorkerPair]:
    made = WorkerPair(nccl=False, timeout_s=5.0)
    yield made
    made.shutdown()


@pytest.fixture
def attacker() -> Iterator[_Attacker]:
    made = _Attacker()
    yield made
    made.server.stop()


def _send(pair: WorkerPair, pull: KVPullRequest) -> None:
    """Send ``pull`` to P on a socket of its own (sealed anew: a byte-exact replay is refused
    by the envelope already) and wait until P's control thread took it."""
    received = pair.producer.stats()["control_messages_received"]
    client = ControlClient(pair.p_addr, make_codec(), send_timeout_s=1.0)
    try:
        client.send(pull)
        assert wait_until(
            lambda: pair.producer.stats()["control_messages_received"] == received + 1, 5.0)
    finally:
        client.close()


def _attacks(pull: KVPullRequest, pair: WorkerPair, attacker: _Attacker) -> list[KVPullRequest]:
    """D's pull redirected to the attacker: with D's grant, with none, with a grant naming
    another producer."""
    redirected = dataclasses.replace(pull, consumer_address=attacker.address, consumer_epoch="x")
    return [redirected,
            dataclasses.replace(redirected, grant=""),
            dataclasses.replace(redirected, grant=transfer_grant(
                pull.transfer_id, "10.0.0.9:1", attacker.address))]


@pytest.mark.parametrize("save_first", [False, True], ids=["pull-waiting", "save-held"])
def test_a_pull_replayed_with_another_receiver_sends_nothing(
        pair: WorkerPair, attacker: _Attacker, save_first: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    """Whether D's pull is waiting for the prefill or P holds the computed KV for it, the
    redirected pulls are refused (counted, logged once for the attacker), the attacker gets
    no message and no byte, and D's own transfer lands intact."""
    assert pair.consumer is not None
    # D's grant, as the attacker could read it from the HTTP leg, in D's own pull.
    if save_first:  # P computed A and holds it for its pull (the GET path, a late pull)
        pair.compute("A")
        pull = pair.consumer.consumer_side.make_pull(
            "A", transfer_grant("A", pair.p_addr, pair.d_addr), 0, len(DST))
    else:
        pair.ask("A")
        pull = pair.consumer.consumer_side._loads["A"].pull  # as D sent it
    with caplog.at_level(logging.WARNING):
        for attack in _attacks(pull, pair, attacker):
            _send(pair, attack)
    assert pair.producer.stats()["pulls_refused"] == 3
    assert caplog.text.count(f"refused transfer grant from {attacker.address}") == 2  # per reason
    if save_first:
        assert pair.producer.stats()["sends_pending_pull"] == 1  # still held for D
        pair.ask_served("A")
    else:
        pair.compute("A")
    assert pair.outcome("A") == "ok"  # D's own pull was served, bytes checked
    assert pair.idle()
    assert attacker.messages == [] and attacker.data_bytes == 0
    stats = pair.producer.stats()
    assert stats["transfers_sent"] == 1 and stats["pull_requests_waiting"] == 0


def test_a_pull_granted_to_its_receiver_is_served(pair: WorkerPair) -> None:
    """The check refuses no legitimate pull: D's transfers run, none is refused."""
    assert pair.transfer("A")[0] == "ok" and pair.transfer("B")[0] == "ok"
    assert pair.producer.stats()["pulls_refused"] == 0


def test_refused_pulls_are_a_metric() -> None:
    assert "pulls_refused" in CONNECTOR_COUNTERS
