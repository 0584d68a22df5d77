"""Two GPUs, two processes, NCCL data plane: bit-exact transfers for every send type.

Producer on cuda:0, consumer on cuda:1. Run on the GPU machine:
``source .device/env.sh && python3 -m pytest -m gpu tests/connectors/test_p2p_nccl_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch

from tests.connectors.test_two_process_transfer import (
    assert_idle,
    make_specs,
    run_consumer_restart,
    run_pair,
)

pytestmark = pytest.mark.gpu


def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    pytest.importorskip("cupy")


@pytest.mark.parametrize("send_type,dtype,min_call_bytes,buffer", [
    ("PUT", "bfloat16", 0, None), ("GET", "float16", 32 << 20, None),
    ("PUT_ASYNC", "bfloat16", 32 << 20, None), ("PUT_ASYNC", "float16", 0, None),
    # Smaller than the longest requests (12 KiB): they stream through it, each call's
    # receive ordered after the scatter of the call that used its slot before.
    ("PUT_ASYNC", "float32", 0, 10_000),
    # The same with calls that would group every layer: the pull caps them at its slot.
    ("PUT_ASYNC", "float32", 32 << 20, 10_000)])
def test_nccl_transfer_bit_exact(send_type: str, dtype: str, min_call_bytes: int,
                                 buffer: int | None) -> None:
    _two_gpus()
    specs = make_specs(110, seed=7)
    results, consumer, producer, _ = run_pair(
        send_type, specs, dtype=dtype, timeout_s=30.0, devices=("cuda:0", "cuda:1"),
        min_call_bytes=min_call_bytes,
        consumer_extra=None if buffer is None else {"kv_buffer_size": buffer})
    bad = {k: v for k, v in results.items() if v not in ("ok", "local")}
    assert not bad, bad
    transferred = sum(v == "ok" for v in results.values())
    assert_idle(consumer)
    assert producer is not None
    assert_idle(producer)
    p_stats, d_stats = producer["worker_stats"], consumer["worker_stats"]
    assert p_stats["transfers_sent"] == d_stats["transfers_received"] == transferred
    calls_per_transfer = 3 if min_call_bytes == 0 else 1
    if buffer is not None and min_call_bytes:  # streamed loads go a slot at a time
        assert transferred < p_stats["data_calls"] == d_stats["data_calls"] < 3 * transferred
    else:
        assert p_stats["data_calls"] == d_stats["data_calls"] == calls_per_transfer * transferred
    assert d_stats["recv_gpu_seconds"] > 0
    if buffer is not None:
        assert d_stats["loads_streamed"] > 0


def test_nccl_producer_killed_mid_transfer() -> None:
    _two_gpus()
    specs = make_specs(8, seed=3)
    for spec in specs:
        spec.update(prompt=list(range(1, 41)), d_hit_blocks=0, preempt_after_load=False)
    results, consumer, _, after_kill = run_pair(
        "PUT_ASYNC", specs, layer_delay_s=0.3, kill_producer_after_s=3.0, timeout_s=4.0,
        devices=("cuda:0", "cuda:1"))
    assert set(results.values()) <= {"ok", "failed"}
    assert after_kill < 4.0 + 3.0
    assert_idle(consumer)


def test_nccl_pair_rebuilt_after_producer_restart() -> None:
    """Kill P mid-transfer (D aborts the pair), restart P at the same address: the pair is
    rebuilt on first contact and the new transfers are bit-exact.

    The deadline leaves room for the new process's first NCCL init (seconds): all 40 of its
    transfers are queued at once behind that init.
    """
    _two_gpus()
    specs = make_specs(8, seed=11)
    for spec in specs:
        spec.update(prompt=list(range(1, 41)), d_hit_blocks=0, preempt_after_load=False)
    again = make_specs(40, seed=12)
    results, consumer, producer, _ = run_pair(
        "PUT_ASYNC", specs, layer_delay_s=0.3, kill_producer_after_s=3.0, timeout_s=15.0,
        devices=("cuda:0", "cuda:1"), after_restart=again)
    assert {results[s["request_id"]] for s in again} <= {"ok", "local"}
    assert "ok" in {results[s["request_id"]] for s in again}
    assert_idle(consumer)
    assert producer is not None
    assert_idle(producer)


def test_nccl_pair_rebuilt_after_consumer_restart() -> None:
    """Kill D while its pair with P is idle (healthy as far as P can tell) and start a new D
    at the same address: P sees the new epoch in D's first pull, aborts the old communicator
    and sends a new NcclHello before its next send; the new transfers are bit-exact. (Before
    the fix P kept sending on the old communicator, whose rank 1 was gone, and the new D,
    which had no pair, failed each load at its deadline.)

    The deadline leaves room for the new process's first NCCL init (seconds): all 40 of its
    transfers are queued at once behind that init.
    """
    _two_gpus()
    first, again = make_specs(8, seed=21), make_specs(40, seed=22)
    results, consumer, producer = run_consumer_restart(
        "PUT_ASYNC", first, again, timeout_s=15.0, dtype="bfloat16", devices=("cuda:0", "cuda:1"))
    assert set(results.values()) <= {"ok", "local"}, results
    assert "ok" in {results[s["request_id"]] for s in first}
    assert "ok" in {results[s["request_id"]] for s in again}
    assert_idle(consumer)
    assert_idle(producer)
    p_stats = producer["worker_stats"]
    assert p_stats["consumer_restarts"] == 1 and p_stats["sends_failed"] == 0
    assert p_stats["transfers_sent"] == sum(v == "ok" for v in results.values())
