"""Hostile registration messages: each is rejected and counted, and the server goes on."""

from __future__ import annotations

import msgpack
import pytest
import zmq
import zmq.asyncio

from engine_core.errors import MessageDecodeError
from proxy.messages import REGISTRATION_CODEC, Heartbeat, decode_registration
from proxy.registration import RegistrationClient, RegistrationServer
from proxy.registry import InstanceRegistry


def _heartbeat_with_deep_zmq_address() -> bytes:
    """A heartbeat whose ``zmq_address`` (``str | None``) is a list nested 1000 deep."""
    payload = msgpack.packb({"t": "Heartbeat", "v": 1, "d": {
        "role": "P", "http_address": "127.0.0.1:8000", "model": "m", "zmq_address": None}})
    return payload.replace(b"\xc0", b"\x91" * 1000 + b"\x90")


HOSTILE = [
    _heartbeat_with_deep_zmq_address(),  # repr() of it raised RecursionError
    msgpack.packb({"t": "Deregister", "v": 1, "d": {"http_address": "h:1", 1: 1, "x": 1}}),
]


async def test_hostile_messages_do_not_stop_the_registration_server(wait_until) -> None:
    """Each used to raise out of the decoder as RecursionError or TypeError, ending the
    server's receive task: the proxy then registered no worker and refreshed no heartbeat
    (every worker expired) until it restarted."""
    registry = InstanceRegistry()
    server = RegistrationServer(registry, "127.0.0.1", port=0)
    await server.start()
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{server.port}")
    client = RegistrationClient(f"127.0.0.1:{server.port}", role="colocated",
                                http_address="127.0.0.1:8000", model="m", interval_s=0.05)
    try:
        for payload in HOSTILE:
            await dealer.send(payload)
        await wait_until(lambda: server.num_bad_messages == len(HOSTILE))
        client.start()
        await wait_until(lambda: len(registry) == 1)  # the server still serves
    finally:
        await client.stop(deregister=False)
        dealer.close(0)
        context.term()
        await server.stop()


@pytest.mark.parametrize("http_address", [
    "127.0.0.1:9/x?:8000",  # the proxy would call http://127.0.0.1:9/x?:8000/v1/...
    "user@10.0.0.9:8000",
    "a b:8000",
    "h\n:8000",
    "h" * 300 + ":8000",
])
def test_an_address_that_is_not_host_port_is_refused(http_address: str) -> None:
    message = Heartbeat(role="D", http_address=http_address, model="m", zmq_address="h:2")
    with pytest.raises(MessageDecodeError, match="http_address"):
        decode_registration(REGISTRATION_CODEC.encode(message))
    bad_kv = Heartbeat(role="D", http_address="h:1", model="m", zmq_address=http_address)
    with pytest.raises(MessageDecodeError, match="zmq_address"):
        decode_registration(REGISTRATION_CODEC.encode(bad_kv))


@pytest.mark.parametrize("address", ["127.0.0.1:8000", "[::1]:8000", "worker-3.cluster_a:80",
                                     "fe80::1:8000"])
def test_host_port_addresses_still_register(address: str) -> None:
    message = Heartbeat(role="D", http_address=address, model="m", zmq_address=address)
    assert decode_registration(REGISTRATION_CODEC.encode(message)) == message


@pytest.mark.parametrize("field,value", [("model", ""), ("model", "m" * 257),
                                         ("version", "v" * 65)])
def test_model_and_version_are_bounded(field: str, value: str) -> None:
    """They become metric labels and /instances fields: an unbounded string from any peer
    on the registration socket would be kept and exported for as long as it heartbeats."""
    message = Heartbeat(role="D", http_address="h:1", model="m", zmq_address="h:2")
    setattr(message, field, value)
    with pytest.raises(MessageDecodeError, match=field):
        decode_registration(REGISTRATION_CODEC.encode(message))
    setattr(message, field, value[:64] or "m")
    assert decode_registration(REGISTRATION_CODEC.encode(message)) == message
