"""`pdserve` flags take effect wherever they are accepted, and bad values are clear errors."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from deploy.cli import build_parser, run_serve
from engine_core.errors import ConfigError

KV_PRODUCER = '{"kv_connector": "P2pNcclConnector", "kv_role": "kv_producer", "kv_port": 21001}'


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What ``serve_worker`` / ``run_server`` were called with (nothing is started)."""
    import engine_core.server.api_server as api_server
    import engine_core.server.worker as worker

    calls: dict[str, Any] = {}

    def fake_serve_worker(config: Any, options: Any, connector_factory: Any,
                          interval: float = 3.0) -> None:
        calls.update(config=config, options=options, interval=interval)

    def fake_run_server(config: Any, options: Any, engine_factory: Any = None,
                        on_startup: Any = (), readiness: Any = None) -> None:
        calls.update(config=config, options=options, on_startup=list(on_startup))

    monkeypatch.setattr(worker, "serve_worker", fake_serve_worker)
    monkeypatch.setattr(api_server, "run_server", fake_run_server)
    return calls


def test_serve_proxy_address_reaches_a_kv_role_worker(served: dict[str, Any]) -> None:
    """vLLM-style ``serve --kv-transfer-config`` with a P/D role: ``--proxy-address`` (as on
    ``pdserve prefill``) names the proxy it registers with, instead of being dropped."""
    args = build_parser().parse_args([
        "serve", "/models/x", "--port", "20001", "--kv-transfer-config", KV_PRODUCER,
        "--proxy-address", "10.1.2.3:31000", "--heartbeat-interval", "1.5", "--insecure"])
    assert run_serve(args) == 0
    kv = served["config"].kv_transfer
    assert (kv.proxy_ip, kv.proxy_port) == ("10.1.2.3", 31000)
    assert kv.kv_port == 21001 and kv.http_port == 20001
    assert served["interval"] == 1.5


def test_a_worker_reachable_from_other_hosts_needs_the_cluster_secret(
        served: dict[str, Any], tmp_path: Any) -> None:
    """Its KV address is the one the proxy reaches it from: not loopback, so without a
    secret (or --insecure) it refuses to start; with one, its config carries it."""
    from engine_core.cluster.trust import write_secret_file

    argv = ["serve", "/models/x", "--port", "20001", "--kv-transfer-config", KV_PRODUCER,
            "--proxy-address", "10.1.2.3:31000"]
    assert run_serve(build_parser().parse_args(argv)) == 1
    assert "config" not in served
    secret = write_secret_file(tmp_path / "secret")
    args = build_parser().parse_args([*argv, "--cluster-secret-file", str(tmp_path / "secret")])
    assert run_serve(args) == 0
    assert served["config"].kv_transfer.cluster_secret == secret


@pytest.mark.parametrize("command", ["serve", "prefill", "decode"])
@pytest.mark.parametrize("value", ["10.1.2.3", "10.1.2.3:", ":30001", "host:port", "h:70000"])
def test_bad_proxy_address_is_a_clear_flag_error(command: str, value: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, "/models/x", "--proxy-address", value])
    assert exc.value.code == 2
    assert "--proxy-address" in capsys.readouterr().err


def test_worker_proxy_address_overrides_the_json() -> None:
    from engine_core.server.worker import worker_kv_config

    args = argparse.Namespace(port=20001, kv_port=None, proxy_address=["[::1]:31000"])
    kv = worker_kv_config(None, "kv_consumer", args)
    assert (kv.proxy_ip, kv.proxy_port, kv.http_port) == ("[::1]", 31000, 20001)


def test_several_proxies_from_the_flag_or_the_json() -> None:
    """A worker registers with every proxy named: a comma-separated ``--proxy-address``
    (which replaces the JSON's) or the JSON's ``proxy_addresses`` beside proxy_ip/port."""
    from engine_core.config import KVTransferConfig
    from engine_core.server.worker import worker_kv_config

    args = build_parser().parse_args([
        "decode", "/models/x", "--proxy-address", "10.0.0.1:30001, 10.0.0.2:30001"])
    kv = KVTransferConfig.from_json({"kv_role": "kv_consumer", "kv_connector_extra_config": {
        "proxy_ip": "10.0.0.9", "proxy_port": 1, "proxy_addresses": ["10.0.0.8:2"]}})
    assert kv.registration_addresses == ("10.0.0.9:1", "10.0.0.8:2")
    moved = worker_kv_config(kv, "kv_consumer", args)
    assert moved.registration_addresses == ("10.0.0.1:30001", "10.0.0.2:30001")
    listed = KVTransferConfig.from_json({"kv_connector_extra_config": {
        "proxy_addresses": "10.0.0.1:5,10.0.0.2:6"}})
    assert listed.registration_addresses == ("10.0.0.1:5", "10.0.0.2:6")
    with pytest.raises(ConfigError, match="proxy_addresses"):
        KVTransferConfig.from_json({"kv_connector_extra_config": {"proxy_addresses": ["x"]}})


@pytest.mark.parametrize("command", ["serve", "prefill", "decode"])
def test_the_grammar_import_delay_reaches_the_server(served: dict[str, Any],
                                                     command: str) -> None:
    """Seconds or inf (import only for a constrained request); 10 s when not given."""
    import math

    base = [command, "/models/x", "--insecure"]
    assert run_serve(build_parser().parse_args(base)) == 0
    assert served["options"].grammar_import_delay_s == 10
    assert run_serve(build_parser().parse_args([*base, "--grammar-import-delay", "inf"])) == 0
    assert served["options"].grammar_import_delay_s == math.inf
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, "--grammar-import-delay", bad])
