"""The cluster secret and the authenticated envelope every internal message travels in.

Every process of a cluster holds one secret. A sender wraps each message's bytes in an
envelope: ``version | timestamp | nonce | sender id | payload | HMAC-SHA256`` under a key
derived from the secret for the message's channel (registration, KV control, ...), so a
message is valid on its own channel only. A receiver refuses an envelope whose MAC does not
match (forged), whose timestamp is outside the skew bound (stale) or whose nonce it has seen
within that bound (replayed); each refusal is counted per reason and logged once per peer.

The envelope authenticates; it does not encrypt. Without a secret (loopback clusters, or
``--insecure``) the envelope is the same, keyed by the empty secret: messages are still
framed, timed and de-duplicated, but anyone who can reach a socket can forge them, so a
process binding a non-loopback address refuses to start that way (``check_exposure``).

Pure: no sockets, no threads; time comes from an injected clock.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import itertools
import logging
import os
import secrets
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from engine_core.errors import ConfigError, PdserveError

logger = logging.getLogger(__name__)

Clock = Callable[[], float]

SECRET_FILE_ENV = "PDSERVE_CLUSTER_SECRET_FILE"
MIN_SECRET_BYTES = 16  # 128 bits; ``generate_secret`` writes 256
# Channels: one derived key each, so an envelope sealed for one is refused on the others.
CHANNEL_REGISTRATION = "registration"
CHANNEL_KV_CONTROL = "kv-control"
CHANNEL_GRANT = "grant"

# Refusal reasons: the label values of every refusal counter.
MALFORMED = "malformed"
FORGED = "forged"
STALE = "stale"
REPLAYED = "replayed"
WRONG_IDENTITY = "wrong_identity"
UNAUTHORISED = "unauthorised"
OVERSIZED = "oversized"
CAPACITY = "capacity"
REFUSAL_REASONS = (MALFORMED, FORGED, STALE, REPLAYED, WRONG_IDENTITY, UNAUTHORISED, OVERSIZED,
                   CAPACITY)

ENVELOPE_VERSION = 1
# version u8, timestamp in microseconds u64, nonce 16 bytes, sender id length u8
_HEADER = struct.Struct("!BQ16sB")
_MAC_BYTES = 32
_SHA256_BLOCK = 64
ENVELOPE_OVERHEAD = _HEADER.size + _MAC_BYTES  # plus the sender id's bytes
MAX_SENDER_BYTES = 255
DEFAULT_MAX_SKEW_S = 30.0
DEFAULT_NONCE_CAPACITY = 1 << 18  # ~40 MB at most; holds 30 s of 8,700 messages/s
MAX_LOGGED_PEERS = 1024


class TrustRefusal(PdserveError):
    """A message or grant failed authentication; ``reason`` is one of ``REFUSAL_REASONS``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class MacKey:
    """HMAC-SHA256 (RFC 2104) under one key, with the padded key hashed once.

    Why not ``hmac.digest``: with OpenSSL 3 it sets up the digest on every call (~9 us on an
    EPYC core, most of the per-message budget); copying the keyed SHA-256 states costs ~3 us.
    """

    def __init__(self, key: bytes) -> None:
        if len(key) > _SHA256_BLOCK:
            key = hashlib.sha256(key).digest()
        padded = key.ljust(_SHA256_BLOCK, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in padded))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in padded))

    def digest(self, data: bytes | memoryview) -> bytes:
        """The 32-byte MAC of ``data``."""
        inner = self._inner.copy()
        inner.update(data)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


class ClusterSecret:
    """The cluster's shared secret; empty means none (see the module docstring).

    Immutable. Not a dataclass on purpose: ``dataclasses.asdict`` of a config holding it (and
    configs get logged) copies it whole, and its ``str`` never shows the bytes.
    """

    __slots__ = ("_value",)

    def __init__(self, value: bytes = b"") -> None:
        if value and len(value) < MIN_SECRET_BYTES:
            raise ConfigError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes")
        object.__setattr__(self, "_value", bytes(value))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("ClusterSecret is immutable")

    def __repr__(self) -> str:
        return f"ClusterSecret({'set' if self.is_set else 'none'})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSecret) and hmac.compare_digest(self._value, other._value)

    def __hash__(self) -> int:
        return hash((ClusterSecret, self._value))

    def __reduce__(self) -> tuple[type, tuple[bytes]]:  # to the engine process, as config
        return ClusterSecret, (self._value,)

    @property
    def value(self) -> bytes:
        return self._value

    @property
    def is_set(self) -> bool:
        return bool(self._value)

    def channel_key(self, channel: str) -> MacKey:
        """The MAC key of one channel, derived from the secret."""
        return MacKey(hmac.digest(self._value, b"pdserve/" + channel.encode(), "sha256"))


