"""The HTTP server's flags, shared by ``pdserve serve`` and the prefill/decode workers, so
every server takes the same ones (vLLM's names) and builds its ``ServerOptions`` one way.

Environment variables (``VLLM_API_KEY``, ``VLLM_SERVER_DEV_MODE``,
``VLLM_ENGINE_READY_TIMEOUT_S``, ``PDSERVE_CLUSTER_SECRET_FILE`` and the engine's of
``arg_utils.engine_environment``) are folded into these flags by ``apply_environment``, the
one place that reads them (``pdserve``, ``python -m prefill|decode`` and ``python -m proxy``
call it).
"""

from __future__ import annotations

import argparse
import math
import os

from engine_core.arg_utils import engine_environment, positive_seconds
from engine_core.cluster.trust import secret_file_path
from engine_core.engine_client import DEFAULT_STARTUP_TIMEOUT_S
from engine_core.errors import ConfigError
from engine_core.server.api_server import ServerOptions
from engine_core.server.http_runner import DEFAULT_HEADER_TIMEOUT_S
from engine_core.server.tool_parsers import TOOL_PARSERS
from engine_core.server.tools import ToolCallOptions

# vLLM's name for the engine startup timeout: the default of --engine-startup-timeout, so a
# vLLM deployment's setting carries over.
ENGINE_READY_TIMEOUT_ENV = "VLLM_ENGINE_READY_TIMEOUT_S"


def apply_environment(args: argparse.Namespace) -> None:
    """vLLM's environment variables as the server flags they stand for (a flag given on the
    command line wins); for every command that runs an API server."""
    if hasattr(args, "api_key"):
        args.api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None
    if hasattr(args, "enable_admin_endpoints"):
        args.enable_admin_endpoints = (args.enable_admin_endpoints
                                       or _env_flag("VLLM_SERVER_DEV_MODE"))
    if hasattr(args, "engine_startup_timeout") and args.engine_startup_timeout is None:
        args.engine_startup_timeout = _env_seconds(ENGINE_READY_TIMEOUT_ENV)
    if hasattr(args, "cluster_secret_file"):
        args.cluster_secret_file = secret_file_path(args.cluster_secret_file, os.environ)
    if hasattr(args, "triton_pdl"):  # the command runs an engine
        for name, value in engine_environment(os.environ).items():
            setattr(args, name, value)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _env_seconds(name: str) -> float | None:
    """``name``'s value as seconds > 0, None when unset or empty. A bad value is an error:
    ignored, it would leave the user believing in a timeout they do not get."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return positive_seconds(raw)
    except (ValueError, argparse.ArgumentTypeError):
        raise SystemExit(f"pdserve: {name}={raw!r}: must be a number of seconds > 0") from None


def non_negative_seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def delay_seconds(text: str) -> float:
    """argparse type: ``non_negative_seconds``, or ``inf`` (never)."""
    return math.inf if text.strip().lower() == "inf" else non_negative_seconds(text)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                             "and /ping (or VLLM_API_KEY); admin routes need it always: without "
                             "a key they answer loopback clients only")
    parser.add_argument("--enable-admin-endpoints", action="store_true",
                        help="expose /reset_prefix_cache, /sleep, /wake_up, /is_sleeping "
                             "(or VLLM_SERVER_DEV_MODE=1); they still need the API key")
    parser.add_argument("--max-request-body-bytes", type=int, default=32 << 20,
                        help="largest accepted request body")
    parser.add_argument("--log-stats-interval", type=float, default=10.0,
                        help="seconds between throughput log lines (0 disables)")
    parser.add_argument("--body-timeout", type=positive_seconds,
                        default=ServerOptions.body_timeout_s, metavar="SECONDS",
                        help="how long a client may take to send its whole request body "
                             "(408 beyond)")
    add_header_timeout_argument(parser)
    add_tool_arguments(parser)
    parser.add_argument("--write-timeout", type=positive_seconds,
                        default=ServerOptions.write_timeout_s, metavar="SECONDS",
                        help="how long a streamed answer's client may take no bytes; past "
                             "that the client (not reading, its window full) "
                             "is disconnected and its engine requests aborted, freeing their "
                             "KV blocks")
    parser.add_argument("--engine-startup-timeout", type=positive_seconds, default=None,
                        metavar="SECONDS",
                        help="how long the engine process may take to load the model and "
                             "start before the server gives up and exits 1 (default: "
                             f"VLLM_ENGINE_READY_TIMEOUT_S, else {DEFAULT_STARTUP_TIMEOUT_S:g})")
    parser.add_argument("--shutdown-timeout", type=non_negative_seconds,
                        default=ServerOptions.shutdown_drain_s, metavar="SECONDS",
                        help="on SIGTERM: new requests are refused (503) and a worker "
                             "deregisters from its proxy; the requests in flight may finish "
                             "and their KV be released for this long, then the rest end with "
                             "an error (0: at once). Keep it below the supervisor's grace "
                             "period (a pod's terminationGracePeriodSeconds)")
    parser.add_argument("--grammar-import-delay", type=delay_seconds,
                        default=ServerOptions.grammar_import_delay_s, metavar="SECONDS",
                        help="seconds after startup the server imports the grammar engine "
                             "(xgrammar: about 1 s of CPU and 240 MB of memory), so the first "
                             "request with a response_format, guided_* field or forced tool "
                             "choice does not wait for it; inf: only when such a request "
                             "comes (for workers that never serve one)")


def add_tool_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's chat flags: the chat template and how tool calls are read from answers."""
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template (a file, or the template itself) used in "
                             "place of the tokenizer's; e.g. one that renders tools")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='serve tool_choice="auto" (the default when a request has '
                             "tools): the model decides, --tool-call-parser reads its calls")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="how the model writes tool calls: hermes (Qwen, Hermes: "
                             "<tool_call> tags), llama3_json (Llama 3.x JSON calls)")


def chat_template_text(value: str | None) -> str | None:
    """``--chat-template``'s template: a file's text, or the value itself when it is a
    template (it has a Jinja brace)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as file:
            return file.read()
    if "{" in value:
        return value
    raise ConfigError(f"--chat-template {value!r:.200}: no such file, and not a template")


def add_header_timeout_argument(parser: argparse._ActionsContainer) -> None:
    """``--header-timeout``, taken by the workers' servers and the proxy alike."""
    parser.add_argument("--header-timeout", type=positive_seconds,
                        default=DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                        help="how long a client may take to send a request line and headers, "
                             "from its connection's opening or its request's first byte (408 "
                             "and the connection closed beyond)")


def server_options(args: argparse.Namespace) -> ServerOptions:
    """``ServerOptions`` from the flags of ``add_server_arguments``."""
    return ServerOptions(host=args.host, port=args.port, api_key=args.api_key or None,
                         enable_admin_endpoints=args.enable_admin_endpoints,
                         client_max_size=args.max_request_body_bytes,
                         log_stats_interval_s=args.log_stats_interval,
                         body_timeout_s=args.body_timeout,
                         header_timeout_s=args.header_timeout,
                         write_timeout_s=args.write_timeout,
                         shutdown_drain_s=args.shutdown_timeout,
                         engine_startup_timeout_s=(args.engine_startup_timeout
                                                   or DEFAULT_STARTUP_TIMEOUT_S),
                         tool_calls=ToolCallOptions(args.enable_auto_tool_choice,
                                                    args.tool_call_parser),
                         chat_template=chat_template_text(args.chat_template),
                         grammar_import_delay_s=args.grammar_import_delay)
