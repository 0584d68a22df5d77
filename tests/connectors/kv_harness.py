"""A tiny engine loop that drives the connector exactly as the scheduler and runner do.

Used by the two-process protocol tests: a producer "computes" prompts by writing
deterministic KV (a pure function of the token prefix, so any process can check it) into its
paged cache and calling the layer hooks; a consumer receives into other block ids and checks
every transferred block bit for bit. Runs in spawned processes: top-level functions only.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from connectors import create_connector
from deploy.launch import free_port  # noqa: F401  (re-exported for the connector tests)
from engine_core.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.sched.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from engine_core.worker.kv_cache import KVCacheShape, allocate_kv_caches
from tests.kv_grants import granted_params

NUM_LAYERS = 3
NUM_HEADS = 2
HEAD_DIM = 4
BLOCK_SIZE = 4


def kv_values(prompt: list[int], dtype: torch.dtype) -> torch.Tensor:
    """K/V of every prompt position: ``[T, layers, 2, heads, head_dim]``, a function of the prefix."""
    seeds = []
    state = 17
    for token in prompt:
        state = (state * 1000003 + token + 1) % 2147483647
        seeds.append(state)
    width = NUM_LAYERS * 2 * NUM_HEADS * HEAD_DIM
    coeff = torch.arange(1, width + 1, dtype=torch.float64)
    values = torch.sin(torch.tensor(seeds, dtype=torch.float64)[:, None] * 1e-6 * coeff[None, :])
    return values.to(dtype).view(len(prompt), NUM_LAYERS, 2, NUM_HEADS, HEAD_DIM)


def slots_of(block_ids: list[int], start: int, end: int) -> torch.Tensor:
    positions = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.int64)[positions // BLOCK_SIZE]
    return blocks * BLOCK_SIZE + positions % BLOCK_SIZE


def write_kv(kv_cache: torch.Tensor, layer: int, values: torch.Tensor, slots: torch.Tensor) -> None:
    """What an attention layer does first: write the new tokens' K/V at their slots."""
    flat = kv_cache.view(2, -1, NUM_HEADS, HEAD_DIM)
    flat[:, slots] = values[:, layer].permute(1, 0, 2, 3)


def read_kv(kv_caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """``[T, layers, 2, heads, head_dim]`` read back from the paged caches."""
    per_layer = [kv.view(2, -1, NUM_HEADS, HEAD_DIM)[:, slots].permute(1, 0, 2, 3) for kv in kv_caches]
    return torch.stack(per_layer, dim=1)


def make_config(role: str, port: int, send_type: str, **extra: Any) -> EngineConfig:
    kv = KVTransferConfig(kv_role=role, kv_port=port, send_type=send_type, **extra)
    return EngineConfig(model=ModelConfig(model="harness"), cache=CacheConfig(block_size=BLOCK_SIZE),
                        kv_transfer=kv)


@dataclass
class _Live:
    request: Request
    block_ids: list[int] = field(default_factory=list)
    seen: bool = False
    chunk: int = 8
    spec: dict[str, Any] = field(default_factory=dict)


class FakeEngine:
    """Block pool + connector pair + paged caches, stepping like the real engine."""

    def __init__(self, config: EngineConfig, num_blocks: int, dtype: torch.dtype,
                 device: str = "cpu") -> None:
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        self.device = device
        self.scheduler, self.worker = create_connector(config, device)
        gen = torch.Generator().manual_seed(1234)
        # One allocation, as the engine makes it (the connector moves all layers at once).
        self.kv_caches = allocate_kv_caches(
            KVCacheShape(NUM_LAYERS, num_blocks, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, dtype), device)
        for kv in self.kv_caches:
            kv.copy_(torch.randn(kv.shape, generator=gen).to(dtype))
        self.dtype = dtype
        self.num_blocks = num_blocks
        self.free_blocks = list(range(num_blocks))
        self.worker.register_kv_caches(self.kv_caches)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free_blocks):
            raise RuntimeError("harness out of blocks")
        taken, self.free_blocks = self.free_blocks[:count], self.free_blocks[count:]
        return taken

    def free(self, block_ids: list[int]) -> None:
        self.free_blocks.extend(block_ids)

    def fill_local(self, prompt: list[int], block_ids: list[int], num_tokens: int) -> None:
        """A local prefix hit: these tokens' KV is already in the cache."""
        if num_tokens == 0:
            return
        values = kv_values(prompt[:num_tokens], self.dtype).to(self.device)
        slots = slots_of(block_ids, 0, num_tokens).to(self.device)
        for layer, kv in enumerate(self.kv_caches):
            write_kv(kv, layer, values, slots)

    def idle_report(self) -> dict[str, Any]:
        return {"free_blocks": len(self.free_blocks), "num_blocks": self.num_blocks,
                "scheduler_idle": self.scheduler.is_idle(), "worker_idle": self.worker.is_idle(),
                "worker_stats": self.worker.stats(), "scheduler_stats": self.scheduler.stats()}


