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

Delivery is what the proxy can know: each message is handed to a connected socket of P
within ``timeout_s``, or the release failed (P unreachable; its lease frees the KV).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from connectors.p2p_nccl.handshake import tcp_endpoint
from connectors.p2p_nccl.kv_layout import rank_pairs
from connectors.p2p_nccl.messages import KVPullRequest, make_codec, release_request
from engine_core.cluster.grants import GrantAuthority
from engine_core.cluster.trust import ClusterSecret
from engine_core.errors import KVTransferError
from proxy.legs import HeldKV

SENDER_ID = "proxy"  # the envelopes' sender (P's refusal log names it)
RELEASE_TIMEOUT_S = 5.0


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
    """Sends release notices to producers' control sockets (a blocking socket per producer
    and call, on a worker thread: releases are rare, one per failed or refused decode leg)."""

    def __init__(self, secret: ClusterSecret, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
        self._codec = make_codec(secret, SENDER_ID)
        self._timeout_ms = max(1, int(timeout_s * 1000))

    async def send(self, notices: Sequence[ReleaseNotice]) -> None:
        """Hand every notice to its producer; raises KVTransferError naming the first
        producer that could not be reached in time (the others still got theirs)."""
        await asyncio.to_thread(self._send_all, list(notices))

    def _send_all(self, notices: list[ReleaseNotice]) -> None:
        by_producer: dict[str, list[KVPullRequest]] = {}
        for notice in notices:
            by_producer.setdefault(notice.producer_address, []).append(notice.message)
        failures = []
        for address, messages in by_producer.items():
            try:
                self._send_to(address, messages)
            except KVTransferError as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    def _send_to(self, address: str, messages: list[KVPullRequest]) -> None:
        """One DEALER that queues only on a live connection (``IMMEDIATE``): a send blocks
        until P accepted the connection or fails at the timeout; closing waits (``LINGER``)
        for the queued bytes to leave."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
        sock.setsockopt(zmq.LINGER, self._timeout_ms)
        try:
            sock.connect(tcp_endpoint(address))
            for message in messages:
                sock.send(self._codec.encode(message))
        except zmq.Again:
            raise KVTransferError(f"prefill worker's KV socket {address} not reachable in "
                                  f"{self._timeout_ms} ms") from None
        except zmq.ZMQError as exc:
            raise KVTransferError(f"release to {address} failed: {exc}") from exc
        finally:
            sock.close()
