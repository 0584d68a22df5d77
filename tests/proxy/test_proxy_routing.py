"""Routing policies and the cluster rule of plan_route."""

from __future__ import annotations

import pytest

from engine_core.cluster.messages import Heartbeat, WorkerLoad
from engine_core.errors import ConfigError, ModelNotFoundError, NoWorkerError
from proxy.config import ProxyConfig
from proxy.registry import InstanceRegistry
from proxy.routing import (
    MODE_COLOCATED,
    MODE_DECODE_ONLY,
    MODE_PD,
    MODE_PREFILL_OVERFLOW,
    LeastLoadPolicy,
    RoundRobinPolicy,
    make_policy,
    plan_route,
)


def registry_with(*workers: tuple[str, str], clock=None, **load: float) -> InstanceRegistry:
    registry = InstanceRegistry(clock=clock) if clock else InstanceRegistry()
    for role, address in workers:
        registry.heartbeat(Heartbeat(role=role, http_address=address, model="m",
                                     zmq_address=None if role == "colocated" else "h:1",
                                     load=WorkerLoad(**load)))
    return registry


def test_round_robin_cycles_per_role() -> None:
    registry = registry_with(("P", "p:1"), ("P", "p:2"), ("D", "d:1"))
    policy = RoundRobinPolicy()
    picks = [plan_route(registry, policy, "m") for _ in range(4)]
    assert [r.prefill.worker_id for r in picks] == ["p:1", "p:2", "p:1", "p:2"]
    assert {r.decode.worker_id for r in picks} == {"d:1"}
    assert all(r.mode == MODE_PD for r in picks)


def test_least_load_uses_in_flight_and_heartbeat_stats() -> None:
    registry = registry_with(("D", "d:1"), ("D", "d:2"), ("D", "d:3"))
    policy = LeastLoadPolicy(kv_weight=4.0)
    registry.get("d:1").load = WorkerLoad(num_waiting=3)
    registry.get("d:2").load = WorkerLoad(kv_cache_usage=0.5)  # score 2
    registry.leg_started("d:3")
    registry.leg_started("d:3")
    registry.leg_started("d:3")  # score 3
    assert policy.choose("D", registry.workers("D")).worker_id == "d:2"
    registry.leg_started("d:2")  # score 3: now d:2, d:3 tie... d:1 is 3 too
    chosen = {policy.choose("D", registry.workers("D")).worker_id for _ in range(3)}
    assert chosen == {"d:1", "d:2", "d:3"}  # ties rotate


def test_least_load_prefers_idle_worker() -> None:
    registry = registry_with(("P", "p:1"), ("P", "p:2"), ("D", "d:1"))
    policy = make_policy("least_load")
    registry.leg_started("p:1")
    for _ in range(3):
        assert plan_route(registry, policy, "m").prefill.worker_id == "p:2"


def test_colocated_when_no_pair() -> None:
    registry = registry_with(("colocated", "c:1"), ("D", "d:1"))
    route = plan_route(registry, RoundRobinPolicy(), "m")
    assert route.mode == MODE_COLOCATED and route.decode.worker_id == "c:1"
    assert route.prefill is None


def test_pair_preferred_over_colocated() -> None:
    registry = registry_with(("colocated", "c:1"), ("D", "d:1"), ("P", "p:1"))
    assert plan_route(registry, RoundRobinPolicy(), None).mode == MODE_PD


def test_decode_only_when_prefill_excluded_or_missing() -> None:
    registry = registry_with(("P", "p:1"), ("D", "d:1"))
    route = plan_route(registry, RoundRobinPolicy(), "m", exclude={"p:1"})
    assert route.mode == MODE_DECODE_ONLY and route.decode.worker_id == "d:1"
    assert plan_route(registry_with(("D", "d:1")), RoundRobinPolicy(), "m").mode == MODE_DECODE_ONLY


def test_prefill_overflow_sends_d_alone_once_every_p_is_full() -> None:
    registry = registry_with(("P", "p:1"), ("P", "p:2"), ("D", "d:1"))
    policy = make_policy("least_load")
    assert plan_route(registry, policy, "m", prefill_overflow=2).mode == MODE_PD
    for _ in range(2):
        registry.leg_started("p:1")
    registry.leg_started("p:2")  # p:2 still has room: disaggregated, on p:2
    route = plan_route(registry, policy, "m", prefill_overflow=2)
    assert route.mode == MODE_PD and route.prefill.worker_id == "p:2"
    registry.leg_started("p:2")
    route = plan_route(registry, policy, "m", prefill_overflow=2)
    assert route.mode == MODE_PREFILL_OVERFLOW and route.prefill is None
    assert route.decode.worker_id == "d:1"
    assert plan_route(registry, policy, "m").mode == MODE_PD  # 0: never
    registry.leg_finished("p:1", ok=True)
    assert plan_route(registry, policy, "m", prefill_overflow=2).mode == MODE_PD
    with pytest.raises(ConfigError, match="prefill_overflow"):
        ProxyConfig(prefill_overflow=-1)


