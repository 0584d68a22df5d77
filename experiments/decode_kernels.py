"""Decode-step kernels timed as a CUDA graph replays them: GEMV (cuBLAS vs Triton) and
split-KV decode attention over tile choices, and a graph of whole Qwen3-8B layers.

Why: inside a decode graph a kernel costs its GPU time plus no launch overhead, so timing
a Python loop of launches would measure the launcher. Each case here captures ``--reps``
calls into one graph and reports the replay time per call. The GEMV cases are the
projections of Qwen3-8B and Qwen3-0.6B (fused qkv, o, fused gate/up, down) at 1-16 rows,
each captured call reading a different copy of the weight (``rotating``: a real step reads
every weight once, so no call may find its weight in L2); the attention cases batches of
1, 64 and 256 sequences (``--attn-cases``, BATCHxCONTEXT) with each model's heads, in the
benchmark engine's block-table width, over a sweep of tilings (``--no-attn-sweep``: the
default only) and with the new token's norm, RoPE and KV write in the kernel; the layer
case (``--parts layer``) a graph of 36 Qwen3-8B layers at batch 1 in each of
``LAYER_VARIANTS`` (``--layer-variants``, ';'-separated): the engine's layer before and
now, and variants without a part (priced by difference) or with a candidate kernel.

    python3 -m experiments.decode_kernels --out /tmp/decode_kernels.json
    python3 -m experiments.decode_kernels --parts attention,layer --no-attn-sweep \
        --attn-cases 1x1024,64x2048,256x2048
"""

from __future__ import annotations

import argparse
import fnmatch
import itertools
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
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
    # one rank's shard at TP=2
    ("qwen3-32b/2", "qkv", 5120, 5120), ("qwen3-32b/2", "o", 5120, 4096),
    ("qwen3-32b/2", "gate_up", 25600, 5120), ("qwen3-32b/2", "down", 5120, 12800),
    ("llama-70b/2", "qkv", 5120, 8192), ("llama-70b/2", "o", 8192, 4096),
    ("llama-70b/2", "gate_up", 28672, 8192), ("llama-70b/2", "down", 8192, 14336),
]
# (BLOCK_N, BLOCK_K, warps, stages)
GEMV_SWEEP = [(bn, bk, w, s) for bn, bk, w, s in itertools.product(
    (16, 32, 64), (128, 256, 512), (4,), (3, 4))] + [(16, 256, 2, 4), (32, 256, 8, 4)]
# The RoPE decode kernel's (BLOCK_N, stages, warps) for --rope-sweep.
ROPE_CONFIGS = [(bn, st, w) for bn in (32, 64) for st in (1, 2, 3) for w in (4, 8)]
# staged_gemv's (K chunks staged, rows a program, warps)
STAGED_CONFIGS = [(12, 32, 4), (12, 32, 8), (11, 32, 4), (6, 32, 4), (10, 16, 4), (10, 16, 8),
                  (5, 16, 4), (5, 16, 2), (4, 8, 2), (2, 8, 1)]
# (model, q heads, kv heads)
ATTN_SHAPES = [("qwen3-8b", 32, 8), ("qwen3-0.6b", 16, 8),
               ("qwen3-32b/2", 32, 4), ("llama-70b/2", 32, 4)]  # one TP=2 rank's heads
# (splits, BLOCK_N, stages, warps); None: the kernel's own choice.
ATTN_CONFIGS = [(None, None, None, 4)] + [
    (splits, bn, stages, w) for splits, bn, stages, w in itertools.product(
        (None, 1, 2, 8), (16, 32, 64), (1, 2, 3), (2, 4))]


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
    from engine_core.kernels.gemv import gemv
    from engine_core.kernels.gemv_tilings import GemvTiling, choose_tiling

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


# SplitKGemvTiling candidates (columns a program, K rows a program, K chunk, warps, stages)
# for --parts gemv_t.
GEMV_T_CONFIGS = ((128, 1024, 64, 4, 4), (64, 2048, 64, 4, 4), (256, 512, 64, 8, 4),
                  (128, 2048, 64, 4, 4), (128, 512, 64, 4, 4), (128, 1024, 32, 4, 4),
                  (64, 1024, 128, 4, 4), (256, 1024, 32, 8, 4))


