"""``pdserve launch``'s tensor-parallel sizes per worker kind and the GPU group of each worker.

Workers take consecutive runs of the ``--gpus`` list in start order (prefill, decode,
placed workers, colocated), one run of ``tensor_parallel_size`` ids each; the run becomes the
worker's ``CUDA_VISIBLE_DEVICES`` and its rank r uses the run's r-th GPU.
"""

from __future__ import annotations

import argparse
import ctypes

from deploy.topology import topology

# The worker kinds with a --<kind>-tp flag (``Topology.worker_kinds``' names).
TP_KINDS = ("prefill", "decode", "worker", "colocated")


def add_tp_arguments(parser: argparse.ArgumentParser) -> None:
    """Per-kind sizes; each defaults to ``--tensor-parallel-size`` (``-tp``)."""
    from engine_core.arg_utils import positive_int

    for kind in TP_KINDS:
        parser.add_argument(f"--{kind}-tp", type=positive_int, default=None, metavar="N",
                            help=f"tensor-parallel size of each {kind} worker "
                                 "(default: --tensor-parallel-size)")


def worker_tp_sizes(args: argparse.Namespace) -> list[int]:
    """The tensor-parallel size of every worker, in start order."""
    default = args.tensor_parallel_size
    return [getattr(args, f"{kind}_tp") or default for kind in topology(args).worker_kinds()]


def gpu_groups(gpus: list[str], sizes: list[int]) -> list[str]:
    """Each worker's ``CUDA_VISIBLE_DEVICES``: consecutive runs of ``gpus``."""
    needed = sum(sizes)
    if len(gpus) < needed:
        raise SystemExit(f"pdserve launch: {len(sizes)} workers of tensor-parallel sizes "
                         f"{sizes} need {needed} GPUs, have {gpus}")
    groups, start = [], 0
    for size in sizes:
        groups.append(",".join(gpus[start:start + size]))
        start += size
    return groups


def detect_gpus(spec: str | None, cuda_visible: str | None) -> list[str]:
    """The GPUs the workers get, as CUDA_VISIBLE_DEVICES values. ``--gpus`` counts the GPUs
    this process sees: under CUDA_VISIBLE_DEVICES=2,3 (``cuda_visible``), ``--gpus 0,1`` is
    physical 2 and 3."""
    visible = None if cuda_visible is None else [
        g.strip() for g in cuda_visible.split(",") if g.strip() and g.strip() != "-1"]
    if spec:
        wanted = [g.strip() for g in spec.split(",") if g.strip()]
        if visible is None:
            return wanted
        try:
            return [visible[int(g)] for g in wanted]
        except (ValueError, IndexError):
            raise SystemExit(f"pdserve launch: --gpus {spec} names GPUs beyond the "
                             f"{len(visible)} of CUDA_VISIBLE_DEVICES={cuda_visible}") from None
    if visible is not None:
        return visible
    return [str(i) for i in range(device_count())]


def device_count() -> int:
    """The GPUs the driver shows this process (a container sees its own), from NVML.

    The launcher only counts devices, so it asks the driver's management library rather than
    importing torch (1.5 s of CPU at every launch, before any worker starts). No library:
    no NVIDIA driver, no GPU. A library that fails to initialise falls back to torch.
    """
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    count = ctypes.c_uint(0)
    if nvml.nvmlInit_v2() != 0:
        return _torch_device_count()
    try:
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return _torch_device_count()
        return count.value
    finally:
        nvml.nvmlShutdown()


def _torch_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0
