"""The placement sweep's workloads and SLO cells, and the topologies that fit N GPUs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from benchmarks.placement.search import SloCell
from benchmarks.serve.config import DatasetConfig

TPOT_CELLS_MS = (10.0, 15.0, 20.0, 40.0)


@dataclass(frozen=True)
class Workload:
    """Prompt and output lengths of one load, its TTFT target, and where its search starts."""

    name: str
    dataset: DatasetConfig
    ttft_ms: float
    start_rate: float
    max_rate: float

    def cells(self, tpot_ms: tuple[float, ...] = TPOT_CELLS_MS) -> tuple[SloCell, ...]:
        return tuple(SloCell(self.ttft_ms, tpot) for tpot in tpot_ms)


def _random(input_len: int, output_len: int) -> DatasetConfig:
    return DatasetConfig(name="random", random_input_len=input_len,
                         random_output_len=output_len)


def _mixed(median_input: int, median_output: int, max_input: int) -> DatasetConfig:
    return DatasetConfig(name="lognormal", random_input_len=median_input,
                         random_output_len=median_output, lognormal_sigma=1.0,
                         lognormal_max_input_len=max_input)


# Rates are requests/s for two H100/H200s of a Qwen3-8B shape; the search grows past them.
GPU_WORKLOADS = {
    "2k": Workload("2k", _random(2048, 256), 1000.0, start_rate=4.0, max_rate=64.0),
    "8k": Workload("8k", _random(8192, 256), 2000.0, start_rate=1.0, max_rate=16.0),
    "512x1024": Workload("512x1024", _random(512, 1024), 1000.0, start_rate=4.0,
                         max_rate=64.0),
    "mixed": Workload("mixed", _mixed(1024, 192, 8192), 1000.0, start_rate=4.0,
                      max_rate=64.0),
}
# The demo model on CPU: checks the pipeline, the figures mean nothing.
SMOKE_WORKLOADS = {
    "2k": Workload("2k", _random(64, 8), 1000.0, start_rate=2.0, max_rate=8.0),
    "mixed": Workload("mixed", _mixed(32, 8, 256), 1000.0, start_rate=2.0, max_rate=8.0),
}


@dataclass(frozen=True)
class SweepTopology:
    """One ``pdserve launch`` layout: colocated replicas, a static xPyD, or adaptive workers."""

    name: str
    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    workers: int = 0
    extra_args: tuple[str, ...] = ()   # more launch flags (e.g. the proxy's SLO targets)

    @property
    def num_workers(self) -> int:
        return self.prefill + self.decode + self.colocated + self.workers

    def launch_args(self) -> list[str]:
        return ["--prefill", str(self.prefill), "--decode", str(self.decode),
                "--colocated", str(self.colocated), "--workers", str(self.workers),
                *self.extra_args]


def topologies_for(num_gpus: int) -> list[SweepTopology]:
    """N colocated replicas, every static xPyD split of N, and N adaptive workers."""
    out = [SweepTopology(f"colo{num_gpus}", colocated=num_gpus)]
    out += [SweepTopology(f"{p}p{num_gpus - p}d", prefill=p, decode=num_gpus - p)
            for p in range(1, num_gpus)]
    out.append(SweepTopology(f"adaptive{num_gpus}", workers=num_gpus))
    return out


ADAPTIVE_TARGETS = ("default", "cell", "both")


@dataclass(frozen=True)
class SweepRun:
    """One launch of the sweep: a topology and what it serves (workloads, TPOT cells).
    ``label`` is the table column its figures go to."""

    topology: SweepTopology
    label: str
    workloads: tuple[Workload, ...]
    tpot_cells: tuple[float, ...]


def sweep_runs(topologies: list[SweepTopology], workloads: list[Workload],
               tpot_cells: tuple[float, ...], adaptive_targets: str = "both") -> list[SweepRun]:
    """Each static topology once for every workload and cell. The adaptive one with the
    proxy's default targets (``default``), and/or once per cell with the cell's targets
    (``cell``: ``--slo-tpot-ms`` its TPOT, ``--slo-ttft-ms`` its TTFT, column
    ``<name>@cell``), which serves only the workloads and the cell it was set for."""
    if adaptive_targets not in ADAPTIVE_TARGETS:
        raise ValueError(f"adaptive_targets must be one of {ADAPTIVE_TARGETS}")
    runs = []
    for topology in topologies:
        if not topology.workers or adaptive_targets in ("default", "both"):
            runs.append(SweepRun(topology, topology.name, tuple(workloads), tpot_cells))
        if not topology.workers or adaptive_targets == "default":
            continue
        for ttft in sorted({w.ttft_ms for w in workloads}):
            for tpot in tpot_cells:
                extra = (*topology.extra_args, "--slo-ttft-ms", f"{ttft:g}",
                         "--slo-tpot-ms", f"{tpot:g}")
                variant = dataclasses.replace(
                    topology, name=f"{topology.name}-ttft{ttft:g}-tpot{tpot:g}",
                    extra_args=extra)
                runs.append(SweepRun(variant, f"{topology.name}@cell",
                                     tuple(w for w in workloads if w.ttft_ms == ttft),
                                     (tpot,)))
    return runs
