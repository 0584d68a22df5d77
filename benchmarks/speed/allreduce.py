"""All-reduce time between the GPUs of a tensor-parallel group, for the decode roofline.

A TP decode step runs two all-reduces of ``[batch, hidden]`` per layer; its roofline is the
per-GPU bytes over the copy rate plus those all-reduces. Each size is timed inside a CUDA
graph (as the engine replays them) and eagerly, through the engine's own path
(``TensorParallelGroup.all_reduce``: peer memory for small tensors unless
``--disable-custom-all-reduce``, else NCCL), in separate processes that form their own group
before the engine under test starts.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine_core.config import ParallelConfig
from engine_core.parallel.group import TensorParallelGroup, free_init_method

OPS_PER_GRAPH = 20


def _time_rank(rank: int, size: int, init: str, rows: list[int], hidden: int, iters: int,
               nccl_only: bool, queue: Any) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    group = TensorParallelGroup.start(
        ParallelConfig(tensor_parallel_size=size, rank=rank, distributed_init_method=init,
                       disable_custom_all_reduce=nccl_only), device)
    out: dict[int, dict[str, float]] = {}
    try:
        for count in rows:
            tensor = torch.randn(count, hidden, device=device, dtype=torch.bfloat16)
            for _ in range(5):
                group.all_reduce(tensor)
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                group.all_reduce(tensor)
            torch.cuda.synchronize()
            eager_us = (time.perf_counter() - t0) / iters * 1e6
            stream = torch.cuda.Stream()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                group.all_reduce(tensor)  # warm the path on this stream
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, stream=stream):
                    for _ in range(OPS_PER_GRAPH):
                        group.all_reduce(tensor)
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


def measure_allreduce(size: int, rows: list[int], hidden: int, iters: int = 200,
                      nccl_only: bool = False) -> dict[str, Any]:
    """Mean microseconds of one bf16 all-reduce of ``[r, hidden]`` over ``size`` GPUs, the
    way the engine runs it (``nccl_only``: ``--disable-custom-all-reduce``)."""
    if torch.cuda.device_count() < size:
        raise RuntimeError(f"all-reduce over {size} GPUs needs {size}; "
                           f"{torch.cuda.device_count()} visible")
    context = mp.get_context("spawn")
    queue = context.Queue()
    init = free_init_method()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    procs = [context.Process(target=_time_rank,
                             args=(rank, size, init, rows, hidden, iters, nccl_only, queue))
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
    return {"size": size, "hidden": hidden, "nccl_only": nccl_only,
            "rows": {str(k): v for k, v in result.items()}}
