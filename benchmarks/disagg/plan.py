"""What the report runs: topologies to launch and the benchmark runs on each. Pure data.

Experiments (issue #7):

- ``ttft_overhead``: low load, 1P1D minus one colocated instance (hit directly, and
  through the proxy), same prompts; 1P1D twice: D computing the first token, and the
  proxy streaming P's (``--first-token-from-prefill``).
- ``goodput_2k`` / ``goodput_8k``: Poisson sweeps, 1P1D against two colocated replicas
  behind the same proxy (round robin), same prompts at each rate.
- ``prefix_cache``: the prefix_repetition workload with prefix caching on and off, on one
  colocated instance and on 1P1D.
- ``proxy_overhead``: a high rate of short requests to one colocated worker, directly and
  through the proxy.

Extra (named in ``--only``: ``kv_offload``, ``prefix_affinity``, ``overflow_2k``,
``goodput_2k_2p1d``; not in the default report):

- ``kv_offload`` (one GPU): a prefix_repetition workload whose prefixes do not fit a
  deliberately small device KV cache, on one colocated worker with KV offload to host
  memory off and on.
- ``prefix_affinity`` (two GPUs, or ``--gpus 0,0`` for two workers sharing one): the same
  workload through the proxy to two colocated workers, each with that small KV cache,
  routed round robin and by prefix affinity (``--routing prefix_affinity``): round robin
  makes both caches hold every prefix, affinity each only its share.
- ``overflow_2k`` (two GPUs): goodput_2k's points (the same prompts) on 1P1D with the proxy's
  ``--prefill-overflow`` (``Scale.prefill_overflow``): once P has that many prefills in
  flight, D prefills a request itself. Compared with goodput_2k's 1P1D and two replicas.
- ``goodput_2k_2p1d`` (three GPUs, e.g. ``--gpus 0,1,2,3`` on a 4-GPU machine): goodput_2k's
  points (its rates, and the same prompts at each rate: goodput_2k's seeds) on 2P1D, the
  proxy routing prefills round robin over both P workers, against three colocated replicas
  behind the same proxy (round robin). Both use three GPUs; the summary also sets their
  goodput per GPU beside goodput_2k's 1P1D and two replicas (two GPUs) where those ran.

Each topology is launched once and serves every run planned on it. Runs on the same
server get different seeds (no accidental prefix hits), except the proxy-overhead pair,
whose prompts are shorter than a block (nothing to hit); runs compared across servers share
their seed (same prompts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from benchmarks.serve.config import DatasetConfig

EXPERIMENTS = ("ttft_overhead", "goodput_2k", "goodput_8k", "prefix_cache", "proxy_overhead")
# Only when named in --only.
EXTRA_EXPERIMENTS = ("kv_offload", "prefix_affinity", "overflow_2k", "goodput_2k_2p1d")
ALL_EXPERIMENTS = EXPERIMENTS + EXTRA_EXPERIMENTS
PROXY = "proxy"  # a run's target: the proxy, or a worker role hit directly


@dataclass(frozen=True)
class Topology:
    """One ``pdserve launch`` layout; every worker gets its own GPU (or all share the CPU)."""

    name: str
    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    prefix_caching: bool = True
    kv_cache_bytes: int | None = None  # --kv-cache-memory-bytes (None: sized from memory)
    kv_offload_gib: float = 0.0        # --kv-offloading-size
    first_token_from_prefill: bool = False  # the proxy's first-token handoff
    routing: str = "round_robin"       # the proxy's --routing
    prefill_overflow: int = 0          # the proxy's --prefill-overflow (0: off)

    @property
    def num_workers(self) -> int:
        return self.prefill + self.decode + self.colocated


COLO1 = Topology("colo1", colocated=1)
COLO1_NOCACHE = Topology("colo1_nocache", colocated=1, prefix_caching=False)
PD = Topology("pd", prefill=1, decode=1)
PD_NOCACHE = Topology("pd_nocache", prefill=1, decode=1, prefix_caching=False)
PD_HANDOFF = Topology("pd_handoff", prefill=1, decode=1, first_token_from_prefill=True)
COLO2 = Topology("colo2", colocated=2)
TOPOLOGY_ORDER = (COLO1, COLO1_NOCACHE, PD, PD_HANDOFF, PD_NOCACHE, COLO2)
# goodput_2k_2p1d's pair, three GPUs each: prefills round robin over two P workers, and
# three colocated replicas.
PD2P1D = Topology("pd2p1d", prefill=2, decode=1)
COLO3 = Topology("colo3", colocated=3)


@dataclass(frozen=True)
class Sweep:
    """A random-prompt Poisson sweep: lengths and rates."""

    input_len: int
    output_len: int
    rates: tuple[float, ...]


@dataclass(frozen=True)
class Scale:
    """Sizes of one report: the GPU defaults or the CPU smoke run."""

    low_load_rate: float = 1.0
    low_load_prompts: int = 60
    low_load_input: int = 2048
    low_load_output: int = 128
    sweep_2k: Sweep = Sweep(2048, 256, (2, 4, 6, 8, 12, 16))
    sweep_8k: Sweep = Sweep(8192, 256, (0.5, 1, 1.5, 2, 3))
    point_seconds: float = 20.0
    min_point_prompts: int = 20
    max_point_prompts: int = 320
    prefix_len: int = 2048
    suffix_len: int = 256
    num_prefixes: int = 8
    prefix_output: int = 128
    prefix_rate: float = 4.0
    prefix_prompts: int = 120
    proxy_rate: float = 200.0
    proxy_prompts: int = 2000
    # Shorter than one KV block: both runs send the same prompts and neither gets prefix
    # hits, and the worker's load is as light as the rate allows. Its step times still
    # drift by tens of ms within a run (at 200 req/s almost every step is a mixed, eager
    # one), so the summary prints that drift beside the difference, and the proxy's own
    # time per request from its histogram.
    proxy_input: int = 8
    proxy_output: int = 2
    warmups: int = 8
    # kv_offload: 24 prefixes of 4096 tokens are ~14 GB of Qwen3-8B KV; the device cache
    # holds 6 GiB (~43k tokens, ~10 prefixes), host memory all of them.
    offload_prefix_len: int = 4096
    offload_suffix_len: int = 128
    offload_num_prefixes: int = 24
    offload_output: int = 64
    offload_rate: float = 4.0
    offload_prompts: int = 240
    offload_kv_cache_bytes: int = 6 << 30
    offload_host_gib: float = 16.0
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 40.0
    prefill_overflow: int = 8  # overflow_2k: P's prefills in flight from which D prefills
    # Every worker's device KV cache where its topology sets none (None: sized from memory).
    kv_cache_bytes: int | None = None

    def point_prompts(self, rate: float) -> int:
        """Prompts at one sweep point: ``point_seconds`` of traffic, within the bounds."""
        wanted = math.ceil(rate * self.point_seconds)
        return max(self.min_point_prompts, min(self.max_point_prompts, wanted))


GPU_SCALE = Scale()
SMOKE_SCALE = Scale(
    low_load_rate=4.0, low_load_prompts=4, low_load_input=64, low_load_output=8,
    sweep_2k=Sweep(96, 8, (2.0, 8.0)), sweep_8k=Sweep(192, 8, (2.0,)), point_seconds=1.0,
    min_point_prompts=3, max_point_prompts=6, prefix_len=64, suffix_len=16, num_prefixes=2,
    prefix_output=4, prefix_rate=8.0, prefix_prompts=6, proxy_rate=200.0, proxy_prompts=20,
    proxy_input=8, proxy_output=2, warmups=1, offload_prefix_len=64, offload_suffix_len=16,
    offload_num_prefixes=4, offload_output=4, offload_rate=8.0, offload_prompts=12,
    # The demo model's KV is 4 KiB a token on CPU: 12 blocks of 16 tokens, a bit over two
    # of the four 5-block prompts.
    offload_kv_cache_bytes=12 * 16 * 4096, offload_host_gib=0.01, slo_ttft_ms=5000.0,
    slo_tpot_ms=1000.0,
    # 2,048 tokens: every smoke run fits; the CPU default (1 GiB) would only make each of the
    # smoke's workers start slower.
    kv_cache_bytes=8 << 20)


@dataclass(frozen=True)
class BenchRun:
    """One ``bench serve`` run; ``name`` is its results file stem."""

    name: str
    experiment: str
    variant: str            # legend text
    target: str             # PROXY or a worker role hit directly ("colocated")
    dataset: DatasetConfig
    rate: float
    interleave: str | None = None  # every other request to this target instead (an A/B)

    @property
    def estimated_seconds(self) -> float:
        """A generous guess of its wall time (arrivals, an overloaded drain, warm-up)."""
        sending = 0.0 if math.isinf(self.rate) else self.dataset.num_prompts / self.rate
        return 1.5 * sending + 20.0


@dataclass(frozen=True)
class TopologyPlan:
    """A topology and the runs made on it, in order."""

    topology: Topology
    runs: tuple[BenchRun, ...] = field(default_factory=tuple)


def _random(n: int, input_len: int, output_len: int, seed: int) -> DatasetConfig:
    return DatasetConfig(name="random", num_prompts=n, seed=seed, random_input_len=input_len,
                         random_output_len=output_len)


def rate_tag(rate: float) -> str:
    """File-name text of a rate: ``2``, ``0.5``, ``inf``."""
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _runs(scale: Scale, experiment: str, seed: int) -> dict[Topology, list[BenchRun]]:
    runs: dict[Topology, list[BenchRun]] = {}

    def add(topology: Topology, run: BenchRun) -> None:
        runs.setdefault(topology, []).append(run)

    if experiment == "ttft_overhead":
        low = _random(scale.low_load_prompts, scale.low_load_input, scale.low_load_output,
                      seed + 100)
        rate = scale.low_load_rate
        add(COLO1, BenchRun(f"{experiment}__colocated_direct", experiment,
                            "colocated (direct)", "colocated", low, rate))
        add(COLO1, BenchRun(f"{experiment}__colocated_proxy", experiment,
                            "colocated (via proxy)", PROXY, replace(low, seed=seed + 101), rate))
        add(PD, BenchRun(f"{experiment}__pd", experiment, "1P1D", PROXY, low, rate))
        add(PD_HANDOFF, BenchRun(f"{experiment}__pd_handoff", experiment,
                                 "1P1D, first token from P", PROXY, low, rate))
    elif experiment in ("goodput_2k", "goodput_8k", "goodput_2k_2p1d"):
        if experiment == "goodput_2k_2p1d":  # goodput_2k's points, on three GPUs each
            pair = ((PD2P1D, "2P1D"), (COLO3, "3x colocated (round robin)"))
        else:
            pair = ((PD, "1P1D"), (COLO2, "2x colocated (round robin)"))
        sweep = "goodput_8k" if experiment == "goodput_8k" else "goodput_2k"
        for rate, data in _sweep_points(scale, sweep, seed):
            for topology, label in pair:
                add(topology, BenchRun(f"{experiment}__{topology.name}__r{rate_tag(rate)}",
                                       experiment, label, PROXY, data, rate))
    elif experiment == "overflow_2k":
        overflow = Topology(f"pd_overflow{scale.prefill_overflow}", prefill=1, decode=1,
                            prefill_overflow=scale.prefill_overflow)
        for rate, data in _sweep_points(scale, "goodput_2k", seed):
            add(overflow, BenchRun(f"{experiment}__{overflow.name}__r{rate_tag(rate)}", experiment,
                                   f"1P1D, prefill overflow at {scale.prefill_overflow}", PROXY,
                                   data, rate))
    elif experiment == "prefix_cache":
        data = DatasetConfig(name="prefix_repetition", num_prompts=scale.prefix_prompts,
                             seed=seed + 400, prefix_len=scale.prefix_len,
                             suffix_len=scale.suffix_len, num_prefixes=scale.num_prefixes,
                             prefix_output_len=scale.prefix_output)
        rate = scale.prefix_rate
        for topology, target, what in ((COLO1, "colocated", "colocated"),
                                       (COLO1_NOCACHE, "colocated", "colocated"),
                                       (PD, PROXY, "1P1D"), (PD_NOCACHE, PROXY, "1P1D")):
            state = "on" if topology.prefix_caching else "off"
            add(topology, BenchRun(f"{experiment}__{topology.name.split('_')[0]}_{state}",
                                   experiment, f"{what}, caching {state}", target, data, rate))
    elif experiment == "proxy_overhead":
        short = _random(scale.proxy_prompts, scale.proxy_input, scale.proxy_output, seed + 500)
        rate = scale.proxy_rate
        add(COLO1, BenchRun(f"{experiment}__direct", experiment, "worker (direct)",
                            "colocated", short, rate))
        add(COLO1, BenchRun(f"{experiment}__proxy", experiment, "through the proxy", PROXY,
                            short, rate))
        # The A/B that decides the goal: one run, even requests direct, odd ones through the
        # proxy, so both halves see the same arrivals and the same worker state (the worker's
        # step times drift by tens of ms within a run, which separate runs cannot cancel).
        add(COLO1, BenchRun(f"{experiment}__interleaved", experiment,
                            "direct and proxied, interleaved", "colocated", short, rate,
                            interleave=PROXY))
    elif experiment == "kv_offload":
        data = _small_cache_workload(scale, seed + 600)
        small = Topology("colo1_smallkv", colocated=1,
                         kv_cache_bytes=scale.offload_kv_cache_bytes)
        for topology, state in ((small, "off"),
                                (replace(small, name="colo1_offload",
                                         kv_offload_gib=scale.offload_host_gib), "on")):
            add(topology, BenchRun(f"{experiment}__{state}", experiment,
                                   f"colocated, small KV cache, offload {state}", "colocated",
                                   data, scale.offload_rate))
    elif experiment == "prefix_affinity":
        data = _small_cache_workload(scale, seed + 700)
        pair = Topology("colo2_smallkv", colocated=2, kv_cache_bytes=scale.offload_kv_cache_bytes)
        for topology, label in ((pair, "round robin"),
                                (replace(pair, name="colo2_affinity",
                                         routing="prefix_affinity"), "prefix affinity")):
            add(topology, BenchRun(f"{experiment}__{topology.routing}", experiment,
                                   f"2x colocated, small KV caches, {label}", PROXY, data,
                                   scale.offload_rate))
    else:
        raise ValueError(f"unknown experiment {experiment!r}; choose from {ALL_EXPERIMENTS}")
    return runs


def _sweep_points(scale: Scale, sweep_name: str, seed: int
                  ) -> list[tuple[float, DatasetConfig]]:
    """goodput_2k's or goodput_8k's points: each rate and its prompts. Every experiment that
    sweeps the same workload (overflow_2k, goodput_2k_2p1d) takes these, so its runs send the
    same prompts at each rate as goodput_2k's and are compared with them."""
    sweep, base = ((scale.sweep_2k, seed + 200) if sweep_name == "goodput_2k"
                   else (scale.sweep_8k, seed + 300))
    return [(rate, _random(scale.point_prompts(rate), sweep.input_len, sweep.output_len,
                           base + index))
            for index, rate in enumerate(sweep.rates)]


