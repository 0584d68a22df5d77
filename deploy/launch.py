"""``pdserve launch``: the proxy plus its workers on this host.

By default N workers (``pdserve worker``) that the proxy places each request on: served
whole on one, or prefilled on one and decoded on another (``proxy/placement.py``).
``--prefill N --decode M`` starts static prefill and decode workers instead, and
``--colocated K`` adds plain replicas. Each worker is a subprocess with its own free HTTP
and KV ports, one GPU per tensor-parallel rank (``CUDA_VISIBLE_DEVICES``, from
``deploy/gpu_groups.py``) or all on CPU. The launcher waits until every worker is
registered with the proxy and healthy, prints the endpoint, watches the children (reports
a death, restarts it with ``--restart``, gives up and exits 1 on a crash loop past
``--max-restarts``) and on SIGINT/SIGTERM stops everything: terminate, then kill after a
deadline. The proxy is restarted with or without ``--restart``, and never takes the
workers down with it: they keep serving any other proxy they register with
(``proxy_addresses`` in ``--kv-transfer-config``) and re-register with the new one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from deploy.child_flags import (
    add_proxy_arguments,
    add_worker_server_arguments,
    engine_argv,
    placed_worker_argv,
    proxy_argv,
    worker_server_argv,
)
from deploy.gpu_groups import add_tp_arguments, detect_gpus, gpu_groups, worker_tp_sizes
from deploy.supervisor import (
    MIN_STARTUP_TIMEOUT_S,
    POLL_S,
    Child,
    RestartPolicy,
    restart_policy,
    startup_timeout,
    stop_all,
    supervise,
)
from deploy.topology import DEFAULT_WORKERS, topology
from proxy.config import ProxyConfig

logger = logging.getLogger("pdserve.launch")
HOST = "127.0.0.1"


CLUSTER_SECRET_FILE = "cluster.secret"


def tcp_port(text: str) -> int:
    """A TCP port to listen on: 1-65535, checked at parse time so a bad one never surfaces
    only once the workers have started, when the proxy fails to bind."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port in 1-65535")
    return port


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    from engine_core.arg_utils import non_negative_int, positive_int, positive_seconds

    parser.add_argument("--workers", type=non_negative_int, default=None,
                        help="number of workers that prefill, decode and serve whole requests "
                             "as the proxy places each request (pdserve worker; default "
                             f"{DEFAULT_WORKERS} unless --prefill/--decode or --colocated is "
                             "given; with them, static workers join the placement)")
    parser.add_argument("--prefill", type=non_negative_int, default=None,
                        help="number of static prefill workers (with --decode; the one not "
                             "given is 1)")
    parser.add_argument("--decode", type=non_negative_int, default=None,
                        help="number of static decode workers")
    parser.add_argument("--colocated", type=non_negative_int, default=0,
                        help="number of colocated workers (pdserve serve; whole requests go to "
                             "them when no P/D pair serves the model)")
    parser.add_argument("--model", default=None,
                        help="HF checkpoint or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--demo", action="store_true",
                        help="serve the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--port", type=tcp_port, default=ProxyConfig.port,
                        help="proxy HTTP port")
    parser.add_argument("--registration-port", type=tcp_port, default=None,
                        help="proxy registration port (default: a free one)")
    parser.add_argument("--gpus", default=None,
                        help="comma-separated GPU ids, one per worker rank (a worker of "
                             "tensor-parallel size N takes the next N); an id may repeat "
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
    parser.add_argument("--api-key", default=None,
                        help="the cluster's API key (or VLLM_API_KEY): the proxy and every "
                             "worker require it, and the proxy sends it to the workers; the "
                             "children get it in their environment, not on their command line")
    add_proxy_arguments(parser)
    add_worker_server_arguments(parser)
    from engine_core.arg_utils import add_engine_args

    add_engine_args(parser)  # passed on to every worker (--kv-transfer-config merged per worker)
    add_tp_arguments(parser)


def free_port() -> int:
    """An ephemeral TCP port on the launch host that was free a moment ago."""
    return free_ports(1)[0]


def free_ports(count: int, avoid: tuple[int, ...] = ()) -> list[int]:
    """``count`` distinct ephemeral ports that were free a moment ago, none in ``avoid``."""
    return free_port_runs([1] * count, avoid)


def free_port_runs(lengths: list[int], avoid: tuple[int, ...] = ()) -> list[int]:
    """The first port of each of ``len(lengths)`` runs of consecutive ports free a moment
    ago (a tensor-parallel worker's rank r listens at ``kv_port + r``), none in ``avoid``,
    no two overlapping. All are held open until the last is picked: picked one at a time and
    released at once, the OS handed the same port out twice in ~3.5% of 16-worker launches,
    and the second worker died at startup."""
    held: list[socket.socket] = []
    try:
        firsts: list[int] = []
        while len(firsts) < len(lengths):
            run = _hold_run(lengths[len(firsts)], avoid)
            if run is None:
                continue
            held.extend(run)
            firsts.append(run[0].getsockname()[1])
        return firsts
    finally:
        for sock in held:
            sock.close()


def _hold_run(length: int, avoid: tuple[int, ...]) -> list[socket.socket] | None:
    """Sockets bound to ``length`` consecutive ports from an ephemeral one, or None (the
    caller tries another start) when one of them is taken or avoided."""
    run: list[socket.socket] = []
    try:
        for offset in range(length):
            sock = socket.socket()
            run.append(sock)
            sock.bind((HOST, run[0].getsockname()[1] + offset if offset else 0))
            if sock.getsockname()[1] in avoid:
                raise OSError("avoided port")
        return run
    except OSError:
        for sock in run:
            sock.close()
        return None


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


def _get_json(url: str, timeout: float = 2.0, api_key: str | None = None) -> object:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                timeout=timeout) as response:
        return json.loads(response.read() or b"null")


