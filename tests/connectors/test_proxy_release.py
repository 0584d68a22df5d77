"""The proxy's release reaches a real producer and frees its KV at once (not at its 60 s lease).

The proxy holds no cache: its release (``proxy/kv_release.py``) carries no geometry, only
the transfer, the decode worker it names and the grant. A real producer worker on loopback
(``WorkerPair``, CPU transport) takes it in every state the transfer can be in: its KV held
for a pull that never came, its prefill not yet saved, or D's pull waiting for the prefill.
A release under no grant, or one for another decode worker, is refused and frees nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from connectors.p2p_nccl import producer as producer_module
from connectors.p2p_nccl.messages import release_request
from engine_core.cluster.trust import ClusterSecret
from engine_core.errors import KVTransferError
from proxy.kv_release import KVReleaser, ReleaseNotice
from tests.connectors.kv_harness import free_port
from tests.connectors.worker_pair import WorkerPair, wait_until
from tests.kv_grants import transfer_grant


@pytest.fixture
def pair() -> Iterator[WorkerPair]:
    made = WorkerPair(nccl=False, timeout_s=5.0)
    yield made
    made.shutdown()


def _release(pair: WorkerPair, transfer_id: str, consumer: str | None = None,
             grant: str | None = None) -> None:
    """The proxy's release of ``transfer_id`` on behalf of D, sent as the proxy sends it;
    returns once P's control thread took it."""
    consumer = consumer or pair.d_addr
    if grant is None:
        grant = transfer_grant(transfer_id, pair.p_addr, consumer)
    received = pair.producer.stats()["control_messages_received"]
    notice = ReleaseNotice(pair.p_addr, release_request(transfer_id, consumer, grant))
    asyncio.run(KVReleaser(ClusterSecret(), timeout_s=2.0).send([notice]))
    assert wait_until(
        lambda: pair.producer.stats()["control_messages_received"] == received + 1, 5.0)


def test_held_kv_is_handed_back_at_once(pair: WorkerPair) -> None:
    pair.compute("A")
    assert pair.producer.stats()["sends_pending_pull"] == 1
    _release(pair, "A")
    assert pair.producer_idle()  # within 10 s; its lease is 60 s
    assert pair.producer.stats()["transfers_sent"] == 0


def test_a_release_before_the_save_ends_it_unsent(pair: WorkerPair) -> None:
    _release(pair, "A")
    pair.compute("A")
    assert pair.producer_idle()
    assert pair.producer.stats()["transfers_sent"] == 0


def test_a_waiting_pull_of_that_decode_worker_is_cancelled(pair: WorkerPair) -> None:
    """D pulled before it failed: the release cancels its pull (D is told, so its bytes are
    free), and the prefill's save then ends without a send."""
    pair.ask("A")
    _release(pair, "A")
    assert pair.outcome("A") == "failed"
    assert pair.consumer is not None  # told by P's abort, not timed out
    assert pair.consumer.stats()["transfers_timed_out"] == 0
    pair.compute("A")
    assert pair.idle()
    assert pair.producer.stats()["transfers_sent"] == 0


@pytest.mark.parametrize("attack", ["no-grant", "other-consumer", "other-producer"])
def test_an_ungranted_release_frees_nothing(pair: WorkerPair, attack: str) -> None:
    pair.compute("A")
    if attack == "no-grant":
        _release(pair, "A", grant="")
    elif attack == "other-consumer":  # D named, under a grant of the transfer to another
        _release(pair, "A", grant=transfer_grant("A", pair.p_addr, "127.0.0.1:9"))
    else:
        _release(pair, "A", grant=transfer_grant("A", "127.0.0.1:9", pair.d_addr))
    stats = pair.producer.stats()
    assert stats["pulls_refused"] >= 1 and stats["sends_pending_pull"] == 1
    pair.ask_served("A")  # D's own pull is still served from the held KV
    assert pair.outcome("A") == "ok"
    assert pair.idle()


