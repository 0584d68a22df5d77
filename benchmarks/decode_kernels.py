"""Decode-step kernels timed as a CUDA graph replays them: GEMV (cuBLAS vs Triton) and
split-KV decode attention over tile choices, and a graph of whole Qwen3-8B layers.

Why: inside a decode graph a kernel costs its GPU time plus no launch overhead, so timing
a Python loop of launches would measure the launcher. Each case here captures ``--reps``
calls into one graph and reports the replay time per call. The GEMV cases are the
projections of Qwen3-8B and Qwen3-0.6B (fused qkv, o, fused gate/up, down) at 1-16 rows,
each captured call reading a different copy of the weight (``rotating``: a real step reads
every weight once, so no call may find its weight in L2); the attention cases batches of
1, 64 and 256 sequences (``--attn-cases``, BATCHxCONTEXT) with each model's heads, in the
benchmark engine's block-table width; the layer case (``--parts layer``) 36 Qwen3-8B
layers at batch 1 with the GEMV tiling rule and without it.

    python3 -m benchmarks.decode_kernels --out /tmp/decode_kernels.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

# (model, projection, N, K): weight [N, K]
GEMV_SHAPES = [
    ("qwen3-8b", "qkv", 6144, 4096), ("qwen3-8b", "o", 4096, 4096),
    ("qwen3-8b", "gate_up", 24576, 4096), ("qwen3-8b", "down", 4096, 12288),
    ("qwen3-0.6b", "qkv", 4096, 1024), ("qwen3-0.6b", "o", 1024, 2048),
    ("qwen3-0.6b", "gate_up", 6144, 1024), ("qwen3-0.6b", "down", 1024, 3072),
]
# (BLOCK_N, BLOCK_K, warps, stages)
GEMV_SWEEP = [(bn, bk, w, s) for bn, bk, w, s in itertools.product(
    (16, 32, 64), (128, 256, 512), (4,), (3, 4))] + [(16, 256, 2, 4), (32, 256, 8, 4)]
# (model, q heads, kv heads)
ATTN_SHAPES = [("qwen3-8b", 32, 8), ("qwen3-0.6b", 16, 8)]
# (splits, BLOCK_N, stages, warps); None: the kernel's own choice.
ATTN_CONFIGS = [(None, None, None, 4)] + [
    (splits, bn, stages, w) for splits, bn, stages, w in itertools.product(
        (None, 8), (16, 32, 64), (1, 2, 3), (2, 4))]


def graph_us(fn: Callable[[], object], reps: int, trials: int = 5) -> float:
    """Median over ``trials`` of one replay of ``reps`` captured calls, per call, in us."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


# Distinct copies of a weight cycled through by the captured calls, at least this many
# bytes in all: twice the H200's 50 MB L2, so no call finds its weight cached (a decode
# step reads every weight once).
ROTATION_BYTES = 100 << 20