def gemv_t_cases(rows_list: list[int], reps: int) -> list[dict[str, Any]]:
    """Qwen3-8B's down projection at ``rows_list`` rows: the Triton GEMV over ``[H, I]``
    (the plain layout) and cuBLAS over both layouts against ``split_k_gemv_t`` over the
    transposed ``[I, H]`` at each ``GEMV_T_CONFIGS`` tiling, its float32 accumulator
    cleared by a memset in the timed loop (the engine clears it in the norm); distinct
    weight copies. us per call."""
    from engine_core.kernels.gemv import gemv
    from engine_core.kernels.split_k_mlp import SplitKGemvTiling, split_k_gemv_t

    hidden, inter = 4096, 12288
    nbytes = hidden * inter * 2
    plain = rotating(lambda: torch.randn(hidden, inter, dtype=torch.bfloat16, device="cuda")
                     / inter ** 0.5, nbytes, reps)
    stored_t = rotating(lambda: torch.randn(inter, hidden, dtype=torch.bfloat16,
                                            device="cuda") / inter ** 0.5, nbytes, reps)
    out = []
    for rows in rows_list:
        x = torch.randn(rows, inter, dtype=torch.bfloat16, device="cuda")
        acc = torch.zeros(rows, hidden, dtype=torch.float32, device="cuda")
        case: dict[str, Any] = {"rows": rows, "weight_bytes": nbytes}
        case["gemv_us"] = graph_us(lambda x=x: gemv(x, plain()), reps)
        case["cublas_us"] = graph_us(lambda x=x: F.linear(x, plain()), reps)
        case["cublas_transposed_us"] = graph_us(lambda x=x: F.linear(x, stored_t().t()), reps)
        case["memset_us"] = graph_us(lambda a=acc: a.zero_(), reps)
        sweep = {}
        for config in GEMV_T_CONFIGS:
            t = SplitKGemvTiling(*config)
            sweep[str(config)] = graph_us(
                lambda x=x, a=acc, t=t: split_k_gemv_t(x, stored_t(), a.zero_(), t), reps)
        case["split_k_t_us"] = sweep
        out.append(case)
        best = min(sweep, key=sweep.get)
        print(f"down m{rows:<2} gemv {case['gemv_us']:6.2f} cublas {case['cublas_us']:6.2f} "
              f"cublas [I, H] {case['cublas_transposed_us']:6.2f} memset "
              f"{case['memset_us']:5.2f} split-K [I, H] best {sweep[best]:6.2f} {best}; "
              + ", ".join(f"{k} {v:.2f}" for k, v in sweep.items()), flush=True)
    return out


def staged_cases(reps: int) -> list[dict[str, Any]]:
    """The staged GEMV (weights into shared memory before the PDL wait) at one row over
    distinct weight copies, each call PDL-chained to the last, against ``gemv``: Qwen3-8B's
    o and qkv projections, in ``STAGED_CONFIGS``."""
    from engine_core.kernels.gemv import gemv
    from experiments.staged_gemv import staged_gemv

    out = []
    for name, n, k in (("o", 4096, 4096), ("qkv", 6144, 4096)):
        weight = rotating(lambda n=n, k=k: torch.randn(n, k, dtype=torch.bfloat16,
                                                        device="cuda") / k ** 0.5, n * k * 2, reps)
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        case: dict[str, Any] = {"proj": name, "n": n, "k": k,
                                "gemv_us": graph_us(lambda x=x, w=weight: gemv(x, w()), reps)}
        for chunks, rows, warps in STAGED_CONFIGS:
            case[str((chunks, rows, warps))] = graph_us(
                lambda x=x, w=weight, c=chunks, r=rows, nw=warps: staged_gemv(
                    x, w(), staged_chunks=c, block_n=r, num_warps=nw), reps)
        out.append(case)
        print(f"staged {name}: " + ", ".join(f"{key} {value:.2f}" for key, value in case.items()
                                             if key.endswith("us") or key.startswith("(")),
              flush=True)
        del weight, x
        torch.cuda.empty_cache()
    return out


