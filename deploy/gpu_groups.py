"""``pdserve launch``'s tensor-parallel sizes per worker kind and the GPU group of each worker.

Workers take consecutive runs of the ``--gpus`` list in start order (prefill, decode,
placed workers, colocated), one run of ``tensor_parallel_size`` ids each; the run becomes the
worker's ``CUDA_VISIBLE_DEVICES`` and its rank r uses the run's r-th GPU.
"""

from __future__ import annotations

import argparse

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
