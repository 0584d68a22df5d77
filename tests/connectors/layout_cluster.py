"""Producer and consumer workers split over tensor-parallel layouts, one connector worker
per rank in this process, for the route tests: each producer rank sends only the KV heads it
holds straight to the consumer ranks that keep them (``plan_head_routes``), every route an
ordinary transfer. Devices per rank may be given (CUDA ranks use the CPU transport)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from connectors.p2p_nccl.connector_worker import P2pConnectorWorker
from connectors.p2p_nccl.kv_layout import HeadRoute, plan_head_routes, route_transfer_ids
from connectors.p2p_nccl.metadata import LoadSpec, P2pConnectorMetadata, SaveSpec
from deploy.launch import free_ports
from engine_core.config import KVTransferConfig
from engine_core.parallel.kv_layout import HeadSlice, KVLayout
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
from tests.kv_grants import transfer_grant

BLOCK_SIZE, KV_HEADS, HEAD_DIM = 4, 4, 4


def on_device(device: str) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` current, as each rank's process has its own: the engine-side hooks
    record their events on the current device's stream."""
    return torch.cuda.device(device) if device.startswith("cuda") else contextlib.nullcontext()


class LayoutCluster:
    """A producer of ``p_size`` ranks and a consumer of ``d_size`` ranks, one worker a rank."""

    def __init__(self, p_size: int, d_size: int, p_devices: list[str] | None = None,
                 d_devices: list[str] | None = None) -> None:
        p_devices = p_devices or ["cpu"] * p_size
        d_devices = d_devices or ["cpu"] * d_size
        self.p_devices, self.d_devices = p_devices, d_devices
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
        self.p_workers = [self._start("kv_producer", ports[r], p_devices[r],
                                      self._rank_caches(self.producer, r, p_devices[r]))
                          for r in range(p_size)]
        self.d_caches = [self._rank_caches(self.consumer, r, d_devices[r], fill=float("nan"))
                         for r in range(d_size)]
        self.d_workers = [self._start("kv_consumer", ports[p_size + r], d_devices[r],
                                      self.d_caches[r]) for r in range(d_size)]

    def _rank_caches(self, layout: KVLayout, rank: int, device: str,
                     fill: float | None = None) -> list[torch.Tensor]:
        own = layout.rank_layout(rank)
        caches = allocate_kv_caches(KVCacheShape(LAYERS, NUM_BLOCKS, BLOCK_SIZE,
                                                 own.num_kv_heads, HEAD_DIM, torch.float32), device)
        for cache, full in zip(caches, self.full, strict=True):
            if fill is None:
                cache.copy_(HeadSlice(own.kv_head_start, own.num_kv_heads).of(full))
            else:
                cache.fill_(fill)
        return caches

    @staticmethod
    def _start(role: str, port: int, device: str,
               caches: list[torch.Tensor]) -> P2pConnectorWorker:
        config = KVTransferConfig(kv_role=role, kv_port=port, transfer_timeout_s=5.0,
                                  transport="cpu")
        worker = P2pConnectorWorker(config, device)
        start_worker(worker, caches)
        return worker

    def ask(self, transfer_id: str, dst_heads: dict[str, HeadSlice] | None = None,
            request_id: str | None = None, ranks: list[int] | None = None) -> None:
        """Each consumer rank (or those of ``ranks``) pulls its routes, each under its
        route's grant (``dst_heads`` overrides a route's slice); the loads belong to
        ``request_id``, else each route is a request of its own."""
        named = self.named_routes(transfer_id)
        for rank, worker in enumerate(self.d_workers):
            if ranks is not None and rank not in ranks:
                continue
            loads = [LoadSpec(request_id or tid, tid, self.p_addrs[route.src_rank], DST, 0, 12,
                              transfer_grant(tid, self.p_addrs[route.src_rank],
                                             self.d_addrs[route.dst_rank]),
                              (dst_heads or {}).get(tid, route.dst_slice))
                     for tid, route in named if route.dst_rank == rank]
            with on_device(self.d_devices[rank]):
                worker.start_load_kv(P2pConnectorMetadata(loads=loads))

    def named_routes(self, transfer_id: str) -> list[tuple[str, HeadRoute]]:
        """(the route's transfer id, the route) for one request."""
        return list(zip(route_transfer_ids(transfer_id, self.routes), self.routes, strict=True))

    def compute(self, transfer_id: str, ranks: list[int] | None = None,
                request_id: str | None = None) -> None:
        """Each producer rank's (or those of ``ranks``) step that computes the prompt: it
        saves its routes, as ``request_id`` or each route as a request of its own."""
        named = self.named_routes(transfer_id)
        for rank, worker in enumerate(self.p_workers):
            if ranks is not None and rank not in ranks:
                continue
            saves = [SaveSpec(request_id or tid, tid, self.d_addrs[route.dst_rank], SRC, 12, route.src_slice)
                     for tid, route in named if route.src_rank == rank]
            with on_device(self.p_devices[rank]):
                worker.bind_step(P2pConnectorMetadata(saves=saves), None)
                for layer in range(LAYERS):
                    worker.after_layer(layer, None)
                worker.wait_for_save()

    def send(self, transfer_id: str, pull_first: bool) -> dict[str, str]:
        """One request's KV over every route: pulls first (each producer rank pushes its
        layers as they are computed) or saves first (it sends from its held blocks)."""
        if pull_first:
            self.ask(transfer_id)
            assert wait_until(lambda: sum(w.stats()["pull_requests_waiting"]
                                          for w in self.p_workers) == len(self.routes), 5.0)
            self.compute(transfer_id)
        else:
            self.compute(transfer_id)
            self.ask(transfer_id)
        return self.outcomes(transfer_id)

    def outcomes(self, transfer_id: str) -> dict[str, str]:
        """Each route's load: "ok" or "failed", once every one resolved."""
        wanted = set(route_transfer_ids(transfer_id, self.routes))
        seen: dict[str, str] = {}

        def resolved() -> bool:
            for rank, worker in enumerate(self.d_workers):
                with on_device(self.d_devices[rank]):
                    finished = worker.land_loads()
                seen.update(dict.fromkeys(finished.recving & wanted, "ok"))
                seen.update(dict.fromkeys(finished.failed_recving & wanted, "failed"))
            return seen.keys() == wanted

        assert wait_until(resolved, 10.0), f"loads never resolved: {seen}"
        return seen

    def d_caches_reset(self) -> None:
        """Fill the consumer ranks' caches with NaN again (a head no route fills shows)."""
        for caches in self.d_caches:
            for cache in caches:
                cache.fill_(float("nan"))

    def assert_landed(self) -> None:
        """Every consumer rank holds, in DST, exactly its heads of the producer's SRC."""
        for rank, caches in enumerate(self.d_caches):
            own = self.consumer.rank_layout(rank)
            for cache, full in zip(caches, self.full, strict=True):
                want = HeadSlice(own.kv_head_start, own.num_kv_heads).of(full[:, SRC])
                assert torch.equal(cache[:, DST].cpu(), want)

    def idle(self) -> bool:
        def drained() -> bool:
            for worker in self.p_workers + self.d_workers:
                worker.get_finished()
            return all(w.is_idle() for w in self.p_workers + self.d_workers)

        return wait_until(drained, 10.0)

    def shutdown(self) -> None:
        for worker in self.d_workers + self.p_workers:
            worker.shutdown()
