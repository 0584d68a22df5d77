"""``pdserve launch``: the proxy plus N prefill and M decode workers on this host.

Each worker is a subprocess (``python -m prefill|decode``) with its own free HTTP and KV
ports, one GPU each (``CUDA_VISIBLE_DEVICES``) or all on CPU. The launcher waits until
every worker is registered with the proxy and healthy, prints the endpoint, watches the
children (reports a death, restarts it with ``--restart``, gives up and exits 1 on a crash
loop past ``--max-restarts``) and on SIGINT/SIGTERM stops everything: terminate, then kill
after a deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

logger = logging.getLogger("pdserve.launch")
HOST = "127.0.0.1"


CLUSTER_SECRET_FILE = "cluster.secret"


def tcp_port(text: str) -> int:
    """A TCP port to listen on: 1-65535 (a bad one used to surface only once the workers
    had started, when the proxy failed to bind)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port in 1-65535")
    return port


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    from engine_core.arg_utils import non_negative_int, positive_int, positive_seconds

    parser.add_argument("--prefill", type=non_negative_int, default=1,
                        help="number of prefill workers")
    parser.add_argument("--decode", type=non_negative_int, default=1,
                        help="number of decode workers")
    parser.add_argument("--colocated", type=non_negative_int, default=0,
                        help="number of colocated workers (pdserve serve; whole requests go to "
                             "them when no P/D pair serves the model)")
    parser.add_argument("--model", default=None, help="HF checkpoint (default: demo model)")
    parser.add_argument("--demo", action="store_true", help="serve the embedded demo model")
    parser.add_argument("--port", type=tcp_port, default=10001, help="proxy HTTP port")
    parser.add_argument("--registration-port", type=tcp_port, default=None,
                        help="proxy registration port (default: a free one)")
    parser.add_argument("--gpus", default=None,
                        help="comma-separated GPU ids, one per worker; an id may repeat "
                             "(default: CUDA_VISIBLE_DEVICES or all)")
    parser.add_argument("--kv-transport", choices=("auto", "nccl", "cpu"), default="auto",
                        help="the P/D data plane: NCCL between GPUs, or bytes over ZMQ "
                             "(CPU workers, or P and D sharing one GPU); auto picks by device")
    parser.add_argument("--restart", action="store_true",
                        help="restart a child that dies (backing off 0.5 s, doubling up to "
                             "30 s), up to --max-restarts per --restart-window")
    parser.add_argument("--max-restarts", type=positive_int, default=None, metavar="N",
                        help="with --restart: a child that needs more than N restarts within "
                             "--restart-window is crash looping; the launcher then stops "
                             f"everything and exits 1 (default {RestartPolicy.max_restarts})")
    parser.add_argument("--restart-window", type=positive_seconds, default=None,
                        metavar="SECONDS",
                        help="with --restart: the window --max-restarts counts restarts in "
                             f"(default {RestartPolicy.window_s:g})")
    parser.add_argument("--log-dir", default=None, help="per-process logs (default: a temp dir)")
    parser.add_argument("--startup-timeout", type=positive_seconds, default=None,
                        help="seconds to wait for every worker to be registered and healthy "
                             "(default: the engine startup timeout + 60, at least "
                             f"{MIN_STARTUP_TIMEOUT_S:g})")
    parser.add_argument("--stop-timeout", type=positive_seconds, default=15.0,
                        help="seconds between SIGTERM and SIGKILL at shutdown")
    parser.add_argument("--heartbeat-interval", type=positive_seconds, default=2.0,
                        help="seconds between a worker's heartbeats (the proxy drops a worker "
                             "after --heartbeat-timeout without one)")
    add_proxy_arguments(parser)
    add_worker_server_arguments(parser)
    from engine_core.arg_utils import add_engine_args

    add_engine_args(parser)  # passed on to every worker (--kv-transfer-config merged per worker)


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
                       "--write-timeout", "--engine-startup-timeout")
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
    """The engine flags the user changed, as argv for the workers."""
    from engine_core.arg_utils import add_engine_args

    actions = _probe(add_engine_args)._actions
    return changed_argv(args, [a for a in actions if a.dest != "kv_transfer_config"])


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

    argv = changed_argv(args, worker_server_actions().values())
    argv = _behind_the_proxy(argv, args.write_timeout)
    try:
        server_options(_parse_as_child(argv, add_server_arguments))
    except ConfigError as exc:
        raise SystemExit(f"pdserve launch: {exc}") from None
    return argv


