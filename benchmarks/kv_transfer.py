"""Raw NCCL send/recv GB/s vs the connector's effective GB/s for one request's KV.

Two processes on two GPUs (producer cuda:0, consumer cuda:1). For each size (1, 16, 64,
256 MB of KV per request) it measures (a) raw: one ncclSend/ncclRecv of that many bytes on
a fresh 2-rank communicator, (b) connector: gather + per-layer send + receive + scatter
through the P2P connector (PUT_ASYNC), timed from the producer's after_layer of layer 0 to
the consumer's finished_recving. Prints JSON. UNTESTED ON GPU at the time of writing.

    source .device/env.sh && python3 benchmarks/kv_transfer.py --sizes-mb 1 16 64 256
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from typing import Any

import torch

from deploy.launch import free_port

NUM_LAYERS = 32
BLOCK_SIZE = 16
NUM_HEADS = 8
HEAD_DIM = 128


def _blocks_for(size_mb: int) -> int:
    per_block = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_HEADS * HEAD_DIM * 2  # bf16
    return max(1, size_mb * (1 << 20) // per_block)


def _raw(rank: int, uid_queue: Any, out: Any, sizes: list[int], iters: int) -> None:
    import cupy
    from cupy.cuda import nccl

    torch.cuda.set_device(rank)
    if rank == 0:
        uid = nccl.get_unique_id()
        uid_queue.put(uid)
    else:
        uid = uid_queue.get()
    with cupy.cuda.Device(rank):
        comm = nccl.NcclCommunicator(2, uid, rank)
    stream = torch.cuda.Stream()
    for size_mb in sizes:
        nbytes = size_mb << 20
        buf = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{rank}")
        timings = []
        for i in range(iters + 2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            if rank == 0:
                comm.send(buf.data_ptr(), nbytes, nccl.NCCL_UINT8, 1, stream.cuda_stream)
            else:
                comm.recv(buf.data_ptr(), nbytes, nccl.NCCL_UINT8, 0, stream.cuda_stream)
            stream.synchronize()
            if i >= 2:
                timings.append(time.perf_counter() - start)
        if rank == 1:
            out.put(("raw", size_mb, nbytes / min(timings) / 1e9))
    comm.destroy()


def _connector(role: str, port: int, peer_port: int, inbox: Any, out: Any, sizes: list[int]) -> None:
    from connectors import create_connector
    from connectors.p2p_nccl.metadata import LoadSpec, P2pConnectorMetadata, SaveSpec
    from engine_core.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig

    device = "cuda:0" if role == "kv_producer" else "cuda:1"
    torch.cuda.set_device(device)
    config = EngineConfig(model=ModelConfig(model="bench"), cache=CacheConfig(block_size=BLOCK_SIZE),
                          kv_transfer=KVTransferConfig(kv_role=role, kv_port=port,
                                                       kv_buffer_size=8e9, send_type="PUT_ASYNC"))
    _, worker = create_connector(config, device)
    num_blocks = _blocks_for(max(sizes)) + 8
    caches = [torch.randn(2, num_blocks, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, device=device,
                          dtype=torch.bfloat16) for _ in range(NUM_LAYERS)]
    worker.register_kv_caches(caches)
    peer = f"127.0.0.1:{peer_port}"
    try:
        for size_mb in sizes:
            blocks = list(range(_blocks_for(size_mb)))
            for trial in range(4):
                tid = f"bench-{size_mb}-{trial}"
                if role == "kv_consumer":
                    meta = P2pConnectorMetadata(loads=[LoadSpec("r", tid, peer, blocks, 0, len(blocks) * BLOCK_SIZE)])
                    worker.start_load_kv(meta)
                    inbox.put(("pulled", tid))
                    while True:
                        worker.start_load_kv(None)
                        finished = worker.get_finished()
                        if finished.recving or finished.failed_recving:
                            break
                    torch.cuda.synchronize()
                    out.put(("done", size_mb, trial, time.time(), bool(finished.recving)))
                else:
                    assert inbox.get(timeout=60)[0] == "pulled"
                    time.sleep(0.2)  # let the pull request land
                    meta = P2pConnectorMetadata(saves=[SaveSpec("r", tid, peer, blocks, len(blocks) * BLOCK_SIZE)])
                    worker.start_load_kv(meta)
                    torch.cuda.synchronize()
                    out.put(("start", size_mb, trial, time.time()))
                    worker.bind_step(meta, None)
                    for layer, cache in enumerate(caches):
                        worker.after_layer(layer, cache)
                    worker.wait_for_save()
                    while not worker.get_finished().sending:
                        time.sleep(0.0005)
        out.put(("stats", role, worker.stats()))
    finally:
        worker.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out, uid_queue = ctx.Queue(), ctx.Queue()
    raw = [ctx.Process(target=_raw, args=(r, uid_queue, out, args.sizes_mb, args.iters)) for r in (0, 1)]
    for p in raw:
        p.start()
    for p in raw:
        p.join(300)
    result: dict[str, Any] = {"sizes_mb": args.sizes_mb, "raw_gbps": {}, "connector_gbps": {}}
    while not out.empty():
        kind, size_mb, gbps = out.get()
        result["raw_gbps"][size_mb] = round(gbps, 1)
    p_port, d_port = free_port(), free_port()
    handoff = ctx.Queue()
    procs = [ctx.Process(target=_connector, args=("kv_consumer", d_port, p_port, handoff, out, args.sizes_mb)),
             ctx.Process(target=_connector, args=("kv_producer", p_port, d_port, handoff, out, args.sizes_mb))]
    for p in procs:
        p.start()
    starts: dict[tuple[int, int], float] = {}
    best: dict[int, float] = {}
    result["stats"] = {}
    pending = len(args.sizes_mb) * 4
    while pending or len(result["stats"]) < 2:
        item = out.get(timeout=300)
        if item[0] == "start":
            starts[(item[1], item[2])] = item[3]
        elif item[0] == "done":
            pending -= 1
            size_mb, trial, end, ok = item[1:]
            if ok and (size_mb, trial) in starts and trial > 0:
                nbytes = _blocks_for(size_mb) * NUM_LAYERS * 2 * BLOCK_SIZE * NUM_HEADS * HEAD_DIM * 2
                best[size_mb] = max(best.get(size_mb, 0.0), nbytes / (end - starts[(size_mb, trial)]) / 1e9)
        elif item[0] == "stats":
            result["stats"][item[1]] = item[2]
    for p in procs:
        p.join(60)
    result["connector_gbps"] = {k: round(v, 1) for k, v in best.items()}
    result["ratio"] = {k: round(best[k] / result["raw_gbps"][k], 3)
                       for k in best if result["raw_gbps"].get(k)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