def gemv_l2_cases(reps: int) -> list[dict[str, Any]]:
    """Each projection at one row with its weight read cold (distinct copies, as a decode
    step reads them) and hot (one copy, called again and again: as far as it fits, from
    L2): how much faster a GEMV whose weight is already in L2 would be, i.e. the most that
    pulling a weight into L2 ahead of its GEMV can give."""
    from engine_core.kernels.gemv import gemv

    out = []
    for model, name, n, k in GEMV_SHAPES:
        nbytes = n * k * 2
        def make(n: int = n, k: int = k) -> torch.Tensor:
            return torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5

        cold = rotating(make, nbytes, reps)
        hot = make()
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        case = {"model": model, "proj": name, "weight_bytes": nbytes,
                "cold_us": graph_us(lambda x=x, w=cold: gemv(x, w()), reps),
                "hot_us": graph_us(lambda x=x, w=hot: gemv(x, w), reps)}
        out.append(case)
        print(f"gemv_l2 {model:10} {name:8} {nbytes / 2**20:6.1f} MiB cold "
              f"{case['cold_us']:7.2f} us hot {case['hot_us']:7.2f} us", flush=True)
        del cold, hot, x
        torch.cuda.empty_cache()
    return out


@dataclass(frozen=True)
class LayerVariant:
    """What one layer of the layer graph runs. The defaults are the engine's layer minus
    RoPE and the KV write; the switches take parts out (to price each by difference) or
    swap in a candidate kernel."""

    per_shape: bool = True  # choose_tiling and the Triton gate/up; else one tiling + cuBLAS
    attention: bool = True
    norms: bool = True
    silu: str = "kernel"  # "kernel": silu_and_mul; "fused": in gate/up's epilogue; "none"
    rope: str = "none"  # q/k norm + RoPE and the KV write: "kernels" (apply_rope, write_kv,
    # as in prefill steps) or "attention" (NewTokenRope: in the decode kernel, as in decode)
    late_trigger: str = "default"  # GEMVs letting their successor in after their loop:
    # "default" (gemv's choice: gate/up with SiLU fused), "never", "gate_up" or "all"
    splits: int | None = None  # decode-attention splits; None: choose_num_splits
    down_tiling: tuple[int, int, int, int] | None = None  # None: as the other GEMVs
    qkv_tiling: tuple[int, int, int, int] | None = None  # the same for qkv and o
    o_tiling: tuple[int, int, int, int] | None = None
    gemv_prefetch: int | None = None  # K chunks of W requested into L2 before the PDL wait
    # (None: gemv's default)
    early_kv: bool | None = None  # decode attention's first K/V tile before its PDL wait
    # (None: paged_decode_attention's choice)
    attn_launch: tuple[int, int, int] | None = None  # decode attention's (BLOCK_N, warps,
    # stages); None: its defaults
    gemv_stages: int | None = None  # pipeline stages of every GEMV (None: their tilings')
    o_staged: tuple[int, int, int] | None = None  # o by staged_gemv: (K chunks staged before
    # its wait, rows a program, warps); None: gemv
    carveout: bool = False  # every kernel prefers the most shared memory (L1 carveout), so
    # a staged GEMV's programs fit on SMs that attention's occupy
    mlp_split_k: tuple[int, int, int, int, int] | None = None  # the MLP as one split_k_mlp
    # launch with this SplitKMlpTiling (its float32 sums cleared by norm2, rounded by the
    # next norm1); None: gate/up + down GEMVs
    down_transposed: bool = False  # split_k_mlp reads down stored [I, H]
    mlp_early: bool = False  # split_k_mlp lets the next norm in once its programs start
    mlp_prefetch: int = 1  # K chunks of gate/up split_k_mlp requests into L2 before its wait


# SplitKMlpTiling candidates (intermediate columns a program, gate/up K chunk, down output
# chunk, warps, stages) for the layer variants "engine now, MLP split-K ...".
SPLIT_K_MLP_CONFIGS = ((32, 128, 256, 4, 4), (16, 256, 256, 2, 4), (32, 256, 256, 4, 4),
                       (32, 128, 512, 4, 3), (64, 128, 128, 8, 4), (32, 128, 128, 4, 4),
                       (16, 128, 256, 2, 4), (32, 128, 256, 4, 3), (32, 256, 128, 4, 4),
                       (32, 256, 256, 8, 4), (32, 128, 256, 8, 4), (32, 256, 256, 4, 3),
                       (32, 512, 256, 8, 3), (32, 256, 512, 8, 3), (64, 256, 256, 8, 3))

