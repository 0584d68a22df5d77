"""The wiring every P/D worker shares: engine core + connector + API server + registration.

A worker is the colocated API server with a connector in its engine and a
``RegistrationClient`` started in its loop. The connector factory is passed in (by
``prefill``, ``decode`` and ``deploy``), so the engine never imports a connector package.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine_core.addresses import route_source_host
from engine_core.cluster.messages import (
    ROLE_COLOCATED,
    ROLE_DECODE,
    ROLE_PREFILL,
    ROLE_WORKER,
    WorkerLoad,
)
from engine_core.cluster.trust import ClusterSecret
from engine_core.config import EngineConfig, KVTransferConfig, address_list
from engine_core.errors import ConfigError
from engine_core.kv_connector import ConnectorScheduler, ConnectorWorker
from engine_core.server.readiness import Readiness

if TYPE_CHECKING:
    from engine_core.engine_core import EngineCore
    from engine_core.messages import EngineStats

logger = logging.getLogger("pdserve.worker")

ROLE_LETTER = {"kv_producer": ROLE_PREFILL, "kv_consumer": ROLE_DECODE, "kv_both": ROLE_WORKER}
DEFAULT_PROXY = ("127.0.0.1", 30001)

# (config, device) -> the engine's (scheduler side, worker side) connector pair; must be
# picklable (a module-level function): the engine process is spawned with it.
ConnectorFactory = Callable[[EngineConfig, str], tuple[ConnectorScheduler, ConnectorWorker]]


def build_engine(config: EngineConfig, connector_factory: ConnectorFactory) -> EngineCore:
    """Runs in the engine process: the engine with this config's connector pair. The import
    is here so the API process, which only pickles this function, never loads torch."""
    from engine_core.engine_core import EngineCore

    return EngineCore(config, connector=connector_factory(config, config.device.resolve()))


def proxy_address(value: str) -> list[str]:
    """argparse type of ``--proxy-address``: HOST:PORT, or several comma-separated (a worker
    registers with each proxy), checked when the flags are parsed, so a typo is a usage
    error rather than a traceback (or a silent zmq failure) later."""
    try:
        addresses = address_list(value, "--proxy-address")
    except ConfigError:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT[,HOST:PORT...], got {value!r}"
                                         ) from None
    if not addresses:
        raise argparse.ArgumentTypeError("expected at least one HOST:PORT")
    return list(addresses)


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve prefill|decode [MODEL] [engine flags]``: the serve flags plus the proxy's."""
    from engine_core.arg_utils import add_engine_args, add_model_arguments, positive_seconds
    from engine_core.cluster.trust_flags import add_cluster_trust_args
    from engine_core.server.server_args import add_server_arguments

    add_model_arguments(parser)
    add_server_arguments(parser)
    add_cluster_trust_args(parser)
    parser.add_argument("--kv-port", type=int, default=None, help="kv_port (overrides the JSON)")
    parser.add_argument("--proxy-address", default=None, type=proxy_address,
                        help="proxy registration HOST:PORT, or several comma-separated to "
                        "register with each (overrides proxy_ip/proxy_port and "
                        "proxy_addresses)")
    parser.add_argument("--heartbeat-interval", type=positive_seconds, default=3.0, help="seconds")
    add_engine_args(parser)


def worker_kv_config(kv: KVTransferConfig | None, role: str, args: argparse.Namespace
                     ) -> KVTransferConfig:
    """The worker's transfer config: the given JSON (role checked) or the 1P1D default."""
    if kv is None:
        kv = KVTransferConfig(kv_role=role, proxy_ip=DEFAULT_PROXY[0], proxy_port=DEFAULT_PROXY[1],
                              kv_ip_given=False)
    if kv.kv_role not in (role, "kv_both"):
        raise SystemExit(f"--kv-transfer-config kv_role is {kv.kv_role!r}; this worker is {role}")
    changes: dict[str, Any] = {"kv_role": role, "http_port": args.port}
    if getattr(args, "kv_port", None) is not None:  # `pdserve serve` has no --kv-port
        changes["kv_port"] = args.kv_port
    if args.proxy_address:
        first, *others = args.proxy_address
        ip, _, port = first.rpartition(":")
        changes.update(proxy_ip=ip, proxy_port=int(port), proxy_addresses=tuple(others))
        if not kv.kv_ip_given:  # advertise the address the (new) proxy is reached from
            changes["kv_ip"] = route_source_host(ip)
    return dataclasses.replace(kv, **changes)


def worker_load(stats: EngineStats | None) -> WorkerLoad:
    """The load a heartbeat carries, from the engine's latest stats (empty before any)."""
    if stats is None:
        return WorkerLoad()
    return WorkerLoad(
        stats.num_running, stats.num_waiting, stats.kv_cache_usage,
        stats.num_waiting_for_remote_kv, sleeping=stats.sleep_level > 0,
        num_prefill_tokens_queued=stats.num_prefill_tokens_queued,
        num_decoding=stats.num_decoding, prefill_tokens_per_s=stats.prefill_tokens_per_s,
        prefill_alone_tokens_per_s=stats.prefill_alone_tokens_per_s,
        decode_step_s=stats.decode_step_s, decode_step_target_s=stats.decode_step_target_s,
        decode_base_s=stats.decode_base_s, decode_hidden_s=stats.decode_hidden_s,
        decode_per_row_s=stats.decode_per_row_s)


