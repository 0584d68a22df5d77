"""Experiment: the GEMV chain of 36 Qwen3-8B layers at batch 1 as ONE persistent kernel.

Why: at batch 1 a layer's four projections (qkv, o, gate/up, down) stream 386 MB of
weights, 91 us at the copy rate, but take ~101 us as four dependent kernels (the layer
graph in docs/PERFORMANCE.md): each kernel's ramp-up and tail leave the memory pipe idle,
and PDL cannot start a successor's weight stream before its input exists. Here one
program per SM runs every projection in turn, separated by grid barriers (an atomic
counter), and loads the first chunk of its next tile of weights *before* waiting at the
barrier: the weight stream should not stop between projections. If the chain gets close
to the copy rate, folding the norms and the attention into such a kernel is the way to
the decode goal (issue #6, goal 1); if not, that road is closed for Triton.

Result (one H200, 2026-11-23, docs/PERFORMANCE.md): the chain is correct (bit-equal to
the separate GEMVs) but slower, 106.4 us a layer at best against 99-102 (TMA loads:
111.5 at best), so the engine does not use it.

Measures, in one call: the persistent chain (several tilings) and, as the baseline, the
same GEMVs as separate kernels (``decode_kernels`` layer variant "GEMVs only, GEMVs trigger
late"), us per layer; and checks the chain's output against the separate GEMVs.

    python3 -m experiments.persistent_chain --out /tmp/persistent_chain.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from benchmarks.speed.limits import measure_limits
from experiments.decode_kernels import graph_us, layer_cases

HIDDEN, INTER, QKV = 4096, 12288, 6144
DESC_FIELDS = tl.constexpr(7)  # w, x, out, N, K, x row stride, out row stride
LAYER_WEIGHT_BYTES = 2 * HIDDEN * (QKV + HIDDEN + 2 * INTER + INTER)


@triton.jit
def _wait_at_least(counter_ptr, target):
    """Spin until ``counter >= target`` (acquire: the other programs' stores are visible)."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _chain_kernel(desc_ptr, counter_ptr, num_steps, M, NUM_PROGS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRE: tl.constexpr, TMA: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    lanes = tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    for s in range(0, num_steps):
        d = desc_ptr + s * DESC_FIELDS
        w_ptr = tl.multiple_of(tl.load(d).to(tl.pointer_type(tl.bfloat16)), 16)
        x_ptr = tl.multiple_of(tl.load(d + 1).to(tl.pointer_type(tl.bfloat16)), 16)
        out_ptr = tl.multiple_of(tl.load(d + 2).to(tl.pointer_type(tl.bfloat16)), 16)
        # Every K and stride of the chain is a multiple of 256 (Qwen3-8B shapes): said so,
        # the loads vectorise (the compiler cannot know it of values read from memory).
        N = tl.multiple_of(tl.load(d + 3).to(tl.int32), 16)
        K = tl.multiple_of(tl.load(d + 4).to(tl.int32), 256)
        stride_x = tl.multiple_of(tl.load(d + 5), 256)
        stride_o = tl.multiple_of(tl.load(d + 6), 256)
        chunks_per_tile = K // BLOCK_K
        my_tiles = tl.maximum(tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, NUM_PROGS), 0)
        # This program's first PRE chunks of weights, requested before the barrier: they
        # stream while the previous projection's last programs finish (K >= 4 chunks here).
        cols = pid * BLOCK_N + lanes
        if TMA:
            # Bulk tensor copies: one thread issues a whole [BLOCK_N, BLOCK_K] tile, so one
            # program can keep many tiles in flight (rows past N come back as zeros).
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1],
                                               block_shape=[BLOCK_N, BLOCK_K])
            w0 = w_desc.load([pid * BLOCK_N, 0])
            if PRE > 1:
                w1 = w_desc.load([pid * BLOCK_N, BLOCK_K])
            if PRE > 2:
                w2 = w_desc.load([pid * BLOCK_N, 2 * BLOCK_K])
            if PRE > 3:
                w3 = w_desc.load([pid * BLOCK_N, 3 * BLOCK_K])
        else:
            w_first = w_ptr + cols.to(tl.int64)[:, None] * K + kk[None, :]
            w_mask = (cols < N)[:, None]
            w0 = tl.load(w_first, mask=w_mask, other=0.0)
            if PRE > 1:
                w1 = tl.load(w_first + BLOCK_K, mask=w_mask, other=0.0)
            if PRE > 2:
                w2 = tl.load(w_first + 2 * BLOCK_K, mask=w_mask, other=0.0)
            if PRE > 3:
                w3 = tl.load(w_first + 3 * BLOCK_K, mask=w_mask, other=0.0)
        if s > 0:
            _wait_at_least(counter_ptr, s * NUM_PROGS)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
        x_first = x_rows + kk[None, :]
        acc = tl.dot(tl.load(x_first, mask=row_ok[:, None], other=0.0, cache_modifier=".cg"),
                     tl.trans(w0))
        if PRE > 1:
            acc += tl.dot(tl.load(x_first + BLOCK_K, mask=row_ok[:, None], other=0.0,
                                  cache_modifier=".cg"), tl.trans(w1))
        if PRE > 2:
            acc += tl.dot(tl.load(x_first + 2 * BLOCK_K, mask=row_ok[:, None], other=0.0,
                                  cache_modifier=".cg"), tl.trans(w2))
        if PRE > 3:
            acc += tl.dot(tl.load(x_first + 3 * BLOCK_K, mask=row_ok[:, None], other=0.0,
                                  cache_modifier=".cg"), tl.trans(w3))
        # One loop over all of this program's (tile, K chunk) pairs, so that the software
        # pipeline does not drain and refill at every tile.
        for i in range(PRE, my_tiles * chunks_per_tile):
            t = pid + (i // chunks_per_tile) * NUM_PROGS
            ks = tl.max_contiguous(tl.multiple_of((i % chunks_per_tile) * BLOCK_K + kk, BLOCK_K),
                                   BLOCK_K)
            cols_i = t * BLOCK_N + lanes
            ok_i = cols_i < N
            if i % chunks_per_tile == 0:
                prev = cols_i - NUM_PROGS * BLOCK_N
                tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + prev[None, :],
                         acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (prev < N)[None, :])
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            if TMA:
                w = w_desc.load([t * BLOCK_N, (i % chunks_per_tile) * BLOCK_K])
            else:
                w = tl.load(w_ptr + cols_i.to(tl.int64)[:, None] * K + ks[None, :],
                            mask=ok_i[:, None], other=0.0)
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None], other=0.0,
                        cache_modifier=".cg")
            acc += tl.dot(x, tl.trans(w))
        last = pid + (my_tiles - 1) * NUM_PROGS
        cols = last * BLOCK_N + lanes
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols < N)[None, :] & (my_tiles > 0))
        tl.debug_barrier()
        tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


