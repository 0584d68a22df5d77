"""`pdserve serve --proxy-address`: the worker registers as colocated and the proxy routes whole requests to it."""

from __future__ import annotations

from types import SimpleNamespace

from deploy.cli import build_parser
from engine_core.cluster.messages import ROLE_COLOCATED
from engine_core.cluster.trust import ClusterSecret
from engine_core.config import EngineConfig, ModelConfig
from engine_core.server.worker import colocated_hook
from proxy.registration import RegistrationServer
from proxy.registry import InstanceRegistry
from proxy.routing import MODE_COLOCATED, RoundRobinPolicy, plan_route


def test_serve_flags() -> None:
    args = build_parser().parse_args(["serve", "--demo", "--proxy-address", "10.0.0.1:30001",
                                      "--heartbeat-interval", "0.5"])
    assert (args.proxy_address, args.heartbeat_interval) == (["10.0.0.1:30001"], 0.5)


async def test_colocated_hook_registers_and_deregisters(wait_until) -> None:
    registry = InstanceRegistry(heartbeat_timeout_s=5)
    secret = ClusterSecret(b"0123456789abcdef0123456789abcdef")
    server = RegistrationServer(registry, "127.0.0.1", port=0, secret=secret)
    await server.start()
    config = EngineConfig(model=ModelConfig(model="/models/x", served_model_name="m"))
    engine = SimpleNamespace(latest_stats=None, add_sleep_listener=lambda listener: None)
    options = SimpleNamespace(host="0.0.0.0", port=8123)
    stop = None
    try:
        stop = await colocated_hook(config, [f"127.0.0.1:{server.port}"], 0.05, secret)(
            engine, options)
        await wait_until(lambda: len(registry) == 1)
        (worker,) = registry.workers(ROLE_COLOCATED)
        assert (worker.http_address, worker.model, worker.zmq_address) == (
            "127.0.0.1:8123", "m", None)
        route = plan_route(registry, RoundRobinPolicy(), "m")
        assert route.mode == MODE_COLOCATED and route.decode is worker
        await stop()
        stop = None
        await wait_until(lambda: len(registry) == 0)
    finally:
        if stop is not None:
            await stop()
        await server.stop()
