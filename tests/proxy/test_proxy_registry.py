"""InstanceRegistry: join, refresh, expiry with a fake clock, load stats, in-flight counts."""

from __future__ import annotations

import pytest

from engine_core.cluster.messages import Heartbeat, WorkerLoad
from proxy.registry import InstanceRegistry


def beat(address: str = "127.0.0.1:8100", role: str = "P", model: str = "m",
         **load: float) -> Heartbeat:
    return Heartbeat(role=role, http_address=address, model=model,
                     zmq_address="127.0.0.1:14579", load=WorkerLoad(**load))


def test_join_and_refresh(proxy_clock) -> None:
    registry = InstanceRegistry(heartbeat_timeout_s=10, clock=proxy_clock)
    assert registry.heartbeat(beat()) is True
    proxy_clock.advance(3)
    assert registry.heartbeat(beat(num_running=2, num_waiting=1, kv_cache_usage=0.5)) is False
    (worker,) = registry.workers("P")
    assert worker.last_heartbeat == proxy_clock.now
    assert worker.registered_at == proxy_clock.now - 3
    assert (worker.load.num_running, worker.load.num_waiting, worker.load.kv_cache_usage) == (2, 1, 0.5)
    assert registry.workers("D") == []


def test_role_change_replaces_worker(proxy_clock) -> None:
    registry = InstanceRegistry(clock=proxy_clock)
    registry.heartbeat(beat(role="P"))
    assert registry.heartbeat(beat(role="D")) is True
    assert [w.role for w in registry.workers()] == ["D"]


def test_expiry_after_missed_heartbeats(proxy_clock) -> None:
    registry = InstanceRegistry(heartbeat_timeout_s=10, clock=proxy_clock)
    registry.heartbeat(beat("127.0.0.1:1"))
    registry.heartbeat(beat("127.0.0.1:2", role="D"))
    proxy_clock.advance(6)
    registry.heartbeat(beat("127.0.0.1:2", role="D"))
    proxy_clock.advance(5)
    assert registry.expire() == ["127.0.0.1:1"]
    assert [w.worker_id for w in registry.workers()] == ["127.0.0.1:2"]
    proxy_clock.advance(5)
    assert registry.expire() == []  # exactly at the timeout it is still alive
    proxy_clock.advance(0.1)
    assert registry.expire() == ["127.0.0.1:2"]
    assert len(registry) == 0


def test_remove_and_models(proxy_clock) -> None:
    registry = InstanceRegistry(clock=proxy_clock)
    registry.heartbeat(beat("127.0.0.1:1", model="b"))
    registry.heartbeat(beat("127.0.0.1:2", model="a"))
    registry.heartbeat(beat("127.0.0.1:3", model="a"))
    assert registry.models() == ["a", "b"]
    assert registry.remove("127.0.0.1:1") is True
    assert registry.remove("127.0.0.1:1") is False
    assert registry.models() == ["a"]
    assert len(registry.workers(model="a")) == 2


def test_in_flight_counts_and_suspects(proxy_clock) -> None:
    registry = InstanceRegistry(suspect_s=5, clock=proxy_clock)
    registry.heartbeat(beat("127.0.0.1:1"))
    registry.heartbeat(beat("127.0.0.1:2"))
    registry.leg_started("127.0.0.1:1")
    registry.leg_started("127.0.0.1:1")
    worker = registry.get("127.0.0.1:1")
    assert worker is not None and worker.in_flight == 2 and worker.num_requests == 2
    registry.leg_finished("127.0.0.1:1", ok=True)
    registry.leg_finished("127.0.0.1:1", ok=False, connection_failed=True)
    assert (worker.in_flight, worker.num_errors) == (0, 1)
    # a suspect worker is avoided while another is healthy, and used when it is the only one
    assert [w.worker_id for w in registry.candidates("P")] == ["127.0.0.1:2"]
    assert [w.worker_id for w in registry.candidates("P", exclude={"127.0.0.1:2"})] == ["127.0.0.1:1"]
    proxy_clock.advance(5)
    assert len(registry.candidates("P")) == 2
    # unknown workers (expired while a leg ran) are ignored
    registry.leg_finished("127.0.0.1:9", ok=False)


def test_heartbeat_clears_suspicion(proxy_clock) -> None:
    registry = InstanceRegistry(suspect_s=60, clock=proxy_clock)
    registry.heartbeat(beat("127.0.0.1:1"))
    registry.heartbeat(beat("127.0.0.1:2"))
    registry.leg_started("127.0.0.1:1")
    registry.leg_finished("127.0.0.1:1", ok=False, connection_failed=True)
    assert len(registry.candidates("P")) == 1
    registry.heartbeat(beat("127.0.0.1:1"))
    assert len(registry.candidates("P")) == 2


