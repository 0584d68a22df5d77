"""Registers, stack and shared memory of the decode step's Triton kernels on sm_90, without a GPU.

Why: whether a kernel's blocks can sit on an SM beside its predecessor's (what PDL overlap
and pre-wait loads depend on) is set by these numbers, and Triton with its bundled ptxas
compiles for an H100 on any machine. Compiles the decode-attention kernel (RoPE and q/k
norm in it, Qwen3 heads, bf16) with and without the early K/V tile at 4 and 8 warps, the
GEMV at its tilings and the step's cos/sin and argmax kernels; prints one line each (and
JSON with ``--out``). Run under the GPU machine's Triton release too (e.g. a venv with
``--system-site-packages`` and that ``triton`` wheel): releases differ in what a kernel may
use (Triton 3.6 rejects module globals that 3.9 accepts).

    python3 -m experiments.kernel_resources [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine_core.kernels import gemv as gemv_module
from engine_core.kernels import paged_decode

SM90 = GPUTarget("cuda", 90, 32)
_INDEX_POINTERS = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
                   "query_start_loc_ptr": "*i32", "work_ptr": "*i32", "slot_ptr": "*i64"}


def resources(kernel: Any) -> dict[str, int]:
    """REG, STACK, SHARED (static) and LOCAL of a compiled kernel, read by ``cuobjdump
    -res-usage``, and the dynamic shared memory Triton launches it with."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out))
    return {**{key.lower(): int(value) for key, value in found.items()},
            "dynamic_shared": kernel.metadata.shared}


def compile_sm90(fn: Any, types: dict[str, str], constants: dict[str, Any],
                 **options: Any) -> dict[str, int]:
    names = fn.arg_names
    signature = {n: "constexpr" if n in constants else types[n] for n in names}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    return resources(triton.compile(source, target=SM90, options=options))


def decode_cases() -> list[dict[str, Any]]:
    fn = paged_decode._decode_kernel
    types = {}
    for name in fn.arg_names:
        if name in _INDEX_POINTERS:
            types[name] = _INDEX_POINTERS[name]
        elif name.startswith("part_"):
            types[name] = "*fp32"
        elif name.endswith("_ptr"):
            types[name] = "*bf16"
        else:
            types[name] = "fp32" if name in ("scale_log2", "eps") else "i32"
    out = []
    for early in (False, True):
        for warps in (4, 8):
            constants = dict(NUM_Q_HEADS=32, GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_D=128,
                             BLOCK_N=64, BLOCK_SIZE=16, DOT_PRECISION="ieee", ROPE=True,
                             HAS_NORM=True, WORK_LIST=False, EARLY_KV=early, USE_PDL=True)
            used = compile_sm90(fn, types, constants, num_warps=warps, num_stages=3,
                                enable_fp_fusion=False)
            out.append({"kernel": "decode attention, RoPE + q/k norm", "early_kv": early,
                        "warps": warps, **used})
    return out


def gemv_cases() -> list[dict[str, Any]]:
    fn = gemv_module._gemv_kernel
    types = {n: "*bf16" if n.endswith("_ptr") else "i32" for n in fn.arg_names}
    out = []
    tilings = {"narrow": gemv_module.NARROW_TILING, "medium": gemv_module.MEDIUM_TILING,
               "deep": gemv_module.DEEP_TILING, "wide": gemv_module.WIDE_TILING}
    for name, t in tilings.items():
        silu = name == "wide"  # the fused gate/up takes the wide tiling
        constants = dict(HAS_BIAS=False, SILU_MUL=silu, BLOCK_M=gemv_module.BLOCK_M,
                         BLOCK_N=t.block_n, BLOCK_K=t.block_k, EARLY_DEPENDENTS=not silu,
                         **gemv_module.prefetch_args(t.block_k, 2), USE_PDL=True)
        used = compile_sm90(fn, types, constants, num_warps=t.num_warps,
                            num_stages=t.num_stages, enable_fp_fusion=not silu)
        out.append({"kernel": f"gemv {name}{' + SiLU' if silu else ''}",
                    "tiling": list(t), **used})
    return out


def split_k_mlp_cases() -> list[dict[str, Any]]:
    """The one-launch MLP (gate/up, SiLU, down by float32 atomics) at its candidate tilings."""
    from engine_core.kernels import split_k_mlp
    from experiments.decode_kernels import SPLIT_K_MLP_CONFIGS

    fn = split_k_mlp._split_k_mlp_kernel
    types = {n: ("*fp32" if n == "acc_ptr" else "*bf16") if n.endswith("_ptr") else "i32"
             for n in fn.arg_names}
    out = []
    for config in SPLIT_K_MLP_CONFIGS:
        t = split_k_mlp.SplitKMlpTiling(*config)
        for transposed in (False, True):
            constants = dict(DOWN_TRANSPOSED=transposed, BLOCK_M=gemv_module.BLOCK_M,
                             BLOCK_I=t.block_i, BLOCK_K=t.block_k, BLOCK_H=t.block_h,
                             **gemv_module.prefetch_args(t.block_k, 2),
                             EARLY_DEPENDENTS=False, USE_PDL=True)
            used = compile_sm90(fn, types, constants, num_warps=t.num_warps,
                                num_stages=t.num_stages, enable_fp_fusion=False)
            out.append({"kernel": f"split-K MLP{' down [I, H]' if transposed else ''}",
                        "tiling": list(t), **used})
    return out


def step_tail_cases() -> list[dict[str, Any]]:
    """The step's small kernels outside the layers: RoPE cos/sin and greedy argmax."""
    from engine_core.kernels import argmax, rotary

    cases = [
        ("rope cos/sin", rotary._cos_sin_kernel,
         {"pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
          "num_tokens": "i32"},
         dict(HALF=64, BLOCK_T=16, BLOCK_HALF=64, USE_PDL=True), 4),
        ("argmax pieces", argmax._piece_argmax_kernel,
         {"x_ptr": "*fp32", "val_ptr": "*fp32", "idx_ptr": "*i32", "vocab": "i32",
          "stride_r": "i32", "pieces": "i32"},
         dict(CHUNK=argmax.CHUNK, BLOCK=1024, USE_PDL=True), 4),
        ("argmax pick", argmax._pick_piece_kernel,
         {"val_ptr": "*fp32", "idx_ptr": "*i32", "out_ptr": "*i64", "pieces": "i32"},
         dict(BLOCK_P=64, USE_PDL=True), 1),
    ]
    return [{"kernel": name, **compile_sm90(fn, types, constants, num_warps=warps)}
            for name, fn, types, constants, warps in cases]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default=None,
                        help="comma-separated parts: decode, gemv, split_k_mlp, tail")
    args = parser.parse_args(argv)
    parts = {"decode": decode_cases, "gemv": gemv_cases, "split_k_mlp": split_k_mlp_cases,
             "tail": step_tail_cases}
    chosen = args.only.split(",") if args.only else list(parts)
    rows = [row for name in chosen for row in parts[name]()]
    for row in rows:
        shape = ", ".join(f"{k} {v}" for k, v in row.items()
                          if k not in ("kernel", "reg", "stack", "shared", "local",
                                       "dynamic_shared"))
        print(f"{row['kernel']:36} {shape:28} registers {row['reg']:3}  stack "
              f"{row['stack']:3}  shared {row['shared'] + row['dynamic_shared']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"target": "sm_90", "triton": triton.__version__,
                                              "kernels": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
