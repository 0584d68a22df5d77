"""KV transfer bandwidth: the P2P connector against raw NCCL send/recv, same run, two GPUs.

Producer on cuda:0, consumer on cuda:1, KV geometry of Qwen3-8B (36 layers, 8 KV heads,
head dim 128, bfloat16, block size 16: 2.25 MiB per block over all layers). For each
request size (rounded to whole blocks; the exact bytes are reported) it measures:

raw        one ncclSend/ncclRecv of the request's bytes, GPU-timed on the receiver from
           the end of a 1-byte rendezvous transfer to the end of the big one (no host or
           launch skew); median of ``--raw-iters``. ``raw_stream_gbps``: the same message
           size sent back to back (the link's steady state). ``raw_idle_gbps``: one send
           issued by the host to idle GPUs (the receive already posted), timed on the
           sender from the event before the send: what one request's transfer can reach.
connector  one request through the connector (PUT_ASYNC): pull request, header, gathers of
           every layer into the staging buffer, the data calls, scatter into the consumer's
           paged cache. ``e2e``: wall time from the producer's ``bind_step`` to the consumer
           reporting the request landed (includes the ZMQ header and the consumer's poll).
           ``data``: the consumer's GPU time from posting its receives to their completion
           (``recv_gpu_seconds``, includes waiting for the producer's data), and
           ``data``: the producer's GPU time from its first send (data gathered, receives
           already posted) to the last send's end (``send_gpu_seconds``): the part raw
           NCCL is the limit of.

``tail``: wall time from the end of the producer's last layer (its GPU event, waited on by
the host) to the consumer reporting the request landed: what a request's TTFT pays for the
transfer after its prefill. ``--layer-us`` gives each layer GPU work (``torch.cuda._sleep``)
before its hook, as a prefill has: with it the header round trip and the consumer's receive
posting happen while the producer computes, as in serving; with 0 (host-bound) they race the
data, and ``data`` includes the wait for the receive. With several data calls and compute,
``data`` spans the compute between the calls: read ``tail`` there.

Each (``--switch-intervals``, ``--min-call-bytes``, ``--layer-us``) combination runs in a
fresh producer/consumer pair (min call bytes 0 = one NCCL call per layer). Prints JSON and
writes it to ``--out`` (default ``results/kv_transfer/<time>.json``).

    source .device/env.sh && python3 -m benchmarks.kv_transfer --out results/kv_transfer.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch

from benchmarks.output import default_out, write_json
from deploy.launch import free_port

NUM_LAYERS = 36
BLOCK_SIZE = 16
NUM_KV_HEADS = 8
HEAD_DIM = 128
BYTES_PER_BLOCK = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2  # bf16


def blocks_for(size_mb: float) -> int:
    """Whole blocks closest to ``size_mb`` MiB of KV (at least one)."""
    return max(1, round(size_mb * (1 << 20) / BYTES_PER_BLOCK))


def sleep_cycles_per_us() -> float:
    """``torch.cuda._sleep`` cycles per microsecond, measured (clocks vary with the part)."""
    cycles = 2_000_000
    torch.cuda._sleep(cycles)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def _raw(rank: int, uid_queue: Any, out: Any, sizes: list[int], iters: int) -> None:
    import cupy
    from cupy.cuda import nccl

    from connectors.p2p_nccl.transport import _new_communicator, unique_id_to_bytes

    torch.cuda.set_device(rank)
    if rank == 0:
        uid = unique_id_to_bytes(nccl.get_unique_id())
        uid_queue.put(uid)
    else:
        uid = uid_queue.get()
    with cupy.cuda.Device(rank):
        comm = _new_communicator(uid, rank)
    stream = torch.cuda.Stream()
    tick = torch.zeros(1, dtype=torch.uint8, device=f"cuda:{rank}")

    def op(buf: torch.Tensor) -> None:
        if rank == 0:
            comm.send(buf.data_ptr(), buf.numel(), nccl.NCCL_UINT8, 1, stream.cuda_stream)
        else:
            comm.recv(buf.data_ptr(), buf.numel(), nccl.NCCL_UINT8, 0, stream.cuda_stream)

    for nbytes in sizes:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{rank}")
        single: list[float] = []
        with torch.cuda.stream(stream):
            for i in range(iters + 2):
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                op(tick)  # rendezvous: both ranks are here
                start.record(stream)
                op(buf)
                end.record(stream)
                stream.synchronize()
                if i >= 2:
                    single.append(start.elapsed_time(end) / 1e3)
            # Idle: as one request's transfer happens. The receive is posted first, the GPUs
            # go idle, then the sender's host issues the send; timed on the sender from the
            # event before the send to its end (the connector's data figure, same span).
            idle: list[float] = []
            for i in range(iters + 2):
                op(tick)
                stream.synchronize()
                if rank == 1:
                    op(buf)
                    stream.synchronize()
                    continue
                time.sleep(0.002)
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record(stream)
                op(buf)
                end.record(stream)
                stream.synchronize()
                if i >= 2:
                    idle.append(start.elapsed_time(end) / 1e3)
            if rank == 0:
                out.put(("raw_idle", nbytes, nbytes / statistics.median(idle) / 1e9, 0.0))
            repeats = max(8, min(200, math.ceil((2 << 30) / nbytes)))
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            op(tick)
            start.record(stream)
            for _ in range(repeats):
                op(buf)
            end.record(stream)
            stream.synchronize()
        if rank == 1:
            out.put(("raw", nbytes, nbytes / statistics.median(single) / 1e9,
                     nbytes * repeats / (start.elapsed_time(end) / 1e3) / 1e9))
        del buf
    comm.destroy()


def _connector(role: str, port: int, peer_port: int, inbox: Any, out: Any, sizes: list[int],
               trials: int, min_call_bytes: int, switch_interval: float,
               layer_us: float, smoke: bool) -> None:
    import sys

    from connectors import create_connector
    from connectors.p2p_nccl.metadata import LoadSpec, P2pConnectorMetadata, SaveSpec
    from engine_core.cluster.grants import GrantAuthority
    from engine_core.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
    from engine_core.worker.kv_cache import KVCacheShape, allocate_kv_caches

    sys.setswitchinterval(switch_interval)
    device = "cpu" if smoke else ("cuda:0" if role == "kv_producer" else "cuda:1")
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
    config = EngineConfig(
        model=ModelConfig(model="bench"), cache=CacheConfig(block_size=BLOCK_SIZE),
        kv_transfer=KVTransferConfig(kv_role=role, kv_port=port, kv_buffer_size=8e9,
                                     send_type="PUT_ASYNC", min_call_bytes=min_call_bytes))
    _, worker = create_connector(config, device)
    num_blocks = max(sizes) + 8
    caches = allocate_kv_caches(KVCacheShape(NUM_LAYERS, num_blocks, BLOCK_SIZE, NUM_KV_HEADS,
                                             HEAD_DIM, torch.bfloat16), device)
    for cache in caches:
        cache.normal_()
    worker.register_kv_caches(caches)
    peer = f"127.0.0.1:{peer_port}"
    grants = GrantAuthority(config.kv_transfer.cluster_secret)  # as the proxy would issue
    cycles = 0
    if role == "kv_producer" and layer_us > 0 and cuda:
        cycles = int(layer_us * sleep_cycles_per_us())
    try:
        for blocks in sizes:
            block_ids = list(range(blocks))
            tokens = blocks * BLOCK_SIZE
            for trial in range(trials + 1):  # trial 0 opens the pair: not timed
                tid = f"bench-{blocks}-{trial}"
                if role == "kv_consumer":
                    before = worker.stats()
                    grant = grants.issue(tid, peer, f"127.0.0.1:{port}", 3600.0)
                    meta = P2pConnectorMetadata(
                        loads=[LoadSpec("r", tid, peer, block_ids, 0, tokens, grant)])
                    worker.start_load_kv(meta)
                    inbox.put(("pulled", tid))
                    while True:
                        worker.start_load_kv(None)
                        finished = worker.get_finished()
                        if finished.recving or finished.failed_recving:
                            break
                        time.sleep(0.00005)
                    sync()
                    done = time.monotonic()
                    after = worker.stats()
                    out.put(("done", blocks, trial, done, bool(finished.recving),
                             after["recv_gpu_seconds"] - before["recv_gpu_seconds"],
                             after["data_calls"] - before["data_calls"]))
                else:
                    assert inbox.get(timeout=120)[1] == tid
                    time.sleep(0.2)  # the pull request lands first, as when D asks early
                    meta = P2pConnectorMetadata(saves=[SaveSpec("r", tid, peer, block_ids, tokens)])
                    sync()
                    before = worker.stats()
                    start = time.monotonic()
                    worker.start_load_kv(meta)
                    worker.bind_step(meta, None)
                    computed = torch.cuda.Event() if cuda else None
                    computed_at = 0.0
                    for layer, cache in enumerate(caches):
                        if cycles:
                            torch.cuda._sleep(cycles)  # this layer's prefill compute
                        elif not cuda and layer_us > 0:
                            time.sleep(layer_us / 1e6)  # smoke: the host computes
                        if layer == len(caches) - 1:  # its compute ends here
                            if computed is not None:
                                computed.record()  # read once the GPU gets there
                            else:
                                computed_at = time.monotonic()
                        worker.after_layer(layer, cache)
                    worker.wait_for_save()
                    hooks_done = time.monotonic()
                    out.put(("start", blocks, trial, start))
                    if computed is not None:
                        computed.synchronize()
                        computed_at = time.monotonic()
                    out.put(("computed", blocks, trial, computed_at))
                    while not worker.get_finished().sending:
                        time.sleep(0.0002)
                    sent = time.monotonic()
                    after = worker.stats()
                    out.put(("sent", blocks, trial, hooks_done - start, sent - start,
                             after["send_gpu_seconds"] - before["send_gpu_seconds"]))
        # The producer stops only after the consumer has everything: a CPU-transport send is
        # done once ZMQ holds the bytes, and closing the socket drops what it still queues.
        if role == "kv_consumer":
            inbox.put(("finished", None))
        else:
            assert inbox.get(timeout=120)[0] == "finished"
        out.put(("stats", role, worker.stats()))
    finally:
        worker.shutdown()


def _process_context(smoke: bool) -> Any:
    """Spawned processes on GPUs (CUDA cannot be forked); on CPU (``--smoke``) each pair is
    forked from a server that imported this module once, not spawned to import torch again."""
    if not smoke:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["benchmarks.kv_transfer"])
    return ctx


def run_raw(ctx: Any, sizes_bytes: list[int], iters: int) -> dict[int, tuple[float, float, float]]:
    out, uid_queue = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_raw, args=(r, uid_queue, out, sizes_bytes, iters)) for r in (0, 1)]
    for p in procs:
        p.start()
    raw: dict[int, tuple[float, float]] = {}
    idle: dict[int, float] = {}
    while len(raw) < len(sizes_bytes) or len(idle) < len(sizes_bytes):
        kind, nbytes, single, streamed = out.get(timeout=300)
        if kind == "raw_idle":
            idle[nbytes] = single
        else:
            raw[nbytes] = (single, streamed, idle.get(nbytes, 0.0))
    raw = {n: (v[0], v[1], idle[n]) for n, v in raw.items()}
    for p in procs:
        p.join(60)
    return raw


def run_connector(ctx: Any, sizes_blocks: list[int], trials: int, min_call_bytes: int,
                  switch_interval: float, layer_us: float, smoke: bool = False
                  ) -> dict[str, Any]:
    out, handoff = ctx.Queue(), ctx.Queue()
    p_port, d_port = free_port(), free_port()
    procs = [ctx.Process(target=_connector, args=("kv_consumer", d_port, p_port, handoff, out,
                                                  sizes_blocks, trials, min_call_bytes,
                                                  switch_interval, layer_us, smoke)),
             ctx.Process(target=_connector, args=("kv_producer", p_port, d_port, handoff, out,
                                                  sizes_blocks, trials, min_call_bytes,
                                                  switch_interval, layer_us, smoke))]
    for p in procs:
        p.start()
    starts: dict[tuple[int, int], float] = {}
    computed: dict[tuple[int, int], float] = {}
    done: dict[tuple[int, int], tuple[float, bool, float, float]] = {}
    sent: dict[tuple[int, int], tuple[float, float, float]] = {}
    stats: dict[str, Any] = {}
    expected = len(sizes_blocks) * (trials + 1)
    while (len(done) < expected or len(sent) < expected or len(computed) < expected
           or len(stats) < 2):
        item = out.get(timeout=300)
        if item[0] == "start":
            starts[(item[1], item[2])] = item[3]
        elif item[0] == "computed":
            computed[(item[1], item[2])] = item[3]
        elif item[0] == "sent":
            sent[(item[1], item[2])] = tuple(item[3:])
        elif item[0] == "done":
            done[(item[1], item[2])] = tuple(item[3:])
        else:
            stats[item[1]] = item[2]
    for p in procs:
        p.join(60)
    result: dict[str, Any] = {}
    def gbps(nbytes: int, seconds: list[float]) -> float | None:
        median = statistics.median(seconds)
        return round(nbytes / median / 1e9, 1) if median > 0 else None  # CPU: no GPU time

    for blocks in sizes_blocks:
        nbytes = blocks * BYTES_PER_BLOCK
        e2e, tail, data, recv, hooks, send_wall, calls, failed = [], [], [], [], [], [], [], 0
        for trial in range(1, trials + 1):
            end, ok, recv_s, n_calls = done[(blocks, trial)]
            hooks_s, sent_s, send_gpu_s = sent[(blocks, trial)]
            if not ok:
                failed += 1
                continue
            e2e.append(end - starts[(blocks, trial)])
            tail.append(end - computed[(blocks, trial)])
            data.append(send_gpu_s)
            recv.append(recv_s)
            hooks.append(hooks_s)
            send_wall.append(sent_s)
            calls.append(n_calls)

        def ms(values: list[float]) -> float:
            return round(statistics.median(values) * 1e3, 4)

        result[str(nbytes)] = {
            "e2e_ms_median": ms(e2e),
            "e2e_gbps": gbps(nbytes, e2e),
            "tail_ms_median": ms(tail),
            "data_ms_median": ms(data),
            "data_gbps": gbps(nbytes, data),
            "consumer_recv_ms_median": ms(recv),
            "producer_hooks_ms_median": ms(hooks),
            "producer_send_done_ms_median": ms(send_wall),
            "nccl_calls_per_request": statistics.median(calls),
            "failed": failed,
        }
    result["stats"] = stats
    return result


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _ratio(value: float | None, limit: float | None) -> float | None:
    return round(value / limit, 3) if value and limit else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--min-call-bytes", type=int, nargs="+", default=[0, 32 << 20])
    parser.add_argument("--raw-iters", type=int, default=10)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--switch-intervals", type=float, nargs="+", default=[0.005],
                        help="sys.setswitchinterval values to run the connector under")
    parser.add_argument("--layer-us", type=float, nargs="+", default=[0.0],
                        help="GPU busy time (torch.cuda._sleep) before each layer's hook on "
                             "the producer: a prefill's compute; 0 = host-bound")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU engines and the CPU transport, no raw NCCL: checks the "
                             "benchmark itself (the numbers mean nothing)")
    parser.add_argument("--out", default=None, help="results JSON (default results/kv_transfer/<time>.json)")
    args = parser.parse_args(argv)
    ctx = _process_context(args.smoke)
    blocks = [blocks_for(s) for s in args.sizes_mb]
    sizes_bytes = [b * BYTES_PER_BLOCK for b in blocks]
    raw = ({n: (None, None, None) for n in sizes_bytes} if args.smoke
           else run_raw(ctx, sizes_bytes, args.raw_iters))
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(0) + " x2",
        "geometry": {"layers": NUM_LAYERS, "block_size": BLOCK_SIZE, "kv_heads": NUM_KV_HEADS,
                     "head_dim": HEAD_DIM, "dtype": "bfloat16", "bytes_per_block": BYTES_PER_BLOCK},
        "sizes": [{"requested_mb": mb, "blocks": b, "bytes": n, "mib": round(n / (1 << 20), 2),
                   "raw_gbps": _round(raw[n][0]), "raw_stream_gbps": _round(raw[n][1]),
                   "raw_idle_gbps": _round(raw[n][2])}
                  for mb, b, n in zip(args.sizes_mb, blocks, sizes_bytes)],
        "connector": {},
    }
    configs = [(si, mc, us) for si in args.switch_intervals for mc in args.min_call_bytes
               for us in args.layer_us]
    for switch_interval, min_call, layer_us in configs:
        measured = run_connector(ctx, blocks, args.trials, min_call, switch_interval,
                                 layer_us, args.smoke)
        for row in result["sizes"]:
            entry = measured[str(row["bytes"])]
            entry["data_vs_raw"] = _ratio(entry["data_gbps"], row["raw_gbps"])
            entry["e2e_vs_raw"] = _ratio(entry["e2e_gbps"], row["raw_gbps"])
            entry["data_vs_raw_idle"] = _ratio(entry["data_gbps"], row["raw_idle_gbps"])
        key = f"min_call_bytes={min_call},switch_interval={switch_interval},layer_us={layer_us:g}"
        result["connector"][key] = measured
    print(json.dumps(result, indent=2))
    print(f"results in {write_json(args.out or default_out('kv_transfer'), result)}")


if __name__ == "__main__":
    main()
