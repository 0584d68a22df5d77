"""``pdserve launch``'s tensor-parallel sizes per role and the GPU group of each worker.

Workers take consecutive runs of the ``--gpus`` list in launch order (prefill, decode,
colocated), one run of ``tensor_parallel_size`` ids each; the run becomes the worker's
``CUDA_VISIBLE_DEVICES`` and its rank r uses the run's r-th GPU.
"""

from __future__ import annotations

import argparse

from engine_core.errors import ConfigError


def add_tp_arguments(parser: argparse.ArgumentParser) -> None:
    """Per-role sizes; each defaults to ``--tensor-parallel-size`` (``-tp``)."""
    from engine_core.arg_utils import positive_int

    for role in ("prefill", "decode", "colocated"):
        parser.add_argument(f"--{role}-tp", type=positive_int, default=None, metavar="N",
                            help=f"tensor-parallel size of each {role} worker "
                                 "(default: --tensor-parallel-size)")


def worker_tp_sizes(args: argparse.Namespace) -> list[int]:
    """The tensor-parallel size of every worker, in launch order."""
    default = args.tensor_parallel_size
    sizes: list[int] = []
    for role in ("prefill", "decode", "colocated"):
        sizes += [getattr(args, f"{role}_tp") or default] * getattr(args, role)
    return sizes


def check_tp_topology(args: argparse.Namespace) -> None:
    """Prefill and decode workers move KV between single-rank layouts only (for now)."""
    sizes = worker_tp_sizes(args)
    num_pd = args.prefill + args.decode
    if any(size > 1 for size in sizes[:num_pd]):
        raise ConfigError("prefill/decode workers with a tensor-parallel size > 1: KV transfer "
                          "between tensor-parallel layouts is not supported yet; use "
                          "--colocated workers (--colocated-tp) for TP > 1")


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
