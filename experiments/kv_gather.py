"""KV gather and scatter for the connector, one GPU: how a request's blocks of many layers
become one contiguous send buffer (producer) and land back in the paged cache (consumer).

Why: the two-GPU transfer run (docs/PERFORMANCE.md, KV transfer) lost most of its time on
the host: 36 ``after_layer`` hooks of ~0.1 ms, each an ``index_select`` per layer. This
measures, for Qwen3-8B KV geometry (36 layers, 8 KV heads, head dim 128, bf16, block 16):

per_layer     one ``index_select`` per layer on a per-layer cache (block-major wire layout):
              what the connector did before the caches were one allocation
index_select  one ``index_select`` over all layers of the stacked ``[L, 2, blocks, ...]``
              cache (kv-major wire layout), and one ``index_copy_`` to scatter
kernel        the connector's ``gather_layers``/``scatter_layers`` (the Triton chunk copy of
              ``engine_core/kernels/kv_blocks.py``)
copy          a plain contiguous copy of the same bytes (the limit: each byte read and written)

``gb_per_s`` counts each byte moved once.

GPU time (CUDA events, median of ``--iters``) and host time to issue, per request size.

    source .device/env.sh && python3 -m experiments.kv_gather --out /tmp/kv_gather.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine_core.worker.block_copy import gather_layers, scatter_layers, stack_layers
from engine_core.worker.kv_cache import KVCacheShape, allocate_kv_caches

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 36, 16, 8, 128


def timed(fn: Callable[[], object], iters: int) -> tuple[float, float]:
    """(median GPU ms, median host ms to issue) of ``fn`` over ``iters`` runs after a warm-up."""
    fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return statistics.median(gpu), statistics.median(host)


def measure_size(stacked: torch.Tensor, separate: list[torch.Tensor], ids: torch.Tensor,
                 iters: int) -> dict[str, Any]:
    """Every variant for one request of ``len(ids)`` blocks."""
    num_blocks, device = len(ids), stacked.device
    nbytes = NUM_LAYERS * 2 * num_blocks * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2
    block_major = torch.empty((NUM_LAYERS, num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM),
                              dtype=torch.bfloat16, device=device)
    kv_major = torch.empty((NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM),
                           dtype=torch.bfloat16, device=device)
    flat_src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)

    def per_layer_gather() -> None:
        for layer in range(NUM_LAYERS):
            torch.index_select(separate[layer].transpose(0, 1), 0, ids, out=block_major[layer])

    def per_layer_scatter() -> None:
        for layer in range(NUM_LAYERS):
            separate[layer].transpose(0, 1).index_copy_(0, ids, block_major[layer])

    words, out_words = stacked.view(torch.int16), kv_major.view(torch.int16)
    variants = {
        "per_layer_gather": per_layer_gather,
        "per_layer_scatter": per_layer_scatter,
        "index_select_gather": lambda: torch.index_select(words, 2, ids, out=out_words),
        "index_copy_scatter": lambda: words.index_copy_(2, ids, out_words),
        "kernel_gather": lambda: gather_layers(stacked, 0, NUM_LAYERS, ids, out=kv_major),
        "kernel_scatter": lambda: scatter_layers(stacked, ids, kv_major),
        "copy": lambda: kv_major.view(-1).copy_(flat_src),
    }
    out: dict[str, Any] = {"bytes": nbytes, "blocks": num_blocks}
    for name, fn in variants.items():
        gpu_ms, host_ms = timed(fn, iters)
        out[name] = {"gpu_ms": round(gpu_ms, 4), "host_ms": round(host_ms, 4),
                     "gb_per_s": round(nbytes / gpu_ms / 1e6, 1)}
    # The stacked path is exact: its gather equals plain indexing, and scattering a buffer
    # then gathering it back returns the same bytes.
    gather_layers(stacked, 0, NUM_LAYERS, ids, out=kv_major)
    assert torch.equal(kv_major, stacked[:, :, ids]), "stacked gather differs from indexing"
    probe = torch.randn_like(kv_major)
    scatter_layers(stacked, ids, probe)
    assert torch.equal(gather_layers(stacked, 0, NUM_LAYERS, ids, out=kv_major), probe)
    return out


def measure(num_blocks_list: list[int], iters: int, cache_blocks: int) -> dict[str, Any]:
    shape = KVCacheShape(NUM_LAYERS, cache_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                         torch.bfloat16)
    stacked = stack_layers(allocate_kv_caches(shape, "cuda"))
    stacked.normal_()
    separate = [torch.randn(2, cache_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                            dtype=torch.bfloat16, device="cuda") for _ in range(NUM_LAYERS)]
    gen = torch.Generator().manual_seed(0)
    rows: dict[str, Any] = {}
    for num_blocks in num_blocks_list:
        ids = torch.randperm(cache_blocks, generator=gen)[:num_blocks].to("cuda")
        rows[str(num_blocks)] = measure_size(stacked, separate, ids, iters)
        print(json.dumps(rows[str(num_blocks)]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 7, 28, 128, 512])
    parser.add_argument("--cache-blocks", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"),
               "geometry": {"layers": NUM_LAYERS, "block_size": BLOCK_SIZE,
                            "kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
               "sizes": measure(args.blocks, args.iters, args.cache_blocks)}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