def heartbeat_hook(role: str, proxy_addresses: list[str] | tuple[str, ...], model: str,
                   zmq_address: str | None, interval_s: float, secret: ClusterSecret,
                   http_ip: str | None = None, fallback_host: str = "127.0.0.1",
                   readiness: Readiness | None = None) -> Any:
    """A startup hook for ``run_server`` that heartbeats ``role`` to each proxy until
    shutdown (one client each: a proxy that is down costs the others nothing), its messages
    sealed with the cluster ``secret``.

    The advertised HTTP host is ``http_ip``, else the bind host, else (wildcard bind)
    ``fallback_host``. With ``readiness``, the server is ready only while its heartbeats
    reach at least one proxy.
    """

    async def start(client: Any, options: Any) -> Any:
        from engine_core.cluster.registration_client import RegistrationClient
        from engine_core.version import package_version

        host = http_ip or (options.host if options.host not in ("", "0.0.0.0", "::")
                           else fallback_host)

        registrations = [RegistrationClient(
            address, role=role, http_address=f"{host}:{options.port}", model=model,
            zmq_address=zmq_address, version=package_version(), load_provider=lambda: worker_load(client.latest_stats),
            interval_s=interval_s, secret=secret,
            kv_ranks=client.info.kv_ranks if zmq_address is not None else None)
            for address in proxy_addresses]
        for registration in registrations:
            registration.start()
        # A sleep or wake-up is heartbeated at once, not at the next tick: the proxy must stop
        # (or start) routing to this worker as soon as its engine changed.
        client.add_sleep_listener(lambda: [r.send_now() for r in registrations])
        if readiness is not None:
            readiness.add_check("proxy_registration",
                                lambda: any(r.registered for r in registrations))
        logger.info("registering as %s with proxy %s", role, ", ".join(proxy_addresses))

        async def stop() -> None:
            for registration in registrations:
                await registration.stop()

        return stop

    return start


def registration_hook(config: EngineConfig, interval_s: float,
                      readiness: Readiness | None = None) -> Any:
    """The P/D worker's heartbeat hook, from its kv-transfer config."""
    kv = config.kv_transfer
    assert kv is not None
    if not kv.registration_addresses or kv.kv_role not in ROLE_LETTER:
        async def skip(client: Any, options: Any) -> None:
            logger.info("no proxy_ip/proxy_port or role %s: not registering", kv.kv_role)

        return skip
    return heartbeat_hook(ROLE_LETTER[kv.kv_role], kv.registration_addresses,
                          config.model.name, f"{kv.kv_ip}:{kv.kv_port}", interval_s,
                          kv.cluster_secret, http_ip=kv.http_ip, fallback_host=kv.kv_ip,
                          readiness=readiness)


def colocated_hook(config: EngineConfig, proxy_addresses: list[str], interval_s: float,
                   secret: ClusterSecret, readiness: Readiness | None = None) -> Any:
    """``pdserve serve --proxy-address``: register as colocated with each proxy, so they send
    whole requests. Bound to a wildcard address, it advertises the address it reaches the
    first proxy from (P/D workers advertise ``http_ip``, else their ``kv_ip``)."""
    proxy_host = proxy_addresses[0].rpartition(":")[0]
    return heartbeat_hook(ROLE_COLOCATED, proxy_addresses, config.model.name, None, interval_s,
                          secret, fallback_host=route_source_host(proxy_host),
                          readiness=readiness)


def serve_worker(config: EngineConfig, options: Any, connector_factory: ConnectorFactory,
                 heartbeat_interval_s: float = 3.0) -> None:
    """Serve ``config`` (its kv_transfer names the role) as a P, D or kv_both worker until
    stopped.

    ``pdserve serve --kv-transfer-config '{"kv_role": "kv_producer", ...}'`` calls this.
    """
    from engine_core.parallel.support import check_parallel_support
    from engine_core.server.api_server import run_server

    check_parallel_support(config)  # refused here, before the server and engine start
    readiness = Readiness()
    run_server(config, options,
               functools.partial(build_engine, connector_factory=connector_factory),
               on_startup=[registration_hook(config, heartbeat_interval_s, readiness)],
               readiness=readiness)


def with_cluster_secret(config: EngineConfig, options: Any, args: argparse.Namespace
                        ) -> EngineConfig:
    """``config`` with the cluster secret of ``--cluster-secret-file`` in its transfer
    config; ConfigError when the worker would bind a non-loopback address without one and
    without ``--insecure``."""
    from engine_core.cluster.trust import check_exposure
    from engine_core.cluster.trust_flags import cluster_secret_from_args

    secret = cluster_secret_from_args(args)
    kv = config.kv_transfer
    check_exposure([options.host, *([kv.kv_ip] if kv is not None else [])], secret,
                   args.insecure)
    if kv is None:
        return config
    return dataclasses.replace(config, kv_transfer=dataclasses.replace(kv, cluster_secret=secret))


def run_worker(args: argparse.Namespace, role: str, connector_factory: ConnectorFactory) -> int:
    """Build the config from flags and serve until SIGINT/SIGTERM; return the exit code."""
    from engine_core.arg_utils import engine_config_from_args, resolve_model_argument
    from engine_core.errors import PdserveError
    from engine_core.server.server_args import server_options

    try:
        resolve_model_argument(args)
        config = engine_config_from_args(args)
        config = dataclasses.replace(
            config, kv_transfer=worker_kv_config(config.kv_transfer, role, args))
        options = server_options(args)
        config = with_cluster_secret(config, options, args)
        logger.info("%s worker, kv config %s", role, json.dumps(dataclasses.asdict(
            config.kv_transfer), default=str))
        serve_worker(config, options, connector_factory, args.heartbeat_interval)
    except PdserveError as exc:
        logger.error("%s", exc)
        return 1
    return 0