def _request(spec: dict[str, Any], flag: str, peer: str, own: str) -> Request:
    params = granted_params({"transfer_id": spec["transfer_id"], flag: True,
                             "remote_kv_address": peer}, own)
    return Request(request_id=spec["request_id"], prompt_token_ids=list(spec["prompt"]),
                   sampling_params=SamplingParams(max_tokens=1), kv_transfer_params=params)


def run_producer(config: EngineConfig, inbox: Any, outbox: Any, peer: str, dtype_name: str,
                 layer_delay_s: float = 0.0, device: str = "cpu") -> None:
    """Producer process: chunked prefill of the requests it is sent, hooks as the runner calls them."""
    logging.basicConfig(level=logging.WARNING, format="producer %(name)s: %(message)s")
    engine = FakeEngine(config, num_blocks=4096, dtype=getattr(torch, dtype_name), device=device)
    outbox.put(("producer_ready", None))
    running: dict[str, _Live] = {}
    held: dict[str, list[int]] = {}
    stopping = False
    step = 0
    try:
        while not (stopping and not running and not held):
            try:
                while True:
                    spec = inbox.get_nowait()
                    if spec is None:
                        stopping = True
                        continue
                    live = _Live(_request(spec, "do_remote_decode", peer, engine.worker.address), chunk=spec["chunk"], spec=spec)
                    hit = spec["p_hit_blocks"] * BLOCK_SIZE
                    live.block_ids = engine.allocate(spec["p_hit_blocks"])
                    engine.fill_local(spec["prompt"], live.block_ids, hit)
                    live.request.num_computed_tokens = hit
                    engine.scheduler.get_num_new_matched_tokens(live.request, hit)
                    running[live.request.request_id] = live
            except queue.Empty:
                pass
            step += 1
            new_reqs, cached_reqs, num_scheduled = [], [], {}
            batch = list(running.values())[:4]
            for live in batch:
                req = live.request
                count = min(live.chunk, req.num_prompt_tokens - req.num_computed_tokens)
                need = -(-(req.num_computed_tokens + count) // BLOCK_SIZE) - len(live.block_ids)
                new_blocks = engine.allocate(max(0, need))
                live.block_ids += new_blocks
                num_scheduled[req.request_id] = count
                if not live.seen:
                    new_reqs.append(NewRequestData(req.request_id, list(req.prompt_token_ids),
                                                   req.num_prompt_tokens, req.sampling_params,
                                                   list(live.block_ids), req.num_computed_tokens))
                    live.seen = True
                else:
                    cached_reqs.append(CachedRequestData(req.request_id, new_blocks,
                                                         req.num_computed_tokens))
            out = SchedulerOutput(new_reqs, cached_reqs, num_scheduled, sum(num_scheduled.values()))
            meta = engine.scheduler.build_connector_meta(out)
            engine.worker.start_load_kv(meta)
            engine.worker.bind_step(meta, None)
            writes = []
            for live in batch:
                req = live.request
                start, end = req.num_computed_tokens, req.num_computed_tokens + num_scheduled[req.request_id]
                writes.append((kv_values(list(req.prompt_token_ids[:end]), engine.dtype)[start:end].to(device),
                               slots_of(live.block_ids, start, end).to(device)))
            for layer, kv in enumerate(engine.kv_caches):
                engine.worker.before_layer(layer)
                for values, slots in writes:
                    write_kv(kv, layer, values, slots)
                if layer_delay_s and batch:
                    time.sleep(layer_delay_s)
                engine.worker.after_layer(layer, kv)
            engine.worker.wait_for_save()
            finished = engine.worker.get_finished()
            done = []
            for live in batch:
                live.request.num_computed_tokens += num_scheduled[live.request.request_id]
                if live.request.num_computed_tokens >= live.request.num_prompt_tokens:
                    done.append(live)
            # Both orders of "send finished" vs "request finished" happen in a real engine.
            if step % 2:
                engine.scheduler.update_finished(finished)
            for live in done:
                del running[live.request.request_id]
                hold, _ = engine.scheduler.request_finished(live.request, live.block_ids)
                if hold:
                    held[live.request.request_id] = live.block_ids
                else:
                    engine.free(live.block_ids)
            if not step % 2:
                engine.scheduler.update_finished(finished)
            for request_id in finished.sending:
                if request_id in held:
                    engine.free(held.pop(request_id))
            if not batch:
                time.sleep(0.002)
        # Orphaned pull requests (e.g. queued for a producer that died) expire by TTL.
        drain_until = time.monotonic() + config.kv_transfer.orphan_ttl_s + 2.0
        while not engine.worker.is_idle() and time.monotonic() < drain_until:
            engine.worker.get_finished()
            time.sleep(0.05)
        outbox.put(("producer_idle", engine.idle_report()))
    finally:
        engine.worker.shutdown()


def run_consumer(config: EngineConfig, inbox: Any, outbox: Any, peer: str, dtype_name: str,
                 device: str = "cpu") -> None:
    """Consumer process: allocate, park, check every landed request bit for bit. An aborted
    request whose blocks the scheduler holds (its load still running) frees them only when
    the worker reports the load's end, as the engine's scheduler does."""
    logging.basicConfig(level=logging.WARNING, format="consumer %(name)s: %(message)s")
    engine = FakeEngine(config, num_blocks=4096, dtype=getattr(torch, dtype_name), device=device)
    outbox.put(("consumer_ready", None))
    waiting: dict[str, _Live] = {}
    held: dict[str, list[int]] = {}

    def release_held(finished: Any) -> None:
        for request_id in finished.recving | finished.failed_recving:
            if request_id in held:
                engine.free(held.pop(request_id))

    stopping = False
    try:
        while not (stopping and not waiting):
            try:
                while True:
                    spec = inbox.get_nowait()
                    if spec is None:
                        stopping = True
                        continue
                    _consumer_admit(engine, spec, peer, waiting, outbox)
            except queue.Empty:
                pass
            meta = engine.scheduler.build_connector_meta(SchedulerOutput([], [], {}, 0))
            engine.worker.start_load_kv(meta)
            engine.worker.bind_step(meta, None)
            engine.worker.wait_for_save()
            finished = engine.worker.get_finished()
            engine.scheduler.update_finished(finished)
            release_held(finished)
            for request_id in finished.recving | finished.failed_recving:
                live = waiting.pop(request_id, None)
                if live is None:
                    continue
                if request_id in finished.recving:
                    result = _check_blocks(engine, live)
                    if live.spec.get("preempt_after_load"):
                        # Preempted after its KV arrived: rescheduled as new, it must compute locally.
                        engine.free(live.block_ids)
                        live.block_ids = []
                        again = engine.scheduler.get_num_new_matched_tokens(live.request, 0)
                        if again.num_tokens != 0:
                            result = "preempted request matched remote tokens again"
                else:
                    result = "failed"
                engine.scheduler.request_finished(live.request, live.block_ids)
                engine.free(live.block_ids)
                outbox.put(("result", request_id, result))
            for live in list(waiting.values()):
                if live.spec.get("abort_after_s") is not None and \
                        time.monotonic() > live.spec["_admitted"] + live.spec["abort_after_s"]:
                    del waiting[live.request.request_id]
                    hold, _ = engine.scheduler.request_finished(live.request, live.block_ids)
                    if hold:
                        held[live.request.request_id] = live.block_ids
                    else:
                        engine.free(live.block_ids)
                    outbox.put(("result", live.request.request_id, "aborted"))
            time.sleep(0.002)
        # Let cancelled loads drain (they complete or reach their deadline), then report.
        deadline = time.monotonic() + config.kv_transfer.transfer_timeout_s + 2
        while (held or not engine.worker.is_idle()) and time.monotonic() < deadline:
            meta = engine.scheduler.build_connector_meta(SchedulerOutput([], [], {}, 0))
            engine.worker.start_load_kv(meta)
            finished = engine.worker.get_finished()
            engine.scheduler.update_finished(finished)
            release_held(finished)
            time.sleep(0.01)
        outbox.put(("consumer_idle", engine.idle_report()))
    finally:
        engine.worker.shutdown()


def _consumer_admit(engine: FakeEngine, spec: dict[str, Any], peer: str,
                    waiting: dict[str, _Live], outbox: Any) -> None:
    live = _Live(_request(spec, "do_remote_prefill", peer, engine.worker.address), spec=spec)
    spec["_admitted"] = time.monotonic()
    prompt = spec["prompt"]
    num_local = min(spec["d_hit_blocks"] * BLOCK_SIZE, (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE)
    local_blocks = engine.allocate(num_local // BLOCK_SIZE)
    engine.fill_local(prompt, local_blocks, num_local)
    match = engine.scheduler.get_num_new_matched_tokens(live.request, num_local)
    live.block_ids = local_blocks
    if match.num_tokens == 0:
        # Nothing to load: the engine computes the rest itself.
        engine.scheduler.request_finished(live.request, live.block_ids)
        engine.free(live.block_ids)
        outbox.put(("result", live.request.request_id, "local"))
        return
    total = -(-(num_local + match.num_tokens) // BLOCK_SIZE)
    live.block_ids = local_blocks + engine.allocate(total - len(local_blocks))
    engine.scheduler.update_state_after_alloc(live.request, list(live.block_ids), num_local,
                                              match.num_tokens)
    waiting[live.request.request_id] = live


def _check_blocks(engine: FakeEngine, live: _Live) -> str:
    prompt = live.spec["prompt"]
    num_tokens = len(prompt) - 1
    expected = kv_values(prompt[:num_tokens], engine.dtype)
    got = read_kv(engine.kv_caches, slots_of(live.block_ids, 0, num_tokens).to(engine.device)).cpu()
    if not torch.equal(expected.view(torch.uint8), got.contiguous().view(torch.uint8)):
        return "mismatch"
    return "ok"
