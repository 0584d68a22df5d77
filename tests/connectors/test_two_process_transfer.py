"""Two processes, real sockets: a producer and a consumer move KV with the CPU transport.

The consumer checks every transferred block bit for bit; both sides must end idle (blocks,
buffers and connector state back to their idle values).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import time
from typing import Any

import pytest

from tests.connectors.kv_harness import (
    BLOCK_SIZE,
    free_port,
    make_config,
    run_consumer,
    run_producer,
)

MAX_PROMPT = 64  # the harness's "max_model_len"


def _context() -> mp.context.BaseContext:
    """Processes forked from a server that imported the harness (torch, the connector) once:
    a spawned process would import them again, seconds of CPU each. That server is itself a
    fresh interpreter, so nothing of this pytest process (threads, sockets) is inherited."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.connectors.kv_harness"])
    return ctx


def make_specs(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    edge = [1, 2, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 1,
            MAX_PROMPT - 1, MAX_PROMPT]
    specs = []
    for i in range(count):
        length = edge[i] if i < len(edge) else rng.randint(1, MAX_PROMPT)
        shared = rng.random() < 0.3  # a common prefix, as prefix hits would see it
        prompt = ([7] * min(length, 12) if shared else []) + [rng.randint(0, 999) for _ in range(length)]
        prompt = prompt[:length]
        max_hit = (length - 1) // BLOCK_SIZE
        specs.append({
            "request_id": f"req-{seed}-{i}", "transfer_id": f"tx-{seed}-{i}", "prompt": prompt,
            "p_hit_blocks": rng.choice([0, 0, rng.randint(0, max_hit)]),
            "d_hit_blocks": rng.choice([0, 0, max_hit, rng.randint(0, max_hit)]),
            # 1..4 tokens per step: many prompts end with a chunk that adds no new block.
            "chunk": rng.choice([1, 3, BLOCK_SIZE, 7, 64]),
            "preempt_after_load": rng.random() < 0.1,
        })
    return specs


def run_pair(send_type: str, specs: list[dict[str, Any]], dtype: str = "float32",
              consumer_extra: dict[str, Any] | None = None, seed: int = 0,
              layer_delay_s: float = 0.0, kill_producer_after_s: float | None = None,
              timeout_s: float = 30.0, devices: tuple[str, str] = ("cpu", "cpu"),
              min_call_bytes: int = 0, after_restart: list[dict[str, Any]] | None = None,
              ) -> tuple[dict[str, str], dict[str, Any], dict[str, Any] | None, float]:
    """Run ``specs`` through a producer and a consumer process; results and idle reports.

    With ``kill_producer_after_s`` the producer is killed mid-transfer; with
    ``after_restart`` a new producer then starts at the same address (new epoch) and those
    specs run too, so the consumer must rebuild its pair with the new process.
    """
    ctx = _context()
    p_port, d_port = free_port(), free_port()
    p_addr, d_addr = f"127.0.0.1:{p_port}", f"127.0.0.1:{d_port}"
    p_config = make_config("kv_producer", p_port, send_type, transfer_timeout_s=timeout_s,
                           get_lease_s=timeout_s * 2, orphan_ttl_s=timeout_s * 2,
                           min_call_bytes=min_call_bytes)
    d_config = make_config("kv_consumer", d_port, send_type, transfer_timeout_s=timeout_s,
                           **(consumer_extra or {}))
    p_in, d_in, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    producer = ctx.Process(target=run_producer, args=(p_config, p_in, out, d_addr, dtype, layer_delay_s,
                                                             devices[0]))
    consumer = ctx.Process(target=run_consumer, args=(d_config, d_in, out, p_addr, dtype, devices[1]))
    producer.start()
    consumer.start()
    processes = [producer, consumer]
    rng = random.Random(seed)

    def feed(batch: list[dict[str, Any]], p_inbox: Any) -> None:
        # Both legs arrive concurrently, in either order.
        for spec in batch:
            first, second = (p_inbox, d_in) if rng.random() < 0.5 else (d_in, p_inbox)
            first.put(spec)
            if rng.random() < 0.2:
                time.sleep(0.01)
            second.put(spec)

    try:
        feed(specs, p_in)
        killed_at = None
        if kill_producer_after_s is not None:
            time.sleep(kill_producer_after_s)
            producer.kill()
            killed_at = time.monotonic()
        results: dict[str, str] = {}
        reports: dict[str, Any] = {}
        deadline = time.monotonic() + 120
        while len(results) < len(specs) and time.monotonic() < deadline:
            try:
                item = out.get(timeout=1)
            except queue.Empty:
                continue
            if item[0] == "result":
                results[item[1]] = item[2]
        last_result_at = time.monotonic()
        if after_restart is not None:
            p_in = ctx.Queue()
            producer = ctx.Process(target=run_producer, args=(p_config, p_in, out, d_addr, dtype,
                                                              0.0, devices[0]))
            producer.start()
            processes.append(producer)
            # The consumer's load deadlines start when a request reaches it: feed only once
            # the new producer is up (a spawned process needs seconds to import torch).
            while time.monotonic() < deadline:
                try:
                    item = out.get(timeout=1)
                except queue.Empty:
                    continue
                if item[0] == "producer_ready":
                    break
                if item[0] == "result":
                    results[item[1]] = item[2]
            feed(after_restart, p_in)
            while len(results) < len(specs) + len(after_restart) and time.monotonic() < deadline:
                try:
                    item = out.get(timeout=1)
                except queue.Empty:
                    continue
                if item[0] == "result":
                    results[item[1]] = item[2]
        d_in.put(None)
        producer_alive = kill_producer_after_s is None or after_restart is not None
        if producer_alive:
            p_in.put(None)
        wanted = {"consumer_idle", "producer_idle"} if producer_alive else {"consumer_idle"}
        while wanted - set(reports) and time.monotonic() < deadline:
            try:
                item = out.get(timeout=1)
            except queue.Empty:
                continue
            if item[0] in wanted:
                reports[item[0]] = item[1]
        elapsed = last_result_at - killed_at if killed_at is not None else 0.0
        return results, reports["consumer_idle"], reports.get("producer_idle"), elapsed
    finally:
        for proc in processes:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def run_consumer_restart(send_type: str, first: list[dict[str, Any]],
                         again: list[dict[str, Any]], timeout_s: float, dtype: str = "float32",
                         devices: tuple[str, str] = ("cpu", "cpu"),
                         ) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
    """Run ``first`` through a producer and a consumer, kill the consumer once all of them
    ended (its pair idle and, as far as the producer can tell, healthy), start a new consumer
    at the same address (new epoch) and run ``again`` through it.

    Returns every result and the idle reports of the new consumer and of the producer.
    """
    ctx = _context()
    p_port, d_port = free_port(), free_port()
    p_addr, d_addr = f"127.0.0.1:{p_port}", f"127.0.0.1:{d_port}"
    p_config = make_config("kv_producer", p_port, send_type, transfer_timeout_s=timeout_s,
                           get_lease_s=timeout_s * 2, orphan_ttl_s=timeout_s * 2)
    d_config = make_config("kv_consumer", d_port, send_type, transfer_timeout_s=timeout_s)
    # Each process reports on its own queue: one killed while its queue's feeder thread holds
    # the queue's write lock would block every other writer of that queue for good.
    p_in, p_out = ctx.Queue(), ctx.Queue()
    processes = [ctx.Process(target=run_producer, args=(p_config, p_in, p_out, d_addr, dtype, 0.0,
                                                        devices[0]))]
    processes[0].start()
    sources = [p_out]
    results: dict[str, str] = {}
    reports: dict[str, Any] = {}
    deadline = time.monotonic() + 180
    rng = random.Random(0)

    def wait_for(done: Any) -> None:
        while not done() and time.monotonic() < deadline:
            for source in sources:
                try:
                    item = source.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item[0] == "result":
                    results[item[1]] = item[2]
                else:
                    reports[item[0]] = item[1]

    def start_consumer() -> tuple[Any, Any]:
        # Loads' deadlines start when a request reaches the consumer: feed only once it is up.
        reports.pop("consumer_ready", None)
        d_in, d_out = ctx.Queue(), ctx.Queue()
        consumer = ctx.Process(target=run_consumer, args=(d_config, d_in, d_out, p_addr, dtype,
                                                          devices[1]))
        consumer.start()
        processes.append(consumer)
        sources[1:] = [d_out]
        wait_for(lambda: "consumer_ready" in reports)
        return consumer, d_in

    def run(batch: list[dict[str, Any]], d_in: Any) -> None:
        for spec in batch:  # both legs, in either order
            for inbox in rng.sample([p_in, d_in], 2):
                inbox.put(spec)
        wait_for(lambda: all(spec["request_id"] in results for spec in batch))

    try:
        consumer, d_in = start_consumer()
        run(first, d_in)
        consumer.kill()
        consumer.join(10)
        consumer, d_in = start_consumer()
        run(again, d_in)
        d_in.put(None)
        p_in.put(None)
        wait_for(lambda: {"consumer_idle", "producer_idle"} <= set(reports))
        return results, reports["consumer_idle"], reports["producer_idle"]
    finally:
        for proc in processes:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def assert_idle(report: dict[str, Any]) -> None:
    assert report["free_blocks"] == report["num_blocks"], report
    assert report["scheduler_idle"] and report["worker_idle"], str(report["worker_stats"])
    stats = report["worker_stats"]
    assert stats["recv_buffer_bytes_in_use"] == 0
    assert stats["send_buffer_bytes_in_use"] == 0
    assert stats["pinned_bytes_in_use"] == 0


# min_call_bytes 0: one data call per layer; 32 MiB: these small requests go in one call.
@pytest.mark.parametrize("send_type,dtype,extra,min_call_bytes", [
    ("PUT_ASYNC", "float32", {}, 0),
    ("PUT", "bfloat16", {}, 32 << 20),
    ("GET", "float32", {}, 32 << 20),
    # A receive buffer for about four requests: loads are pushed back, none is lost.
    ("PUT_ASYNC", "float16", {"kv_buffer_size": 40_000}, 0),
    # Smaller than the longest requests (12 KiB): they stream through it a layer at a time.
    ("PUT_ASYNC", "float32", {"kv_buffer_size": 10_000}, 0),
    # The same with calls that would group all three layers: the pull caps them at its slot.
    ("PUT_ASYNC", "float32", {"kv_buffer_size": 10_000}, 32 << 20),
])
def test_transfer_bit_exact(send_type: str, dtype: str, extra: dict[str, Any],
                            min_call_bytes: int) -> None:
    specs = make_specs(110, seed=len(send_type) + len(dtype))
    results, consumer, producer, _ = run_pair(send_type, specs, dtype=dtype, consumer_extra=extra,
                                              min_call_bytes=min_call_bytes)
    bad = {k: v for k, v in results.items() if v not in ("ok", "local")}
    assert not bad, bad
    assert len(results) == len(specs)
    transferred = sum(v == "ok" for v in results.values())
    assert transferred >= 80
    assert_idle(consumer)
    assert producer is not None
    assert_idle(producer)
    p_stats, d_stats = producer["worker_stats"], consumer["worker_stats"]
    assert p_stats["transfers_sent"] == d_stats["transfers_received"] == transferred
    # Three layers: one data call per layer, or all three in one call, on each side; a
    # streamed load goes in calls of at most its slot, whatever min_call_bytes asks.
    calls_per_transfer = 3 if min_call_bytes == 0 else 1
    streamed = extra.get("kv_buffer_size", 1e9) < 12 * 1024
    if streamed and min_call_bytes:
        assert transferred < p_stats["data_calls"] == d_stats["data_calls"] < 3 * transferred
    else:
        assert p_stats["data_calls"] == d_stats["data_calls"] == calls_per_transfer * transferred
    assert p_stats["bytes_sent"] == d_stats["bytes_received"]
    assert d_stats["transfers_failed"] == d_stats["transfers_timed_out"] == 0
    assert d_stats["messages_rejected"] == 0 and p_stats["messages_rejected"] == 0
    if extra:
        assert d_stats["loads_pushed_back"] > 0
    if streamed:
        assert d_stats["loads_streamed"] > 0


def test_producer_killed_mid_transfer() -> None:
    specs = make_specs(12, seed=99)
    for spec in specs:  # every request needs a transfer
        spec.update(prompt=list(range(1, 41)), d_hit_blocks=0, preempt_after_load=False)
    timeout_s = 2.0
    results, consumer, _, after_kill = run_pair(
        "PUT_ASYNC", specs, layer_delay_s=0.3, kill_producer_after_s=1.5, timeout_s=timeout_s)
    assert len(results) == len(specs)
    assert "failed" in results.values()
    assert set(results.values()) <= {"ok", "failed"}
    # Every load resolves once its deadline passes; the slack covers a loaded 2-core machine
    # (polling and process scheduling), far below the 30 s a hang would take.
    assert after_kill < timeout_s + 8.0
    assert_idle(consumer)
    assert consumer["worker_stats"]["transfers_timed_out"] >= 1


def test_consumer_abort_while_waiting() -> None:
    specs = make_specs(6, seed=5)
    for spec in specs:
        spec.update(prompt=list(range(3, 30)), d_hit_blocks=0, preempt_after_load=False,
                    abort_after_s=0.05)
    results, consumer, producer, _ = run_pair("PUT_ASYNC", specs, layer_delay_s=0.2, timeout_s=3.0)
    assert set(results.values()) <= {"aborted", "ok"}
    assert_idle(consumer)
    assert producer is not None
    assert_idle(producer)


def test_producer_restarted_at_same_address() -> None:
    """A new producer process (new epoch, sequence numbers from 1 again) is served at once."""
    specs = make_specs(8, seed=41)
    for spec in specs:
        spec.update(prompt=list(range(1, 41)), d_hit_blocks=0, preempt_after_load=False)
    again = make_specs(20, seed=42)
    results, consumer, producer, _ = run_pair(
        "PUT_ASYNC", specs, layer_delay_s=0.3, kill_producer_after_s=1.0, timeout_s=2.0,
        after_restart=again)
    assert {results[s["request_id"]] for s in again} <= {"ok", "local"}
    assert "ok" in {results[s["request_id"]] for s in again}
    assert_idle(consumer)
    assert producer is not None
    # Pulls queued for the dead process may reach the new one (whether ZMQ still holds them
    # depends on reconnect timing): such orphans are freed by their TTL, so the new producer
    # ends idle either way (the TTL itself: test_p2p_units, orphan pull test).
    assert_idle(producer)


def test_consumer_restarted_at_same_address() -> None:
    """A new consumer process at the same address (new epoch) is served at once, and the
    producer counts the restart (on NCCL it drops its pair with the address at that moment,
    so its next send re-handshakes: test_peer_restart and the GPU test)."""
    first, again = make_specs(8, seed=51), make_specs(20, seed=52)
    results, consumer, producer = run_consumer_restart("PUT_ASYNC", first, again, timeout_s=5.0)
    assert set(results.values()) <= {"ok", "local"}, results
    assert len(results) == len(first) + len(again)
    assert "ok" in {results[s["request_id"]] for s in first}
    assert "ok" in {results[s["request_id"]] for s in again}
    assert_idle(consumer)
    assert_idle(producer)
    assert producer["worker_stats"]["consumer_restarts"] == 1
    assert producer["worker_stats"]["sends_failed"] == 0
