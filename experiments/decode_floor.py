"""The floor under issue #6's goal 1: how fast can a Qwen3-8B batch-1 decode step be with
the weight stream this GPU gives, if everything but the weight reads cost nothing?

Why: the goal is a step within 1.10x of (weight bytes + KV bytes) / copy bandwidth. A step
must at least stream every weight through the GEMVs; this script measures that part alone
on the same card, in one run, beside the limits it is judged by:

- ``copy``: the benchmark's limit (a large device-to-device copy, read + write bytes / s),
  and ``read``: a pure read of the same bytes (``torch.sum``), the other ceiling a
  weight stream could reach;
- ``layers``: 36 Qwen3-8B layers at batch 1 as one CUDA graph (``decode_kernels``'s layer
  graph: distinct weights per layer), as the engine runs them and with only their four
  GEMVs (no norms, attention, RoPE, KV write or SiLU), us per layer;
- ``lm_head``: the ``[151936, 4096]`` projection of 1-8 rows, cuBLAS and the Triton GEMV
  (the engine's up to ``--triton-gemv-max-rows``), in a graph over distinct copies;
- ``floor`` = 36 GEMV-only layers + the faster lm_head; its ratio to the roofline is the
  best goal-1 ratio any step built on these kernels can reach.

    source .device/env.sh && python3 -m experiments.decode_floor --out f.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.speed.limits import measure_limits, time_ms
from experiments.decode_kernels import graph_us, layer_cases, rotating

HIDDEN, VOCAB, LAYERS, CONTEXT = 4096, 151936, 36, 1024
# Qwen3-8B bytes a batch-1 decode step reads at context 1k (bf16): every weight but the
# input embedding (q/k norms and layer norms included), and the KV of 1024 positions.
LAYER_WEIGHT_BYTES = 2 * (HIDDEN * (32 + 2 * 8) * 128 + 32 * 128 * HIDDEN
                          + 3 * HIDDEN * 12288 + 2 * HIDDEN + 2 * 128)
LM_HEAD_BYTES = 2 * VOCAB * HIDDEN
KV_BYTES = 2 * LAYERS * 8 * 128 * 2 * CONTEXT
STEP_BYTES = LAYERS * LAYER_WEIGHT_BYTES + LM_HEAD_BYTES + 2 * HIDDEN + KV_BYTES
GEMVS_ONLY = "GEMVs only, GEMVs trigger late"
ENGINE_LAYER = "engine now: RoPE and KV write in attention, SiLU fused"


def read_bandwidth(nbytes: int, iters: int) -> float:
    """Bytes per second of a reduction reading ``nbytes`` once (median of ``iters``)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    times = time_ms(lambda: src.sum(dtype=torch.float32), torch.device("cuda"), iters)
    return nbytes / (statistics.median(times) / 1e3)


def lm_head_us(rows_list: list[int], reps: int) -> dict[int, dict[str, float]]:
    """``rows`` rows through the LM head, cuBLAS and the Triton GEMV, us by row count."""
    from engine_core.kernels.gemv import gemv

    weight = rotating(lambda: torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16, device="cuda")
                      / HIDDEN ** 0.5, LM_HEAD_BYTES, reps)
    out = {}
    for rows in rows_list:
        x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
        out[rows] = {"cublas": graph_us(lambda x=x: F.linear(x, weight()), reps),
                     "triton_gemv": graph_us(lambda x=x: gemv(x, weight()), reps)}
        print(f"lm_head {rows} rows: cuBLAS {out[rows]['cublas']:.1f} us, "
              f"Triton GEMV {out[rows]['triton_gemv']:.1f} us", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=4 << 30, help="copy / read size")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=4, help="LM-head calls per graph")
    parser.add_argument("--lm-head-rows", default="1,2,4,8")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    limits = measure_limits(torch.device("cuda"), args.bytes, 8192, args.iters)
    copy = limits["copy_bandwidth_bytes_per_s"]
    read = read_bandwidth(args.bytes, args.iters)
    torch.cuda.empty_cache()
    layers = {c["variant"]: c["us_per_layer"] for c in layer_cases(LAYERS, [GEMVS_ONLY,
                                                                            ENGINE_LAYER])}
    heads = lm_head_us([int(r) for r in args.lm_head_rows.split(",")], args.reps)
    head = heads[1] if 1 in heads else lm_head_us([1], args.reps)[1]
    roofline_ms = STEP_BYTES / copy * 1e3
    floor_ms = (LAYERS * layers[GEMVS_ONLY] + min(head.values())) / 1e3
    engine_ms = (LAYERS * layers[ENGINE_LAYER] + head["triton_gemv"]) / 1e3
    weights_at_copy_us = LAYER_WEIGHT_BYTES / copy * 1e6
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "limits": limits,
        "read_bandwidth_bytes_per_s": read, "step_bytes": STEP_BYTES,
        "layer_us": layers, "layer_weights_at_copy_us": weights_at_copy_us,
        "lm_head_us": {str(r): v for r, v in heads.items()}, "roofline_ms": roofline_ms,
        "floor_ms": floor_ms, "floor_ratio": floor_ms / roofline_ms,
        "engine_layers_and_head_ms": engine_ms, "engine_layers_and_head_ratio":
            engine_ms / roofline_ms,
        "goal_ms": 1.10 * roofline_ms,
    }
    print(f"device {result['device']}: copy {copy / 1e12:.2f} TB/s, read {read / 1e12:.2f} TB/s, "
          f"matmul {limits['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    print(f"layer: GEMVs only {layers[GEMVS_ONLY]:.2f} us, engine {layers[ENGINE_LAYER]:.2f} us, "
          f"weights at the copy rate {weights_at_copy_us:.2f} us "
          f"(GEMV stream {LAYER_WEIGHT_BYTES / layers[GEMVS_ONLY] / 1e6:.2f} TB/s)")
    print(f"lm_head: cuBLAS {head['cublas']:.1f} us, Triton GEMV {head['triton_gemv']:.1f} us, "
          f"at the copy rate {LM_HEAD_BYTES / copy * 1e6:.1f} us")
    print(f"roofline {roofline_ms:.3f} ms, goal (1.10x) {result['goal_ms']:.3f} ms; "
          f"floor (GEMVs + lm_head alone) {floor_ms:.3f} ms = {result['floor_ratio']:.3f}x; "
          f"engine layers + lm_head {engine_ms:.3f} ms = "
          f"{result['engine_layers_and_head_ratio']:.3f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