def _healthy(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=2.0) as response:
            return response.status == 200
    except Exception:
        return False


def _registered(proxy_url: str, api_key: str | None) -> set[str]:
    try:
        data = _get_json(f"{proxy_url}/instances", api_key=api_key)
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


# A launched connector worker's subcommand and kv_role, by kind.
CONNECTOR_KINDS = {"prefill": "kv_producer", "decode": "kv_consumer", "worker": "kv_both"}


def build_children(args: argparse.Namespace, engine_args: list[str], log_dir: Path,
                   environ: Mapping[str, str] | None = None) -> tuple[Child, list[Child], str]:
    """The proxy and the workers; every one reads the new cluster secret this writes into
    ``log_dir``. ``environ``: what the children inherit (default: this process's
    environment), its ``CUDA_VISIBLE_DEVICES`` the GPUs they may get."""
    # NCCL_*, HF_* and the rest pass through unchanged
    base_env = dict(os.environ if environ is None else environ)
    trust_args = ["--cluster-secret-file", str(new_cluster_secret(log_dir))]
    if args.api_key:  # the children read it at their entry points (not visible in `ps`)
        base_env["VLLM_API_KEY"] = args.api_key
    shape = topology(args)
    kinds = shape.connector_kinds()
    # Every port at once, so no two sockets get the same one (registration, HTTP and KV).
    fixed = tuple(p for p in (args.port, args.registration_port) if p)
    tp_sizes = worker_tp_sizes(args)
    # KV ports: one run per connector worker, rank r of it at kv_port + r.
    firsts = free_port_runs([1] * (1 + len(kinds) + shape.colocated) + tp_sizes[:len(kinds)],
                            fixed)
    ports = iter(firsts[:1 + len(kinds) + shape.colocated])
    kv_ports = iter(firsts[1 + len(kinds) + shape.colocated:])
    reg_port = args.registration_port or next(ports)
    proxy_flags = proxy_argv(args)
    proxy = Child("proxy", [sys.executable, "-m", "proxy", "--host", HOST, "--port",
                            str(args.port), "--registration-port", str(reg_port),
                            *trust_args, *proxy_flags],
                  base_env, log_dir / "proxy.log")
    server_args = worker_server_argv(args)
    gpus = detect_gpus(args.gpus, base_env.get("CUDA_VISIBLE_DEVICES"))
    groups = gpu_groups(gpus, tp_sizes) if gpus else []
    cpu_env = {} if gpus else cpu_thread_env(base_env, sum(tp_sizes))
    user_kv, user_extra = user_kv_settings(args.kv_transfer_config)
    transport = args.kv_transport
    pd_gpus = [gpu for group in groups[:len(kinds)] for gpu in group.split(",")]
    if transport == "auto" and len(set(pd_gpus)) < len(pd_gpus):
        # NCCL takes no two ranks on one GPU: workers sharing one send their KV over ZMQ.
        transport = "cpu"
    placed_args = placed_worker_argv(args)
    workers = []
    for i, (module, index) in enumerate(kinds):
        http_port, kv_port = next(ports), next(kv_ports)
        role = CONNECTOR_KINDS[module]
        kv = {"kv_connector": "P2pNcclConnector", "kv_buffer_size": "1e9", **user_kv,
              "kv_role": role, "kv_rank": i, "kv_ip": HOST, "kv_port": kv_port,
              "kv_connector_extra_config": {
                  "send_type": "PUT_ASYNC", "transport": transport, **user_extra,
                  "proxy_ip": HOST, "proxy_port": reg_port, "http_port": http_port}}
        env = dict(base_env)
        device_args: list[str] = []
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = groups[i]
        else:
            device_args = ["--device", "cpu"]
            env.update(cpu_env)
        # Through the pdserve command, as the colocated workers: it folds vLLM's environment
        # variables (VLLM_SERVER_DEV_MODE, VLLM_API_KEY) into the worker's server flags.
        argv = [sys.executable, "-m", "deploy.cli", module, args.model, "--host", HOST, "--port",
                str(http_port), "--kv-transfer-config", json.dumps(kv),
                "--heartbeat-interval", str(args.heartbeat_interval), *trust_args,
                *server_args, *device_args, *engine_args,
                *(placed_args if module == "worker" else []),
                "--tensor-parallel-size", str(tp_sizes[i])]
        workers.append(Child(f"{module}{index}", argv, env, log_dir / f"{module}{index}.log",
                             http_address=f"{HOST}:{http_port}"))
    for index in range(shape.colocated):
        gpu_env = {"CUDA_VISIBLE_DEVICES": groups[len(workers)]} if gpus else {}
        http_port = next(ports)
        argv = [sys.executable, "-m", "deploy.cli", "serve", args.model, "--host", HOST,
                "--port", str(http_port), "--proxy-address", f"{HOST}:{reg_port}",
                "--heartbeat-interval", str(args.heartbeat_interval), *trust_args,
                *server_args, *([] if gpus else ["--device", "cpu"]), *engine_args,
                "--tensor-parallel-size", str(tp_sizes[len(workers)])]
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


