"""The weight-streaming Triton GEMV at 17-64 rows (one ``BLOCK_M`` tile of 32 or 64) against
cuBLAS, on one TP=2 rank's projections.

Why: at batch 64 one rank of Qwen3-32B TP=2 steps at 1.20x of its roofline on an H200, and
the excess is cuBLAS's GEMMs at 64 rows (gate/up ~3.8 TB/s, down ~3.2, qkv/o ~3.1). The
engine's GEMV streams each weight once with ``tl.dot`` over a 16-row tile; a 64-row tile is
the same kernel with a larger ``BLOCK_M``. Each case captures ``--reps`` calls, each on a
distinct copy of the weight, into one CUDA graph (as ``decode_kernels.py`` does).

    python3 -m experiments.gemm_rows --rows 32,64
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from engine_core.kernels.gemv import _gemv_kernel, prefetch_args
from engine_core.kernels.gemv_tilings import GemvTiling
from engine_core.kernels.pdl import pdl_args
from experiments.decode_kernels import GEMV_SHAPES, graph_us, rotating

TILINGS = [GemvTiling(bn, bk, w, s) for bn, bk, w, s in (
    (32, 64, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3),
    (128, 64, 8, 3), (64, 64, 4, 4), (32, 128, 4, 4))]


def triton_rows(x: torch.Tensor, w: torch.Tensor, t: GemvTiling, block_m: int) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, t.block_n),)](
        x, w, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), HAS_BIAS=False,
        SILU_MUL=False, EARLY_DEPENDENTS=True, **prefetch_args(t.block_k, 2),
        BLOCK_M=block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps,
        num_stages=t.num_stages, **pdl_args(x.device))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="32,64")
    parser.add_argument("--models", default="qwen3-32b/2,llama-70b/2,qwen3-8b")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    models = args.models.split(",")
    results = []
    for (model, name, n, k) in GEMV_SHAPES:
        if model not in models:
            continue
        nbytes = n * k * 2
        weight = rotating(lambda n=n, k=k: torch.randn(n, k, dtype=torch.bfloat16,
                                                        device="cuda") / k ** 0.5,
                          nbytes, args.reps)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
            block_m = max(16, triton.next_power_of_2(rows))
            ref = F.linear(x, weight())
            case = {"model": model, "proj": name, "n": n, "k": k, "rows": rows,
                    "cublas_us": graph_us(lambda x=x, w=weight: F.linear(x, w()), args.reps),
                    "triton_us": {}}
            for t in TILINGS:
                try:
                    got = triton_rows(x, weight(), t, block_m)
                    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
                    case["triton_us"][str(tuple(t))] = graph_us(
                        lambda x=x, w=weight, t=t, bm=block_m: triton_rows(x, w(), t, bm), args.reps)
                except triton.runtime.errors.OutOfResources:
                    continue
                except AssertionError as exc:  # a wrong result is reported, not timed
                    case.setdefault("wrong", {})[str(tuple(t))] = str(exc)[:200]
            best = min(case["triton_us"], key=case["triton_us"].get)
            case["best"] = best
            print(f"{model:12} {name:8} m{rows:<3} cublas {case['cublas_us']:7.2f} us "
                  f"({nbytes / case['cublas_us'] / 1e6:.2f} TB/s)  triton best "
                  f"{case['triton_us'][best]:7.2f} us "
                  f"({nbytes / case['triton_us'][best] / 1e6:.2f} TB/s) {best}", flush=True)
            results.append(case)
        del weight
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