LAYER_VARIANTS = {
    "shape tilings, Triton gate/up": LayerVariant(),
    "one tiling, cuBLAS gate/up": LayerVariant(per_shape=False),
    "no norms": LayerVariant(norms=False),
    "no attention": LayerVariant(attention=False),
    "GEMVs only, GEMVs trigger late": LayerVariant(attention=False, norms=False, silu="none",
                                                   late_trigger="all"),
    "SiLU in gate/up's epilogue, gate/up triggers early": LayerVariant(silu="fused",
                                                                       late_trigger="never"),
    "SiLU in gate/up's epilogue": LayerVariant(silu="fused"),
    "GEMVs trigger late": LayerVariant(late_trigger="all"),
    "RoPE and KV write in attention": LayerVariant(rope="attention"),
    "engine before: RoPE, KV write, SiLU kernels": LayerVariant(rope="kernels"),
    "engine now: RoPE and KV write in attention, SiLU fused": LayerVariant(rope="attention",
                                                                           silu="fused"),
    "attention in 16 splits": LayerVariant(splits=16),
    "engine now, down at (32, 256, 4, 4)": LayerVariant(rope="attention", silu="fused",
                                                         down_tiling=(32, 256, 4, 4)),
    **{f"engine now, GEMVs prefetch {c} chunks before the wait": LayerVariant(
        rope="attention", silu="fused", gemv_prefetch=c) for c in (0, 1, 2, 4, 8)},
    "engine now, attention without early K/V": LayerVariant(rope="attention", silu="fused",
                                                            early_kv=False),
    **{f"engine now, attention at {a}": LayerVariant(rope="attention", silu="fused",
                                                     attn_launch=a)
       for a in ((32, 4, 3), (64, 4, 3), (64, 8, 3), (64, 4, 1), (64, 4, 2), (64, 8, 1),
                 (64, 8, 2), (64, 8, 4), (32, 8, 3), (128, 8, 2))},
    "engine now, attention in 8 splits": LayerVariant(rope="attention", silu="fused",
                                                      splits=8),
    **{f"engine now, qkv at {t}": LayerVariant(rope="attention", silu="fused", qkv_tiling=t)
       for t in ((16, 256, 2, 4), (16, 512, 2, 4), (32, 512, 4, 4), (64, 128, 4, 4))},
    **{f"engine now, o at {t}": LayerVariant(rope="attention", silu="fused", o_tiling=t)
       for t in ((16, 256, 2, 4), (32, 512, 4, 4))},
    **{f"engine now, GEMVs with {s} stages": LayerVariant(rope="attention", silu="fused",
                                                          gemv_stages=s) for s in (2, 3)},
    **{f"engine now, o staged {c}{', attention 4 warps' if w == 4 else ''}{cv}": LayerVariant(
        rope="attention", silu="fused", o_staged=(c, 32, 4),
        attn_launch=None if w == 8 else (64, 4, 3), carveout=bool(cv))
       for c in (4, 8, 11, 12) for w in (4, 8)
       for cv in ("", ", max shared")},
    **{f"engine now, o staged {t}": LayerVariant(rope="attention", silu="fused", o_staged=t)
       for t in STAGED_CONFIGS},
    **{f"engine now{cv}{', attention 4 warps' if w == 4 else ''}": LayerVariant(
        rope="attention", silu="fused", attn_launch=None if w == 8 else (64, 4, 3),
        carveout=bool(cv)) for w in (4, 8) for cv in ("", ", max shared")},
    **{f"engine now, MLP split-K {t}{', down stored [I, H]' if dt else ''}": LayerVariant(
        rope="attention", silu="fused", mlp_split_k=t, down_transposed=dt)
       for t in SPLIT_K_MLP_CONFIGS for dt in (False, True)},
    **{f"engine now, MLP split-K {t}, down stored [I, H], early trigger": LayerVariant(
        rope="attention", silu="fused", mlp_split_k=t, down_transposed=True, mlp_early=True)
       for t in SPLIT_K_MLP_CONFIGS[:3]},
    **{f"engine now, MLP split-K {t}, down stored [I, H], prefetch {c}": LayerVariant(
        rope="attention", silu="fused", mlp_split_k=t, down_transposed=True, mlp_prefetch=c)
       for t in SPLIT_K_MLP_CONFIGS[:3:2] for c in (0, 2)},
}


