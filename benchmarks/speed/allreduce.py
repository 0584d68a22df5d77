"""All-reduce time between the GPUs of a tensor-parallel group, for the decode roofline.

A TP decode step runs two all-reduces of ``[batch, hidden]`` per layer; its roofline is the
per-GPU bytes over the copy rate plus those all-reduces. Each size is timed inside a CUDA
graph (as the engine replays them) and eagerly, in separate processes that form their own
NCCL group, before the engine under test starts.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine_core.parallel.group import free_init_method

OPS_PER_GRAPH = 20


def _time_rank(rank: int, size: int, init: str, rows: list[int], hidden: int, iters: int,
               queue: Any) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=size,
                            device_id=device)
    out: dict[int, dict[str, float]] = {}
    try:
        for count in rows:
            tensor = torch.randn(count, hidden, device=device, dtype=torch.bfloat16)
            for _ in range(5):
                dist.all_reduce(tensor)
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(tensor)
            torch.cuda.synchronize()
            eager_us = (time.perf_counter() - t0) / iters * 1e6
            stream = torch.cuda.Stream()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                dist.all_reduce(tensor)  # warm the stream's communicator path
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, stream=stream):
                    for _ in range(OPS_PER_GRAPH):
                        dist.all_reduce(tensor)
            torch.cuda.synchronize()
            replays = max(1, iters // OPS_PER_GRAPH)
            graph.replay()
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
            graphed_us = (time.perf_counter() - t0) / (replays * OPS_PER_GRAPH) * 1e6
            out[count] = {"eager_us": eager_us, "graphed_us": graphed_us,
                          "bytes": count * hidden * 2}
            del graph
    finally:
        if rank == 0:
            queue.put(out)
        dist.barrier()
        dist.destroy_process_group()


def measure_allreduce(size: int, rows: list[int], hidden: int, iters: int = 200
                      ) -> dict[str, Any]:
    """Mean microseconds of one bf16 all-reduce of ``[r, hidden]`` over ``size`` GPUs."""
    if torch.cuda.device_count() < size:
        raise RuntimeError(f"all-reduce over {size} GPUs needs {size}; "
                           f"{torch.cuda.device_count()} visible")
    context = mp.get_context("spawn")
    queue = context.Queue()
    init = free_init_method()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    procs = [context.Process(target=_time_rank,
                             args=(rank, size, init, rows, hidden, iters, queue))
             for rank in range(size)]
    for proc in procs:
        proc.start()
    try:
        result = queue.get(timeout=300)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return {"size": size, "hidden": hidden, "rows": {str(k): v for k, v in result.items()}}