def free_port() -> int:
    """An ephemeral TCP port on the launch host that was free a moment ago."""
    return free_ports(1)[0]


def free_ports(count: int, avoid: tuple[int, ...] = ()) -> list[int]:
    """``count`` distinct ephemeral ports that were free a moment ago, none in ``avoid``.
    All are held open until the last is picked: picked one at a time and released at once,
    the OS handed the same port out twice in ~3.5% of 16-worker launches, and the second
    worker died at startup."""
    sockets: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < count:
            sock = socket.socket()
            sockets.append(sock)
            sock.bind((HOST, 0))
            port = sock.getsockname()[1]
            if port not in avoid:
                ports.append(port)
        return ports
    finally:
        for sock in sockets:
            sock.close()


def detect_gpus(spec: str | None) -> list[str]:
    if spec:
        return [g.strip() for g in spec.split(",") if g.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:
        return []


def cpu_thread_env(base_env: dict[str, str], num_workers: int) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for CPU workers sharing this host: its cores split between them.

    Each worker's engine would otherwise run one torch thread per core; N such engines
    oversubscribe the cores and OpenMP threads spin at every op's barrier (3 workers on 2
    cores decoded 30-60x slower). A value the user exported stands.
    """
    if "OMP_NUM_THREADS" in base_env:
        return {}
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return {"OMP_NUM_THREADS": str(max(1, cores // max(1, num_workers)))}


def die_with_parent() -> None:
    """In the child: get SIGTERM when the launcher dies, even by SIGKILL (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


# --restart backs off: a child that dies again soon after a restart waits twice as long
# each time, up to RESTART_MAX_DELAY_S (a crash loop restarted every 0.5 s floods its log
# and the GPU's startup work); one that ran RESTART_RESET_S counts as healthy again.
RESTART_FIRST_DELAY_S = 0.5
RESTART_MAX_DELAY_S = 30.0
RESTART_RESET_S = 60.0


def restart_delay(restarts: int, ran_s: float) -> tuple[float, int]:
    """(seconds to wait before starting a child that died after running ``ran_s``,
    its restart count after this one) given the restarts it had so far."""
    if ran_s >= RESTART_RESET_S:
        restarts = 0
    return min(RESTART_FIRST_DELAY_S * 2 ** restarts, RESTART_MAX_DELAY_S), restarts + 1


# The cluster's startup wait is at least this, and covers the workers' own engine startup
# timeout (a longer --engine-startup-timeout would otherwise be cut short by launch).
MIN_STARTUP_TIMEOUT_S = 300.0
STARTUP_MARGIN_S = 60.0


def engine_startup_timeout(args: argparse.Namespace) -> float:
    """The workers' engine startup timeout (flag, else VLLM_ENGINE_READY_TIMEOUT_S folded in
    by the CLI, else the engine's default)."""
    from engine_core.engine_client import DEFAULT_STARTUP_TIMEOUT_S

    return getattr(args, "engine_startup_timeout", None) or DEFAULT_STARTUP_TIMEOUT_S


def startup_timeout(args: argparse.Namespace) -> float:
    """How long launch waits for the cluster: ``--startup-timeout``, else long enough for
    the workers' engines to load."""
    if args.startup_timeout is not None:
        return args.startup_timeout
    return max(MIN_STARTUP_TIMEOUT_S, engine_startup_timeout(args) + STARTUP_MARGIN_S)


@dataclass(frozen=True)
class RestartPolicy:
    """The bound on ``--restart``: at most ``max_restarts`` restarts of one child within
    any ``window_s`` seconds.

    Why a bound: backoff alone restarted a worker that can never come up (a model that no
    longer fits, a bad checkpoint) every 30 s for ever, and the launcher kept running, so
    the supervisor above it (systemd, Kubernetes) and the operator never saw a failure. A
    window, not a lifetime count: a worker that dies once a day is restarted every time.
    5 in 10 minutes covers a crash loop of models that take minutes to load."""

    max_restarts: int = 5
    window_s: float = 600.0
    # A run shorter than this counts as a failed start. More than max_restarts failed starts
    # in a row also give up, however far apart: a child that hangs loading until its engine
    # startup timeout (600 s) and dies never has six deaths inside one window.
    short_run_s: float = 660.0

    def __post_init__(self) -> None:
        if (self.max_restarts < 1 or not 0 < self.window_s < float("inf")
                or not 0 < self.short_run_s < float("inf")):
            raise ValueError(f"restart policy needs max_restarts >= 1, window_s > 0 and "
                             f"short_run_s > 0, got {self.max_restarts}, {self.window_s}, "
                             f"{self.short_run_s}")

    def recent(self, restart_times: list[float], now: float) -> list[float]:
        """The restarts of ``restart_times`` that still count at ``now``."""
        return [t for t in restart_times if now - t < self.window_s]

    def describe(self) -> str:
        return f"--max-restarts {self.max_restarts} within --restart-window {self.window_s:g} s"


def restart_policy(args: argparse.Namespace) -> RestartPolicy | None:
    """The ``--restart`` policy from the flags; None without ``--restart``."""
    if not args.restart:
        if args.max_restarts is not None or args.restart_window is not None:
            raise SystemExit("pdserve launch: --max-restarts and --restart-window need "
                             "--restart (without it no child is restarted)")
        return None
    default = RestartPolicy()
    window_s = args.restart_window or default.window_s
    return RestartPolicy(max_restarts=args.max_restarts or default.max_restarts,
                         window_s=window_s,
                         short_run_s=max(window_s,
                                         engine_startup_timeout(args) + STARTUP_MARGIN_S))


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    http_address: str | None = None
    proc: subprocess.Popen | None = None
    log: IO[bytes] | None = field(default=None, repr=False)
    restarts: int = 0  # in the current backoff run (restart_delay)
    started_at: float = 0.0
    restart_at: float | None = None  # when a dead child is due to start again (--restart)
    restart_times: list[float] = field(default_factory=list)  # when it died and was restarted
    failed_starts: int = 0  # deaths in a row after a run shorter than RestartPolicy.short_run_s

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.restart_at = None
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - kept open while the child runs
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=die_with_parent)
        logger.info("started %s (pid %d), log %s", self.name, self.proc.pid, self.log_path)

    def kill_group(self) -> None:
        """SIGKILL whatever is left of the child's process group (it leads its own session):
        a worker that died can leave its engine process behind, still loading or holding
        its GPU memory, and a restarted worker would then find the GPU taken."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)


def _get_json(url: str, timeout: float = 2.0) -> object:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


def _healthy(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=2.0) as response:
            return response.status == 200
    except Exception:
        return False


def _registered(proxy_url: str) -> set[str]:
    try:
        data = _get_json(f"{proxy_url}/instances")
    except Exception:
        return set()
    items = data.get("workers", []) if isinstance(data, dict) else data
    if isinstance(items, dict):  # address -> info
        items = list(items.values())
    return {str(x.get("http_address")) for x in items or [] if isinstance(x, dict)}


# What launch decides for each worker itself: a user's --kv-transfer-config may not set it.
LAUNCH_KV_KEYS = frozenset({"kv_role", "kv_rank", "kv_ip", "kv_port"})
LAUNCH_EXTRA_KEYS = frozenset({"proxy_ip", "proxy_port", "http_ip", "http_port"})


def user_kv_settings(text: str | None) -> tuple[dict, dict]:
    """The user's ``--kv-transfer-config`` (top-level keys, extra-config keys), applied to
    every launched P and D worker (``kv_buffer_size``, ``send_type``,
    ``kv_load_failure_policy``, timeouts...): before, launch accepted it and dropped it.
    Validated here as a worker would, and refused when it names what launch assigns."""
    from engine_core.config import KVTransferConfig
    from engine_core.errors import ConfigError

    if not text:
        return {}, {}
    try:
        KVTransferConfig.from_json(text)  # a bad key or value fails now, not in every worker
    except ConfigError as exc:
        raise SystemExit(f"pdserve launch: {exc}") from None
    data = json.loads(text)
    extra = dict(data.pop("kv_connector_extra_config", None) or {})
    owned = sorted((set(data) & LAUNCH_KV_KEYS) | (set(extra) & LAUNCH_EXTRA_KEYS))
    if owned:
        raise SystemExit(f"pdserve launch: --kv-transfer-config may not set {owned}: launch "
                         "assigns them to each worker")
    return data, extra


def build_children(args: argparse.Namespace, engine_args: list[str], log_dir: Path
                   ) -> tuple[Child, list[Child], str]:
    """The proxy and the workers; every one reads the new cluster secret this writes into
    ``log_dir``."""
    base_env = dict(os.environ)  # NCCL_*, HF_* and the rest pass through unchanged
    trust_args = ["--cluster-secret-file", str(new_cluster_secret(log_dir))]
    # Every port at once, so no two sockets get the same one (registration, HTTP and KV).
    fixed = tuple(p for p in (args.port, args.registration_port) if p)
    ports = iter(free_ports(1 + 2 * (args.prefill + args.decode) + args.colocated, fixed))
    reg_port = args.registration_port or next(ports)
    proxy = Child("proxy", [sys.executable, "-m", "proxy", "--host", HOST, "--port",
                            str(args.port), "--registration-port", str(reg_port),
                            *trust_args, *proxy_argv(args)],
                  base_env, log_dir / "proxy.log")
    server_args = worker_server_argv(args)
    gpus = detect_gpus(args.gpus)
    num_colocated = args.colocated
    total = args.prefill + args.decode + num_colocated
    if gpus and len(gpus) < total:
        raise SystemExit(f"pdserve launch: {total} workers need {total} GPUs, have {gpus}")
    cpu_env = {} if gpus else cpu_thread_env(base_env, total)
    user_kv, user_extra = user_kv_settings(args.kv_transfer_config)
    transport = args.kv_transport
    pd_gpus = gpus[:args.prefill + args.decode]
    if transport == "auto" and len(set(pd_gpus)) < len(pd_gpus):
        # NCCL takes no two ranks on one GPU: workers sharing one send their KV over ZMQ.
        transport = "cpu"
    workers = []
    for i in range(args.prefill + args.decode):
        module, index = ("prefill", i) if i < args.prefill else ("decode", i - args.prefill)
        http_port, kv_port = next(ports), next(ports)
        role = "kv_producer" if module == "prefill" else "kv_consumer"
        kv = {"kv_connector": "P2pNcclConnector", "kv_buffer_size": "1e9", **user_kv,
              "kv_role": role, "kv_rank": i, "kv_ip": HOST, "kv_port": kv_port,
              "kv_connector_extra_config": {
                  "send_type": "PUT_ASYNC", "transport": transport, **user_extra,
                  "proxy_ip": HOST, "proxy_port": reg_port, "http_port": http_port}}
        env = dict(base_env)
        device_args: list[str] = []
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i]
        else:
            device_args = ["--device", "cpu"]
            env.update(cpu_env)
        # Through the pdserve command, as the colocated workers: it folds vLLM's environment
        # variables (VLLM_SERVER_DEV_MODE, VLLM_API_KEY) into the worker's server flags.
        argv = [sys.executable, "-m", "deploy.cli", module, args.model, "--host", HOST, "--port",
                str(http_port), "--kv-transfer-config", json.dumps(kv),
                "--heartbeat-interval", str(args.heartbeat_interval), *trust_args,
                *server_args, *device_args, *engine_args]
        workers.append(Child(f"{module}{index}", argv, env, log_dir / f"{module}{index}.log",
                             http_address=f"{HOST}:{http_port}"))
    for index in range(num_colocated):
        gpu_env = {"CUDA_VISIBLE_DEVICES": gpus[len(workers)]} if gpus else {}
        http_port = next(ports)
        argv = [sys.executable, "-m", "deploy.cli", "serve", args.model, "--host", HOST,
                "--port", str(http_port), "--proxy-address", f"{HOST}:{reg_port}",
                "--heartbeat-interval", str(args.heartbeat_interval), *trust_args,
                *server_args, *([] if gpus else ["--device", "cpu"]), *engine_args]
        workers.append(Child(f"colocated{index}", argv, {**base_env, **gpu_env, **cpu_env},
                             log_dir / f"colocated{index}.log",
                             http_address=f"{HOST}:{http_port}"))
    return proxy, workers, f"http://{HOST}:{args.port}"


def new_cluster_secret(run_dir: Path) -> Path:
    """A new cluster secret for this launch, written 0600 as ``run_dir/cluster.secret``
    (replacing one a previous launch left there); the children read it from there."""
    from engine_core.cluster.trust import write_secret_file

    path = run_dir / CLUSTER_SECRET_FILE
    path.unlink(missing_ok=True)
    write_secret_file(path)
    return path


def stop_all(children: list[Child], timeout_s: float) -> None:
    live = [c for c in children if c.proc is not None and c.proc.poll() is None]
    for child in live:
        child.proc.terminate()
    deadline = time.monotonic() + timeout_s
    for child in live:
        try:
            child.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in %.0fs; killing it", child.name, timeout_s)
            os.killpg(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
    for child in children:
        child.kill_group()  # what a dead or stopped child left behind (its engine)
        if child.log is not None:
            child.log.close()


def _on_death(child: Child, policy: RestartPolicy, now: float) -> bool:
    """Schedule a restart of ``child``, which just died; False when ``policy`` says it is
    crash looping (the caller gives up)."""
    recent = policy.recent(child.restart_times, now)
    short = now - child.started_at < policy.short_run_s
    child.failed_starts = child.failed_starts + 1 if short else 0
    if len(recent) >= policy.max_restarts:
        print(f"pdserve launch: giving up on {child.name}: it died again after "
              f"{len(recent)} restart(s) within {policy.window_s:g} s ({policy.describe()}); "
              f"stopping everything, exit 1; see {child.log_path}", flush=True)
        return False
    if child.failed_starts > policy.max_restarts:
        print(f"pdserve launch: giving up on {child.name}: {child.failed_starts} runs in a row "
              f"ended within {policy.short_run_s:g} s of their start; stopping everything, "
              f"exit 1; see {child.log_path}", flush=True)
        return False
    child.restart_times = [*recent, now]
    delay, child.restarts = restart_delay(child.restarts, now - child.started_at)
    child.restart_at = now + delay
    if child.log is not None:
        child.log.close()
    print(f"pdserve launch: restarting {child.name} in {delay:.1f} s (restart "
          f"{len(child.restart_times)} of {policy.max_restarts} allowed within "
          f"{policy.window_s:g} s)", flush=True)
    return True


def supervise(proxy: Child, workers: list[Child], policy: RestartPolicy | None,
              stopping: Callable[[], bool], poll_s: float = 0.5) -> int:
    """Watch the running children until ``stopping()``: report each death, restart the
    child under ``policy`` (None: no restarts). Returns the launcher's exit code: 0 when
    stopped, 1 when the proxy died unrestarted or a child outran ``policy``."""
    reported: set[str] = set()
    while not stopping():
        now = time.monotonic()
        for child in [proxy, *workers]:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.start()
                continue
            code = child.proc.poll()
            if code is None or child.name in reported:
                continue
            print(f"pdserve launch: {child.name} (pid {child.proc.pid}) died with {code}; "
                  f"log {child.log_path}", flush=True)
            child.kill_group()
            if policy is not None:
                if not _on_death(child, policy, now):
                    return 1
            elif child is proxy:
                return 1
            else:
                reported.add(child.name)
        time.sleep(poll_s)
    return 0


def check_topology(args: argparse.Namespace) -> None:
    """Refuse a cluster that cannot answer a request (no decode or colocated worker, or
    prefill workers with no decode worker to hand to), and the proxy's ports when taken."""
    from engine_core.errors import ConfigError
    from engine_core.server.api_server import check_port_free

    if args.prefill and not args.decode:
        raise ConfigError(f"--prefill {args.prefill} without a decode worker: prefill workers "
                          "hand their KV to decode workers (use --decode, or --prefill 0)")
    if args.decode == 0 and args.colocated == 0:
        raise ConfigError("--decode and --colocated are both 0: nothing would serve requests")
    check_port_free(HOST, args.port)
    if args.registration_port is not None:
        check_port_free(HOST, args.registration_port)