class Chain:
    """Descriptors and buffers of a 36-layer GEMV chain: h -> qkv -> o (q part) -> gate/up
    -> down (first half) -> h."""

    def __init__(self, layers: list[dict[str, torch.Tensor]], m: int):
        bf16 = dict(dtype=torch.bfloat16, device="cuda")
        self.h = torch.randn(m, HIDDEN, **bf16)
        self.qkv = torch.empty(m, QKV, **bf16)
        self.o = torch.empty(m, HIDDEN, **bf16)
        self.gate_up = torch.empty(m, 2 * INTER, **bf16)
        self.m = m
        rows = []
        for layer in layers:
            rows += [
                (layer["qkv"], self.h, self.qkv, QKV, HIDDEN),
                (layer["o"], self.qkv, self.o, HIDDEN, HIDDEN),
                (layer["gate_up"], self.o, self.gate_up, 2 * INTER, HIDDEN),
                (layer["down"], self.gate_up, self.h, HIDDEN, INTER),
            ]
        self.steps = rows
        self.desc = torch.tensor(
            [[w.data_ptr(), x.data_ptr(), o.data_ptr(), n, k, x.stride(0), o.stride(0)]
             for w, x, o, n, k in rows], dtype=torch.int64, device="cuda")
        self.counter = torch.zeros(1, dtype=torch.int32, device="cuda")

    def run(self, block_n: int, block_k: int, pre: int, warps: int, stages: int,
            per_sm: int, tma: bool = False) -> None:
        props = torch.cuda.get_device_properties(0)
        progs = props.multi_processor_count * per_sm
        if per_sm > 1:  # every program must be resident at once, or the barrier deadlocks
            kernel = _chain_kernel.warmup(
                self.desc, self.counter, len(self.steps), self.m, NUM_PROGS=progs, BLOCK_M=16,
                BLOCK_N=block_n, BLOCK_K=block_k, PRE=pre, TMA=tma, num_warps=warps, num_stages=stages,
                grid=(progs,))
            kernel._init_handles()
            smem = getattr(props, "shared_memory_per_multiprocessor", 228 << 10)
            if (kernel.metadata.shared * per_sm > smem - 2048
                    or kernel.n_regs * 32 * warps * per_sm > 65536):
                raise RuntimeError(f"{per_sm} programs do not fit on an SM")
        self.counter.zero_()
        _chain_kernel[(progs,)](self.desc, self.counter, len(self.steps), self.m,
                                NUM_PROGS=progs, BLOCK_M=16, BLOCK_N=block_n,
                                BLOCK_K=block_k, PRE=pre, TMA=tma, num_warps=warps,
                                num_stages=stages)

    def reference(self, h0: torch.Tensor, layers: int | None = None) -> torch.Tensor:
        """The same chain (its first ``layers``) as separate GEMV kernels (the engine's
        gemv, plain projections)."""
        from engine_core.kernels.gemv import gemv

        h = h0
        for w, x, *_ in self.steps[:None if layers is None else 4 * layers]:
            if x is self.h:
                qkv = gemv(h, w)
            elif x is self.qkv:
                o = gemv(qkv[:, :HIDDEN].contiguous(), w)
            elif x is self.o:
                gu = gemv(o, w)
            else:
                h = gemv(gu[:, :INTER].contiguous(), w)
        return h


