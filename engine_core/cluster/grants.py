"""Transfer grants: the proxy's signed word on where one request's KV may go.

Per request the proxy issues a grant naming the transfer id, the producer P and the consumer
D (their registered KV addresses) and an expiry, signed with the cluster secret's grant key,
and attaches the same token to both legs' ``kv_transfer_params``. P sends the request's KV
only to the D its grant names; D pulls only from the P its grant names. So neither an HTTP
client writing its own ``kv_transfer_params`` nor a peer naming itself as receiver can
steer another user's KV anywhere.

A token is ``g1.<base64url(msgpack [transfer id, producer, consumer, expiry ms])>.<base64url(mac)>``:
a plain string, as ``kv_transfer_params`` carries only JSON strings and integers.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import time
from dataclasses import dataclass

import msgpack

from engine_core.addresses import MAX_ADDRESS_CHARS
from engine_core.cluster.trust import (
    CHANNEL_GRANT,
    FORGED,
    MALFORMED,
    STALE,
    UNAUTHORISED,
    Clock,
    ClusterSecret,
    RefusalLog,
)
from engine_core.errors import ConfigError

_PREFIX = "g1."
_MAC_BYTES = 32
MAX_TRANSFER_ID_CHARS = 1024
MAX_GRANT_CHARS = 4096  # a grant at the field bounds is ~1,800 characters
DEFAULT_GRANT_LEEWAY_S = 5.0  # clock skew tolerated between the proxy and the workers


@dataclass(frozen=True)
class TransferGrant:
    """Transfer ``transfer_id`` may move KV from ``producer`` to ``consumer`` until
    ``expires_at`` (Unix seconds). Producer and consumer are KV addresses (``host:kv_port``)."""

    transfer_id: str
    producer: str
    consumer: str
    expires_at: float

    def __post_init__(self) -> None:
        if not 0 < len(self.transfer_id) <= MAX_TRANSFER_ID_CHARS:
            raise ConfigError(f"a grant's transfer id must be 1-{MAX_TRANSFER_ID_CHARS} characters")
        for name in (self.producer, self.consumer):
            if not 0 < len(name) <= MAX_ADDRESS_CHARS:
                raise ConfigError(f"a grant's peer must be 1-{MAX_ADDRESS_CHARS} characters")


def covers(granted_id: str, transfer_id: str) -> bool:
    """Whether a grant for ``granted_id`` covers ``transfer_id``: the id itself, or the
    transfer of one prompt of its batch (``<id>-p<index>``, as the workers derive them)."""
    if transfer_id == granted_id:
        return True
    prefix = granted_id + "-p"
    return transfer_id.startswith(prefix) and transfer_id[len(prefix):].isdigit()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)


class GrantAuthority:
    """Issues and verifies grants with the cluster secret's grant key.

    The proxy issues; P and D verify. ``refusals`` counts refused grants by reason
    (``malformed``, ``forged``, ``stale``: expired, ``unauthorised``: names another transfer
    or peer).
    """

    def __init__(self, secret: ClusterSecret, clock: Clock = time.time,
                 leeway_s: float = DEFAULT_GRANT_LEEWAY_S) -> None:
        self._key = secret.channel_key(CHANNEL_GRANT)
        self._clock = clock
        self._leeway_s = leeway_s
        self.refusals = RefusalLog("transfer grant")

    def issue(self, transfer_id: str, producer: str, consumer: str, ttl_s: float) -> str:
        """A signed token granting ``transfer_id`` from ``producer`` to ``consumer`` for
        ``ttl_s`` seconds."""
        grant = TransferGrant(transfer_id, producer, consumer, self._clock() + ttl_s)
        return self.sign(grant)

    def sign(self, grant: TransferGrant) -> str:
        """The token of ``grant``."""
        body = _b64(msgpack.packb([grant.transfer_id, grant.producer, grant.consumer,
                                   int(grant.expires_at * 1000)], use_bin_type=True))
        signed = _PREFIX + body
        return f"{signed}.{_b64(self._key.digest(signed.encode()))}"

    def for_route(self, token: str, transfer_id: str, producer: str, consumer: str) -> str:
        """The grant of one route of a transfer whose grant ``token`` was checked: between
        tensor-parallel layouts each route moves between two ranks under its own transfer
        id, and the producer rank checks every pull against its own address. The route's
        grant expires with the transfer's."""
        grant = self._authentic(token, producer)
        return self.sign(TransferGrant(transfer_id, producer, consumer, grant.expires_at))

    def verify(self, token: object, *, transfer_id: str, producer: str | None = None,
               consumer: str | None = None, peer: str = "?") -> TransferGrant:
        """The grant in ``token`` if it is authentic, unexpired, covers ``transfer_id`` and
        names the given producer and consumer; raises TrustRefusal (counted) otherwise.

        ``peer`` names who presented the token, for the log."""
        grant = self._authentic(token, peer)
        if self._clock() > grant.expires_at + self._leeway_s:
            raise self.refusals.refuse(STALE, f"grant for {grant.transfer_id:.80} expired", peer)
        if not covers(grant.transfer_id, transfer_id):
            raise self.refusals.refuse(UNAUTHORISED, f"grant for {grant.transfer_id:.80} "
                                       f"presented for {transfer_id:.80}", peer)
        if producer is not None and grant.producer != producer:
            raise self.refusals.refuse(UNAUTHORISED, f"transfer {transfer_id:.80} is granted "
                                       f"from {grant.producer}, not {producer:.100}", peer)
        if consumer is not None and grant.consumer != consumer:
            raise self.refusals.refuse(UNAUTHORISED, f"transfer {transfer_id:.80} is granted "
                                       f"to {grant.consumer}, not {consumer:.100}", peer)
        return grant

    def _authentic(self, token: object, peer: str) -> TransferGrant:
        if not isinstance(token, str) or not 0 < len(token) <= MAX_GRANT_CHARS:
            raise self.refusals.refuse(MALFORMED, "grant is not a string of at most "
                                       f"{MAX_GRANT_CHARS} characters", peer)
        signed, _, mac_text = token.rpartition(".")
        if not signed.startswith(_PREFIX):
            raise self.refusals.refuse(MALFORMED, "not a g1 grant", peer)
        try:
            mac = _unb64(mac_text)
        except (binascii.Error, ValueError):
            mac = b""
        if len(mac) != _MAC_BYTES:
            raise self.refusals.refuse(MALFORMED, "grant MAC is not 32 bytes of base64url",
                                       peer)
        expected = self._key.digest(signed.encode())
        if not hmac.compare_digest(expected, mac):
            raise self.refusals.refuse(FORGED, "grant MAC mismatch", peer)
        try:  # signed by a holder of the secret: the fields are ours unless versions differ
            transfer_id, producer, consumer, expires_ms = msgpack.unpackb(
                _unb64(signed[len(_PREFIX):]), raw=False)
            if not (isinstance(transfer_id, str) and isinstance(producer, str)
                    and isinstance(consumer, str) and type(expires_ms) is int):
                raise TypeError("field types")
            return TransferGrant(transfer_id, producer, consumer, expires_ms / 1000)
        except (ValueError, TypeError, binascii.Error, msgpack.UnpackException) as exc:
            raise self.refusals.refuse(MALFORMED, f"grant fields: {exc}", peer) from None

