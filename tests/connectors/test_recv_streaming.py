"""A transfer larger than the consumer's receive buffer streams through it.

The consumer reserves whole layers of ``kv_buffer_size``, not the whole transfer; its data
calls take the buffer's slots in turn, each scattered into the paged cache before the next
call reuses its slot (a stream orders that on a GPU; here the fake NCCL transport and the
CPU transport run them in that order). Before this, a Qwen3-8B prompt of 8k tokens (1.2 GB
of KV) could never load with vLLM's default ``kv_buffer_size`` of 1e9: every one failed
over to recompute on D.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from connectors.p2p_nccl.metadata import LoadSpec, P2pConnectorMetadata
from connectors.p2p_nccl.transport import PostedRecv, RecvPostError
from tests.connectors.worker_pair import DST, WorkerPair, wait_until
from tests.kv_grants import transfer_grant

# Four layers of 16-token blocks, 4 KV heads of 32 dims, float32: a layer of the
# request's 3 blocks is 48 KiB, the whole request 192 KiB.
LAYERS, BLOCK_SHAPE = 4, (16, 4, 32)
LAYER_BYTES = 2 * len(DST) * 16 * 4 * 32 * 4
BUFFER = 150_000  # bytes (three layers); a load larger than it takes whole layers of half


@pytest.mark.parametrize("nccl", [True, False], ids=["fake-nccl", "cpu-transport"])
def test_transfer_larger_than_the_buffer_streams_through_it(nccl: bool) -> None:
    """One call a layer (min_call_bytes 0): four calls through the one layer of half the
    buffer, in turn; the blocks arrive bit for bit (``outcome`` compares them, and each
    round sends new values) and the reservation stays within half the buffer."""
    pair = WorkerPair(nccl=nccl, kv_buffer_size=BUFFER, layers=LAYERS, block_shape=BLOCK_SHAPE)
    try:
        assert pair.consumer is not None
        gen = torch.Generator().manual_seed(5)
        for round_ in range(3):
            for cache in pair.p_caches:
                cache.copy_(torch.randn(cache.shape, generator=gen))
            tid = f"big-{round_}"
            pair.ask(tid)
            reserved = pair.consumer.stats()["recv_buffer_bytes_in_use"]
            assert reserved == LAYER_BYTES <= BUFFER // 2 < LAYERS * LAYER_BYTES
            pair.compute(tid)
            assert pair.outcome(tid) == "ok"
        assert pair.idle()
        stats = pair.consumer.stats()
        assert stats["recv_buffer_bytes_in_use"] == 0
        assert stats["transfers_received"] == 3 and stats["transfers_failed"] == 0
        assert stats["data_calls"] == 3 * LAYERS
    finally:
        pair.shutdown()


@pytest.mark.parametrize("nccl", [True, False], ids=["fake-nccl", "cpu-transport"])
def test_the_producer_keeps_its_calls_within_the_consumers_slot(nccl: bool) -> None:
    """The producer would group all four layers into one call (min_call_bytes above the
    request), which the load's one-layer slot does not hold: the pull says so
    (``max_layers_per_call``) and the producer sends one layer a call. Before, the header was
    refused and the pair aborted, so such a producer could never serve this consumer."""
    pair = WorkerPair(nccl=nccl, kv_buffer_size=BUFFER, min_call_bytes=1 << 30, layers=LAYERS,
                      block_shape=BLOCK_SHAPE)
    try:
        assert pair.consumer is not None
        pair.ask("grouped")
        pair.compute("grouped")
        assert pair.outcome("grouped") == "ok"
        stats = pair.consumer.stats()
        assert stats["data_calls"] == LAYERS and stats["loads_streamed"] == 1
        assert stats["messages_rejected"] == 0
        assert pair.idle()
    finally:
        pair.shutdown()


@pytest.mark.parametrize("nccl", [True, False], ids=["fake-nccl", "cpu-transport"])
def test_calls_larger_than_the_slot_fail_at_the_header(nccl: bool) -> None:
    """A producer that ignores the pull's cap (another implementation, or a bug) sends all
    four layers in one call: the consumer rejects the header and the load fails at once, not
    at its deadline (NCCL: the producer's send, never matched, gives up at its own)."""
    pair = WorkerPair(nccl=nccl, kv_buffer_size=BUFFER, min_call_bytes=1 << 30, layers=LAYERS,
                      block_shape=BLOCK_SHAPE, timeout_s=3.0)
    pair.producer.producer_side._jobs.layers_per_call = lambda pull: LAYERS  # type: ignore[method-assign]
    try:
        assert pair.consumer is not None
        start = time.monotonic()
        pair.ask("too-big")
        pair.compute("too-big")
        assert pair.outcome("too-big") == "failed"
        assert time.monotonic() - start < 2.5
        assert pair.consumer.stats()["messages_rejected"] >= 1  # the header (CPU: its data too)
        assert pair.idle()
    finally:
        pair.shutdown()


def test_a_layer_larger_than_the_buffer_fails_before_its_pull() -> None:
    pair = WorkerPair(kv_buffer_size=LAYER_BYTES - 1, layers=LAYERS, block_shape=BLOCK_SHAPE)
    try:
        assert pair.consumer is not None
        pair.consumer.start_load_kv(P2pConnectorMetadata(loads=[LoadSpec(
            "r", "r", pair.p_addr, DST, first_block=0, num_tokens=40,
            grant=transfer_grant("r", pair.p_addr, pair.d_addr))]))
        finished = pair.consumer.land_loads()
        assert finished.failed_recving == {"r"}
        assert pair.consumer.stats()["recv_buffer_bytes_in_use"] == 0
    finally:
        pair.shutdown()


def test_a_failed_load_is_reported_only_once_its_stream_drained() -> None:
    """A posted load that times out aborts its pair, but the scatters queued behind its
    receives may still run: it is reported (and its blocks handed back) only once the pair's
    stream has passed them."""
    pair = WorkerPair(timeout_s=0.5, layers=LAYERS, block_shape=BLOCK_SHAPE)
    consumer = pair.consumer
    assert consumer is not None
    drained = {"now": False}
    aborted: list[str] = []
    real_post, real_abort = pair.d_transport.post_recv, pair.d_transport.abort

    def post_never_landing(*args: Any, **kwargs: Any) -> Any:
        posted = real_post(*args, **kwargs)
        return type(posted)(poll=lambda: False, drained=lambda: drained["now"])

    def abort(peer_address: str) -> None:
        aborted.append(peer_address)
        real_abort(peer_address)

    pair.d_transport.post_recv = post_never_landing  # type: ignore[method-assign]
    pair.d_transport.abort = abort  # type: ignore[method-assign]
    try:
        pair.ask("stuck")
        pair.compute("stuck")
        assert wait_until(lambda: consumer.stats()["bytes_received"] > 0, 5.0)
        reported: set[str] = set()

        def failed() -> bool:
            reported.update(consumer.land_loads().failed_recving)
            return bool(reported)

        assert not wait_until(failed, 1.5)  # past its deadline, not drained: held
        assert consumer.stats()["loads_in_flight"] == 1
        assert aborted == [pair.p_addr]  # its receives wait for nothing: the pair is aborted
        drained["now"] = True
        assert wait_until(failed, 5.0) and reported == {"stuck"}
        # Its deadline passed on both sides: the producer, whose sends now end with the
        # consumer's deadline less a margin, may give up (and say so) first.
        stats = consumer.stats()
        assert stats["transfers_timed_out"] + stats["transfers_failed"] == 1
        assert consumer.stats()["recv_buffer_bytes_in_use"] == 0
    finally:
        pair.shutdown()


def test_a_post_that_failed_midway_drains_before_it_is_reported() -> None:
    """The pair failed while the receives were being posted: part of them (and their
    scatters) is queued, so the load, failed at once, is reported only once that drained."""
    pair = WorkerPair(layers=LAYERS, block_shape=BLOCK_SHAPE)
    consumer = pair.consumer
    assert consumer is not None
    drained = {"now": False}

    def post_failing_midway(*args: Any, **kwargs: Any) -> Any:
        raise RecvPostError("pair aborted midway", PostedRecv(
            poll=lambda: False, drained=lambda: drained["now"]))

    pair.d_transport.post_recv = post_failing_midway  # type: ignore[method-assign]
    try:
        pair.ask("midway")
        pair.compute("midway")
        reported: set[str] = set()

        def failed() -> bool:
            reported.update(consumer.land_loads().failed_recving)
            return bool(reported)

        assert not wait_until(failed, 1.0)
        assert consumer.stats()["loads_in_flight"] == 1
        drained["now"] = True
        assert wait_until(failed, 5.0) and reported == {"midway"}
    finally:
        pair.shutdown()
