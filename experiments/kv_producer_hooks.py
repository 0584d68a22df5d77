"""The KV producer's host side on ONE GPU: hook cost and the hand-off gap to the send.

Why: in the two-GPU transfer run (docs/PERFORMANCE.md, KV transfer) the producer's
``bind_step`` + 36 ``after_layer`` + ``wait_for_save`` took 3.4-5 ms of host time per
request and each send started ~0.2 ms after its data was ready: host time, not the link.
Both can be measured without a second GPU: here the connector's NCCL transport is replaced
by a stand-in that turns each data call into a device-to-device copy of the call's bytes on
its own stream (after the call's gather event, like ``ncclSend``), and the consumer is a
control socket that takes the header and drops it. Everything else is the real producer:
pull request over ZMQ, ``CallSlots``/sender thread, gathers, events, the GIL at the engine's
switch interval.

Per request size (whole blocks of Qwen3-8B KV, 2.25 MiB a block) and per emulated layer
compute (``torch.cuda._sleep`` between hooks; 0 = host-bound, as in the two-GPU benchmark):
hooks_ms    host time of bind_step + every after_layer + wait_for_save
tail_ms     GPU time from the end of the last layer's compute to the end of the last
            data call (gathers after it, hand-off to the sender thread, the copy)
e2e_ms      GPU time from just before bind_step to the end of the last data call (with
            0 us a layer the GPU waits on the host, so this is the host-bound latency)
copy_ms     the data calls' own GPU time (the stand-in's share of tail_ms)
gap_ms      tail_ms - copy_ms - the gather time after the last layer: how late the last
            data call started after its data was ready (host hand-off)

Uses only interfaces that predate the kv-major rewrite, so the same file measures an older
checkout (``--label``) in the same device call.

    source .device/env.sh && python3 -m experiments.kv_producer_hooks --out /tmp/hooks.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.kv_transfer import sleep_cycles_per_us

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 36, 16, 8, 128
BYTES_PER_BLOCK = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2


class DeviceCopyTransport:
    """Stands in for the NCCL pair: a data call is a copy of its bytes on the pair stream."""

    name = "device-copy"
    uses_data_messages = False

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.device = device
        self.data_calls = 0
        self.calls: list[tuple[Any, Any]] = []  # (start, end) timing events per data call
        self._sink = torch.empty(0, dtype=torch.uint8, device=device)

    def open_pair(self, client: Any, peer_address: str, deadline: float) -> None:
        return None

    def send_call(self, client: Any, header: Any, first_layer: int, buffer: torch.Tensor,
                  event: Any, deadline: float) -> None:
        nbytes = buffer.numel() * buffer.element_size()
        with torch.cuda.stream(self.stream):
            if event is not None:
                self.stream.wait_event(event)
            if self._sink.numel() < nbytes:
                self._sink = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record(self.stream)
            buffer.record_stream(self.stream)
            self._sink[:nbytes].copy_(buffer.reshape(-1).view(torch.uint8))
            end.record(self.stream)
        self.calls.append((start, end))
        self.data_calls += 1

    def finish_sends(self, peer_address: str, deadline: float) -> None:
        self.stream.synchronize()

    @contextlib.contextmanager
    def gather_context(self, peer_address: str, event: Any) -> Iterator[None]:
        with torch.cuda.stream(self.stream):
            if event is not None:
                self.stream.wait_event(event)
            yield

    def on_hello(self, hello: Any) -> None:
        return None

    def abort(self, peer_address: str) -> None:
        return None

    def close(self) -> None:
        return None


def run(sizes_blocks: list[int], layer_us: list[float], trials: int,
        switch_intervals: list[float]) -> dict[str, Any]:
    from connectors.p2p_nccl.connector_worker import P2pConnectorWorker
    from connectors.p2p_nccl.handshake import ControlClient, ControlServer
    from connectors.p2p_nccl.messages import KVPullRequest, make_codec
    from connectors.p2p_nccl.metadata import P2pConnectorMetadata, SaveSpec
    from deploy.launch import free_port
    from engine_core.config import KVTransferConfig
    from engine_core.engine_process import CONNECTOR_SWITCH_INTERVAL_S
    from engine_core.worker.kv_cache import KVCacheShape, allocate_kv_caches

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    transport = DeviceCopyTransport(device)
    config = KVTransferConfig(kv_role="kv_producer", kv_port=free_port(), kv_buffer_size=8e9,
                              send_type="PUT_ASYNC")
    worker = P2pConnectorWorker(config, str(device), transport=transport)
    caches = allocate_kv_caches(KVCacheShape(NUM_LAYERS, max(sizes_blocks) + 8, BLOCK_SIZE,
                                             NUM_KV_HEADS, HEAD_DIM, torch.bfloat16), str(device))
    for cache in caches:
        cache.normal_()
    worker.register_kv_caches(caches)
    consumer_address = f"127.0.0.1:{free_port()}"
    consumer = ControlServer(consumer_address, make_codec(), lambda message, frames: None)
    consumer.start()
    pull_client = ControlClient(worker.address, make_codec(), send_timeout_s=1.0)
    cycles_per_us = sleep_cycles_per_us()
    results: dict[str, Any] = {}
    try:
        for interval in switch_intervals or [CONNECTOR_SWITCH_INTERVAL_S]:
            sys.setswitchinterval(interval)
            for us in layer_us:
                for blocks in sizes_blocks:
                    hooks, tails, copies, gaps, gathers, e2e = [], [], [], [], [], []
                    for trial in range(trials + 1):  # trial 0 warms up: not counted
                        tid = f"hooks-{interval}-{us}-{blocks}-{trial}"
                        pull_client.send(KVPullRequest(
                            transfer_id=tid, consumer_address=consumer_address, first_block=0,
                            num_blocks=blocks, num_layers=NUM_LAYERS, dtype="bfloat16",
                            block_shape=[BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM], timeout_s=30.0))
                        deadline = time.monotonic() + 5
                        while worker.stats()["pull_requests_waiting"] < 1:
                            if time.monotonic() > deadline:
                                raise RuntimeError("pull request never arrived")
                            time.sleep(0.001)
                        meta = P2pConnectorMetadata(saves=[SaveSpec(
                            "r", tid, consumer_address, list(range(blocks)), blocks * BLOCK_SIZE)])
                        transport.calls.clear()
                        torch.cuda.synchronize()
                        step_start = torch.cuda.Event(enable_timing=True)
                        layers_done = torch.cuda.Event(enable_timing=True)
                        hooks_end = torch.cuda.Event(enable_timing=True)
                        step_start.record()
                        t0 = time.perf_counter()
                        worker.bind_step(meta, None)
                        for layer, cache in enumerate(caches):
                            if us > 0:
                                torch.cuda._sleep(int(us * cycles_per_us))
                            if layer == NUM_LAYERS - 1:
                                layers_done.record()
                            worker.after_layer(layer, cache)
                        hooks_end.record()
                        worker.wait_for_save()
                        hooks_s = time.perf_counter() - t0
                        deadline = time.monotonic() + 30
                        while not worker.get_finished().sending:
                            if time.monotonic() > deadline:
                                raise RuntimeError("send never finished")
                            time.sleep(0.0002)
                        torch.cuda.synchronize()
                        if trial == 0:
                            continue
                        last_start, last_end = transport.calls[-1]
                        copy_ms = sum(start.elapsed_time(end) for start, end in transport.calls)
                        gather_ms = layers_done.elapsed_time(hooks_end)
                        tail_ms = layers_done.elapsed_time(last_end)
                        hooks.append(hooks_s * 1e3)
                        e2e.append(step_start.elapsed_time(last_end))
                        tails.append(tail_ms)
                        copies.append(copy_ms)
                        gathers.append(gather_ms)
                        gaps.append(layers_done.elapsed_time(last_start) - gather_ms)
                    row = {"blocks": blocks, "bytes": blocks * BYTES_PER_BLOCK, "layer_us": us,
                           "switch_interval_s": interval,
                           "data_calls": len(transport.calls),
                           "hooks_ms": round(statistics.median(hooks), 4),
                           "tail_ms": round(statistics.median(tails), 4),
                           "e2e_ms": round(statistics.median(e2e), 4),
                           "copy_ms": round(statistics.median(copies), 4),
                           "gather_after_last_layer_ms": round(statistics.median(gathers), 4),
                           "gap_ms": round(statistics.median(gaps), 4)}
                    results[f"{interval}s/{us}us/{blocks}"] = row
                    print(json.dumps(row), flush=True)
    finally:
        pull_client.close()
        consumer.stop()
        worker.shutdown()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 7, 28, 114])
    parser.add_argument("--layer-us", type=float, nargs="+", default=[0.0, 200.0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--switch-intervals", type=float, nargs="*", default=[],
                        help="sys.setswitchinterval values (default: the engine's)")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "label": args.label,
               "rows": run(args.blocks, args.layer_us, args.trials, args.switch_intervals)}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
