"""The registration attacks of issue 33 against a proxy with a cluster secret: each is refused,
counted by reason, and leaves the registry as it was."""

from __future__ import annotations

import argparse
import asyncio
import logging

import pytest
import zmq
import zmq.asyncio

from engine_core.cluster.messages import REGISTRATION_CODEC, Deregister, Heartbeat, WorkerLoad
from engine_core.cluster.registration_client import RegistrationClient
from engine_core.cluster.trust import (
    CAPACITY,
    CHANNEL_REGISTRATION,
    FORGED,
    REPLAYED,
    STALE,
    WRONG_IDENTITY,
    ClusterSecret,
    Sealer,
)
from proxy.registration import RegistrationServer
from proxy.registry import InstanceRegistry
from tests.manual_clock import ManualClock

SECRET = ClusterSecret(b"0123456789abcdef0123456789abcdef")
D_HTTP, D_KV = "127.0.0.1:8200", "127.0.0.1:14580"



def heartbeat(http: str = D_HTTP, kv: str = D_KV, role: str = "D",
              sleeping: bool = False) -> bytes:
    return REGISTRATION_CODEC.encode(Heartbeat(role=role, http_address=http, model="m",
                                               zmq_address=kv, heartbeat_interval_s=3.0,
                                               load=WorkerLoad(sleeping=sleeping)))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def server(clock: ManualClock) -> RegistrationServer:
    """A server (never started: ``handle`` takes payloads) with the real D registered."""
    server = RegistrationServer(InstanceRegistry(max_workers=256), secret=SECRET, clock=clock)
    server.handle(Sealer(SECRET, CHANNEL_REGISTRATION, "real-d", clock=clock).seal(heartbeat()))
    return server


def registry_of(server: RegistrationServer) -> InstanceRegistry:
    return server._registry


def test_forged_registration_of_a_fake_decode_worker_is_refused(server, clock):
    """A fake D captured 10 of 20 prompts; without the secret it is not registered at all."""
    for secret in (ClusterSecret(), ClusterSecret(b"attacker-guess-0123456789abcdef")):
        attacker = Sealer(secret, CHANNEL_REGISTRATION, "fake-d", clock=clock)
        server.handle(attacker.seal(heartbeat("127.0.0.1:9999", "127.0.0.1:9998")))
    server.handle(heartbeat("127.0.0.1:9999", "127.0.0.1:9998"))  # no envelope at all
    assert [w.http_address for w in registry_of(server).workers()] == [D_HTTP]
    assert server.refusals[FORGED] == 2 and server.refusals["malformed"] == 1


def test_replayed_sleeping_heartbeat_and_deregister_are_refused(server, clock):
    """Forged Deregister / sleeping: true gave 40/40 clients a 503: a captured message of the
    real D cannot be played again."""
    real = Sealer(SECRET, CHANNEL_REGISTRATION, "real-d", clock=clock)
    asleep = real.seal(heartbeat(sleeping=True))
    awake = real.seal(heartbeat())
    bye = real.seal(REGISTRATION_CODEC.encode(Deregister(D_HTTP)))
    server.handle(asleep)
    server.handle(awake)
    clock.now += 1.0
    server.handle(asleep)  # the attacker replays what it captured
    assert not registry_of(server).get(D_HTTP).load.sleeping
    server.handle(bye)
    server.handle(real.seal(heartbeat()))
    clock.now += 1.0
    server.handle(bye)
    assert registry_of(server).get(D_HTTP) is not None
    assert server.refusals[REPLAYED] == 2


def test_stale_message_is_refused(server, clock):
    sender_clock = ManualClock(clock.now - 120.0)  # captured two minutes ago, or a clock far off
    old = Sealer(SECRET, CHANNEL_REGISTRATION, "real-d", clock=sender_clock)
    server.handle(old.seal(REGISTRATION_CODEC.encode(Deregister(D_HTTP))))
    assert registry_of(server).get(D_HTTP) is not None
    assert server.refusals[STALE] == 1


