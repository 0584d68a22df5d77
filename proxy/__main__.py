"""`pdserve proxy` / `python -m proxy`: the disaggregated prefill/decode OpenAI proxy."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from aiohttp import web

from engine_core.cluster.trust import check_exposure
from engine_core.cluster.trust_flags import add_cluster_trust_args, cluster_secret_from_args
from engine_core.errors import ConfigError
from engine_core.server.http_runner import EdgeAppRunner
from engine_core.server.server_args import add_header_timeout_argument, apply_environment
from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.routing import POLICIES

logger = logging.getLogger("proxy")


def add_proxy_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the proxy's flags to ``parser`` (used by ``pdserve proxy``)."""
    d = ProxyConfig()
    parser.add_argument("--host", default=d.host, help="HTTP bind address")
    parser.add_argument("--port", type=int, default=d.port, help="HTTP port of the OpenAI API")
    parser.add_argument("--registration-host", default=None,
                        help="bind address of the ZMQ registration socket (default: --host)")
    parser.add_argument("--registration-port", "--proxy-port", dest="registration_port",
                        type=int, default=d.registration_port,
                        help="ZMQ port workers heartbeat to (their proxy_port)")
    add_cluster_trust_args(parser)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health, "
                        "/ping and /ready (or VLLM_API_KEY), and send it to the workers; "
                        "/instances needs it always: without a key it answers loopback "
                        "clients only")
    add_proxy_policy_args(parser)
    return parser


def add_proxy_policy_args(parser: argparse._ActionsContainer) -> None:
    """Add the proxy's flags other than its addresses: routing, limits, timeouts. Apart, so
    ``pdserve launch`` takes them with the same names, defaults and types and forwards them
    to the proxy it starts (it assigns the addresses itself)."""
    d = ProxyConfig()
    parser.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout_s,
                        help="drop a worker after this many seconds without a heartbeat")
    parser.add_argument("--routing", choices=sorted(POLICIES), default=d.routing,
                        help="how P, D and colocated workers are picked (prefix_affinity: "
                        "requests that begin alike go to the same workers, for their prefix "
                        "caches, unless that worker is much busier)")
    parser.add_argument("--affinity-prefix-chars", type=int, default=d.affinity_prefix_chars,
                        help="prefix_affinity: leading prompt characters that key a route")
    parser.add_argument("--affinity-max-imbalance", type=float,
                        default=d.affinity_max_imbalance,
                        help="prefix_affinity: when the affine worker's load score (in-flight "
                        "legs + queued + 4 x KV usage) exceeds the lowest by more, the least "
                        "loaded worker is used")
    parser.add_argument("--max-workers", type=int, default=d.max_workers,
                        help="registered workers at most; registrations beyond are refused")
    parser.add_argument("--max-inflight", type=int, default=d.max_inflight,
                        help="client requests in flight before answering 429")
    parser.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                        help="largest request body accepted (413 beyond)")
    parser.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                        help="seconds a client may take to send its whole request body once "
                        "its headers arrived (408 beyond; a slow or stalled upload holds an "
                        "--max-inflight slot while it is read)")
    add_header_timeout_argument(parser)
    parser.add_argument("--write-timeout", type=float, default=d.write_timeout_s,
                        help="seconds a streamed answer's client may take no bytes; past that "
                        "the client (not reading, its window full) is "
                        "disconnected and the decode worker's request aborted, instead of "
                        "holding an --max-inflight slot and the worker's KV while it stays")
    parser.add_argument("--prefill-timeout", type=float, default=d.prefill_timeout_s,
                        help="seconds for the whole prefill leg before it is retried elsewhere")
    parser.add_argument("--decode-timeout", type=float, default=d.decode_timeout_s,
                        help="seconds D (or a colocated worker) may go without sending a byte")
    parser.add_argument("--connect-timeout", type=float, default=d.connect_timeout_s,
                        help="seconds to connect to a worker")
    parser.add_argument("--max-attempts", type=int, default=d.max_attempts,
                        help="attempts per request (retries on prefill or connect failures)")
    parser.add_argument("--migration-limit", type=int, default=d.migration_limit,
                        help="times one request may move to another worker when its decode "
                        "leg dies or stalls (a stream continues after the tokens already "
                        "sent, unbroken); 0: never")
    parser.add_argument("--first-byte-timeout", type=float, default=None,
                        help="seconds a streamed decode leg may take to its first event once "
                        "its prompt's KV is ready before the request moves to another worker "
                        "(default: 30 x --slo-ttft-ms, at least 30)")
    parser.add_argument("--stall-timeout", type=float, default=d.stall_timeout_s,
                        help="seconds a streamed decode leg may go between events before the "
                        "request moves to another worker")
    parser.add_argument("--first-token-from-prefill", action=argparse.BooleanOptionalAction,
                        default=d.first_token_from_prefill,
                        help="stream the prefill worker's sampled token of each choice to the "
                        "client as soon as it answers and let the decode worker continue "
                        "after it (streams; stop strings, logprobs, n, penalties and seeds "
                        "as a single worker serves them): colocated's TTFT, while the second "
                        "token waits for the KV transfer. --no-first-token-from-prefill: the "
                        "decode worker computes the first token, its KV transfer overlapping "
                        "the prefill")
    parser.add_argument("--prefill-overflow", type=int, default=d.prefill_overflow,
                        metavar="N",
                        help="when every prefill worker has N prefill legs in flight, send "
                        "the request to a decode worker alone, which prefills it itself "
                        "(conditional disaggregation: P's overload spills to D instead of "
                        "queueing); 0 (default) never")
    parser.add_argument("--slo-ttft-ms", type=float, default=d.slo_ttft_ms,
                        help="placement (workers started with `pdserve worker`): the TTFT "
                        "target; a prefill that would miss it where the request decodes moves "
                        "to a worker that finishes it sooner")
    parser.add_argument("--slo-tpot-ms", type=float, default=d.slo_tpot_ms,
                        help="placement: the target for a request's mean TPOT. Decodes pack "
                        "onto workers whose decode step is within it, so others stay free to "
                        "prefill at full rate; pdserve launch bounds each placed worker's "
                        "steps with decodes to 0.8 of it (--decode-step-target-ms), and a "
                        "prefill goes where it finishes first at those rates. State the "
                        "target you serve to")
    parser.add_argument("--placement-short-prompt-tokens", type=int,
                        default=d.placement_short_prompt_tokens,
                        help="placement: a prompt with at most this many uncached tokens "
                        "(estimated) is served whole where it decodes")


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """The frozen ProxyConfig of parsed flags (the cluster secret read from its file)."""
    return ProxyConfig(
        host=args.host, port=args.port, registration_host=args.registration_host,
        registration_port=args.registration_port, heartbeat_timeout_s=args.heartbeat_timeout,
        routing=args.routing, affinity_prefix_chars=args.affinity_prefix_chars,
        affinity_max_imbalance=args.affinity_max_imbalance, max_inflight=args.max_inflight,
        max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
        header_timeout_s=args.header_timeout, api_key=args.api_key or None,
        write_timeout_s=args.write_timeout,
        prefill_timeout_s=args.prefill_timeout, decode_timeout_s=args.decode_timeout,
        connect_timeout_s=args.connect_timeout, max_attempts=args.max_attempts,
        migration_limit=args.migration_limit, first_byte_timeout_s=args.first_byte_timeout,
        stall_timeout_s=args.stall_timeout,
        first_token_from_prefill=args.first_token_from_prefill,
        prefill_overflow=args.prefill_overflow, slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        placement_short_prompt_tokens=args.placement_short_prompt_tokens,
        max_workers=args.max_workers,
        cluster_secret=cluster_secret_from_args(args), insecure=args.insecure)


