"""A real EngineCore with the P2P connector on CPU, driven into the corners where request
params or scheduling pressure used to corrupt, leak or crash: a producer preempted between
its save and its send, two producer requests naming one transfer (a bad peer address is
refused before it reaches an engine: tests/engine_core/test_kv_transfer_params.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from connectors import create_connector
from engine_core.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from engine_core.demo_model import build_checkpoint
from engine_core.engine_core import EngineCore
from engine_core.messages import AddRequest
from tests.connectors.kv_harness import free_port
from tests.kv_grants import granted_params

NOWHERE = "127.0.0.1:1"  # a peer that never answers: pulls and sends wait for it


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="llama", num_layers=2, seed=1)


def _engine(checkpoint: Path, role: str, num_blocks: int, **kv: object) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model=str(checkpoint), max_model_len=256),
        cache=CacheConfig(block_size=16, num_gpu_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8),
        device=DeviceConfig(device="cpu"),
        kv_transfer=KVTransferConfig(kv_role=role, kv_port=free_port(), **kv))
    return EngineCore(config, connector=create_connector(config, "cpu"))


def _producer_request(engine: EngineCore, request_id: str, prompt: list[int],
                      transfer_id: str) -> AddRequest:
    return AddRequest(request_id, prompt, {"max_tokens": 1}, time.time(),
                      granted_params({"do_remote_decode": True, "transfer_id": transfer_id,
                                      "remote_kv_address": NOWHERE},
                                     engine.connector_worker.address))


def test_a_producer_is_not_preempted_between_its_save_and_its_send(checkpoint: Path) -> None:
    """R's save is scheduled in step 1 and deferred (no pull yet); in step 2 the older Q
    needs a block. Preempting R would free the blocks the deferred send later gathers,
    and Q would write into one of them: R must keep its blocks and Q yield instead."""
    engine = _engine(checkpoint, "kv_producer", num_blocks=8)
    try:
        engine.add_request(AddRequest("Q", list(range(1, 65)),
                                      {"max_tokens": 50, "ignore_eos": True}, time.time()))
        engine.add_request(_producer_request(engine, "R", list(range(100, 150)), "tR"))
        engine.step()
        saved = engine.connector_worker.producer_side._pending["tR"].save.block_ids
        assert saved == engine.kv_manager.get_block_ids("R")
        engine.step()
        assert engine.scheduler.counters.num_preemptions >= 1  # the pressure was real
        assert engine.connector_worker.producer_side._pending["tR"].save.block_ids == saved
        assert set(engine.kv_manager.get_block_ids("R")) == set(saved)  # still R's (held)
        assert not set(saved) & set(engine.kv_manager.get_block_ids("Q"))
    finally:
        engine.shutdown()


def test_one_transfer_id_sends_once_and_leaks_nothing(checkpoint: Path) -> None:
    """Two producer requests with one transfer id: the second is answered without a send
    (counted invalid) instead of replacing the first's pending send and pinning its blocks
    forever; once the lease lapses every block is free and the engine is idle."""
    engine = _engine(checkpoint, "kv_producer", num_blocks=32, get_lease_s=0.3,
                     orphan_ttl_s=0.3)
    try:
        for request_id in ("A", "B"):
            engine.add_request(_producer_request(engine, request_id, list(range(1, 40)), "tD"))
        deadline = time.monotonic() + 10.0
        while engine.has_work() and time.monotonic() < deadline:
            engine.step()
            time.sleep(0.02)
        assert not engine.has_work(), list(engine.scheduler.held)
        assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks
        assert engine.scheduler.connector.stats()["invalid_transfer_params"] == 1
        assert engine.scheduler.connector.is_idle() and engine.connector_worker.is_idle()
    finally:
        engine.shutdown()