def expand_variants(spec: str) -> list[str]:
    """``LAYER_VARIANTS`` names from ';'-separated items; an item with ``*`` or ``?`` is a
    shell pattern standing for every name it matches, in table order."""
    names = []
    for item in spec.split(";"):
        if any(c in item for c in "*?"):
            matched = fnmatch.filter(LAYER_VARIANTS, item)
            assert matched, f"no layer variant matches {item!r}"
            names += matched
        else:
            names.append(item)
    return names


def set_carveout(percent: int) -> None:
    """Every compiled kernel of ``engine_core.kernels`` (and the staged GEMV) prefers ``percent`` of the unified
    L1 as shared memory (-1: the driver's default). Why: an SM runs blocks of different
    kernels side by side only in one carveout, so a kernel that needs most of the shared
    memory cannot join an SM configured for its predecessor's small needs."""
    import ctypes
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import engine_core.kernels as kernels

    cuda = ctypes.CDLL("libcuda.so.1")
    names = [f"engine_core.kernels.{info.name}" for info in pkgutil.iter_modules(kernels.__path__)]
    for name in names + ["experiments.staged_gemv"]:
        for fn in vars(importlib.import_module(name)).values():
            if not isinstance(fn, JITFunction):
                continue
            for cache, *_ in fn.device_caches.values():
                for compiled in cache.values():
                    compiled._init_handles()
                    rc = cuda.cuFuncSetAttribute(ctypes.c_void_p(compiled.function), 9,
                                                 ctypes.c_int(percent))
                    assert rc == 0, (fn, rc)


