"""The cluster secret, the exposure check and the authenticated envelope (pure, ms)."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from engine_core.cluster.trust import (
    CHANNEL_KV_CONTROL,
    CHANNEL_REGISTRATION,
    ENVELOPE_OVERHEAD,
    FORGED,
    MALFORMED,
    REPLAYED,
    SECRET_FILE_ENV,
    STALE,
    ClusterSecret,
    ReplayWindow,
    Sealer,
    TrustRefusal,
    Verifier,
    check_exposure,
    is_loopback,
    load_secret_file,
    max_sealed_bytes,
    secret_file_path,
    write_secret_file,
)
from engine_core.errors import ConfigError
from tests.manual_clock import ManualClock

SECRET = ClusterSecret(b"0123456789abcdef0123456789abcdef")
OTHER_SECRET = ClusterSecret(b"fedcba9876543210fedcba9876543210")



def pair(clock: ManualClock, secret: ClusterSecret = SECRET, channel: str = CHANNEL_REGISTRATION,
         **verifier_args: float) -> tuple[Sealer, Verifier]:
    return (Sealer(secret, channel, "worker-1", clock=clock),
            Verifier(secret, channel, clock=clock, **verifier_args))


def refusal(verifier: Verifier, sealed: bytes) -> str:
    with pytest.raises(TrustRefusal) as info:
        verifier.open(sealed)
    return info.value.reason


# -- the secret ------------------------------------------------------------------------------

def test_secret_file_is_written_0600_and_loads_back(tmp_path):
    path = tmp_path / "cluster.secret"
    written = write_secret_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_secret_file(path) == written
    assert written.is_set and len(written.value) == 64
    assert "set" in repr(written) and written.value.decode() not in repr(written)
    with pytest.raises(FileExistsError):  # never overwrites a cluster's secret
        write_secret_file(path)


def test_two_generated_secrets_differ(tmp_path):
    assert write_secret_file(tmp_path / "a") != write_secret_file(tmp_path / "b")


def test_short_or_missing_secret_file_is_a_config_error(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"tooshort\n")
    with pytest.raises(ConfigError, match="at least 16"):
        load_secret_file(short)
    with pytest.raises(ConfigError, match="cannot read"):
        load_secret_file(tmp_path / "absent")


def test_secret_file_flag_wins_over_environment():
    environ = {SECRET_FILE_ENV: "/env/secret"}
    assert secret_file_path("/flag/secret", environ) == "/flag/secret"
    assert secret_file_path(None, environ) == "/env/secret"
    assert secret_file_path(None, {}) is None


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.5.0.1", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.0.0.5", False),
    ("worker-3.cluster.local", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_exposed_bind_without_secret_refuses_unless_insecure():
    with pytest.raises(ConfigError, match="0.0.0.0.*--insecure"):
        check_exposure(["127.0.0.1", "0.0.0.0"], ClusterSecret(), insecure=False)
    check_exposure(["0.0.0.0"], ClusterSecret(), insecure=True)
    check_exposure(["0.0.0.0"], SECRET, insecure=False)
    check_exposure(["127.0.0.1", "localhost"], ClusterSecret(), insecure=False)


# -- the envelope ----------------------------------------------------------------------------

def test_sealed_message_opens_with_sender_time_and_payload():
    clock = ManualClock()
    sealer, verifier = pair(clock)
    sealed = sealer.seal(b"heartbeat bytes")
    assert len(sealed) == len(b"heartbeat bytes") + ENVELOPE_OVERHEAD + len(b"worker-1")
    assert len(sealed) <= max_sealed_bytes(len(b"heartbeat bytes"))
    opened = verifier.open(sealed)
    assert (opened.sender_id, opened.payload) == ("worker-1", b"heartbeat bytes")
    assert opened.timestamp == pytest.approx(clock.now, abs=1e-6)
    assert verifier.refusals.total == 0


def test_empty_secret_still_frames_and_deduplicates():
    clock = ManualClock()
    sealer, verifier = pair(clock, secret=ClusterSecret())
    sealed = sealer.seal(b"x")
    assert verifier.open(sealed).payload == b"x"
    assert refusal(verifier, sealed) == REPLAYED


def test_forged_payload_is_refused():
    clock = ManualClock()
    sealer, verifier = pair(clock)
    sealed = bytearray(sealer.seal(b"role=D http=10.0.0.9:8200"))
    sealed[-40] ^= 0x01  # a byte of the payload
    assert refusal(verifier, bytes(sealed)) == FORGED
    assert verifier.refusals.counts[FORGED] == 1


def test_forged_sender_id_is_refused():
    clock = ManualClock()
    sealer, verifier = pair(clock)
    sealed = sealer.seal(b"deregister")
    forged = sealed.replace(b"worker-1", b"worker-2", 1)
    assert refusal(verifier, forged) == FORGED


def test_wrong_secret_or_other_channel_is_forged():
    clock = ManualClock()
    outsider = Sealer(OTHER_SECRET, CHANNEL_REGISTRATION, "attacker", clock=clock)
    _, verifier = pair(clock)
    assert refusal(verifier, outsider.seal(b"heartbeat")) == FORGED
    kv_sealer = Sealer(SECRET, CHANNEL_KV_CONTROL, "worker-1", clock=clock)
    assert refusal(verifier, kv_sealer.seal(b"pull")) == FORGED  # not valid off its channel
    no_secret = Sealer(ClusterSecret(), CHANNEL_REGISTRATION, "attacker", clock=clock)
    assert refusal(verifier, no_secret.seal(b"heartbeat")) == FORGED


def test_replayed_message_is_refused_and_counted():
    clock = ManualClock()
    sealer, verifier = pair(clock)
    sealed = sealer.seal(b"pull to attacker")
    verifier.open(sealed)
    clock.now += 5.0
    assert refusal(verifier, sealed) == REPLAYED
    assert verifier.refusals.counts[REPLAYED] == 1
    assert verifier.open(sealer.seal(b"pull to attacker")).payload  # a fresh one passes


@pytest.mark.parametrize("offset_s", [-31.0, 31.0])
def test_message_outside_the_skew_bound_is_stale(offset_s):
    sender_clock, receiver_clock = ManualClock(), ManualClock()
    receiver_clock.now += offset_s
    sealer = Sealer(SECRET, CHANNEL_REGISTRATION, "worker-1", clock=sender_clock)
    verifier = Verifier(SECRET, CHANNEL_REGISTRATION, clock=receiver_clock, max_skew_s=30.0)
    assert refusal(verifier, sealer.seal(b"old heartbeat")) == STALE
    receiver_clock.now = sender_clock.now + offset_s * 0.9
    assert verifier.open(sealer.seal(b"heartbeat")).payload == b"heartbeat"


def test_replay_after_the_window_is_stale_not_accepted():
    clock = ManualClock()
    sealer, verifier = pair(clock, max_skew_s=10.0)
    sealed = sealer.seal(b"sleeping: true")
    verifier.open(sealed)
    for _ in range(3):  # later traffic evicts the first nonce once it is out of the window
        clock.now += 6.0
        verifier.open(sealer.seal(b"heartbeat"))
    assert refusal(verifier, sealed) == STALE


@pytest.mark.parametrize("sealed", [
    b"", b"\x01" * 20, b"\x02" + b"\x00" * 80, bytes([1]) + b"\x00" * 24 + b"\xff" + b"\x00" * 40])
def test_malformed_envelopes_are_refused(sealed):
    _, verifier = pair(ManualClock())
    assert refusal(verifier, sealed) == MALFORMED


def test_non_utf8_sender_is_malformed():
    clock = ManualClock()
    sealer, verifier = pair(clock)
    sealed = sealer.seal(b"x").replace(b"worker-1", b"\xff\xfeorker", 1)
    assert refusal(verifier, sealed) == MALFORMED


def test_refusals_are_logged_once_per_peer_and_reason(caplog):
    clock = ManualClock()
    _, verifier = pair(clock)
    attacker = Sealer(OTHER_SECRET, CHANNEL_REGISTRATION, "attacker", clock=clock)
    with caplog.at_level(logging.WARNING, logger="engine_core.cluster.trust"):
        for _ in range(50):
            refusal(verifier, attacker.seal(b"fake D"))
        other = Sealer(OTHER_SECRET, CHANNEL_REGISTRATION, "attacker-2", clock=clock)
        refusal(verifier, other.seal(b"fake D"))
    assert verifier.refusals.counts[FORGED] == 51
    assert len(caplog.records) == 2


def test_sender_id_must_fit_the_envelope():
    with pytest.raises(ConfigError):
        Sealer(SECRET, CHANNEL_REGISTRATION, "")
    with pytest.raises(ConfigError):
        Sealer(SECRET, CHANNEL_REGISTRATION, "x" * 256)


def test_nonces_are_unique_per_message_and_per_sealer():
    clock = ManualClock()
    first = Sealer(SECRET, CHANNEL_REGISTRATION, "w", clock=clock)
    second = Sealer(SECRET, CHANNEL_REGISTRATION, "w", clock=clock)
    verifier = Verifier(SECRET, CHANNEL_REGISTRATION, clock=clock)
    for _ in range(100):  # same sender id, same payload, same instant: all distinct
        verifier.open(first.seal(b"same"))
        verifier.open(second.seal(b"same"))
    assert verifier.refusals.total == 0


# -- the replay window -----------------------------------------------------------------------

def test_replay_window_stays_bounded_and_refuses_below_its_floor():
    window = ReplayWindow(max_skew_s=30.0, capacity=4)
    now = 1000.0
    for i in range(10):
        assert window.check(now + i * 0.001, bytes([i]) * 16, now) is None
        assert len(window) <= 4
    # Nonces 0-5 were forgotten under pressure; their replays are refused as stale.
    for i in range(6):
        assert window.check(now + i * 0.001, bytes([i]) * 16, now) == STALE
    for i in range(6, 10):
        assert window.check(now + i * 0.001, bytes([i]) * 16, now) == REPLAYED


def test_replay_window_forgets_expired_nonces():
    window = ReplayWindow(max_skew_s=1.0, capacity=1000)
    for i in range(100):
        window.check(1000.0, i.to_bytes(16, "big"), 1000.0)
    window.check(1005.0, b"\xff" * 16, 1005.0)
    assert len(window) == 1


def test_replay_window_rejects_bad_bounds():
    with pytest.raises(ConfigError):
        ReplayWindow(max_skew_s=0.0)
    with pytest.raises(ConfigError):
        ReplayWindow(capacity=0)


def test_secret_must_be_long_enough():
    with pytest.raises(ConfigError):
        ClusterSecret(b"short")


@pytest.mark.parametrize("key", [b"", b"k" * 32, b"k" * 64, b"k" * 65, bytes(range(200))])
def test_mac_key_is_rfc2104_hmac_sha256(key):
    import hmac

    from engine_core.cluster.trust import MacKey
    for data in (b"", b"x", bytes(range(256)) * 5):
        assert MacKey(key).digest(data) == hmac.digest(key, data, "sha256")
        assert MacKey(key).digest(memoryview(data)) == hmac.digest(key, data, "sha256")


def test_secret_never_shows_its_bytes_in_configs():
    import copy
    import dataclasses
    import json
    import pickle

    @dataclasses.dataclass(frozen=True)
    class Config:
        secret: ClusterSecret = ClusterSecret()

    config = Config(SECRET)
    text = json.dumps(dataclasses.asdict(config), default=str) + repr(config) + str(config)
    assert SECRET.value.decode() not in text and "ClusterSecret(set)" in text
    assert pickle.loads(pickle.dumps(SECRET)) == SECRET == copy.deepcopy(config).secret
    with pytest.raises(AttributeError):
        SECRET._value = b"x" * 32