def test_prefill_overflow_caps_each_p_whatever_the_policy() -> None:
    """Round robin ignores load: a P at the cap is still skipped while another has room."""
    registry = registry_with(("P", "p:1"), ("P", "p:2"), ("D", "d:1"))
    policy = RoundRobinPolicy()
    registry.leg_started("p:1")
    registry.leg_started("p:1")
    picks = [plan_route(registry, policy, "m", prefill_overflow=2) for _ in range(4)]
    assert [(r.mode, r.prefill.worker_id) for r in picks] == [(MODE_PD, "p:2")] * 4


def test_no_worker_and_unknown_model() -> None:
    with pytest.raises(NoWorkerError, match="No worker is registered"):
        plan_route(InstanceRegistry(), RoundRobinPolicy(), "m")
    with pytest.raises(NoWorkerError, match="No decode or colocated"):
        plan_route(registry_with(("P", "p:1")), RoundRobinPolicy(), "m")
    with pytest.raises(ModelNotFoundError, match="other"):
        plan_route(registry_with(("P", "p:1"), ("D", "d:1")), RoundRobinPolicy(), "other")


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


def test_prefix_affinity_is_sticky_spread_and_stable() -> None:
    from proxy.routing import PrefixAffinityPolicy

    registry = registry_with(*[("P", f"p:{i}") for i in range(4)], ("D", "d:1"), ("D", "d:2"))
    policy = PrefixAffinityPolicy(max_imbalance=8.0)
    keys = [f"system prompt number {i}" for i in range(64)]
    first = {k: plan_route(registry, policy, "m", key=k) for k in keys}
    for k in keys:  # the same key: the same P and D every time
        again = plan_route(registry, policy, "m", key=k)
        assert (again.prefill.worker_id, again.decode.worker_id) == \
            (first[k].prefill.worker_id, first[k].decode.worker_id)
    by_p = [sum(r.prefill.worker_id == f"p:{i}" for r in first.values()) for i in range(4)]
    assert min(by_p) >= 6, by_p  # 64 keys spread over 4 workers (rendezvous hashing)
    # Rendezvous: excluding one P moves only the keys it won.
    moved = [k for k in keys
             if plan_route(registry, policy, "m", {"p:0"}, key=k).prefill.worker_id
             != first[k].prefill.worker_id]
    assert set(moved) == {k for k in keys if first[k].prefill.worker_id == "p:0"}


def test_prefix_affinity_yields_to_load_and_needs_a_key() -> None:
    from proxy.routing import PrefixAffinityPolicy

    registry = registry_with(("P", "p:1"), ("P", "p:2"), ("D", "d:1"))
    policy = PrefixAffinityPolicy(max_imbalance=2.0)
    key = "a shared few-shot prefix"
    home = plan_route(registry, policy, "m", key=key).prefill.worker_id
    other = "p:2" if home == "p:1" else "p:1"
    for _ in range(2):
        registry.leg_started(home)
    assert plan_route(registry, policy, "m", key=key).prefill.worker_id == home  # gap 2: stays
    registry.leg_started(home)
    assert plan_route(registry, policy, "m", key=key).prefill.worker_id == other  # gap 3
    # No key (a prompt batch): least load.
    assert plan_route(registry, policy, "m").prefill.worker_id == other


def test_affinity_key_of_prompts_and_messages() -> None:
    from proxy.forwarding import affinity_key

    system = {"role": "system", "content": "You are terse. " * 20}
    a = {"messages": [system, {"role": "user", "content": "first question"}]}
    b = {"messages": [system, {"role": "user", "content": "another one"}]}
    chat = "/v1/chat/completions"
    assert affinity_key(chat, a, 64) == affinity_key(chat, b, 64)  # the system prompt decides
    assert affinity_key(chat, a, 1000) != affinity_key(chat, b, 1000)
    assert affinity_key("/v1/completions", {"prompt": "x" * 300 + "tail"}, 256) == "x" * 256
    ids = affinity_key("/v1/completions", {"prompt": list(range(100))}, 16)
    assert ids == "ids:0,1,2,3"
    for bad in ({"prompt": ["a", "b"]}, {"prompt": 5}, {}):
        assert affinity_key("/v1/completions", bad, 64) is None
    assert affinity_key(chat, {"messages": "hi"}, 64) is None
