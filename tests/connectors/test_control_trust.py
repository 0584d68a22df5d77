"""The KV control socket under the attacks of issue 33: forged, replayed and oversized
messages are refused before any handler sees them, and the socket keeps serving."""

from __future__ import annotations

import socket
import struct
import threading
import time

from connectors.p2p_nccl.handshake import ControlClient, ControlServer
from connectors.p2p_nccl.messages import CONTROL_CODEC, KVPullRequest, make_codec
from deploy.launch import free_port
from engine_core.cluster.trust import FORGED, REPLAYED, ClusterSecret

SECRET = ClusterSecret(b"0123456789abcdef0123456789abcdef")


def _pull(consumer: str) -> KVPullRequest:
    return KVPullRequest(transfer_id="t", consumer_address=consumer, first_block=0,
                         num_blocks=4, num_layers=2, dtype="float32", block_shape=[4, 2, 4],
                         timeout_s=5.0, consumer_epoch="e1")


class _Producer:
    """A control server that records what reaches its handler."""

    def __init__(self, **server_args: int) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.got: list[object] = []
        self.arrived = threading.Event()
        self.codec = make_codec(SECRET, self.address)
        self.server = ControlServer(self.address, self.codec, self._handle,
                                    poll_interval_s=0.01, **server_args)
        self.server.start()

    def _handle(self, message: object, frames: list) -> None:
        self.got.append(message)
        self.arrived.set()

    def wait_for(self, count: int, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while len(self.got) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(self.got) >= count


def _raw_dealer(address: str) -> socket.socket:
    """A TCP connection that speaks just enough ZMTP 3.0 to be a DEALER peer."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=5.0)
    sock.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
                 + b"\x00" + b"\x00" * 31)
    sock.recv(64)  # the server's greeting
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack("!I", 6) + b"DEALER"
    sock.sendall(b"\x04" + bytes([len(ready)]) + ready)
    return sock


def test_a_frame_declaring_2_gb_drops_the_peer_and_the_socket_keeps_serving() -> None:
    """A frame declaring 2 GB was read (the engine process grew by 300 MB); now the size cap
    closes the connection at the frame's header."""
    producer = _Producer()
    attacker = _raw_dealer(producer.address)
    client = ControlClient(producer.address, make_codec(SECRET, "d"), send_timeout_s=1.0)
    try:
        attacker.sendall(b"\x02" + struct.pack("!Q", 2 << 30) + b"\x00" * 4096)
        attacker.settimeout(5.0)
        try:  # the server closes the connection (a timeout here: it kept reading)
            while attacker.recv(65536):
                pass
        except ConnectionResetError:
            pass
        assert producer.got == []
        client.send(_pull("127.0.0.1:2"))
        assert producer.wait_for(1)
    finally:
        attacker.close()
        client.close()
        producer.server.stop()


def test_an_oversized_frame_over_zmq_is_never_handled() -> None:
    producer = _Producer()
    client = ControlClient(producer.address, make_codec(SECRET, "d"), send_timeout_s=1.0)
    try:
        client.send(_pull("127.0.0.1:2"), [bytes(1 << 20)])  # past the 64 KiB control cap
        time.sleep(0.3)
        assert producer.got == []
        fresh = ControlClient(producer.address, make_codec(SECRET, "d"), send_timeout_s=1.0)
        fresh.send(_pull("127.0.0.1:2"))
        assert producer.wait_for(1)
        fresh.close()
    finally:
        client.close()
        producer.server.stop()


def test_data_frames_within_the_cap_pass() -> None:
    producer = _Producer(max_message_bytes=2 << 20)
    client = ControlClient(producer.address, make_codec(SECRET, "d"), send_timeout_s=1.0)
    try:
        client.send(_pull("127.0.0.1:2"), [bytes(1 << 20)])
        assert producer.wait_for(1)
    finally:
        client.close()
        producer.server.stop()


def test_replayed_and_forged_pulls_naming_another_receiver_reach_no_handler() -> None:
    """Replaying one pull with the attacker as receiver sent 851,968 bytes of another user's
    KV to the attacker: the replay is refused, and so is the pull edited to name it."""
    producer = _Producer()
    genuine = make_codec(SECRET, "127.0.0.1:2").encode(_pull("127.0.0.1:2"))
    edited = genuine.replace(b"127.0.0.1:2", b"127.0.0.1:6")  # the receiver is the attacker
    outsider = make_codec(ClusterSecret(b"k" * 32), "a").encode(_pull("127.0.0.1:6"))
    unsealed = CONTROL_CODEC.encode(_pull("127.0.0.1:6"))
    sender = ControlClient(producer.address, make_codec(SECRET, "x"), send_timeout_s=1.0)
    try:
        for payload in (genuine, genuine, edited, outsider, unsealed):
            sender._socket.send(payload)
        assert producer.wait_for(1)
        deadline = time.monotonic() + 5.0
        while producer.server.messages_rejected < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [p.consumer_address for p in producer.got] == ["127.0.0.1:2"]
        refusals = producer.codec.refusals.counts
        assert (refusals[REPLAYED], refusals[FORGED], refusals["malformed"]) == (1, 2, 1)
    finally:
        sender.close()
        producer.server.stop()