def run_proxy(args: argparse.Namespace) -> int:
    """Run the proxy until SIGINT/SIGTERM; return the exit code."""
    from engine_core.server.api_server import check_port_free

    try:
        config = config_from_args(args)
        # The internal plane is the registration socket (the HTTP API is public anyway).
        check_exposure([config.registration_bind_host], config.cluster_secret, config.insecure)
        # A taken port is one clear line, not an asyncio traceback after startup.
        check_port_free(config.host, config.port)
        if config.registration_port:
            check_port_free(config.registration_bind_host, config.registration_port)
    except ConfigError as exc:
        logger.error("%s", exc)
        return 2
    app = create_app(config)
    logger.info("pdserve proxy: http://%s:%d (registration tcp://%s:%s, routing %s)",
                config.host, config.port, config.registration_bind_host,
                config.registration_port, config.routing)
    asyncio.run(serve_app(app, config))
    return 0


async def serve_app(app: web.Application, config: ProxyConfig) -> None:
    """Serve ``app`` on the configured address until SIGINT/SIGTERM."""
    # Handler cancellation makes a client disconnect cancel the handler, which closes both
    # upstream legs so the workers abort the request and free its KV.
    runner = EdgeAppRunner(app, header_timeout_s=config.header_timeout_s,
                           handler_cancellation=True, access_log=None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port).start()
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m proxy``."""
    parser = add_proxy_args(argparse.ArgumentParser(prog="pdserve proxy", description=__doc__))
    args = parser.parse_args(argv)
    apply_environment(args)  # VLLM_API_KEY, PDSERVE_CLUSTER_SECRET_FILE
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise SystemExit(run_proxy(args))


if __name__ == "__main__":
    main()
