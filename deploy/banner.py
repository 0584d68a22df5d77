"""What ``pdserve launch`` prints once the cluster is ready: every process's address and
metrics URL, a request to try, and the ``pdserve bench serve`` command aimed at this proxy.

Pure text from the launch's values, so its lines are tested without starting anything.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from deploy.supervisor import Child

# On CPU the benchmark's defaults (1,000 prompts of 1,024 tokens) take hours: the banner's
# command asks for a load a CPU cluster finishes in minutes.
CPU_BENCH_FLAGS = ("--num-prompts", "32", "--random-input-len", "256",
                   "--random-output-len", "64")


@dataclass(frozen=True)
class Endpoint:
    """One launched process as the banner shows it."""

    name: str        # proxy, prefill0, decode1, worker0, colocated0, ...
    role: str        # proxy, prefill, decode, worker or colocated
    http_url: str    # http://host:port

    @property
    def metrics_url(self) -> str:
        """Its Prometheus endpoint (the proxy and every worker serve one)."""
        return f"{self.http_url}/metrics"


def worker_endpoint(name: str, http_address: str) -> Endpoint:
    """A launched worker's endpoint: its role is its name without the index
    (``prefill0`` -> ``prefill``)."""
    return Endpoint(name, name.rstrip("0123456789"), f"http://{http_address}")


def bench_tokenizer(served_model: str, model: str) -> str | None:
    """The ``--tokenizer`` the banner's bench command needs: None when ``pdserve bench serve``
    finds the tokenizer from the served name itself (a local path, an embedded model's
    name), else the launched model."""
    from benchmarks.serve.datasets import resolve_tokenizer_path
    from engine_core.errors import ModelLoadError

    if served_model == model:
        return None
    try:
        found = resolve_tokenizer_path(None, served_model)
    except ModelLoadError:  # an embedded model's name, that model not installed here
        found = None
    return None if found is not None else model


def bench_command(proxy_url: str, served_model: str, tokenizer: str | None = None,
                  on_cpu: bool = False) -> str:
    """The ``pdserve bench serve`` command that measures this proxy; ``tokenizer`` when the
    benchmark cannot find it from the served name (a local checkpoint served under
    another name)."""
    argv = ["pdserve", "bench", "serve", "--base-url", proxy_url, "--model", served_model]
    if tokenizer is not None:
        argv += ["--tokenizer", tokenizer]
    if on_cpu:
        argv += CPU_BENCH_FLAGS
    return shlex.join(argv)


def ready_banner(description: str, proxy: Endpoint, workers: Sequence[Endpoint],
                 served_model: str, bench: str) -> str:
    """The lines printed once every worker is registered and healthy: one per process (role,
    HTTP address, metrics URL), then a request to try and the benchmark command."""
    rows = [proxy, *workers]
    name_width = max(len(row.name) for row in rows)
    role_width = max(len(row.role) for row in rows)
    url_width = max(len(row.http_url) for row in rows)
    lines = [f"pdserve launch: ready: {description} at {proxy.http_url}"]
    lines += [f"  {row.name:<{name_width}}  {row.role:<{role_width}}  "
              f"{row.http_url:<{url_width}}  metrics {row.metrics_url}" for row in rows]
    body = json.dumps({"model": served_model, "prompt": "Hello", "max_tokens": 16})
    lines += [f"  try:   curl {proxy.http_url}/v1/completions "
              f"-H 'Content-Type: application/json' -d '{body}'",
              f"  bench: {bench}"]
    return "\n".join(lines)


def launch_banner(description: str, proxy_url: str, workers: Sequence[Child],
                  served_model: str, model: str) -> str:
    """``ready_banner`` for launched ``workers``, serving ``model`` as ``served_model``
    behind the proxy at ``proxy_url``."""
    on_cpu = any(_flag(w.argv, "--device") == "cpu" for w in workers)
    bench = bench_command(proxy_url, served_model, bench_tokenizer(served_model, model), on_cpu)
    return ready_banner(description, Endpoint("proxy", "proxy", proxy_url),
                        [worker_endpoint(w.name, w.http_address) for w in workers],
                        served_model, bench)


def _flag(argv: Sequence[str], name: str) -> str | None:
    """The value after the last ``name`` in ``argv`` (argparse keeps the last), or None."""
    at = max((i for i, arg in enumerate(argv[:-1]) if arg == name), default=None)
    return None if at is None else argv[at + 1]
