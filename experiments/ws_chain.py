"""Experiment: 36 Qwen3-8B layers' batch-1 GEMV chain as one persistent CUDA kernel with a
warp-specialised weight stream (``ws_chain.cu``: a producer warp streams weights into a ring
of shared-memory slots with bulk async copies; consumer warps compute behind grid barriers).

Why: the Triton persistent chain (``persistent_chain.py``) streamed slower than separate
kernels (106.4 against ~100 us a layer; the weights alone are ~92 us at the copy rate). If
this kernel gets close to the copy rate, a persistent decode layer written this way is the
road to issue #6's batch-1 goal; if not, that road is closed too.

Result (one H200, 2026-11-23, docs/PERFORMANCE.md): 100.6 us a layer at best, the same as
the separate GEMVs (100.6 in the same call), and each empty grid-barrier step a layer
(``--barriers``) adds ~2.3 us: not the way past the separate kernels either.

One call measures the chain in several ring shapes, the separate Triton GEMVs of the engine
(the same layers, in a CUDA graph) as the baseline, and checks the chain's output against
the separate GEMVs (the float32 sums run in another order, so within rounding, not bit-equal).
The kernel is compiled at run time by CuPy (NVRTC); ``--cubin-dir`` loads prebuilt cubins
named ``ws_chain_<slot>_<slots>_<warps>.cubin`` instead where NVRTC is missing. They can be
built on a machine without a GPU from an NVRTC library (``pip install
nvidia-cuda-nvrtc-cu12``) and the ptxas that Triton ships:

    python3 -m experiments.ws_chain --build-cubins .device/ws_chain \
        --nvrtc .../nvidia/cuda_nvrtc/lib/libnvrtc.so.12
    python3 -m experiments.ws_chain --cubin-dir .device/ws_chain --out /tmp/ws_chain.json
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from experiments.decode_kernels import graph_us
from experiments.persistent_chain import INTER, Chain, limits_and_baseline, make_layers

SOURCE = Path(__file__).with_name("ws_chain.cu")
MAX_K = INTER
STEP_DTYPE = np.dtype({"names": ["w", "x", "out", "n", "k", "pad0", "pad1"],
                       "formats": ["<u8", "<u8", "<u8", "<i4", "<i4", "<i4", "<i4"]})
# (slot bytes, slots, consumer warps); a slot must hold a row of the widest K (24 KB).
CONFIGS = [(32768, 6, 8), (24576, 8, 8), (32768, 4, 8), (49152, 4, 8), (24576, 8, 4),
           (32768, 6, 16), (24576, 4, 8)]


def defines(slot: int, slots: int, warps: int) -> tuple[str, ...]:
    return (f"-DSLOT_BYTES={slot}", f"-DNUM_SLOTS={slots}", f"-DNUM_CONSUMER_WARPS={warps}",
            f"-DMAX_K={MAX_K}")


def build_cubins(out_dir: Path, nvrtc_path: str) -> None:
    """Compile ``ws_chain.cu`` for sm_90 in every CONFIGS shape: NVRTC to PTX, then ptxas."""
    import ctypes
    import subprocess

    import triton

    nvrtc = ctypes.CDLL(nvrtc_path)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    out_dir.mkdir(parents=True, exist_ok=True)
    for slot, slots, warps in CONFIGS:
        prog = ctypes.c_void_p()
        if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), SOURCE.read_bytes(), b"ws_chain.cu",
                                    0, None, None):
            raise RuntimeError("nvrtcCreateProgram failed")
        opts = [o.encode() for o in ("--gpu-architecture=compute_90", "--std=c++17",
                                     *defines(slot, slots, warps))]
        if nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)):
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(log.value.decode())
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetPTX(prog, ptx)
        ptx_path = out_dir / f"ws_chain_{slot}_{slots}_{warps}.ptx"
        ptx_path.write_bytes(ptx.value)
        subprocess.run([str(ptxas), "-arch=sm_90", str(ptx_path), "-o",
                        str(ptx_path.with_suffix(".cubin"))], check=True)
        print(f"built {ptx_path.with_suffix('.cubin')}", flush=True)


def smem_bytes(slot: int, slots: int) -> int:
    return slot * slots + MAX_K * 2 + 2 * 8 * slots


def load_kernel(cupy: Any, slot: int, slots: int, warps: int,
                cubin_dir: str | None) -> tuple[Any, str]:
    """The compiled ``gemv_chain`` for one ring shape and where it came from: NVRTC, else
    a prebuilt cubin."""
    try:
        module = cupy.RawModule(code=SOURCE.read_text(),
                                options=("--std=c++17",) + defines(slot, slots, warps))
        kernel, origin = module.get_function("gemv_chain"), "nvrtc"
    except Exception:  # noqa: BLE001 - no NVRTC on this machine: the prebuilt cubin
        if cubin_dir is None:
            raise
        path = Path(cubin_dir) / f"ws_chain_{slot}_{slots}_{warps}.cubin"
        kernel, origin = cupy.RawModule(path=str(path)).get_function("gemv_chain"), str(path)
    kernel.max_dynamic_shared_size_bytes = smem_bytes(slot, slots)
    return kernel, origin


class WsChain:
    """The chain's step table for ``ws_chain.cu`` over ``Chain``'s buffers (one row)."""

    def __init__(self, chain: Chain, num_layers: int | None = None, barriers: int = 0):
        steps = chain.steps if num_layers is None else chain.steps[:4 * num_layers]
        rows = []
        for i, (w, x, out, n, k) in enumerate(steps):
            rows.append((w.data_ptr(), x.data_ptr(), out.data_ptr(), n, k, 0, 0))
            if i % 4 == 0:
                # Stand-ins for a layer's latency-bound work (norms, attention): projections
                # of no rows, i.e. a grid barrier and an input load each, and no weights.
                rows += [(w.data_ptr(), x.data_ptr(), out.data_ptr(), 0, k, 0, 0)] * barriers
        table = np.array(rows, dtype=STEP_DTYPE)
        self.table = torch.from_numpy(table.view(np.uint8).copy()).cuda()
        self.num_steps = len(rows)
        self.counter = torch.zeros(1, dtype=torch.int32, device="cuda")

    def run(self, cupy: Any, kernel: Any, warps: int, slot: int, slots: int) -> None:
        self.counter.zero_()
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        blocks = torch.cuda.get_device_properties(0).multi_processor_count
        kernel((blocks,), ((warps + 1) * 32,),
               (np.uint64(self.table.data_ptr()), np.int32(self.num_steps),
                np.uint64(self.counter.data_ptr())),
               shared_mem=smem_bytes(slot, slots), stream=stream)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--cubin-dir", default=None)
    parser.add_argument("--build-cubins", default=None, metavar="DIR",
                        help="only compile the cubins into DIR (no GPU needed), then exit")
    parser.add_argument("--nvrtc", default="libnvrtc.so.12", help="NVRTC library, for "
                        "--build-cubins")
    parser.add_argument("--configs", default=None,
                        help="SLOT:SLOTS:WARPS list, ','-separated (default: CONFIGS)")
    parser.add_argument("--barriers", type=int, nargs="*", default=[],
                        help="also time the chain with this many empty grid-barrier steps "
                             "a layer (latency-bound work the weight stream should hide)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.build_cubins:
        build_cubins(Path(args.build_cubins), args.nvrtc)
        return 0
    cupy = importlib.import_module("cupy")  # cupy-cuda12x or -13x, by module name
    results = limits_and_baseline(args.layers)
    chain = Chain(make_layers(args.layers), 1)
    h0 = chain.h.clone()
    expected = chain.reference(h0)
    one_expected = chain.reference(h0, layers=1)  # the first layer: a check before any drift
    runs = []
    configs = (CONFIGS if args.configs is None else
               [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")])
    for slot, slots, warps in configs:
        entry: dict[str, Any] = {"slot_bytes": slot, "slots": slots, "consumer_warps": warps}
        try:
            kernel, entry["kernel_from"] = load_kernel(cupy, slot, slots, warps, args.cubin_dir)
            for name, ws, want in (("one_layer", WsChain(chain, 1), one_expected),
                                   ("chain", WsChain(chain), expected)):
                chain.h.copy_(h0)
                ws.run(cupy, kernel, warps, slot, slots)
                torch.cuda.synchronize()
                entry[f"{name}_max_rel_diff"] = rel_diff(chain.h, want)
            for extra in (0,) + tuple(args.barriers):
                timed = WsChain(chain, barriers=extra)
                key = "us_per_layer" if extra == 0 else f"us_per_layer_{extra}_more_barriers"
                entry[key] = graph_us(
                    lambda t=timed, k=kernel, w=warps, s=slot, n=slots: t.run(cupy, k, w, s, n),
                    1) / args.layers
        except Exception as exc:  # noqa: BLE001 - one failing shape must not end the sweep
            entry["error"] = f"{type(exc).__name__}: {exc}"[:400]
        runs.append(entry)
        print(f"ws chain {entry}", flush=True)
    results["chain"] = runs
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def rel_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).abs().max()
            / expected.float().abs().max().clamp_min(1e-6)).item()


if __name__ == "__main__":
    raise SystemExit(main())