def test_another_sender_cannot_rebind_sleep_or_deregister_a_worker(server, clock):
    """With the secret but another identity: P's name with another KV address (12 of 12
    pulls went to the attacker), sleeping: true, Deregister."""
    insider = Sealer(SECRET, CHANNEL_REGISTRATION, "other", clock=clock)
    server.handle(insider.seal(heartbeat(kv="127.0.0.1:6666")))
    server.handle(insider.seal(heartbeat(sleeping=True)))
    server.handle(insider.seal(REGISTRATION_CODEC.encode(Deregister(D_HTTP))))
    worker = registry_of(server).get(D_HTTP)
    assert (worker.zmq_address, worker.load.sleeping) == (D_KV, False)
    assert server.refusals[WRONG_IDENTITY] == 3


def test_three_thousand_fake_workers_stop_at_the_cap(clock, caplog):
    server = RegistrationServer(InstanceRegistry(max_workers=256), clock=clock)  # no secret
    flood = Sealer(ClusterSecret(), CHANNEL_REGISTRATION, "flood", clock=clock)
    with caplog.at_level(logging.WARNING):
        for i in range(3000):
            server.handle(flood.seal(heartbeat(f"10.{i // 250}.{i % 250}.1:8200",
                                               f"10.{i // 250}.{i % 250}.1:14580")))
    assert len(registry_of(server)) == 256
    assert server.refusals[CAPACITY] == 3000 - 256
    assert len([r for r in caplog.records if "capacity" in r.getMessage()]) == 1


async def test_oversized_frame_is_dropped_and_the_server_keeps_serving(wait_until):
    """A frame declaring 2 GB was read; now ZMQ drops the peer past the size cap."""
    registry = InstanceRegistry()
    server = RegistrationServer(registry, "127.0.0.1", port=0, secret=SECRET)
    await server.start()
    context = zmq.asyncio.Context()
    attacker = context.socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(f"tcp://127.0.0.1:{server.port}")
    client = RegistrationClient(f"127.0.0.1:{server.port}", role="D", http_address=D_HTTP,
                                model="m", zmq_address=D_KV, interval_s=0.05, secret=SECRET)
    try:
        await attacker.send(b"\0" * (8 << 20))
        await asyncio.sleep(0.2)
        assert server.num_messages == 0
        client.start()
        await wait_until(lambda: len(registry) == 1)
        assert server.refusals[FORGED] == 0
    finally:
        await client.stop()
        attacker.close(0)
        context.term()
        await server.stop()


async def test_client_and_server_with_one_secret_register(wait_until):
    registry = InstanceRegistry()
    server = RegistrationServer(registry, "127.0.0.1", port=0, secret=SECRET)
    await server.start()
    client = RegistrationClient(f"127.0.0.1:{server.port}", role="D", http_address=D_HTTP,
                                model="m", zmq_address=D_KV, interval_s=0.05, secret=SECRET)
    stranger = RegistrationClient(f"127.0.0.1:{server.port}", role="D",
                                  http_address="127.0.0.1:9999", model="m",
                                  zmq_address="127.0.0.1:9998", interval_s=0.05)
    try:
        client.start()
        stranger.start()
        await wait_until(lambda: len(registry) == 1 and server.refusals[FORGED] >= 2)
        assert registry.get(D_HTTP) is not None
        await client.stop()  # its Deregister is its own: accepted
        await wait_until(lambda: len(registry) == 0)
    finally:
        await client.stop()
        await stranger.stop()
        await server.stop()


def test_proxy_refuses_a_public_bind_without_a_secret(caplog, tmp_path):
    from proxy.__main__ import add_proxy_args, run_proxy

    parser = add_proxy_args(argparse.ArgumentParser())
    with caplog.at_level(logging.ERROR, logger="proxy"):
        assert run_proxy(parser.parse_args(["--host", "0.0.0.0", "--port", "1"])) == 2
    assert "--insecure" in caplog.text
    missing = str(tmp_path / "absent")
    assert run_proxy(parser.parse_args(["--cluster-secret-file", missing])) == 2
    assert "cannot read the cluster secret file" in caplog.text
