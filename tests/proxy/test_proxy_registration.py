"""Registration server and client over real ZMQ sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import zmq
import zmq.asyncio

from engine_core.cluster.messages import WorkerLoad
from engine_core.cluster.registration_client import RegistrationClient
from engine_core.cluster.trust import CHANNEL_REGISTRATION, ClusterSecret, Sealer
from proxy.registration import RegistrationServer
from proxy.registry import InstanceRegistry


async def test_client_registers_heartbeats_and_deregisters(wait_until) -> None:
    registry = InstanceRegistry(heartbeat_timeout_s=5)
    server = RegistrationServer(registry, "127.0.0.1", port=0)
    await server.start()
    loads = iter(range(1000))

    async def load() -> WorkerLoad:
        return WorkerLoad(num_running=next(loads))

    client = RegistrationClient(f"127.0.0.1:{server.port}", role="D", http_address="127.0.0.1:8200",
                                model="m", zmq_address="127.0.0.1:14580", version="test",
                                load_provider=load, interval_s=0.05)
    try:
        client.start()
        await wait_until(lambda: len(registry) == 1)
        (worker,) = registry.workers("D")
        assert (worker.zmq_address, worker.model, worker.version) == ("127.0.0.1:14580", "m", "test")
        first = worker.last_heartbeat
        await wait_until(lambda: worker.last_heartbeat > first and worker.load.num_running > 0)
        await client.stop()
        await wait_until(lambda: len(registry) == 0)
        assert server.num_bad_messages == 0 and client.num_sent >= 2
    finally:
        await client.stop()
        await server.stop()


def _heartbeat_with_deep_zmq_address() -> bytes:
    """A heartbeat whose ``zmq_address`` (``str | None``) is a list nested 1000 deep."""
    payload = msgpack.packb({"t": "Heartbeat", "v": 1, "d": {
        "role": "P", "http_address": "127.0.0.1:8000", "model": "m", "zmq_address": None}})
    return payload.replace(b"\xc0", b"\x91" * 1000 + b"\x90")


def sealed(payload: bytes) -> bytes:
    """``payload`` in a valid envelope (no cluster secret, as the server's)."""
    return Sealer(ClusterSecret(), CHANNEL_REGISTRATION, "test-sender").seal(payload)


def malformed() -> list[list[bytes]]:
    return [[sealed(b"not msgpack")], [b"two", b"frames"]]


def hostile() -> list[list[bytes]]:
    """Messages whose decoding raises deep inside (RecursionError, TypeError): each must be
    counted, never end the server's receive task."""
    return [
        [sealed(_heartbeat_with_deep_zmq_address())],  # repr() of it raises RecursionError
        [sealed(msgpack.packb({"t": "Deregister", "v": 1,
                               "d": {"http_address": "h:1", 1: 1, "x": 1}}))],
    ]


# Sealed when the test runs: an envelope made at collection time is stale by then.
@pytest.mark.parametrize("make_messages", [malformed, hostile], ids=["malformed", "hostile"])
async def test_bad_messages_counted_not_fatal(wait_until, make_messages) -> None:
    messages = make_messages()
    registry = InstanceRegistry()
    server = RegistrationServer(registry, "127.0.0.1", port=0)
    await server.start()
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        for frames in messages:
            await dealer.send_multipart(frames)
        await wait_until(lambda: server.num_bad_messages == len(messages))
        client = RegistrationClient(f"127.0.0.1:{server.port}", role="colocated",
                                    http_address="127.0.0.1:8000", model="m", interval_s=0.05)
        client.start()
        await wait_until(lambda: len(registry) == 1)  # the server still serves
        await client.stop(deregister=False)
        assert len(registry) == 1
    finally:
        dealer.close(linger=0)
        context.term()
        await server.stop()


async def test_client_without_proxy_never_blocks() -> None:
    # Nothing listens on this port: heartbeats are dropped, never queued or blocking.
    client = RegistrationClient("127.0.0.1:1", role="P", http_address="127.0.0.1:8100",
                                model="m", zmq_address="127.0.0.1:14579", interval_s=0.01)
    client.start()
    await asyncio.sleep(0.1)
    started = asyncio.get_running_loop().time()
    await client.stop()
    assert asyncio.get_running_loop().time() - started < 0.5
    assert client.num_sent == 0 and client.num_dropped > 0


async def test_load_provider_failure_still_heartbeats(wait_until) -> None:
    registry = InstanceRegistry()
    server = RegistrationServer(registry, "127.0.0.1", port=0)
    await server.start()

    def broken() -> WorkerLoad:
        raise RuntimeError("engine busy")

    client = RegistrationClient(f"127.0.0.1:{server.port}", role="P", http_address="127.0.0.1:8100",
                                model="m", zmq_address="127.0.0.1:14579", load_provider=broken,
                                interval_s=0.05)
    try:
        client.start()
        await wait_until(lambda: len(registry) == 1)
    finally:
        await client.stop()
        await server.stop()


async def test_proxy_app_registers_over_zmq_and_expires(make_worker, wait_until) -> None:
    from aiohttp import test_utils

    from proxy import keys
    from proxy.app import create_app
    from proxy.config import ProxyConfig

    app = create_app(ProxyConfig(registration_port=0, heartbeat_timeout_s=0.3))
    client = test_utils.TestClient(test_utils.TestServer(app))
    await client.start_server()
    p, d = await make_worker("P"), await make_worker("D")
    port = app[keys.REGISTRATION_SERVER].port
    heartbeats = [RegistrationClient(f"127.0.0.1:{port}", role=w.role, http_address=w.http_address,
                                     model="tiny", zmq_address=w.zmq_address, interval_s=0.05)
                  for w in (p, d)]
    try:
        for heartbeat in heartbeats:
            heartbeat.start()
        await wait_until(lambda: len(app[keys.REGISTRY]) == 2)
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert resp.status == 200
        await heartbeats[1].stop(deregister=False)  # D dies silently: dropped by expiry
        await wait_until(lambda: len(app[keys.REGISTRY]) == 1)
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert resp.status == 503
        instances = await (await client.get("/instances")).json()
        assert [w["role"] for w in instances["workers"]] == ["P"]
    finally:
        for heartbeat in heartbeats:
            await heartbeat.stop()
        await client.close()


async def test_a_backlog_of_registration_messages_does_not_hold_the_event_loop() -> None:
    """recv_multipart returns at once while messages wait, so the receive loop never gave
    the event loop back: 20k queued heartbeats (a flood on this unauthenticated port, or a
    backlog) held HTTP and streams until drained. It now yields every few messages."""
    import threading
    import time

    from engine_core.cluster.messages import REGISTRATION_CODEC, Heartbeat

    server = RegistrationServer(InstanceRegistry(), "127.0.0.1", port=0)
    await server.start()
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    payload = REGISTRATION_CODEC.encode(Heartbeat(role="D", http_address="10.0.0.1:1",
                                                  model="m", zmq_address="10.0.0.1:2"))
    count = 20000
    try:
        await asyncio.sleep(0.2)
        sender = threading.Thread(target=lambda: [sock.send(payload) for _ in range(count)])
        sender.start()
        sender.join()  # the loop is held here on purpose: the backlog builds up
        time.sleep(0.3)
        slowest, last = 0.0, time.monotonic()
        deadline = last + 30.0
        while server.num_messages < count and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            slowest, last = max(slowest, now - last), now
        assert server.num_messages == count
        assert slowest < 0.2, f"the event loop was held {slowest:.2f} s draining the backlog"
    finally:
        await server.stop()
        sock.close(0)
        context.term()


async def test_send_now_heartbeats_without_waiting_for_the_interval(wait_until) -> None:
    """A sleep or wake-up (``send_now``) reaches the proxy at once, with the load read
    then, although the next tick is a minute away."""
    registry = InstanceRegistry(heartbeat_timeout_s=600)
    server = RegistrationServer(registry, "127.0.0.1", port=0)
    await server.start()
    sleeping = False
    client = RegistrationClient(f"127.0.0.1:{server.port}", role="D",
                                http_address="127.0.0.1:8200", model="m",
                                zmq_address="127.0.0.1:14580",
                                load_provider=lambda: WorkerLoad(sleeping=sleeping),
                                interval_s=60.0)
    try:
        client.start()
        await wait_until(lambda: len(registry) == 1)

        def asleep() -> bool:
            (worker,) = registry.workers("D")
            return worker.load.sleeping

        await asyncio.sleep(0.1)
        assert client.num_sent == 1 and not asleep()
        sleeping = True
        client.send_now()
        await wait_until(asleep, timeout_s=10.0)
        sleeping = False
        client.send_now()
        await wait_until(lambda: not asleep(), timeout_s=10.0)
        assert client.num_sent == 3
    finally:
        await client.stop()
        await server.stop()
