"""The ``pdserve`` command line: the only place that reads environment variables.

Subcommands are a table: each row names a module and the two functions in it that add the
subcommand's flags and run it, so a new subcommand is one more row.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence

logger = logging.getLogger("pdserve.cli")

# name -> (help, "module:add_arguments", "module:run"); run(args) returns the exit code.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("serve one model with the OpenAI-compatible API (colocated prefill+decode)",
              "deploy.cli:add_serve_arguments", "deploy.cli:run_serve"),
    "prefill": ("one prefill worker (kv_producer)", "prefill.worker:add_worker_arguments", "prefill.worker:run"),
    "decode": ("one decode worker (kv_consumer)", "decode.worker:add_worker_arguments", "decode.worker:run"),
    "worker": ("one worker that prefills for others, decodes what others prefilled and serves "
               "whole requests, as the proxy places them (kv_both)",
               "engine_core.server.worker:add_worker_arguments", "deploy.cli:run_worker"),
    "launch": ("proxy + N workers (or N prefill + M decode workers) on this host", "deploy.launch:add_launch_arguments", "deploy.launch:run_launch"),
    "proxy": ("run the prefill/decode proxy (OpenAI API, ZMQ worker registration)",
              "proxy.__main__:add_proxy_args", "proxy.__main__:run_proxy"),
    "bench": ("benchmarks: `bench serve` measures an OpenAI server (vLLM's bench serve flags)",
              "benchmarks.serve.cli:add_bench_arguments", "benchmarks.serve.cli:run_bench"),
}

def _resolve(target: str) -> Callable:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``pdserve serve``: vLLM's names."""
    from engine_core.arg_utils import add_engine_args, add_model_arguments, positive_seconds
    from engine_core.cluster.trust_flags import add_cluster_trust_args
    from engine_core.server.server_args import add_server_arguments
    from engine_core.server.worker import proxy_address

    add_model_arguments(parser)
    add_server_arguments(parser)
    add_cluster_trust_args(parser)
    parser.add_argument("--proxy-address", default=None, type=proxy_address,
                        help="register with this proxy (registration HOST:PORT; several "
                             "comma-separated: with each) as a colocated worker: it sends "
                             "whole requests here (with a P/D role in --kv-transfer-config: as "
                             "that worker, overriding proxy_ip/port and proxy_addresses)")
    parser.add_argument("--heartbeat-interval", type=positive_seconds, default=3.0,
                        help="seconds between heartbeats to the proxy")
    add_engine_args(parser)


def run_serve(args: argparse.Namespace) -> int:
    """``pdserve serve``: resolve the model, then run the API server until stopped."""
    from engine_core.arg_utils import engine_config_from_args, resolve_model_argument
    from engine_core.errors import PdserveError
    from engine_core.server.api_server import run_server
    from engine_core.server.server_args import server_options

    try:
        options = server_options(args)
        started = time.monotonic()
        resolve_model_argument(args)
        config = engine_config_from_args(args)
        logger.info("Model %s ready in %.2fs at %s", config.model.name,
                    time.monotonic() - started, config.model.model)
        kv = config.kv_transfer
        if kv is not None:
            # vLLM-style `serve ... --kv-transfer-config` starts the worker its kv_role names
            # (kv_both: `pdserve worker`), with the flags `pdserve prefill|decode|worker`
            # would apply (--proxy-address, --port).
            from connectors import create_connector
            from engine_core.server.worker import (
                serve_worker,
                with_cluster_secret,
                worker_kv_config,
            )

            config = dataclasses.replace(
                config, kv_transfer=worker_kv_config(kv, kv.kv_role, args))
            serve_worker(with_cluster_secret(config, options, args), options, create_connector,
                         args.heartbeat_interval)
        elif args.proxy_address:
            from engine_core.cluster.trust_flags import cluster_secret_from_args
            from engine_core.server.readiness import Readiness
            from engine_core.server.worker import colocated_hook

            readiness = Readiness()
            run_server(config, options, on_startup=[
                colocated_hook(config, args.proxy_address, args.heartbeat_interval,
                               cluster_secret_from_args(args), readiness)],
                readiness=readiness)
        else:
            run_server(config, options)
    except PdserveError as exc:
        logger.error("%s", exc)
        return 1
    return 0


def run_worker(args: argparse.Namespace) -> int:
    """``pdserve worker``: a kv_both worker; the proxy places each request on it."""
    from connectors import create_connector
    from engine_core.server.worker import run_worker as run_role

    return run_role(args, "kv_both", create_connector)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, add_arguments, _) in SUBCOMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        _resolve(add_arguments)(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point."""
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from engine_core.server.server_args import apply_environment

    apply_environment(args)
    return int(_resolve(SUBCOMMANDS[args.command][2])(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
