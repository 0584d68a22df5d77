"""Registration messages the codec accepts but the proxy must refuse (addresses that are
not host:port, unbounded names). Hostile payloads against the running server are in
test_proxy_registration.py."""

from __future__ import annotations

import pytest

from engine_core.cluster.messages import REGISTRATION_CODEC, Heartbeat, decode_registration
from engine_core.errors import MessageDecodeError


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