def test_asleep_workers_are_not_candidates(proxy_clock) -> None:
    """A worker that reports itself asleep (sleep mode) gets no requests, even when it is
    the only one of its role, and is routable again from its first awake heartbeat."""
    registry = InstanceRegistry(clock=proxy_clock)
    registry.heartbeat(beat("127.0.0.1:1"))
    registry.heartbeat(beat("127.0.0.1:2", sleeping=True))
    assert [w.worker_id for w in registry.candidates("P")] == ["127.0.0.1:1"]
    registry.heartbeat(beat("127.0.0.1:1", sleeping=True))
    assert registry.candidates("P") == []
    assert [e["load"]["sleeping"] for e in registry.snapshot()] == [True, True]
    registry.heartbeat(beat("127.0.0.1:2"))
    assert [w.worker_id for w in registry.candidates("P")] == ["127.0.0.1:2"]


def test_snapshot_is_json_ready(proxy_clock) -> None:
    registry = InstanceRegistry(clock=proxy_clock)
    registry.heartbeat(beat(num_waiting=4))
    proxy_clock.advance(2)
    (entry,) = registry.snapshot()
    assert entry["role"] == "P" and entry["load"]["num_waiting"] == 4
    assert entry["seconds_since_heartbeat"] == 2.0
    assert entry["suspect"] is False


def test_invalid_timeout() -> None:
    with pytest.raises(ValueError):
        InstanceRegistry(heartbeat_timeout_s=0)


def test_expiry_skips_a_round_that_wakes_late() -> None:
    """A proxy whose own loop was held must not drop workers for heartbeats it has not read
    yet: the late round is skipped; an unheard worker is still dropped on a later one."""
    import asyncio
    import time

    from proxy.app import expiry_loop

    async def scenario() -> tuple[int, int, int]:
        registry = InstanceRegistry(heartbeat_timeout_s=0.2)
        registry.heartbeat(beat())
        task = asyncio.create_task(expiry_loop(registry, 0.05))
        await asyncio.sleep(0.01)
        time.sleep(0.5)  # the proxy's loop held: the worker's heartbeats would queue unread
        await asyncio.sleep(0.01)  # the late round runs
        after_stall = len(registry.workers())
        registry.heartbeat(beat())  # the queued heartbeat, read once the loop turns
        await asyncio.sleep(0.1)
        heard = len(registry.workers())
        await asyncio.sleep(0.4)  # no more heartbeats: dropped on time
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return after_stall, heard, len(registry.workers())

    assert asyncio.run(scenario()) == (1, 1, 0)


def test_a_replaced_worker_keeps_its_legs_in_flight(proxy_clock) -> None:
    """A worker that re-registers changed (a new KV port after a restart) gets a new state;
    the legs already sent to its address still end against it, so the count carries over.
    Before, they decremented a fresh zero, and --prefill-overflow's cap let more in."""
    registry = InstanceRegistry(clock=proxy_clock)
    registry.heartbeat(beat())
    registry.leg_started("127.0.0.1:8100")
    moved = beat()
    moved.zmq_address = "127.0.0.1:29999"
    assert registry.heartbeat(moved) is True
    registry.leg_started("127.0.0.1:8100")
    registry.leg_finished("127.0.0.1:8100", ok=True)  # the leg sent before the change
    worker = registry.get("127.0.0.1:8100")
    assert worker is not None and worker.zmq_address == "127.0.0.1:29999"
    assert worker.in_flight == 1


@pytest.mark.parametrize("address,url", [
    ("127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("::1:8000", "http://[::1]:8000"),
    ("fe80::1:8000", "http://[fe80::1]:8000"),
    ("[::1]:8000", "http://[::1]:8000"),
    ("host.example:80", "http://host.example:80"),
])
def test_worker_urls_bracket_ipv6_hosts(proxy_clock, address: str, url: str) -> None:
    """A worker started with --host ::1 advertises ``::1:PORT``; as ``http://::1:PORT`` no
    URL parser takes it and every request to the worker failed."""
    registry = InstanceRegistry(clock=proxy_clock)
    registry.heartbeat(beat(address))
    worker = registry.get(address)
    assert worker is not None and worker.url == url


def test_metrics_label_roles_alike_and_count_remote_kv_waits(proxy_clock) -> None:
    """Every proxy family labels a role the same way (prefill / decode / colocated), and a
    worker's waiting gauge is its vllm:num_requests_waiting (KV-parked requests included)."""
    from prometheus_client.parser import text_string_to_metric_families

    from proxy.metrics import ProxyMetrics

    registry = InstanceRegistry(clock=proxy_clock)
    registry.heartbeat(beat("127.0.0.1:1", role="P"))
    registry.heartbeat(beat("127.0.0.1:2", role="D", num_waiting=2, num_waiting_for_remote_kv=3))
    metrics = ProxyMetrics(registry)
    metrics.worker_requests.labels("127.0.0.1:2", "decode").inc()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render().decode())
               for s in family.samples}
    roles = {dict(labels).get("role") for _, labels in samples} - {None}
    assert roles == {"prefill", "decode", "colocated", "worker"}
    d = (("role", "decode"), ("worker", "127.0.0.1:2"))
    assert samples[("pdserve:proxy_worker_num_requests_waiting", d)] == 5
    assert samples[("pdserve:proxy_worker_requests_total", d)] == 1
