"""The one-shot all-reduce over peer memory: which tensors it takes, and on two GPUs that it
sums exactly what NCCL sums, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from engine_core.parallel.peer_all_reduce import PeerAllReduce


def test_accepts_small_dense_float_tensors_only() -> None:
    peer = PeerAllReduce(torch.empty(1024, dtype=torch.uint8), "unused")
    assert peer.accepts(torch.empty(2, 256, dtype=torch.bfloat16))  # 1024 bytes: the limit
    assert peer.accepts(torch.empty(4, 64, dtype=torch.float32))
    assert not peer.accepts(torch.empty(2, 257, dtype=torch.bfloat16))  # past the buffer
    assert not peer.accepts(torch.empty(4, 4, dtype=torch.float16))
    assert not peer.accepts(torch.empty(8, 8, dtype=torch.float32).t())  # not contiguous
    assert not peer.accepts(torch.empty(3, dtype=torch.bfloat16))  # not a 16-byte multiple
    assert not peer.accepts(torch.empty(0, dtype=torch.float32))


def _rank(rank: int, init: str, queue) -> None:
    import torch.distributed as dist

    from engine_core.config import ParallelConfig
    from engine_core.parallel.group import TensorParallelGroup

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    group = TensorParallelGroup.start(
        ParallelConfig(tensor_parallel_size=2, rank=rank, distributed_init_method=init), device)
    failures = [] if group.uses_peer_memory else ["peer memory was not mapped"]
    generator = torch.Generator(device=device).manual_seed(rank)
    for shape, dtype in (((1, 8192), torch.bfloat16), ((64, 8192), torch.bfloat16),
                         ((3, 4096), torch.float32)):
        x = torch.randn(shape, generator=generator, device=device, dtype=dtype)
        expected = x.clone()
        dist.all_reduce(expected)
        eager = group.all_reduce(x.clone())
        chained = x.clone()  # a graph of several all-reduces reusing the one buffer
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            group.all_reduce(chained.clone())
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(3):
                    group.all_reduce(chained)
                    chained.mul_(0.5)
        chained.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        reference = x.clone()
        for _ in range(3):
            dist.all_reduce(reference)
            reference.mul_(0.5)
        for name, got, want in (("eager", eager, expected), ("graph", chained, reference)):
            if not torch.equal(got, want):
                failures.append(f"{name} {tuple(shape)} {dtype}: max diff "
                                f"{(got.float() - want.float()).abs().max().item()}")
    queue.put((rank, failures))
    dist.barrier()


@pytest.mark.gpu
def test_peer_all_reduce_equals_nccl_on_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from engine_core.parallel.group import free_init_method

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    init = free_init_method()
    procs = [context.Process(target=_rank, args=(rank, init, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=180) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    assert results == {0: [], 1: []}
