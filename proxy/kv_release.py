"""Releases of KV that a prefill worker holds for a decode leg that will never pull it.

The proxy sends them itself, straight to the KV control socket of each of P's ranks that
holds a route of the transfer: the message a decode worker's connector sends for a load it
cancels (``KVPullRequest`` with ``num_blocks == 0``, ``connectors/p2p_nccl/messages.py``),
sealed in the cluster's authenticated envelope and carrying the transfer's grant, which names
P and the decode worker the proxy chose. P then hands the held blocks back at once, cancels a
pull still waiting for them, or drops a send still queued; a release that comes after the KV
left is a no-op, and one that comes before P's save ends the save unsent. Because nothing of
D takes part, it reaches P whatever became of D: refused the request, asleep, unreachable,
dead.

Delivery is what the proxy can know: each message is handed to a connection to P's rank
within ``timeout_s`` (all ranks at once), or the release failed (P unreachable; its lease
frees the KV).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from connectors.p2p_nccl.handshake import tcp_endpoint
from connectors.p2p_nccl.kv_layout import rank_pairs
from connectors.p2p_nccl.messages import KVPullRequest, make_codec, release_request
from engine_core.cluster.grants import GrantAuthority
from engine_core.cluster.trust import ClusterSecret
from engine_core.errors import KVTransferError
from proxy.legs import HeldKV

SENDER_ID = "proxy"  # the envelopes' sender (P's refusal log names it)
RELEASE_TIMEOUT_S = 5.0
# Sockets the releases of one proxy hold open at once (each a file descriptor; a context
# allows 1,023): a burst of releases to a dead P waits for a socket instead of failing.
MAX_OPEN_SOCKETS = 64


@dataclass(frozen=True)
class ReleaseNotice:
    """One release: the producer rank's control address and the message it gets."""

    producer_address: str
    message: KVPullRequest


def release_notices(held: HeldKV, grants: GrantAuthority) -> list[ReleaseNotice]:
    """Every release that drops ``held``: one per prompt transfer and route between P's and
    D's layouts, each under its route's grant (the transfer's own for a single route)."""
    prefill, decode = held.prefill, held.decode
    assert prefill.zmq_address is not None and decode.zmq_address is not None
    notices = []
    for transfer_id in held.transfer_ids:
        pairs = rank_pairs(transfer_id, prefill.kv_ranks, prefill.zmq_address,
                           decode.kv_ranks, decode.zmq_address)
        for route_id, producer, consumer in pairs:
            grant = (held.grant if len(pairs) == 1 or not held.grant
                     else grants.for_route(held.grant, route_id, producer, consumer))
            notices.append(ReleaseNotice(producer, release_request(route_id, consumer, grant)))
    return notices


class KVReleaser:
    """Sends release notices to producers' control sockets: one asyncio ZMQ socket per
    producer rank and call, all ranks at once under one deadline (releases are rare, one
    per failed or refused decode leg, and cancelling one stops it at once)."""

    def __init__(self, secret: ClusterSecret, timeout_s: float = RELEASE_TIMEOUT_S,
                 max_open_sockets: int = MAX_OPEN_SOCKETS) -> None:
        self._codec = make_codec(secret, SENDER_ID)
        self._timeout_s = timeout_s
        self._max_open_sockets = max_open_sockets
        self._sockets: asyncio.Semaphore | None = None  # made in the loop that sends
        self.messages_sent = 0  # handed to a connection to their producer rank

    async def send(self, notices: Sequence[ReleaseNotice]) -> None:
        """Hand every notice to its producer within ``timeout_s``; raises KVTransferError
        naming a producer that could not be reached in time (the others still got theirs)."""
        by_producer: dict[str, list[KVPullRequest]] = {}
        for notice in notices:
            by_producer.setdefault(notice.producer_address, []).append(notice.message)
        results = await asyncio.gather(
            *(self._send_to(address, messages) for address, messages in by_producer.items()),
            return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _send_to(self, address: str, messages: list[KVPullRequest]) -> None:
        """One DEALER that queues only on a live connection (``IMMEDIATE``): a send waits
        until P accepted the connection, or fails at the deadline. Closing does not wait:
        the context's I/O thread still delivers what was queued (``LINGER``)."""
        if self._sockets is None:
            self._sockets = asyncio.Semaphore(self._max_open_sockets)
        async with self._sockets:
            sock = None
            try:
                sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
                sock.setsockopt(zmq.IMMEDIATE, 1)
                sock.setsockopt(zmq.LINGER, int(self._timeout_s * 1000))
                sock.connect(tcp_endpoint(address))
                await asyncio.wait_for(self._send_each(sock, messages), self._timeout_s)
            except asyncio.TimeoutError:
                raise KVTransferError(f"prefill worker's KV socket {address} not reachable "
                                      f"in {self._timeout_s:g} s") from None
            except zmq.ZMQError as exc:
                raise KVTransferError(f"release to {address} failed: {exc}") from exc
            finally:
                if sock is not None:
                    sock.close()

    async def _send_each(self, sock: zmq.asyncio.Socket, messages: list[KVPullRequest]) -> None:
        for message in messages:
            await sock.send(self._codec.encode(message))
            self.messages_sent += 1