def test_a_release_to_an_unreachable_producer_fails_in_time() -> None:
    """Nothing listens: the release fails at its timeout (the proxy counts it, and the lease
    frees the KV) instead of waiting for a connection."""
    notice = ReleaseNotice(f"127.0.0.1:{free_port()}", release_request("A", "127.0.0.1:9", ""))
    with pytest.raises(KVTransferError, match="not reachable"):
        asyncio.run(KVReleaser(ClusterSecret(), timeout_s=0.3).send([notice]))


def test_a_second_release_is_dropped_not_kept_as_a_pull(pair: WorkerPair) -> None:
    """The proxy's release and D's own (D took the request, then was cut) both arrive: the
    second finds the transfer ended and is dropped, so P is idle at once, not holding a
    waiting pull for ``orphan_ttl_s``."""
    pair.compute("A")
    _release(pair, "A")
    _release(pair, "A")
    assert pair.producer_idle()
    assert pair.producer.stats()["releases_waiting"] == 0


def test_a_pull_after_a_release_is_told_at_once(pair: WorkerPair) -> None:
    """A decode worker that pulls after the proxy released (it was slow, not dead) gets an
    abort at once instead of waiting for its deadline."""
    pair.compute("A")
    _release(pair, "A")
    assert pair.producer_idle()
    pair.ask_served("A")
    assert pair.outcome("A") == "failed"
    assert pair.consumer is not None
    assert pair.consumer.stats()["transfers_timed_out"] == 0
    assert pair.idle()


def test_a_release_in_flight_is_cancelled_at_once() -> None:
    """The proxy shutting down cancels its releases: one waiting for an unreachable P stops
    then, not at its own 60 s deadline, and leaves nothing running (a thread would hold up
    the loop's shutdown until that deadline)."""
    notice = ReleaseNotice(f"127.0.0.1:{free_port()}", release_request("A", "127.0.0.1:9", ""))

    async def cancel_early() -> None:
        task = asyncio.create_task(KVReleaser(ClusterSecret(), timeout_s=60.0).send([notice]))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    started = time.monotonic()
    asyncio.run(cancel_early())
    assert time.monotonic() - started < 30.0  # far below the release's 60 s deadline


def test_a_release_for_a_request_p_never_got_holds_nothing(pair: WorkerPair) -> None:
    """The client left before P received its leg, and the proxy released anyway: the
    release waits for a save that never comes. It holds no bytes or blocks, so P reads idle
    (it may sleep, or stop, at once) and shows it apart; it expires after orphan_ttl_s."""
    _release(pair, "never-saved")
    stats = pair.producer.stats()
    assert stats["releases_waiting"] == 1 and stats["pull_requests_waiting"] == 0
    assert pair.producer.is_idle()


def test_waiting_releases_make_room_for_a_pull(pair: WorkerPair,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Releases waiting for saves that never come fill the registry P keeps for early
    pulls: a decode worker's pull then takes the oldest release's place instead of being
    refused (a release holds nothing; a pull is a decode worker waiting)."""
    monkeypatch.setattr(producer_module, "MAX_WAITING_PULLS", 2)
    _release(pair, "never-1")
    _release(pair, "never-2")
    pair.ask_served("A")  # its prefill has not reached the save yet: the pull waits
    assert wait_until(lambda: pair.producer.stats()["pull_requests_waiting"] == 1, 5.0)
    stats = pair.producer.stats()
    assert stats["pull_requests_waiting"] == 1 and stats["releases_waiting"] == 1
    assert stats["messages_rejected"] == 0
    pair.compute("A")
    assert pair.outcome("A") == "ok"


def test_a_waiting_release_expires_on_an_idle_producer() -> None:
    """An idle engine takes no steps (which expire what waited ``orphan_ttl_s``): reading
    the gauges expires a release waiting for a save that never came, so the gauge falls
    back to 0 as its help says."""
    pair = WorkerPair(nccl=False, timeout_s=5.0, orphan_ttl_s=0.3)
    try:
        _release(pair, "never-saved")
        assert pair.producer.stats()["releases_waiting"] == 1
        assert wait_until(lambda: pair.producer.stats()["releases_waiting"] == 0, 5.0)
    finally:
        pair.shutdown()
