"""Registration message codec: round trip and validation of bad messages."""

from __future__ import annotations

import msgpack
import pytest

from engine_core.cluster.messages import (
    REGISTRATION_CODEC,
    Deregister,
    Heartbeat,
    WorkerLoad,
    decode_registration,
)
from engine_core.errors import MessageDecodeError
from engine_core.parallel.kv_layout import KVLayout, PeerRanks


def test_round_trip() -> None:
    message = Heartbeat(role="D", http_address="10.0.0.2:8200", model="m",
                        zmq_address="10.0.0.2:14580", version="0.1.0",
                        load=WorkerLoad(num_running=3, num_waiting=1, kv_cache_usage=0.25))
    assert decode_registration(REGISTRATION_CODEC.encode(message)) == message
    leave = Deregister("10.0.0.2:8200")
    assert decode_registration(REGISTRATION_CODEC.encode(leave)) == leave


def test_a_worker_announces_capabilities_and_placement_load() -> None:
    message = Heartbeat(role="worker", http_address="h:1", model="m", zmq_address="h:2",
                        capabilities=["prefill", "decode", "whole"],
                        load=WorkerLoad(num_prefill_tokens_queued=4096,
                                        prefill_tokens_per_s=17_000.0, decode_step_s=0.012,
                                        decode_step_target_s=0.012,
                                        prefill_alone_tokens_per_s=45_000.0))
    assert decode_registration(REGISTRATION_CODEC.encode(message)) == message


def test_colocated_needs_no_kv_address() -> None:
    message = Heartbeat(role="colocated", http_address="h:8000", model="m")
    assert decode_registration(REGISTRATION_CODEC.encode(message)) == message


@pytest.mark.parametrize("message, match", [
    (Heartbeat(role="X", http_address="h:1", model="m", zmq_address="h:2"), "role"),
    (Heartbeat(role="P", http_address="h:1", model="m"), "zmq_address"),
    (Heartbeat(role="P", http_address="nope", model="m", zmq_address="h:2"), "http_address"),
    (Heartbeat(role="P", http_address="h:1", model="m", zmq_address="h:99999"), "zmq_address"),
    (Heartbeat(role="D", http_address="h:1", model="", zmq_address="h:2"), "model"),
    (Heartbeat(role="D", http_address="h:1", model="m", zmq_address="h:2",
               load=WorkerLoad(kv_cache_usage=1.5)), "kv_cache_usage"),
    (Heartbeat(role="D", http_address="h:1", model="m", zmq_address="h:2",
               load=WorkerLoad(num_waiting=-1)), "load counts"),
    (Heartbeat(role="worker", http_address="h:1", model="m"), "zmq_address"),
    (Heartbeat(role="worker", http_address="h:1", model="m", zmq_address="h:2",
               capabilities=["prefill", "teleport"]), "capabilities"),
    (Heartbeat(role="worker", http_address="h:1", model="m", zmq_address="h:2",
               load=WorkerLoad(num_prefill_tokens_queued=-5)), "load counts"),
    (Heartbeat(role="worker", http_address="h:1", model="m", zmq_address="h:2",
               load=WorkerLoad(prefill_tokens_per_s=float("nan"))), "prefill_tokens_per_s"),
    (Heartbeat(role="worker", http_address="h:1", model="m", zmq_address="h:2",
               load=WorkerLoad(decode_step_s=float("inf"))), "decode_step_s"),
    (Heartbeat(role="worker", http_address="h:1", model="m", zmq_address="h:2",
               load=WorkerLoad(decode_step_target_s=-0.01)), "decode_step_target_s"),
    (Heartbeat(role="worker", http_address="h:1", model="m", zmq_address="h:2",
               load=WorkerLoad(decode_base_s=float("nan"))), "decode_base_s"),
    (Heartbeat(role="worker", http_address="h:1", model="m", zmq_address="h:2",
               load=WorkerLoad(prefill_alone_tokens_per_s=-1.0)), "prefill_alone_tokens_per_s"),
])
def test_invalid_values(message: Heartbeat, match: str) -> None:
    with pytest.raises(MessageDecodeError, match=match):
        decode_registration(REGISTRATION_CODEC.encode(message))


@pytest.mark.parametrize("payload", [
    b"\xc1garbage",
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"t": "Heartbeat", "v": 99, "d": {}}),
    msgpack.packb({"t": "Pickle", "v": 1, "d": {}}),
    msgpack.packb({"t": "Heartbeat", "v": 1, "d": {"role": "P"}}),
    msgpack.packb({"t": "Heartbeat", "v": 1, "d": {"role": 1, "http_address": "h:1", "model": "m"}}),
    msgpack.packb({"t": "WorkerLoad", "v": 1, "d": {}}),
])
def test_malformed_payloads(payload: bytes) -> None:
    with pytest.raises(MessageDecodeError):
        decode_registration(payload)


def _ranks(tp_size: int, first: str = "h:2") -> PeerRanks:
    host, _, port = first.rpartition(":")
    return PeerRanks(KVLayout.of_rank(tp_size, 0, 2, 8, 16, "float32", 2),
                     tuple(f"{host}:{int(port) + r}" for r in range(tp_size)))


def test_a_worker_registers_its_kv_ranks() -> None:
    message = Heartbeat(role="P", http_address="h:1", model="m", zmq_address="h:2",
                        kv_ranks=_ranks(2))
    assert decode_registration(REGISTRATION_CODEC.encode(message)).kv_ranks == _ranks(2)


def test_kv_ranks_must_start_at_the_kv_address_and_name_a_held_layout() -> None:
    other = Heartbeat(role="P", http_address="h:1", model="m", zmq_address="h:2",
                      kv_ranks=_ranks(2, "h:7"))
    with pytest.raises(MessageDecodeError, match="zmq_address"):
        decode_registration(REGISTRATION_CODEC.encode(other))
    forged = Heartbeat(role="P", http_address="h:1", model="m", zmq_address="h:2",
                       kv_ranks=PeerRanks(KVLayout(2, 0, 0, 2, 2, 8, 16, "float32", 2),
                                          ("h:2", "h:3")))
    with pytest.raises(MessageDecodeError, match="kv_ranks"):
        decode_registration(REGISTRATION_CODEC.encode(forged))