def generate_secret() -> bytes:
    """A new cluster secret: 32 random bytes as 64 hex characters (printable, so an operator
    can also make one with ``openssl rand -hex 32``)."""
    return secrets.token_hex(32).encode()


def write_secret_file(path: str | os.PathLike[str]) -> ClusterSecret:
    """Create ``path`` (mode 0600; it must not exist) holding a new secret, and return it."""
    value = generate_secret()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(value + b"\n")
    return ClusterSecret(value)


def load_secret_file(path: str | os.PathLike[str]) -> ClusterSecret:
    """The secret in ``path`` (surrounding whitespace ignored); ConfigError if unreadable or
    too short."""
    try:
        value = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the cluster secret file {path}: {exc.strerror}") from None
    if len(value) < MIN_SECRET_BYTES:
        raise ConfigError(f"the cluster secret file {path} holds {len(value)} bytes; "
                          f"at least {MIN_SECRET_BYTES} are needed")
    return ClusterSecret(value)


def secret_file_path(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The secret file an entry point loads: ``--cluster-secret-file``, else the environment's
    ``PDSERVE_CLUSTER_SECRET_FILE``, else none."""
    return flag or environ.get(SECRET_FILE_ENV) or None


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` exposes a socket to this machine only."""
    bare = host.strip("[]")
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def check_exposure(bind_hosts: Iterable[str], secret: ClusterSecret, insecure: bool) -> None:
    """Refuse (ConfigError) to bind a non-loopback host without a secret unless ``insecure``."""
    exposed = sorted({host for host in bind_hosts if not is_loopback(host)})
    if exposed and not secret.is_set and not insecure:
        raise ConfigError(
            f"binding {', '.join(exposed)} without a cluster secret lets anyone on the network "
            f"register workers and read KV: pass --cluster-secret-file (or set "
            f"{SECRET_FILE_ENV}), or --insecure to accept that")


class RefusalLog:
    """Counts refusals per reason and logs the first of each (peer, reason) pair.

    Logging once per peer keeps a flood of forgeries from flooding the log too; at most
    ``MAX_LOGGED_PEERS`` pairs are remembered, then new ones are counted silently.
    """

    def __init__(self, what: str) -> None:
        self._what = what
        self.counts = dict.fromkeys(REFUSAL_REASONS, 0)
        self._logged: set[tuple[str, str]] = set()

    def refuse(self, reason: str, detail: str, peer: str) -> TrustRefusal:
        """Count one refusal and return the exception to raise."""
        self.counts[reason] += 1
        key = (peer[:MAX_SENDER_BYTES], reason)
        if key not in self._logged and len(self._logged) < MAX_LOGGED_PEERS:
            self._logged.add(key)
            logger.warning("refused %s from %.100s: %s (%s); further ones from this peer "
                           "are counted, not logged", self._what, peer, reason, detail)
        return TrustRefusal(reason, detail)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class ReplayWindow:
    """Accepts a (timestamp, nonce) once while the timestamp is within ``max_skew_s`` of now.

    A nonce is remembered until its timestamp leaves the window, so a replay is either seen
    or stale. At ``capacity`` the oldest nonce is forgotten and the window's floor rises past
    its timestamp: memory stays bounded and no replay gets through (messages at or below the
    floor are refused as stale).
    """

    def __init__(self, max_skew_s: float = DEFAULT_MAX_SKEW_S,
                 capacity: int = DEFAULT_NONCE_CAPACITY) -> None:
        if max_skew_s <= 0 or capacity < 1:
            raise ConfigError("the replay window needs max_skew_s > 0 and capacity >= 1")
        self.max_skew_s = max_skew_s
        self._capacity = capacity
        self._order: deque[tuple[float, bytes]] = deque()
        self._seen: set[bytes] = set()
        self._floor = float("-inf")

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, timestamp: float, nonce: bytes, now: float) -> str | None:
        """Record the pair; return None when fresh, else ``STALE`` or ``REPLAYED``."""
        if not abs(now - timestamp) <= self.max_skew_s or timestamp <= self._floor:
            return STALE
        if nonce in self._seen:
            return REPLAYED
        cutoff = now - self.max_skew_s
        order, seen = self._order, self._seen
        while order and order[0][0] < cutoff:
            seen.discard(order.popleft()[1])
        if len(seen) >= self._capacity:
            oldest, forgotten = order.popleft()
            seen.discard(forgotten)
            self._floor = max(self._floor, oldest)
        order.append((timestamp, nonce))
        seen.add(nonce)
        return None


