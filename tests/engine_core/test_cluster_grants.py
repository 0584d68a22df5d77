"""Transfer grants: issued by the proxy, checked by P and D (pure, ms)."""

from __future__ import annotations

import pytest

from engine_core.cluster.grants import MAX_GRANT_CHARS, GrantAuthority, TransferGrant
from engine_core.cluster.trust import (
    FORGED,
    MALFORMED,
    STALE,
    UNAUTHORISED,
    ClusterSecret,
    TrustRefusal,
)
from tests.manual_clock import ManualClock

SECRET = ClusterSecret(b"0123456789abcdef0123456789abcdef")
P_KV, D_KV, ATTACKER_KV = "10.0.0.1:14579", "10.0.0.2:14580", "10.6.6.6:14580"



def refusal(authority: GrantAuthority, token: object, **names: str) -> str:
    names.setdefault("transfer_id", "cmpl-1")
    with pytest.raises(TrustRefusal) as info:
        authority.verify(token, **names)
    return info.value.reason


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def proxy(clock: ManualClock) -> GrantAuthority:
    return GrantAuthority(SECRET, clock=clock)


@pytest.fixture
def worker(clock: ManualClock) -> GrantAuthority:
    return GrantAuthority(SECRET, clock=clock, leeway_s=0.0)


def test_grant_verifies_for_its_transfer_producer_and_consumer(proxy, worker, clock):
    token = proxy.issue("cmpl-1", P_KV, D_KV, ttl_s=60.0)
    assert isinstance(token, str) and token.startswith("g1.")
    grant = worker.verify(token, transfer_id="cmpl-1", producer=P_KV, consumer=D_KV)
    assert grant == TransferGrant("cmpl-1", P_KV, D_KV, pytest.approx(clock.now + 60.0))
    assert worker.refusals.total == 0


def test_p_sends_only_to_the_granted_consumer(proxy, worker):
    """A pull naming the attacker as receiver is refused even with a valid grant."""
    token = proxy.issue("cmpl-1", P_KV, D_KV, ttl_s=60.0)
    assert refusal(worker, token, producer=P_KV, consumer=ATTACKER_KV) == UNAUTHORISED
    assert worker.refusals.counts[UNAUTHORISED] == 1


def test_d_pulls_only_from_the_granted_producer(proxy, worker):
    token = proxy.issue("cmpl-1", P_KV, D_KV, ttl_s=60.0)
    assert refusal(worker, token, producer=ATTACKER_KV, consumer=D_KV) == UNAUTHORISED


def test_grant_for_another_transfer_is_unauthorised(proxy, worker):
    token = proxy.issue("cmpl-2", P_KV, D_KV, ttl_s=60.0)
    assert refusal(worker, token, producer=P_KV) == UNAUTHORISED


def test_expired_grant_is_stale(proxy, worker, clock):
    token = proxy.issue("cmpl-1", P_KV, D_KV, ttl_s=10.0)
    clock.now += 10.5
    assert refusal(worker, token, producer=P_KV) == STALE


def test_leeway_covers_clock_skew(proxy, clock):
    token = proxy.issue("cmpl-1", P_KV, D_KV, ttl_s=10.0)
    clock.now += 12.0
    assert GrantAuthority(SECRET, clock=clock, leeway_s=5.0).verify(token, transfer_id="cmpl-1")


def test_grant_signed_without_the_secret_is_forged(clock, worker):
    outsider = GrantAuthority(ClusterSecret(b"x" * 32), clock=clock)
    assert refusal(worker, outsider.issue("cmpl-1", P_KV, ATTACKER_KV, 60.0)) == FORGED
    unkeyed = GrantAuthority(ClusterSecret(), clock=clock)
    assert refusal(worker, unkeyed.issue("cmpl-1", P_KV, ATTACKER_KV, 60.0)) == FORGED


def test_edited_grant_is_forged(proxy, worker):
    token = proxy.issue("cmpl-1", P_KV, D_KV, ttl_s=60.0)
    body, mac = token[3:].split(".")
    # Re-signing is impossible without the key; re-using the MAC with another body fails.
    other = proxy.issue("cmpl-1", P_KV, ATTACKER_KV, ttl_s=60.0)
    assert refusal(worker, f"{other.rsplit('.', 1)[0]}.{mac}") == FORGED
    assert refusal(worker, f"g1.{body}.{mac[:-2]}AA") == FORGED


@pytest.mark.parametrize("token", [
    None, 7, "", "g1.", "g2.abc.def", "no-dots", "g1.abc.!!!!", "x" * (MAX_GRANT_CHARS + 1)])
def test_malformed_grants_are_refused(worker, token):
    assert refusal(worker, token) == MALFORMED


def test_authentic_token_with_bad_fields_is_malformed(proxy, worker):
    """Fields a future version might sign differently are refused, not trusted blindly."""
    import base64

    import msgpack

    from engine_core.cluster.trust import CHANNEL_GRANT
    body = base64.urlsafe_b64encode(msgpack.packb(["cmpl-1", P_KV])).rstrip(b"=").decode()
    signed = f"g1.{body}"
    mac = SECRET.channel_key(CHANNEL_GRANT).digest(signed.encode())
    token = f"{signed}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"
    assert refusal(worker, token) == MALFORMED


def test_grant_fields_are_bounded():
    with pytest.raises(ValueError):
        TransferGrant("", P_KV, D_KV, 0.0)
    with pytest.raises(ValueError):
        TransferGrant("t" * 1025, P_KV, D_KV, 0.0)
    with pytest.raises(ValueError):
        TransferGrant("t", "", D_KV, 0.0)


def test_grant_covers_the_prompts_of_its_batch(proxy, worker):
    token = proxy.issue("cmpl-1", P_KV, D_KV, ttl_s=60.0)
    assert worker.verify(token, transfer_id="cmpl-1-p3", producer=P_KV, consumer=D_KV)
    for other in ("cmpl-1-p", "cmpl-1-px", "cmpl-1-retry1", "cmpl-10", "cmpl-1-p1-p2"):
        assert refusal(worker, token, transfer_id=other) == UNAUTHORISED


def test_a_route_grant_names_the_route_and_keeps_the_expiry(proxy, worker, clock):
    """Between tensor-parallel layouts a route moves between two ranks under its own id: its
    grant names them and expires with the transfer's; a forged grant gets none."""
    token = proxy.issue("cmpl-1", P_KV, D_KV, ttl_s=60.0)
    p_rank1, d_rank1 = "10.0.0.1:14581", "10.0.0.2:14582"
    route = worker.for_route(token, "cmpl-1/kv1-1", p_rank1, d_rank1)
    grant = worker.verify(route, transfer_id="cmpl-1/kv1-1", producer=p_rank1,
                          consumer=d_rank1)
    assert grant.expires_at == pytest.approx(clock.now + 60.0)
    assert refusal(worker, route, transfer_id="cmpl-1/kv1-1", producer=P_KV) == UNAUTHORISED
    with pytest.raises(TrustRefusal):
        worker.for_route(token[:-4] + "AAAA", "cmpl-1/kv1-1", p_rank1, d_rank1)