def make_layers(num_layers: int) -> list[dict[str, torch.Tensor]]:
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    return [{"qkv": torch.randn(QKV, HIDDEN, **bf16) / HIDDEN ** 0.5,
             "o": torch.randn(HIDDEN, HIDDEN, **bf16) / HIDDEN ** 0.5,
             "gate_up": torch.randn(2 * INTER, HIDDEN, **bf16) / HIDDEN ** 0.5,
             "down": torch.randn(HIDDEN, INTER, **bf16) / INTER ** 0.5}
            for _ in range(num_layers)]


# (BLOCK_N, BLOCK_K, chunks requested before the barrier, warps, stages, programs per SM,
#  TMA loads)
CONFIGS = [(32, 512, 1, 4, 4, 1, False), (32, 256, 2, 4, 4, 1, False),
           (32, 256, 1, 4, 4, 1, True), (32, 256, 1, 4, 6, 1, True),
           (32, 512, 1, 4, 4, 1, True), (16, 256, 1, 4, 8, 1, True),
           (16, 512, 1, 4, 6, 1, True), (64, 256, 1, 4, 4, 1, True),
           (32, 256, 2, 4, 6, 1, True), (32, 256, 1, 4, 3, 2, True)]


def limits_and_baseline(layers: int, baseline: bool = True) -> dict[str, Any]:
    """What a chain experiment compares against, measured in its own call: the copy rate
    (and a layer's weights at it) and, with ``baseline``, the same GEMVs as separate kernels
    (``decode_kernels`` layer variant "GEMVs only, GEMVs trigger late")."""
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "layers": layers}
    limits = measure_limits(torch.device("cuda"), 1 << 30, 8192, 20)
    results["copy_tb_per_s"] = limits["copy_bandwidth_bytes_per_s"] / 1e12
    results["weights_at_copy_rate_us_per_layer"] = (LAYER_WEIGHT_BYTES
                                                    / results["copy_tb_per_s"] / 1e6)
    print(f"copy {results['copy_tb_per_s']:.2f} TB/s: a layer's weights "
          f"{results['weights_at_copy_rate_us_per_layer']:.2f} us", flush=True)
    if baseline:
        results["separate_kernels"] = layer_cases(layers, ["GEMVs only, GEMVs trigger late"])
        torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = limits_and_baseline(args.layers, args.baseline)
    results["triton"] = triton.__version__
    # Scratch for the descriptors the TMA variant builds on the device.
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
    chain = Chain(make_layers(args.layers), 1)
    h0 = chain.h.clone()
    expected = chain.reference(h0)
    runs = []
    for cfg in CONFIGS:
        entry: dict[str, Any] = {"config": dict(zip(
            ("block_n", "block_k", "pre", "warps", "stages", "per_sm", "tma"), cfg))}
        try:
            chain.h.copy_(h0)
            chain.run(*cfg)
            torch.cuda.synchronize()
            got = chain.h.float()
            entry["max_abs_diff_vs_separate"] = (got - expected.float()).abs().max().item()
            entry["bit_equal"] = bool(torch.equal(chain.h, expected))
            entry["us_per_layer"] = graph_us(lambda cfg=cfg: chain.run(*cfg), 1) / args.layers
        except Exception as exc:  # noqa: BLE001 - one failing tiling must not end the sweep
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        runs.append(entry)
        print(f"chain {cfg}: {entry}", flush=True)
    results["chain"] = runs
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
