"""The flags ``pdserve launch`` forwards to the processes it starts.

Each child keeps its own flag definitions; launch reuses them (the proxy's routing,
limit and timeout flags, the workers' cluster-wide server flags, the engine flags), passes
on only what the user changed, and checks it as the child would before anything starts.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    """The proxy's own flag definitions (``pdserve proxy``'s), but for the addresses launch
    assigns; and --heartbeat-timeout defaults to one derived from --heartbeat-interval."""
    from proxy.__main__ import add_proxy_policy_args

    group = parser.add_argument_group(
        "proxy", "passed to the proxy when given (see pdserve proxy --help); --port and "
        "--registration-port above are its ports")
    add_proxy_policy_args(group)
    timeout = _options(parser)["--heartbeat-timeout"]
    timeout.default = None
    timeout.help = (f"{timeout.help} (default: max({MIN_HEARTBEAT_TIMEOUT_S:g}, "
                    f"{HEARTBEAT_TIMEOUTS_PER_INTERVAL} x --heartbeat-interval))")


def add_worker_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The workers' cluster-wide server flags, as ``pdserve serve`` defines them; one the
    proxy takes too (--body-timeout) is the proxy group's flag, and goes to both."""
    from proxy.__main__ import add_proxy_policy_args

    proxy_flags = _options(_probe(add_proxy_policy_args))
    actions = worker_server_actions()
    shared = [flag for flag in actions if flag in proxy_flags]
    group = parser.add_argument_group(
        "worker servers", "passed to every worker when given (see pdserve serve --help)"
        + (f"; so are the proxy's {', '.join(shared)}" if shared else ""))
    for flag, action in actions.items():
        if flag not in proxy_flags:
            group._add_action(action)  # the server's Action itself: its type, default, help


# The workers' server flags that are cluster-wide settings, forwarded to every worker (those
# their server takes). Not forwarded: --host and --port,
# which launch assigns, and --api-key and --enable-admin-endpoints, which reach every worker
# from VLLM_API_KEY and VLLM_SERVER_DEV_MODE in the environment (not in `ps`).
WORKER_SERVER_FLAGS = ("--max-request-body-bytes", "--log-stats-interval", "--body-timeout",
                       "--header-timeout", "--write-timeout", "--engine-startup-timeout",
                       "--shutdown-timeout", "--chat-template", "--enable-auto-tool-choice",
                       "--tool-call-parser", "--grammar-import-delay")
# The proxy drops a worker after max(10 s, 3 heartbeat intervals) without a heartbeat unless
# --heartbeat-timeout says otherwise: a worker heartbeating every interval is not dropped in
# between.
MIN_HEARTBEAT_TIMEOUT_S = 10.0
HEARTBEAT_TIMEOUTS_PER_INTERVAL = 3


def _probe(add_arguments: Callable[[argparse.ArgumentParser], object],
           exit_on_error: bool = True) -> argparse.ArgumentParser:
    """A parser with only ``add_arguments``'s flags: a child's definitions to read or check."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=exit_on_error)
    add_arguments(parser)
    return parser


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """``parser``'s optional flags by their first name."""
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings}


def worker_server_actions() -> dict[str, argparse.Action]:
    """The definitions of ``WORKER_SERVER_FLAGS`` that launch parses with: the proxy's where
    the proxy takes the flag too (one flag for both), else the workers' server's."""
    from engine_core.server.server_args import add_server_arguments
    from proxy.__main__ import add_proxy_policy_args

    server = _options(_probe(add_server_arguments))
    proxy = _options(_probe(add_proxy_policy_args))
    return {flag: proxy.get(flag, server[flag]) for flag in WORKER_SERVER_FLAGS
            if flag in server}