@dataclass(slots=True)
class Opened:
    """An envelope that passed every check: who sealed it, when, and the message bytes."""

    sender_id: str
    timestamp: float
    payload: bytes


class Sealer:
    """Seals messages of one sender on one channel. Safe to share between threads."""

    def __init__(self, secret: ClusterSecret, channel: str, sender_id: str,
                 clock: Clock = time.time) -> None:
        sender = sender_id.encode()
        if not 0 < len(sender) <= MAX_SENDER_BYTES:
            raise ConfigError(f"a sender id must be 1-{MAX_SENDER_BYTES} bytes of UTF-8")
        self._key = secret.channel_key(channel)
        self._sender = sender
        self._clock = clock
        # A random prefix per sealer and a counter: unique nonces without a syscall each.
        self._nonce_prefix = secrets.token_bytes(8)
        self._counter = itertools.count()

    @property
    def sender_id(self) -> str:
        return self._sender.decode()

    def seal(self, payload: bytes) -> bytes:
        """``payload`` in an envelope, ready for one socket frame."""
        nonce = self._nonce_prefix + next(self._counter).to_bytes(8, "big")
        body = b"".join((_HEADER.pack(ENVELOPE_VERSION, int(self._clock() * 1e6), nonce,
                                      len(self._sender)), self._sender, payload))
        return body + self._key.digest(body)


class Verifier:
    """Opens envelopes of one channel: checks the MAC, the timestamp and the nonce.

    One per receiving socket, used by one thread (the replay window is not locked).
    ``refusals`` counts every refusal by reason.
    """

    def __init__(self, secret: ClusterSecret, channel: str, clock: Clock = time.time,
                 max_skew_s: float = DEFAULT_MAX_SKEW_S,
                 nonce_capacity: int = DEFAULT_NONCE_CAPACITY) -> None:
        self._key = secret.channel_key(channel)
        self._clock = clock
        self._window = ReplayWindow(max_skew_s, nonce_capacity)
        self.refusals = RefusalLog(f"{channel} message")

    def open(self, sealed: bytes, peer: str | None = None) -> Opened:
        """The envelope's contents; raises TrustRefusal (counted) when it fails a check.

        ``peer`` names the sender for the log (default: the sender id it claims)."""
        body_end = len(sealed) - _MAC_BYTES
        if body_end < _HEADER.size:
            raise self.refusals.refuse(MALFORMED, f"{len(sealed)} bytes", peer or "?")
        version, timestamp_us, nonce, sender_len = _HEADER.unpack_from(sealed)
        payload_start = _HEADER.size + sender_len
        if version != ENVELOPE_VERSION or payload_start > body_end:
            raise self.refusals.refuse(MALFORMED, f"version {version}, sender of {sender_len} "
                                       f"bytes in {len(sealed)}", peer or "?")
        try:
            sender_id = sealed[_HEADER.size:payload_start].decode()
        except UnicodeDecodeError:
            raise self.refusals.refuse(MALFORMED, "sender id is not UTF-8", peer or "?") from None
        expected = self._key.digest(sealed[:body_end])
        if not hmac.compare_digest(expected, sealed[body_end:]):
            raise self.refusals.refuse(FORGED, "MAC mismatch", peer or sender_id)
        timestamp = timestamp_us / 1e6
        reason = self._window.check(timestamp, nonce, self._clock())
        if reason is not None:
            raise self.refusals.refuse(reason, f"timestamp {timestamp:.3f}", peer or sender_id)
        return Opened(sender_id, timestamp, sealed[payload_start:body_end])


def max_sealed_bytes(max_payload_bytes: int) -> int:
    """The largest envelope of a payload of ``max_payload_bytes``: a socket's size cap."""
    return max_payload_bytes + ENVELOPE_OVERHEAD + MAX_SENDER_BYTES