def run_launch(args: argparse.Namespace, engine_args: list[str] | None = None) -> int:
    # Flag errors before anything starts (the children's flags are built again with ports).
    from engine_core.errors import ConfigError

    try:
        check_topology(args)
    except ConfigError as exc:
        print(f"pdserve launch: {exc}", file=sys.stderr, flush=True)
        return 2
    policy = restart_policy(args)
    proxy_argv(args)
    worker_server_argv(args)
    engine_args = engine_argv(args) + list(engine_args or [])
    if args.model is None or args.demo:
        from engine_core.demo_model import demo_model_path

        args.model = args.model or str(demo_model_path())  # built once, before the workers
        if "--served-model-name" not in engine_args:
            engine_args += ["--served-model-name", "pdserve-demo"]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-launch-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"pdserve launch: logs in {log_dir}", flush=True)
    proxy, workers, url = build_children(args, engine_args, log_dir)
    children = [proxy, *workers]
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for child in children:
            child.start()
        wait_s = startup_timeout(args)
        deadline = time.monotonic() + wait_s
        expected = {w.http_address for w in workers}
        while not stopping:
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                for c in dead:
                    print(f"pdserve launch: {c.name} exited with {c.proc.returncode} "
                          f"during startup; see {c.log_path}", flush=True)
                return 1
            if expected <= _registered(url) and all(_healthy(w.http_address) for w in workers):
                break
            if time.monotonic() > deadline:
                print(f"pdserve launch: not ready after {wait_s:.0f}s; "
                      f"see {log_dir}", flush=True)
                return 1
            time.sleep(0.5)
        if stopping:
            return 0
        model = next((engine_args[i + 1] for i, a in enumerate(engine_args[:-1])
                      if a == "--served-model-name"), args.model)
        colocated = f" + {args.colocated} colocated" if args.colocated else ""
        print(f"pdserve launch: ready: {args.prefill}P{args.decode}D{colocated} at {url}\n"
              f"  curl {url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{model}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'",
              flush=True)
        return supervise(proxy, workers, policy, lambda: stopping)
    finally:
        print("pdserve launch: stopping", flush=True)
        stop_all([proxy, *workers], args.stop_timeout)
        print("pdserve launch: stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="pdserve launch", description=__doc__)
    add_launch_arguments(parser)
    return run_launch(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