def changed_argv(args: argparse.Namespace, actions: Iterable[argparse.Action]) -> list[str]:
    """The flags of ``actions`` whose value in ``args`` is not their default, as argv: what
    the user gave, so a child keeps its own default for the rest."""
    argv: list[str] = []
    for action in actions:
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif action.nargs == 0:
            argv.append(flag)
        else:
            argv += [flag, *(map(str, value) if isinstance(value, list) else [str(value)])]
    return argv


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags the user changed, as argv for the workers; launch sets each worker's
    --kv-transfer-config and --tensor-parallel-size itself."""
    from engine_core.arg_utils import add_engine_args

    assigned = ("kv_transfer_config", "tensor_parallel_size")
    actions = _probe(add_engine_args)._actions
    return changed_argv(args, [a for a in actions if a.dest not in assigned])


def placed_worker_argv(args: argparse.Namespace) -> list[str]:
    """Flags for the workers the proxy places requests on (``--workers``): their
    ``--decode-step-target-ms``, the step time the placement plans to (the proxy's
    ``--slo-tpot-ms`` less its headroom, ``PlacementConfig.decode_step_target_s``), unless
    the user gave one (it reaches every worker with the other engine flags)."""
    from proxy.placement import PlacementConfig

    if args.decode_step_target_ms is not None:
        return []
    target_s = PlacementConfig(slo_tpot_s=args.slo_tpot_ms / 1e3).decode_step_target_s
    return ["--decode-step-target-ms", f"{target_s * 1e3:g}"]


def _parse_as_child(argv: list[str],
                    add_arguments: Callable[[argparse.ArgumentParser], object]
                    ) -> argparse.Namespace:
    """``argv`` parsed with a child's own flag definitions: a value the child would refuse
    stops the launch now, with the child's reason, instead of the child at startup."""
    try:
        return _probe(add_arguments, exit_on_error=False).parse_args(argv)
    except argparse.ArgumentError as exc:
        raise SystemExit(f"pdserve launch: {exc}") from None


def _seconds_text(value: float) -> str:
    """``value`` as short text that parses back to it ("10", not "10.0")."""
    text = f"{value:g}"
    return text if float(text) == value else repr(value)


def heartbeat_timeout(args: argparse.Namespace) -> float:
    """The proxy's --heartbeat-timeout: the user's, else derived from --heartbeat-interval.
    One not above the interval is refused: the proxy would drop workers between heartbeats."""
    if args.heartbeat_timeout is None:
        return max(MIN_HEARTBEAT_TIMEOUT_S,
                   HEARTBEAT_TIMEOUTS_PER_INTERVAL * args.heartbeat_interval)
    if not args.heartbeat_timeout > args.heartbeat_interval:
        raise SystemExit(f"pdserve launch: --heartbeat-timeout {args.heartbeat_timeout:g} must "
                         f"exceed --heartbeat-interval {args.heartbeat_interval:g}")
    return args.heartbeat_timeout


def proxy_argv(args: argparse.Namespace) -> list[str]:
    """The proxy's routing, limit and timeout flags the user gave, plus its
    --heartbeat-timeout; checked as ``pdserve proxy`` checks them (``ProxyConfig``)."""
    from engine_core.errors import ConfigError
    from proxy.__main__ import add_proxy_args, add_proxy_policy_args, config_from_args

    actions = [a for a in _probe(add_proxy_policy_args)._actions
               if a.dest != "heartbeat_timeout"]
    argv = [*changed_argv(args, actions),
            "--heartbeat-timeout", _seconds_text(heartbeat_timeout(args))]
    try:
        config_from_args(_parse_as_child(argv, add_proxy_args))
    except ConfigError as exc:
        raise SystemExit(f"pdserve launch: {exc}") from None
    return argv


# Behind the proxy a worker's stream is read by the proxy, which stops reading it while its
# own write to a slow client waits: the worker's write bound must outlast the proxy's, or
# the worker aborts a request the client is still reading (and the proxy reports D failed).
WORKER_WRITE_TIMEOUT_FACTOR = 2.0


def _behind_the_proxy(argv: list[str], write_timeout_s: float) -> list[str]:
    """``argv`` with the workers' ``--write-timeout`` at ``WORKER_WRITE_TIMEOUT_FACTOR``
    times the proxy's (given or default), so the proxy, which sees the client, decides."""
    if "--write-timeout" in argv:
        at = argv.index("--write-timeout")
        argv = argv[:at] + argv[at + 2:]
    return [*argv, "--write-timeout", f"{WORKER_WRITE_TIMEOUT_FACTOR * write_timeout_s:g}"]


def worker_server_argv(args: argparse.Namespace) -> list[str]:
    """The workers' server flags the user gave, as argv for every worker; checked as the
    workers' server checks them (``ServerOptions``)."""
    from engine_core.errors import ConfigError
    from engine_core.server.server_args import add_server_arguments, server_options

    given = args.shutdown_timeout != worker_server_actions()["--shutdown-timeout"].default
    if given and not args.shutdown_timeout < args.stop_timeout:  # drain before launch kills
        raise SystemExit(f"pdserve launch: --shutdown-timeout {args.shutdown_timeout:g} must "
                         f"be below --stop-timeout {args.stop_timeout:g}")
    argv = changed_argv(args, worker_server_actions().values())
    argv = _behind_the_proxy(argv, args.write_timeout)
    try:
        server_options(_parse_as_child(argv, add_server_arguments))
    except ConfigError as exc:
        raise SystemExit(f"pdserve launch: {exc}") from None
    return argv
