"""Routes between tensor-parallel layouts over real sockets (CPU transport), one connector
worker per rank (``layout_cluster.LayoutCluster``)."""

from __future__ import annotations

import pytest

from engine_core.parallel.kv_layout import HeadSlice
from tests.connectors.layout_cluster import LayoutCluster
from tests.connectors.worker_pair import wait_until


@pytest.fixture
def make_cluster():
    clusters: list[LayoutCluster] = []

    def make(p_size: int, d_size: int) -> LayoutCluster:
        clusters.append(LayoutCluster(p_size, d_size))
        return clusters[-1]

    yield make
    for cluster in clusters:
        cluster.shutdown()


@pytest.mark.parametrize(("p_size", "d_size", "pull_first"),
                         [(2, 1, True), (1, 2, True), (2, 2, False), (1, 4, False)])
def test_every_consumer_rank_gets_its_heads(make_cluster, p_size: int, d_size: int,
                                            pull_first: bool):
    cluster = make_cluster(p_size, d_size)
    assert set(cluster.send("req", pull_first).values()) == {"ok"}
    cluster.assert_landed()
    assert cluster.idle()


def test_requests_in_turn_reuse_the_routes(make_cluster):
    cluster = make_cluster(2, 1)
    for index in range(4):  # pushed and deferred sends alternate on the same pairs
        cluster.d_caches_reset()
        assert set(cluster.send(f"req-{index}", pull_first=index % 2 == 0).values()) == {"ok"}
        cluster.assert_landed()
    assert cluster.idle()


def test_a_pull_for_other_heads_than_the_route_is_refused(make_cluster):
    cluster = make_cluster(1, 2)
    (wrong, _), (right, _) = cluster.named_routes("req")
    cluster.compute("req")
    cluster.ask("req", dst_heads={wrong: HeadSlice(0, 1)})  # asks 1 head of the route's 2
    outcomes = cluster.outcomes("req")
    assert outcomes[wrong] == "failed"
    assert outcomes[right] == "ok"
    assert cluster.p_workers[0].stats()["messages_rejected"] >= 1
    assert cluster.idle()


def reports(cluster: LayoutCluster, request_id: str, seconds: float) -> list[str]:
    """What the one consumer rank reports for ``request_id`` within ``seconds``."""
    seen: list[str] = []

    def reported() -> bool:
        finished = cluster.d_workers[0].land_loads()
        seen.extend(["ok"] * (request_id in finished.recving)
                    + ["failed"] * (request_id in finished.failed_recving))
        return bool(seen)

    wait_until(reported, seconds)
    return seen


def test_a_request_whose_heads_come_from_two_ranks_lands_once_both_did(make_cluster):
    cluster = make_cluster(2, 1)
    cluster.ask("req", request_id="r")
    cluster.compute("req", ranks=[1])
    assert reports(cluster, "r", 0.5) == []  # rank 0's heads are not there yet
    cluster.compute("req", ranks=[0])
    assert reports(cluster, "r", 10.0) == ["ok"]
    cluster.assert_landed()
    assert cluster.idle()


def test_one_failed_route_fails_the_request_after_every_route_ended(make_cluster):
    cluster = make_cluster(2, 1)
    (_, _), (wrong, _) = cluster.named_routes("req")
    cluster.ask("req", dst_heads={wrong: HeadSlice(2, 1)}, request_id="r")
    cluster.compute("req", ranks=[1])  # refuses the pull: that route fails at once
    assert wait_until(lambda: cluster.p_workers[1].stats()["messages_rejected"] >= 1, 5.0)
    # The other route still runs (its scatters may yet write the blocks): no report.
    assert reports(cluster, "r", 0.5) == []
    cluster.compute("req", ranks=[0])
    assert reports(cluster, "r", 10.0) == ["failed"]
    assert cluster.idle()


def test_a_producer_hands_blocks_back_once_every_route_out_of_it_ended(make_cluster):
    cluster = make_cluster(1, 2)
    producer = cluster.p_workers[0]
    sent: list[str] = []

    def finished(seconds: float) -> list[str]:
        wait_until(lambda: bool(sent.extend(producer.get_finished().sending) or sent), seconds)
        return sent

    (first, _), (second, _) = cluster.named_routes("req")
    cluster.compute("req", request_id="r")  # both routes' saves wait for their pulls
    cluster.ask("req", ranks=[0])
    assert wait_until(lambda: first in cluster.d_workers[0].land_loads().recving, 10.0)
    assert finished(0.5) == []  # the route to rank 1 still reads the blocks
    cluster.ask("req", ranks=[1])
    assert finished(10.0) == ["r"]
    assert wait_until(lambda: second in cluster.d_workers[1].land_loads().recving, 10.0)
    cluster.assert_landed()
    assert cluster.idle()
