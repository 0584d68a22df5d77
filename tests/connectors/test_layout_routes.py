"""Routes between tensor-parallel layouts over real sockets (CPU transport): one connector
worker per rank, each producer rank sends only the KV heads it holds straight to the
consumer ranks that keep them (``plan_head_routes``), every route an ordinary transfer."""

from __future__ import annotations

import pytest
import torch

from connectors.p2p_nccl.connector_worker import P2pConnectorWorker
from connectors.p2p_nccl.kv_layout import KVLayout, plan_head_routes
from connectors.p2p_nccl.metadata import LoadSpec, P2pConnectorMetadata, SaveSpec
from deploy.launch import free_ports
from engine_core.config import KVTransferConfig
from engine_core.worker.block_copy import HeadSlice
from engine_core.worker.kv_cache import KVCacheShape, allocate_kv_caches
from tests.connectors.worker_pair import (
    DST,
    LAYERS,
    NUM_BLOCKS,
    SRC,
    make_caches,
    start_worker,
    wait_until,
)

BLOCK_SIZE, KV_HEADS, HEAD_DIM = 4, 4, 4


class LayoutCluster:
    """A producer of ``p_size`` ranks and a consumer of ``d_size`` ranks, one worker a rank."""

    def __init__(self, p_size: int, d_size: int) -> None:
        shape = dict(total_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                     dtype="float32", num_layers=LAYERS)
        self.producer = KVLayout.of_rank(p_size, 0, **shape)
        self.consumer = KVLayout.of_rank(d_size, 0, **shape)
        self.routes = plan_head_routes(self.producer, self.consumer)
        # The KV a single-device producer would hold; each rank keeps its heads of it.
        self.full = make_caches(1, LAYERS, (BLOCK_SIZE, KV_HEADS, HEAD_DIM))
        ports = free_ports(p_size + d_size)
        self.p_addrs = [f"127.0.0.1:{port}" for port in ports[:p_size]]
        self.d_addrs = [f"127.0.0.1:{port}" for port in ports[p_size:]]
        self.p_workers = [self._start("kv_producer", port, self._rank_caches(self.producer, r))
                          for r, port in enumerate(ports[:p_size])]
        self.d_caches = [self._rank_caches(self.consumer, r, fill=float("nan"))
                         for r in range(d_size)]
        self.d_workers = [self._start("kv_consumer", port, caches)
                          for port, caches in zip(ports[p_size:], self.d_caches, strict=True)]

    def _rank_caches(self, layout: KVLayout, rank: int,
                     fill: float | None = None) -> list[torch.Tensor]:
        own = layout.rank_layout(rank)
        caches = allocate_kv_caches(KVCacheShape(LAYERS, NUM_BLOCKS, BLOCK_SIZE,
                                                 own.num_kv_heads, HEAD_DIM, torch.float32), "cpu")
        for cache, full in zip(caches, self.full, strict=True):
            if fill is None:
                cache.copy_(HeadSlice(own.kv_head_start, own.num_kv_heads).of(full))
            else:
                cache.fill_(fill)
        return caches

    @staticmethod
    def _start(role: str, port: int, caches: list[torch.Tensor]) -> P2pConnectorWorker:
        config = KVTransferConfig(kv_role=role, kv_port=port, transfer_timeout_s=5.0)
        worker = P2pConnectorWorker(config, "cpu")
        start_worker(worker, caches)
        return worker

    def ask(self, transfer_id: str, dst_heads: dict[str, HeadSlice] | None = None) -> None:
        """Each consumer rank pulls its routes (``dst_heads`` overrides a route's slice)."""
        for rank, worker in enumerate(self.d_workers):
            loads = [LoadSpec(route.transfer_id(transfer_id), route.transfer_id(transfer_id),
                              self.p_addrs[route.src_rank], DST, 0, 12,
                              (dst_heads or {}).get(route.transfer_id(transfer_id),
                                                    route.dst_slice))
                     for route in self.routes if route.dst_rank == rank]
            worker.start_load_kv(P2pConnectorMetadata(loads=loads))

    def compute(self, transfer_id: str) -> None:
        """Each producer rank's step that computes the prompt: it saves its routes."""
        for rank, worker in enumerate(self.p_workers):
            saves = [SaveSpec(route.transfer_id(transfer_id), route.transfer_id(transfer_id),
                              self.d_addrs[route.dst_rank], SRC, 12, route.src_slice)
                     for route in self.routes if route.src_rank == rank]
            worker.bind_step(P2pConnectorMetadata(saves=saves), None)
            for layer in range(LAYERS):
                worker.after_layer(layer, None)
            worker.wait_for_save()

    def outcomes(self, transfer_id: str) -> dict[str, str]:
        """Each route's load: "ok" or "failed", once every one resolved."""
        wanted = {route.transfer_id(transfer_id) for route in self.routes}
        seen: dict[str, str] = {}

        def resolved() -> bool:
            for worker in self.d_workers:
                finished = worker.land_loads()
                seen.update(dict.fromkeys(finished.recving & wanted, "ok"))
                seen.update(dict.fromkeys(finished.failed_recving & wanted, "failed"))
            return seen.keys() == wanted

        assert wait_until(resolved, 10.0), f"loads never resolved: {seen}"
        return seen

    def assert_landed(self) -> None:
        """Every consumer rank holds, in DST, exactly its heads of the producer's SRC."""
        for rank, caches in enumerate(self.d_caches):
            own = self.consumer.rank_layout(rank)
            for cache, full in zip(caches, self.full, strict=True):
                want = HeadSlice(own.kv_head_start, own.num_kv_heads).of(full[:, SRC])
                assert torch.equal(cache[:, DST], want)

    def idle(self) -> bool:
        def drained() -> bool:
            for worker in self.p_workers + self.d_workers:
                worker.get_finished()
            return all(w.is_idle() for w in self.p_workers + self.d_workers)

        return wait_until(drained, 10.0)

    def shutdown(self) -> None:
        for worker in self.d_workers + self.p_workers:
            worker.shutdown()


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
    if pull_first:  # the pulls wait at P: each rank pushes its layers as they are computed
        cluster.ask("req")
        assert wait_until(lambda: sum(w.stats()["pull_requests_waiting"]
                                      for w in cluster.p_workers) == len(cluster.routes), 5.0)
        cluster.compute("req")
    else:  # the saves wait for their pulls: each rank sends from its held blocks
        cluster.compute("req")
        cluster.ask("req")
    assert set(cluster.outcomes("req").values()) == {"ok"}
    cluster.assert_landed()
    assert cluster.idle()


def test_a_pull_for_other_heads_than_the_route_is_refused(make_cluster):
    cluster = make_cluster(1, 2)
    wrong = cluster.routes[0].transfer_id("req")
    cluster.compute("req")
    cluster.ask("req", dst_heads={wrong: HeadSlice(0, 1)})  # asks 1 head of the route's 2
    outcomes = cluster.outcomes("req")
    assert outcomes[wrong] == "failed"
    assert outcomes[cluster.routes[1].transfer_id("req")] == "ok"
    assert cluster.p_workers[0].stats()["messages_rejected"] >= 1
    assert cluster.idle()