def _small_cache_workload(scale: Scale, seed: int) -> DatasetConfig:
    """prefix_repetition whose prefixes overflow one worker's small device KV cache
    (``offload_*`` sizes): the kv_offload and prefix_affinity experiments."""
    return DatasetConfig(name="prefix_repetition", num_prompts=scale.offload_prompts,
                         seed=seed, prefix_len=scale.offload_prefix_len,
                         suffix_len=scale.offload_suffix_len,
                         num_prefixes=scale.offload_num_prefixes,
                         prefix_output_len=scale.offload_output)


def build_plan(scale: Scale, experiments: tuple[str, ...] = EXPERIMENTS, seed: int = 0
               ) -> list[TopologyPlan]:
    """Topologies in launch order, each with its runs (experiments in the given order)."""
    collected: dict[Topology, list[BenchRun]] = {}
    for experiment in experiments:
        for topology, runs in _runs(scale, experiment, seed).items():
            collected.setdefault(topology, []).extend(runs)
    # The report's fixed topologies in their order, then the extra experiments' ones.
    rank = {t: index for index, t in enumerate(TOPOLOGY_ORDER)}
    ordered = sorted(collected, key=lambda t: rank.get(t, len(rank)))
    return [TopologyPlan(t, tuple(collected[t])) for t in ordered]
