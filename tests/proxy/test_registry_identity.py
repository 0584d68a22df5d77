"""InstanceRegistry: a worker's name and KV address are bound to the sender that registered
them; the number of workers is capped (the registration attacks of issue 33, at the registry)."""

from __future__ import annotations

import pytest

from engine_core.cluster.messages import Heartbeat, WorkerLoad
from engine_core.cluster.trust import CAPACITY, WRONG_IDENTITY, TrustRefusal
from proxy.registry import InstanceRegistry

P_HTTP, P_KV = "10.0.0.1:8100", "10.0.0.1:14579"
D_HTTP, D_KV = "10.0.0.2:8200", "10.0.0.2:14580"


def beat(http: str, kv: str | None, role: str = "P", sleeping: bool = False) -> Heartbeat:
    return Heartbeat(role=role, http_address=http, model="m", zmq_address=kv,
                     load=WorkerLoad(sleeping=sleeping), heartbeat_interval_s=3.0)


def refused(call, *args, **kwargs) -> str:
    with pytest.raises(TrustRefusal) as info:
        call(*args, **kwargs)
    return info.value.reason


@pytest.fixture
def registry(proxy_clock) -> InstanceRegistry:
    registry = InstanceRegistry(heartbeat_timeout_s=10, clock=proxy_clock, max_workers=4)
    registry.heartbeat(beat(P_HTTP, P_KV), sender_id="p-1")
    registry.heartbeat(beat(D_HTTP, D_KV, role="D"), sender_id="d-1")
    return registry


def test_reregistering_p_with_another_kv_address_is_refused(registry):
    """The attack that sent 12 of 12 pulls to the attacker: P's name, the attacker's KV port."""
    reason = refused(registry.heartbeat, beat(P_HTTP, "10.6.6.6:14579"), sender_id="attacker")
    assert reason == WRONG_IDENTITY
    assert registry.get(P_HTTP).zmq_address == P_KV


def test_another_name_with_p_kv_address_is_refused(registry):
    reason = refused(registry.heartbeat, beat("10.6.6.6:8100", P_KV), sender_id="attacker")
    assert reason == WRONG_IDENTITY
    assert registry.get("10.6.6.6:8100") is None


def test_deregistering_or_sleeping_another_senders_worker_is_refused(registry):
    """Forged Deregister / sleeping: true for the real D (40/40 clients got a 503)."""
    assert refused(registry.remove, D_HTTP, sender_id="attacker") == WRONG_IDENTITY
    assert refused(registry.heartbeat, beat(D_HTTP, D_KV, role="D", sleeping=True),
                   sender_id="attacker") == WRONG_IDENTITY
    assert [w.http_address for w in registry.candidates("D")] == [D_HTTP]


def test_the_bound_sender_changes_and_removes_its_own_worker(registry):
    assert registry.heartbeat(beat(P_HTTP, "10.0.0.1:14600"), sender_id="p-1") is True
    assert registry.get(P_HTTP).zmq_address == "10.0.0.1:14600"
    assert registry.remove(P_HTTP, sender_id="p-1") is True
    assert registry.get(P_HTTP) is None


def test_a_restarted_worker_takes_over_a_silent_name(registry, proxy_clock):
    proxy_clock.advance(5.0)  # P missed one heartbeat: still live
    registry.heartbeat(beat(D_HTTP, D_KV, role="D"), sender_id="d-1")
    assert refused(registry.heartbeat, beat(P_HTTP, P_KV), sender_id="p-2") == WRONG_IDENTITY
    proxy_clock.advance(1.5)  # more than two 3 s intervals: gone
    assert registry.heartbeat(beat(P_HTTP, P_KV), sender_id="p-2") is True
    assert registry.get(P_HTTP).sender_id == "p-2"
    # The old process, if it comes back, no longer owns the name.
    assert refused(registry.remove, P_HTTP, sender_id="p-1") == WRONG_IDENTITY


def test_a_silent_holders_kv_address_moves_to_a_new_name(registry, proxy_clock):
    proxy_clock.advance(7.0)
    registry.heartbeat(beat(D_HTTP, D_KV, role="D"), sender_id="d-1")
    assert registry.heartbeat(beat("10.0.0.1:8101", P_KV), sender_id="p-2") is True
    assert registry.get(P_HTTP) is None  # the silent holder of the KV address is dropped
    assert registry.get("10.0.0.1:8101").zmq_address == P_KV


def test_worker_cap(registry):
    """3,000 fake workers were accepted; now at most max_workers are."""
    for i in range(2):
        registry.heartbeat(beat(f"10.0.1.{i}:8100", f"10.0.1.{i}:14579"), sender_id=f"w{i}")
    assert refused(registry.heartbeat, beat("10.0.2.1:8100", "10.0.2.1:14579"),
                   sender_id="w9") == CAPACITY
    assert len(registry) == 4
    registry.heartbeat(beat(P_HTTP, P_KV), sender_id="p-1")  # the registered still refresh
    registry.remove(P_HTTP, sender_id="p-1")
    assert registry.heartbeat(beat("10.0.2.1:8100", "10.0.2.1:14579"), sender_id="w9")