def check_topology(args: argparse.Namespace) -> None:
    """Refuse a cluster that cannot answer a request (no decode or colocated worker, or
    prefill workers with no decode worker to hand to), and the proxy's ports when taken."""
    from engine_core.addresses import check_distinct_ports
    from engine_core.errors import ConfigError
    from engine_core.server.api_server import check_port_free

    check_distinct_ports({"--port": args.port, "--registration-port": args.registration_port})
    shape = topology(args)
    if shape.prefill and not shape.decode:
        raise ConfigError(f"--prefill {shape.prefill} without a decode worker: prefill workers "
                          "hand their KV to decode workers (use --decode, or --prefill 0)")
    if shape.decode == 0 and shape.workers == 0 and shape.colocated == 0:
        raise ConfigError("no decode, colocated or --workers worker: nothing would serve "
                          "requests")
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
        from engine_core.default_model import DEFAULT_MODEL_NAME, default_model_path

        args.model = args.model or str(default_model_path())  # found once, before the workers
        if "--served-model-name" not in engine_args:
            engine_args += ["--served-model-name", DEFAULT_MODEL_NAME]
    from deploy.launch_logs import LaunchLogs

    logs = LaunchLogs.create(args.log_dir)
    print(f"pdserve launch: {logs.describe()}", flush=True)
    code = 1  # an exception is a failure: its logs are kept
    try:
        code = _run_cluster(args, engine_args, logs.path, policy)
    finally:
        kept = logs.finish(code)
        if kept:
            print(f"pdserve launch: {kept}", flush=True)
    return code


def _run_cluster(args: argparse.Namespace, engine_args: list[str], log_dir: Path,
                 policy: RestartPolicy | None) -> int:
    """Start the proxy and workers, wait until ready, print the banner, supervise until
    stopped; the exit code. Everything is stopped when it returns."""
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
            if expected <= _registered(url, args.api_key) and all(_healthy(w.http_address) for w in workers):
                break
            if time.monotonic() > deadline:
                print(f"pdserve launch: not ready after {wait_s:.0f}s; "
                      f"see {log_dir}", flush=True)
                return 1
            time.sleep(POLL_S)
        if stopping:
            return 0
        from deploy.banner import launch_banner

        model = next((engine_args[i + 1] for i, a in enumerate(engine_args[:-1])
                      if a == "--served-model-name"), args.model)
        print(launch_banner(topology(args).describe(), url, workers, model, args.model),
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
    args = parser.parse_args(argv)
    from engine_core.server.server_args import apply_environment

    apply_environment(args)
    return run_launch(args)


if __name__ == "__main__":
    sys.exit(main())
