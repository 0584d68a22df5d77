"""Small all-reduces for TP decode: NCCL against a one-shot all-reduce over peer memory.

A TP=2 decode step of Llama-3.1-70B runs 160 all-reduces of ``[batch, 8192]`` bf16 (two a
layer); NCCL takes ~12 us each inside a CUDA graph at batch 1, ~9% of the step. This script
measures, inside CUDA graphs on two GPUs of one host, NCCL's all-reduce against torch's
symmetric-memory ``one_shot_all_reduce_out`` (each rank reads every peer's buffer over
NVLink; no multicast) and ``two_shot_all_reduce_``, checks they sum the same, and prints a
table. Run: ``python3 -m experiments.small_allreduce [--rows 1,8,32,64,256] [--hidden 8192]``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPEATS = 100


def _graph_time_us(step, repeats: int = REPEATS) -> float:
    """Mean time of one ``step()`` replayed ``repeats`` times inside one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            step()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / repeats)
    return sorted(times)[len(times) // 2]


def _rank_main(rank: int, size: int, init: str, rows: list[int], hidden: int,
               out_path: str) -> None:
    import torch.distributed._symmetric_memory as symm_mem

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=size,
                            device_id=device)
    group = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group)
    results = {}
    for n in rows:
        x = torch.randn(n, hidden, device=device, dtype=torch.bfloat16) * (rank + 1)
        gathered = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(gathered, x)
        expected = torch.stack([g.float() for g in gathered]).sum(0)

        nccl_buf = x.clone()
        nccl_us = _graph_time_us(lambda b=nccl_buf: dist.all_reduce(b))

        symm = symm_mem.empty(n, hidden, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(symm, group)
        out = torch.empty_like(x)

        def one_shot(symm=symm, x=x, out=out):
            symm.copy_(x)
            torch.ops.symm_mem.one_shot_all_reduce_out(symm, "sum", group, out)

        one_us = _graph_time_us(one_shot)
        symm.copy_(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(symm, "sum", group, out)
        one_err = (out.float() - expected).abs().max().item()

        def two_shot(symm=symm, x=x):
            symm.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_(symm, "sum", group)

        try:
            two_us = _graph_time_us(two_shot)
            symm.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_(symm, "sum", group)
            two_err = (symm.float() - expected).abs().max().item()
        except Exception as error:  # an op this torch lacks is a result, not a crash
            two_us, two_err = None, repr(error)[:120]
        nccl_buf.copy_(x)
        dist.all_reduce(nccl_buf)
        results[n] = {"bytes": x.numel() * 2, "nccl_us": nccl_us, "one_shot_us": one_us,
                      "two_shot_us": two_us, "nccl_err": (nccl_buf.float() - expected).abs()
                      .max().item(), "one_shot_err": one_err, "two_shot_err": two_err}
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump({"size": size, "hidden": hidden, "torch": torch.__version__,
                       "rows": results}, handle, indent=1)
        for n, r in results.items():
            two = "-" if r["two_shot_us"] is None else f"{r['two_shot_us']:.1f}"
            print(f"rows {n:5d} ({r['bytes'] / 1024:8.0f} KiB): nccl {r['nccl_us']:7.1f} us, "
                  f"one-shot {r['one_shot_us']:7.1f} us, two-shot {two} us; max |err| "
                  f"nccl {r['nccl_err']:.3g} one-shot {r['one_shot_err']:.3g} "
                  f"two-shot {r['two_shot_err']}")
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,64,256")
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--out", default="small_allreduce.json")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    port = 29500 + os.getpid() % 1000
    mp.spawn(_rank_main, args=(args.size, f"tcp://127.0.0.1:{port}", rows, args.hidden,
                               args.out), nprocs=args.size)


if __name__ == "__main__":
    main()
