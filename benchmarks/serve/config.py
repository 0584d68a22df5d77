"""``pdserve bench serve`` flags (vLLM's ``bench serve`` names) and the frozen config they build."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

DATASETS = ("random", "sharegpt", "prefix_repetition", "lognormal")
METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
CHAT_BACKENDS = ("openai-chat",)
BACKENDS = ("openai", "vllm", "openai-chat")


@dataclass(frozen=True)
class DatasetConfig:
    """What prompts to send; lengths in tokens."""

    name: str = "random"
    path: str | None = None
    num_prompts: int = 1000
    seed: int = 0
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    prefix_output_len: int = 128
    sharegpt_output_len: int | None = None
    # lognormal: random tokens, lengths lognormal around random_input_len / random_output_len
    # (their medians) like chat traffic, inputs capped at lognormal_max_input_len.
    lognormal_sigma: float = 1.0
    lognormal_max_input_len: int = 8192


@dataclass(frozen=True)
class BenchConfig:
    """One ``bench serve`` invocation; ``request_rates`` has several entries for a sweep."""

    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None              # None: the first of GET /v1/models
    served_model_name: str | None = None  # name sent in requests (default: model)
    tokenizer: str | None = None
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    chat: bool = False
    request_rates: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    max_concurrency: int | None = None
    goodput: dict[str, float] = field(default_factory=dict)  # metric -> SLO in ms
    ignore_eos: bool = False
    temperature: float = 0.0
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    metric_percentiles: tuple[float, ...] = (99.0,)
    num_warmups: int = 0
    ready_check_timeout_s: float = 600.0
    request_id_prefix: str = "bench-"
    api_key: str | None = None
    label: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    save_result: bool = False
    save_detailed: bool = False
    result_dir: str | None = None
    result_filename: str | None = None
    plot: bool = True
    disable_tqdm: bool = False
    request_timeout_s: float = 6 * 3600.0
    # Every odd-numbered request goes here instead (the report's proxy A/B): both targets
    # then see one arrival process and one server state, and the result splits the metrics.
    interleave_base_url: str | None = None

    @property
    def url(self) -> str:
        """Where requests go."""
        return self.base_url.rstrip("/") + self.endpoint

    def url_for(self, index: int) -> str:
        """Where request ``index`` goes: ``url``, or every other one to the interleaved target."""
        if self.interleave_base_url is None or index % 2 == 0:
            return self.url
        return self.interleave_base_url.rstrip("/") + self.endpoint


def parse_rates(text: str) -> tuple[float, ...]:
    """``inf``, ``4`` or a sweep ``1,2,4,8`` (requests per second)."""
    rates = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        rate = float(part)
        if not rate > 0:
            raise argparse.ArgumentTypeError(f"request rates must be > 0 or inf, got {part!r}")
        rates.append(rate)
    if not rates:
        raise argparse.ArgumentTypeError("give at least one request rate")
    return tuple(rates)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:1000", "tpot:40"]`` -> ``{"ttft": 1000.0, "tpot": 40.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {GOODPUT_METRICS}, got {item!r}")
        slo = float(value)
        if slo < 0:
            raise ValueError(f"--goodput {name} must be >= 0 ms, got {value}")
        slos[name] = slo
    return slos


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pdserve bench serve``: vLLM's names and defaults where vLLM has them,
    but for --port: ``pdserve launch``'s proxy port, the server a pdserve user measures."""
    from proxy.config import ProxyConfig

    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default=None, help="server URL (overrides --host/--port)")
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=ProxyConfig.port,
                        help="server port (default: pdserve launch's proxy port, %(default)s)")
    target.add_argument("--endpoint", default="/v1/completions",
                        help="/v1/completions or /v1/chat/completions")
    target.add_argument("--backend", choices=BACKENDS, default=None,
                        help="openai|vllm: completions; openai-chat: chat (default: from --endpoint)")
    target.add_argument("--model", default=None,
                        help="model name to request (default: the server's first model)")
    target.add_argument("--served-model-name", default=None,
                        help="name sent in requests when --model is a tokenizer path")
    target.add_argument("--tokenizer", default=None,
                        help="local tokenizer directory (default: --model when it is one; the "
                             "embedded models' for their served names)")
    target.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=DATASETS, default="random")
    data.add_argument("--dataset-path", default=None, help="ShareGPT JSON file")
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-r), len*(1+r)]")
    data.add_argument("--random-prefix-len", type=int, default=0,
                      help="tokens of one shared prefix before every random prompt")
    data.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    data.add_argument("--prefix-repetition-output-len", type=int, default=128)
    data.add_argument("--sharegpt-output-len", type=int, default=None,
                      help="override each ShareGPT request's output length")
    load = parser.add_argument_group("traffic")
    load.add_argument("--request-rate", type=parse_rates, default=(math.inf,),
                      help="requests/s: inf (all at once), a rate, or a sweep such as 1,2,4,8")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, >1 steadier")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="most requests in flight (later arrivals wait)")
    load.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--num-warmups", type=int, default=0, help="requests sent before measuring")
    load.add_argument("--ready-check-timeout-sec", type=float, default=600.0,
                      help="retry a first request this long until the server answers (0: skip)")
    load.add_argument("--request-id-prefix", default="bench-", help="X-Request-Id prefix")
    out = parser.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                     help="SLOs for goodput, e.g. ttft:1000 tpot:40 e2el:20000")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                     help=f"comma-separated subset of {','.join(METRICS)}")
    out.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99")
    out.add_argument("--save-result", action="store_true", help="write JSON (and PNG plots)")
    out.add_argument("--save-detailed", action="store_true",
                     help="also keep every ITL and error per request in the JSON")
    out.add_argument("--result-dir", default=None, help="where results go (default: results/serve)")
    out.add_argument("--result-filename", default=None, help="JSON name (a sweep adds -RATEqps)")
    out.add_argument("--label", default=None, help="name of this run in results and plots")
    out.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE",
                     help="extra fields stored in the JSON")
    out.add_argument("--no-plot", action="store_true", help="no PNGs with --save-result")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Validate parsed flags into a ``BenchConfig``; ``ValueError`` names the bad flag."""
    metrics = tuple(_csv(args.percentile_metrics))
    unknown = sorted(set(metrics) - set(METRICS))
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; choose from {METRICS}")
    percentiles = tuple(float(p) for p in _csv(args.metric_percentiles))
    if any(not 0 <= p <= 100 for p in percentiles):
        raise ValueError("--metric-percentiles must lie in [0, 100]")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    metadata = {}
    for item in args.metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata takes KEY=VALUE, got {item!r}")
        metadata[key] = value
    chat = (args.backend in CHAT_BACKENDS if args.backend
            else args.endpoint.rstrip("/").endswith("chat/completions"))
    dataset = DatasetConfig(
        name=args.dataset_name, path=args.dataset_path, num_prompts=args.num_prompts,
        seed=args.seed, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len,
        prefix_len=args.prefix_repetition_prefix_len,
        suffix_len=args.prefix_repetition_suffix_len,
        num_prefixes=args.prefix_repetition_num_prefixes,
        prefix_output_len=args.prefix_repetition_output_len,
        sharegpt_output_len=args.sharegpt_output_len)
    return BenchConfig(
        base_url=args.base_url or f"http://{args.host}:{args.port}", endpoint=args.endpoint,
        model=args.model, served_model_name=args.served_model_name, tokenizer=args.tokenizer,
        dataset=dataset, chat=chat, request_rates=tuple(args.request_rate),
        burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        goodput=parse_goodput(args.goodput), ignore_eos=args.ignore_eos,
        temperature=args.temperature, percentile_metrics=metrics,
        metric_percentiles=percentiles, num_warmups=args.num_warmups,
        ready_check_timeout_s=args.ready_check_timeout_sec,
        request_id_prefix=args.request_id_prefix, api_key=args.api_key, label=args.label,
        metadata=metadata, save_result=args.save_result, save_detailed=args.save_detailed,
        result_dir=args.result_dir, result_filename=args.result_filename,
        plot=not args.no_plot, disable_tqdm=args.disable_tqdm)