def layer_cases(num_layers: int, names: list[str]) -> list[dict[str, Any]]:
    """Qwen3-8B decoder layers at batch 1, context 1k, as a graph of ``num_layers`` layers
    with distinct weights and caches, in the variants ``names`` of ``LAYER_VARIANTS``
    (norm, qkv, [q/k norm, RoPE, KV write], decode attention, o, norm, gate/up, SiLU,
    down). us per layer; the block table is the benchmark engine's width (10k tokens), so
    the default split count is the engine's."""
    from engine_core.kernels.gemv import gemv
    from engine_core.kernels.gemv_tilings import NARROW_TILING, GemvTiling, choose_tiling
    from engine_core.kernels.kv_write import write_kv
    from engine_core.kernels.paged_decode import NewTokenRope, paged_decode_attention
    from engine_core.kernels.rms_norm import rms_norm
    from engine_core.kernels.rotary import apply_rope
    from engine_core.kernels.silu_mul import silu_and_mul
    from engine_core.kernels.split_k_mlp import SplitKMlpTiling, split_k_mlp
    from experiments.staged_gemv import staged_gemv

    hidden, inter, hq, hkv, d, context, block_size = 4096, 12288, 32, 8, 128, 1024, 16
    width = 10240 // block_size
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    layers = []
    for _ in range(num_layers):
        layers.append({
            "qkv": torch.randn((hq + 2 * hkv) * d, hidden, **bf16) / hidden ** 0.5,
            "o": torch.randn(hidden, hq * d, **bf16) / hidden ** 0.5,
            "gate_up": torch.randn(2 * inter, hidden, **bf16) / hidden ** 0.5,
            "down": torch.randn(hidden, inter, **bf16) / inter ** 0.5,
            "cache": torch.randn(2, context // block_size + 1, block_size, hkv, d, **bf16),
            "norm1": torch.rand(hidden, **bf16) + 0.5, "norm2": torch.rand(hidden, **bf16) + 0.5,
            "q_norm": torch.rand(d, **bf16) + 0.5, "k_norm": torch.rand(d, **bf16) + 0.5})
    tables = torch.zeros(1, width, dtype=torch.int32, device="cuda")
    tables[0, :context // block_size + 1] = torch.arange(context // block_size + 1)
    seq_lens = torch.full((1,), context, dtype=torch.int32, device="cuda")
    slots = torch.full((1,), context - 1, dtype=torch.int64, device="cuda")
    qsl = torch.arange(2, dtype=torch.int32, device="cuda")
    x = torch.randn(1, hidden, **bf16)
    residual = torch.randn(1, hidden, **bf16)
    cos = torch.rand(1, 1, d, **bf16)
    sin = torch.rand(1, 1, d, **bf16)
    q_fixed = torch.randn(1, hq, d, **bf16)
    mlp_acc = torch.empty(1, hidden, dtype=torch.float32, device="cuda")
    if any(LAYER_VARIANTS[name].down_transposed for name in names):
        for layer in layers:
            layer["down_t"] = layer["down"].t().contiguous()
    out = []
    for name in names:
        v = LAYER_VARIANTS[name]

        def forward(v: LayerVariant = v) -> None:
            tiling = None if v.per_shape else NARROW_TILING

            def staged(w: torch.Tensor, given: GemvTiling | None) -> GemvTiling | None:
                if v.gemv_stages is None:
                    return given
                return (given or choose_tiling(*w.shape))._replace(num_stages=v.gemv_stages)

            late_all = v.late_trigger == "all"
            # None: gemv's own choice (late with the SiLU epilogue, else early).
            gate_up_early = {"default": None, "never": True}.get(v.late_trigger, False)
            h, r = x, residual
            attn_out = torch.empty_like(q_fixed)
            for layer in layers:
                normed, r = rms_norm(h, layer["norm1"], 1e-6, r) if v.norms else (h, r)
                pf = v.gemv_prefetch
                qkv_tiling = GemvTiling(*v.qkv_tiling) if v.qkv_tiling else tiling
                qkv = gemv(normed, layer["qkv"], tiling=staged(layer["qkv"], qkv_tiling),
                           early_dependents=not late_all, prefetch_chunks=pf)
                q, rope = q_fixed, None
                attn_launch = ({} if v.attn_launch is None else dict(
                    zip(("block_n", "num_warps", "num_stages"), v.attn_launch)))
                if v.rope != "none":
                    q, k_, v_ = (t.view(1, -1, d) for t in
                                 qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
                    if v.rope == "kernels":
                        q, k_ = apply_rope(q, k_, cos, sin, layer["q_norm"], layer["k_norm"],
                                           1e-6)
                        write_kv(k_, v_, layer["cache"], slots)
                    else:
                        rope = NewTokenRope(k_, v_, cos, sin, slots, layer["q_norm"],
                                            layer["k_norm"], 1e-6)
                if v.attention:
                    attn_out = torch.empty(q.shape, **bf16)
                    paged_decode_attention(q, layer["cache"][0], layer["cache"][1], attn_out,
                                           tables, seq_lens, qsl, 0.088, num_splits=v.splits,
                                           rope=rope, early_kv=v.early_kv,
                                           **attn_launch)
                o_tiling = GemvTiling(*v.o_tiling) if v.o_tiling else tiling
                if v.o_staged is not None:
                    chunks, rows, warps = v.o_staged
                    h = staged_gemv(attn_out.view(1, hq * d), layer["o"], staged_chunks=chunks,
                                    block_n=rows, num_warps=warps)
                else:
                    h = gemv(attn_out.view(1, hq * d), layer["o"],
                             tiling=staged(layer["o"], o_tiling),
                             early_dependents=not late_all, prefetch_chunks=pf)
                if v.mlp_split_k is not None:
                    normed, r = rms_norm(h, layer["norm2"], 1e-6, r, clear=mlp_acc)
                    down = layer["down_t"] if v.down_transposed else layer["down"]
                    h = split_k_mlp(normed, layer["gate_up"], down, mlp_acc,
                                    SplitKMlpTiling(*v.mlp_split_k),
                                    down_transposed=v.down_transposed,
                                    prefetch_chunks=v.mlp_prefetch,
                                    early_dependents=v.mlp_early)
                    continue
                normed, r = rms_norm(h, layer["norm2"], 1e-6, r) if v.norms else (h, r)
                if v.silu == "fused":
                    act = gemv(normed, layer["gate_up"], silu_mul=True,
                               tiling=staged(layer["gate_up"], None),
                               early_dependents=gate_up_early, prefetch_chunks=pf)
                else:
                    gate_up = (gemv(normed, layer["gate_up"], early_dependents=gate_up_early)
                               if v.per_shape else F.linear(normed, layer["gate_up"]))
                    act = silu_and_mul(gate_up) if v.silu == "kernel" else gate_up[:, :inter]
                down_tiling = GemvTiling(*v.down_tiling) if v.down_tiling else tiling
                h = gemv(act, layer["down"], tiling=staged(layer["down"], down_tiling),
                         early_dependents=not late_all,
                         prefetch_chunks=pf)

        forward()
        set_carveout(100 if v.carveout else -1)
        us = graph_us(forward, 1) / num_layers
        out.append({"variant": name, "us_per_layer": us, "layers": num_layers,
                    "options": asdict(v)})
        print(f"layer {name:40} {us:7.2f} us/layer", flush=True)
    return out


def attention_cases(cases: list[tuple[int, int]], reps: int, sweep: bool,
                    rope_sweep: bool = False) -> list[dict[str, Any]]:
    return [attention_case(model, hq, hkv, batch, context, reps, sweep, rope_sweep)
            for batch, context in cases for model, hq, hkv in ATTN_SHAPES]


def attention_case(model: str, hq: int, hkv: int, batch: int, context: int,
                   reps: int, sweep: bool, rope_sweep: bool = False) -> dict[str, Any]:
    """The decode kernel's default tiling against the ``ATTN_CONFIGS`` sweep (``sweep``),
    and the default tiling finishing q/k norm, RoPE and the KV write itself
    (``NewTokenRope``, as decode steps run it: "rope in kernel"), over ``ROPE_CONFIGS``
    too with ``rope_sweep``."""
    from engine_core.kernels.paged_decode import (
        NewTokenRope,
        choose_num_splits,
        paged_decode_attention,
    )

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
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    rope = NewTokenRope(torch.randn(batch, hkv, 128, **bf16), torch.randn(batch, hkv, 128, **bf16),
                        torch.rand(batch, 1, 128, **bf16), torch.rand(batch, 1, 128, **bf16),
                        (tables[:, per_seq - 1].long() * block_size + (context - 1) % block_size),
                        torch.rand(128, **bf16) + 0.5, torch.rand(128, **bf16) + 0.5)
    results = {}
    configs = ATTN_CONFIGS if sweep else ATTN_CONFIGS[:1]
    for splits, block_n, stages, warps in configs:
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
    results["rope in kernel"] = graph_us(lambda: paged_decode_attention(
        q, cache[0], cache[1], out_t, tables, seq_lens, qsl, 0.088, rope=rope), reps)
    for block_n, stages, warps in ROPE_CONFIGS if rope_sweep else []:
        results[f"rope in kernel at {(block_n, stages, warps)}"] = graph_us(
            lambda bn=block_n, st=stages, w=warps: paged_decode_attention(
                q, cache[0], cache[1], out_t, tables, seq_lens, qsl, 0.088, rope=rope,
                block_n=bn, num_stages=st, num_warps=w), reps)
    results["rope in kernel, 4 warps"] = graph_us(lambda: paged_decode_attention(
        q, cache[0], cache[1], out_t, tables, seq_lens, qsl, 0.088, rope=rope, num_warps=4),
        reps)
    results["rope in kernel, no early K/V"] = graph_us(lambda: paged_decode_attention(
        q, cache[0], cache[1], out_t, tables, seq_lens, qsl, 0.088, rope=rope,
        early_kv=False), reps)
    best = min(results, key=results.get)
    print(f"attn {model:10} b{batch} ctx{context}: default {results['default']:.2f}, "
          f"rope in kernel {results['rope in kernel']:.2f}; "
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
    parser.add_argument("--attn-sweep", action=argparse.BooleanOptionalAction, default=True,
                        help="time every ATTN_CONFIGS tiling, not just the default")
    parser.add_argument("--rope-sweep", action="store_true",
                        help="time the RoPE decode kernel at every ROPE_CONFIGS launch too")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--parts", default="attention,gemv,layer")
    parser.add_argument("--layers", type=int, default=36, help="layers in the layer graph")
    parser.add_argument("--layer-variants", default=";".join(LAYER_VARIANTS),
                        help="names of LAYER_VARIANTS to time, separated by ';'")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    parts = args.parts.split(",")
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if "attention" in parts:
        cases = [tuple(int(v) for v in c.split("x")) for c in args.attn_cases.split(",")]
        results["attention"] = attention_cases(cases, args.reps, args.attn_sweep,  # type: ignore[arg-type]
                                               args.rope_sweep)
    if "gemv" in parts:
        results["gemv"] = gemv_cases(rows, args.reps)
    if "staged" in parts:
        results["staged"] = staged_cases(args.reps)
    if "gemv_t" in parts:
        results["gemv_t"] = gemv_t_cases(rows, args.reps)
    if "gemv_l2" in parts:
        results["gemv_l2"] = gemv_l2_cases(args.reps)
    if "layer" in parts:
        results["layer"] = layer_cases(args.layers, expand_variants(args.layer_variants))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
