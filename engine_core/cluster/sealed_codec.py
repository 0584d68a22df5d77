"""A message codec whose payloads travel in the cluster's authenticated envelope.

``encode`` seals what the inner ``MessageCodec`` encodes; ``decode`` opens (raising
TrustRefusal, counted, for a forged, stale, replayed or malformed envelope) and then decodes
(raising MessageDecodeError for a bad message). Sockets built on a codec get authentication
by being handed this one instead.
"""

from __future__ import annotations

import time
from typing import Any

from engine_core.cluster.trust import (
    DEFAULT_MAX_SKEW_S,
    OVERSIZED,
    Clock,
    ClusterSecret,
    RefusalLog,
    Sealer,
    Verifier,
    max_sealed_bytes,
)
from engine_core.codec import MessageCodec


class SealedCodec:
    """Seals on encode, opens on decode; one channel, one sender id.

    ``encode`` is safe from any thread; ``decode`` belongs to one receiving socket's thread
    (its replay window is not locked).
    """

    def __init__(self, codec: MessageCodec, secret: ClusterSecret, channel: str,
                 sender_id: str, clock: Clock = time.time,
                 max_skew_s: float = DEFAULT_MAX_SKEW_S) -> None:
        self._codec = codec
        self._sealer = Sealer(secret, channel, sender_id, clock=clock)
        self._verifier = Verifier(secret, channel, clock=clock, max_skew_s=max_skew_s)

    @property
    def max_bytes(self) -> int:
        """The largest sealed payload ``decode`` accepts: a socket's message-size cap."""
        return max_sealed_bytes(self._codec.max_bytes)

    @property
    def refusals(self) -> RefusalLog:
        """Envelopes refused by ``decode``, by reason."""
        return self._verifier.refusals

    def encode(self, message: Any) -> bytes:
        return self._sealer.seal(self._codec.encode(message))

    def decode(self, payload: bytes, peer: str | None = None) -> Any:
        """The message in a sealed payload; TrustRefusal or MessageDecodeError when invalid."""
        if len(payload) > self.max_bytes:
            raise self._verifier.refusals.refuse(OVERSIZED, f"{len(payload)} bytes",
                                                 peer or "?")
        return self._codec.decode(self._verifier.open(payload, peer).payload)