def rotating(make: Callable[[], torch.Tensor], nbytes: int, reps: int) -> Callable[[], torch.Tensor]:
    """A function returning the next of enough distinct tensors from ``make``."""
    pool = [make() for _ in range(max(2, min(reps, -(-ROTATION_BYTES // nbytes))))]
    counter = itertools.count()
    return lambda: pool[next(counter) % len(pool)]


def gemv_cases(rows_list: list[int], reps: int) -> list[dict[str, Any]]:
    from engine_core.kernels.gemv import GemvTiling, choose_tiling, gemv

    out = []
    for (model, name, n, k), rows in itertools.product(GEMV_SHAPES, rows_list):
        nbytes = n * k * 2
        weight = rotating(lambda n=n, k=k: torch.randn(n, k, dtype=torch.bfloat16,
                                                        device="cuda") / k ** 0.5, nbytes, reps)
        x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        case: dict[str, Any] = {"model": model, "proj": name, "n": n, "k": k, "rows": rows,
                                "weight_bytes": nbytes}
        case["cublas_us"] = graph_us(lambda x=x, w=weight: F.linear(x, w()), reps)
        case["triton_default_tiles"] = list(choose_tiling(n, k))
        case["triton_default_us"] = graph_us(lambda x=x, w=weight: gemv(x, w()), reps)
        if rows == 1:
            sweep = {}
            for tiles in GEMV_SWEEP:
                t = GemvTiling(*tiles)
                try:
                    sweep[str(tuple(t))] = graph_us(
                        lambda x=x, w=weight, t=t: gemv(x, w(), tiling=t), reps)
                except triton.runtime.errors.OutOfResources:  # too much shared memory
                    continue
            best = min(sweep, key=sweep.get)
            case["triton_sweep_us"] = sweep
            case["triton_best"] = {"tiles": best, "us": sweep[best]}
        case["cublas_tb_per_s"] = nbytes / case["cublas_us"] / 1e6
        case["triton_default_tb_per_s"] = nbytes / case["triton_default_us"] / 1e6
        out.append(case)
        print(f"gemv {model:10} {name:8} m{rows:<2} cublas {case['cublas_us']:7.2f} us "
              f"triton {case['triton_default_us']:7.2f} us"
              + (f" best {case['triton_best']['us']:7.2f} us {case['triton_best']['tiles']}"
                 if "triton_best" in case else ""), flush=True)
        del weight, x
        torch.cuda.empty_cache()
    return out


LAYER_VARIANTS = ("shape tilings, Triton gate/up", "one tiling, cuBLAS gate/up")


def layer_cases(num_layers: int) -> list[dict[str, Any]]:
    """Qwen3-8B decoder layers at batch 1, context 1k, as a graph of ``num_layers`` layers
    with distinct weights and caches (norm, qkv, decode attention, o, norm, gate/up, SiLU,
    down; RoPE and the KV write left out), with the GEMV tilings ``choose_tiling`` picks
    per shape and the Triton GEMV for gate/up (what ``Linear`` does), and with one tiling
    for all and cuBLAS for gate/up (before). us per layer."""
    from engine_core.kernels.gemv import NARROW_TILING, gemv
    from engine_core.kernels.paged_decode import paged_decode_attention
    from engine_core.kernels.rms_norm import rms_norm
    from engine_core.kernels.silu_mul import silu_and_mul

    hidden, inter, hq, hkv, d, context, block_size = 4096, 12288, 32, 8, 128, 1024, 16
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    layers = []
    for _ in range(num_layers):
        layers.append({
            "qkv": torch.randn((hq + 2 * hkv) * d, hidden, **bf16) / hidden ** 0.5,
            "o": torch.randn(hidden, hq * d, **bf16) / hidden ** 0.5,
            "gate_up": torch.randn(2 * inter, hidden, **bf16) / hidden ** 0.5,
            "down": torch.randn(hidden, inter, **bf16) / inter ** 0.5,
            "cache": torch.randn(2, context // block_size, block_size, hkv, d, **bf16),
            "norm1": torch.rand(hidden, **bf16) + 0.5, "norm2": torch.rand(hidden, **bf16) + 0.5})
    tables = torch.arange(context // block_size, dtype=torch.int32, device="cuda")[None]
    seq_lens = torch.full((1,), context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(2, dtype=torch.int32, device="cuda")
    x = torch.randn(1, hidden, **bf16)
    residual = torch.randn(1, hidden, **bf16)
    q = torch.randn(1, hq, d, **bf16)
    attn_out = torch.empty_like(q)
    out = []
    for variant in LAYER_VARIANTS:
        per_shape = variant.startswith("shape")

        def forward(per_shape: bool = per_shape) -> None:
            tiling = None if per_shape else NARROW_TILING
            h, r = x, residual
            for layer in layers:
                normed, r = rms_norm(h, layer["norm1"], 1e-6, r)
                gemv(normed, layer["qkv"], tiling=tiling)
                paged_decode_attention(q, layer["cache"][0], layer["cache"][1], attn_out,
                                       tables, seq_lens, qsl, 0.088)
                h = gemv(attn_out.view(1, hq * d), layer["o"], tiling=tiling)
                normed, r = rms_norm(h, layer["norm2"], 1e-6, r)
                if per_shape:
                    gate_up = gemv(normed, layer["gate_up"])
                else:
                    gate_up = F.linear(normed, layer["gate_up"])
                h = gemv(silu_and_mul(gate_up), layer["down"], tiling=tiling)

        us = graph_us(forward, 1) / num_layers
        out.append({"variant": variant, "us_per_layer": us, "layers": num_layers})
        print(f"layer {variant:32} {us:7.2f} us/layer", flush=True)
    return out


def attention_cases(cases: list[tuple[int, int]], reps: int) -> list[dict[str, Any]]:
    return [attention_case(model, hq, hkv, batch, context, reps)
            for batch, context in cases for model, hq, hkv in ATTN_SHAPES]


def attention_case(model: str, hq: int, hkv: int, batch: int, context: int,
                   reps: int) -> dict[str, Any]:
    from engine_core.kernels.paged_decode import choose_num_splits, paged_decode_attention

    block_size, width = 16, 10240 // 16  # the benchmark engine's block-table width
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq + 8
    cache = torch.randn(2, num_blocks, block_size, hkv, 128, dtype=torch.bfloat16,
                        device="cuda")
    q = torch.randn(batch, hq, 128, dtype=torch.bfloat16, device="cuda")
    out_t = torch.empty_like(q)
    tables = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
    order = torch.randperm(num_blocks, device="cuda")[:batch * per_seq].to(torch.int32)
    tables[:, :per_seq] = order.view(batch, per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    default_splits = choose_num_splits(batch, hkv, width, block_size, q.device)
    results = {}
    for splits, block_n, stages, warps in ATTN_CONFIGS:
        def run(s=splits, bn=block_n, st=stages, w=warps):
            paged_decode_attention(q, cache[0], cache[1], out_t, tables, seq_lens, qsl,
                                   0.088, num_splits=s, block_n=bn, num_warps=w,
                                   num_stages=st)
        key = "default" if block_n is None else str((splits or default_splits, block_n,
                                                      stages, warps))
        try:
            results[key] = graph_us(run, reps)
        except Exception as exc:  # a tiling over the shared-memory limit: skip it
            print(f"attn {key}: {type(exc).__name__}", flush=True)
    best = min(results, key=results.get)
    print(f"attn {model:10} b{batch} ctx{context}: default {results['default']:.2f}; "
          + ", ".join(f"{k} {v:.2f}" for k, v in
                      sorted(results.items(), key=lambda kv: kv[1])[:5]), flush=True)
    return {"model": model, "q_heads": hq, "kv_heads": hkv, "batch": batch,
            "context": context, "default_splits": default_splits, "us": results,
            "best": {"config": best, "us": results[best]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--attn-cases", default="1x1024,1x8192,64x2048,256x2048",
                        help="BATCHxCONTEXT list for the attention sweep")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--parts", default="attention,gemv,layer")
    parser.add_argument("--layers", type=int, default=36, help="layers in the layer graph")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    parts = args.parts.split(",")
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if "attention" in parts:
        cases = [tuple(int(v) for v in c.split("x")) for c in args.attn_cases.split(",")]
        results["attention"] = attention_cases(cases, args.reps)  # type: ignore[arg-type]
    if "gemv" in parts:
        results["gemv"] = gemv_cases(rows, args.reps)
    if "layer" in parts:
        results["layer"] = layer_cases(args.layers)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
