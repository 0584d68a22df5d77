"""``pdserve launch`` passes the proxy's and the workers' cluster-wide flags on to its children.

Before, launch forwarded only --routing, --first-token-from-prefill and --prefill-overflow to
the proxy (and a --heartbeat-timeout it derived), so a launched cluster ran with the proxy's
default limits and timeouts and the workers' default body and engine-startup timeouts. The
checks read the argv ``build_children`` gives each child, parsed by that child's own parser.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

import deploy.child_flags as child_flags
import deploy.launch as launch  # its new names looked up at call time: old code fails
from deploy.cli import build_parser
from deploy.cli import main as pdserve
from engine_core.cluster.trust import load_secret_file
from engine_core.server.server_args import add_server_arguments, server_options
from engine_core.server.tools import ToolCallOptions
from proxy.__main__ import add_proxy_args, config_from_args
from proxy.config import ProxyConfig

# (flag, value given to launch, ProxyConfig field, the value the proxy gets)
PROXY_FLAGS = [
    ("--max-inflight", "7", "max_inflight", 7),
    ("--max-body-bytes", "12345", "max_body_bytes", 12345),
    ("--body-timeout", "4.5", "body_timeout_s", 4.5),
    ("--write-timeout", "9", "write_timeout_s", 9.0),
    ("--prefill-timeout", "11", "prefill_timeout_s", 11.0),
    ("--decode-timeout", "12.5", "decode_timeout_s", 12.5),
    ("--connect-timeout", "1.5", "connect_timeout_s", 1.5),
    ("--max-attempts", "5", "max_attempts", 5),
    ("--heartbeat-timeout", "25", "heartbeat_timeout_s", 25.0),
    ("--routing", "least_load", "routing", "least_load"),
    ("--affinity-prefix-chars", "64", "affinity_prefix_chars", 64),
    ("--affinity-max-imbalance", "2.5", "affinity_max_imbalance", 2.5),
    ("--prefill-overflow", "3", "prefill_overflow", 3),
    ("--max-workers", "9", "max_workers", 9),
]
# (flag, value, ServerOptions field, the value a worker gets)
WORKER_FLAGS = [
    ("--body-timeout", "4.5", "body_timeout_s", 4.5),
    ("--write-timeout", "9", "write_timeout_s", 9.0),
    ("--engine-startup-timeout", "90", "engine_startup_timeout_s", 90.0),
    ("--max-request-body-bytes", "4096", "client_max_size", 4096),
    ("--log-stats-interval", "0", "log_stats_interval_s", 0.0),
]
# The server flags launch does not take: it assigns --host and --port; the API key and the
# admin endpoints reach every worker from VLLM_API_KEY / VLLM_SERVER_DEV_MODE.
SERVER_FLAGS_NOT_FORWARDED = {"--host", "--port", "--api-key", "--enable-admin-endpoints"}
# The proxy flags launch owns: it binds every child to 127.0.0.1, names the ports itself and
# makes the cluster secret.
PROXY_FLAGS_OWNED = {"--host", "--registration-host", "--port", "--registration-port",
                     "--cluster-secret-file", "--insecure"}


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["launch", "--model", "/m", *argv])


def _children(tmp_path: Path, *argv: str) -> tuple[launch.Child, list[launch.Child]]:
    """The proxy and workers (1P1D, a placed worker and one colocated) ``pdserve launch
    argv`` would start."""
    static = _parse("--colocated", "1", "--prefill", "1", "--decode", "1", *argv)
    proxy, workers, _ = launch.build_children(static, launch.engine_argv(static), tmp_path)
    assert [w.name for w in workers] == ["prefill0", "decode0", "colocated0"]
    placed = _parse("--workers", "1", *argv)
    workers += launch.build_children(placed, launch.engine_argv(placed), tmp_path)[1]
    assert workers[-1].name == "worker0" and workers[-1].argv[3] == "worker"
    return proxy, workers


def _proxy_config(proxy: launch.Child) -> ProxyConfig:
    """The proxy child's argv as ``python -m proxy`` reads it."""
    assert proxy.argv[1:3] == ["-m", "proxy"]
    return config_from_args(add_proxy_args(argparse.ArgumentParser()).parse_args(proxy.argv[3:]))


def _worker_args(worker: launch.Child) -> argparse.Namespace:
    """A worker child's argv as ``pdserve prefill|decode|worker|serve`` reads it."""
    assert worker.argv[1:3] == ["-m", "deploy.cli"]
    return build_parser().parse_args(worker.argv[3:])


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {a.option_strings[0] for a in parser._actions if a.option_strings}


def _launch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    launch.add_launch_arguments(parser)
    return parser


def _probe_server() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    add_server_arguments(parser)
    return parser


def _flag(child: launch.Child, name: str) -> str:
    return child.argv[child.argv.index(name) + 1]


@pytest.mark.parametrize("flag,value,field,expected", PROXY_FLAGS,
                         ids=[row[0] for row in PROXY_FLAGS])
def test_a_proxy_flag_reaches_the_proxy(tmp_path: Path, flag: str, value: str, field: str,
                                        expected: object) -> None:
    proxy, workers = _children(tmp_path, flag, value)
    assert proxy.argv.count(flag) == 1 and type(expected)(_flag(proxy, flag)) == expected
    assert getattr(_proxy_config(proxy), field) == expected
    if flag not in {row[0] for row in WORKER_FLAGS}:
        assert all(flag not in w.argv for w in workers)


def test_first_token_from_prefill_is_on_unless_turned_off(tmp_path: Path) -> None:
    proxy, _ = _children(tmp_path)
    assert _proxy_config(proxy).first_token_from_prefill
    assert not any("first-token-from-prefill" in arg for arg in proxy.argv)
    proxy, _ = _children(tmp_path, "--no-first-token-from-prefill")
    assert not _proxy_config(proxy).first_token_from_prefill


@pytest.mark.parametrize("flag,value,field,expected", WORKER_FLAGS,
                         ids=[row[0] for row in WORKER_FLAGS])
def test_a_server_flag_reaches_every_worker(tmp_path: Path, flag: str, value: str, field: str,
                                            expected: object) -> None:
    proxy, workers = _children(tmp_path, flag, value)
    # A worker's write bound is twice the proxy's: the proxy, which sees the client, decides.
    at_worker = expected * 2 if flag == "--write-timeout" else expected
    for worker in workers:
        assert worker.argv.count(flag) == 1, worker.argv
        assert type(expected)(_flag(worker, flag)) == at_worker
        assert getattr(server_options(_worker_args(worker)), field) == at_worker
    proxy_fields = {row[0]: row[2] for row in PROXY_FLAGS}
    if flag in proxy_fields:  # the proxy takes it too: one flag for both
        assert getattr(_proxy_config(proxy), proxy_fields[flag]) == expected
    else:
        assert flag not in proxy.argv


def test_every_forwarded_server_flag_reaches_the_workers(tmp_path: Path) -> None:
    """Whatever the server takes of ``WORKER_SERVER_FLAGS`` goes to every worker, and the
    proxy gets a flag it takes too."""
    server = _options(_probe_server())
    proxy_flags = _options(add_proxy_args(argparse.ArgumentParser()))
    forwarded = [f for f in child_flags.WORKER_SERVER_FLAGS if f in server]
    assert {"--body-timeout", "--engine-startup-timeout"} <= set(forwarded)
    # Seconds flags take 7; the chat flags a template, a switch and a parser.
    template = "{{ messages }}"
    chat = {"--chat-template": [template], "--enable-auto-tool-choice": [],
            "--tool-call-parser": ["hermes"]}
    seconds = [flag for flag in forwarded if flag not in chat]
    argv = [arg for flag in forwarded for arg in (flag, *chat.get(flag, ["7"]))]
    proxy, workers = _children(tmp_path, *argv)
    for worker in workers:
        # Behind the proxy a worker's write bound is twice the proxy's, so the proxy decides.
        assert all(float(_flag(worker, flag)) == (14 if flag == "--write-timeout" else 7)
                   for flag in seconds)
        options = server_options(_worker_args(worker))
        assert options.chat_template == template
        assert options.tool_calls == ToolCallOptions(True, "hermes")
        assert options.grammar_import_delay_s == 7
    for flag in forwarded:
        assert (flag in proxy.argv) == (flag in proxy_flags)


def test_launch_takes_every_proxy_and_cluster_wide_server_flag() -> None:
    """A flag the proxy or the server gains later is either taken by launch or knowingly
    left to launch or the environment: the defect was flags silently not taken."""
    launch_flags = _options(_launch_parser())
    proxy_flags = _options(add_proxy_args(argparse.ArgumentParser(add_help=False)))
    assert proxy_flags - PROXY_FLAGS_OWNED <= launch_flags
    server_flags = _options(_probe_server())
    assert server_flags - SERVER_FLAGS_NOT_FORWARDED <= launch_flags
    assert server_flags - SERVER_FLAGS_NOT_FORWARDED <= set(child_flags.WORKER_SERVER_FLAGS)


def test_launch_parses_them_as_the_children_do() -> None:
    """Same names, types, choices and defaults as ``pdserve proxy`` / ``pdserve serve``
    (launch's --heartbeat-timeout defaults to one derived from --heartbeat-interval)."""
    launch_actions = {a.option_strings[0]: a for a in _launch_parser()._actions}
    proxy = add_proxy_args(argparse.ArgumentParser(add_help=False))
    children = [a for a in proxy._actions if a.option_strings[0] not in PROXY_FLAGS_OWNED]
    proxy_flags = {a.option_strings[0] for a in children}
    children += [a for a in _probe_server()._actions
                 if a.option_strings[0] not in SERVER_FLAGS_NOT_FORWARDED | proxy_flags]
    for child in children:
        mine = launch_actions[child.option_strings[0]]
        assert (mine.dest, mine.type, mine.choices, mine.nargs) == (
            child.dest, child.type, child.choices, child.nargs), child.option_strings
        if child.dest != "heartbeat_timeout":
            assert mine.default == child.default, child.option_strings


def test_defaults_are_unchanged(tmp_path: Path) -> None:
    """Nothing given: the proxy gets its own defaults (and the derived heartbeat timeout),
    the workers their server's defaults."""
    proxy, workers = _children(tmp_path)
    tail = proxy.argv[proxy.argv.index("--registration-port") + 2:]
    secret_file = tmp_path / launch.CLUSTER_SECRET_FILE
    assert tail == ["--cluster-secret-file", str(secret_file), "--heartbeat-timeout", "10"]
    config = _proxy_config(proxy)
    assert config == ProxyConfig(host="127.0.0.1", port=config.port,
                                 registration_port=config.registration_port,
                                 cluster_secret=load_secret_file(secret_file))
    default = server_options(_probe_server().parse_args([]))
    for worker in workers:
        # Only the write bound is set: twice the proxy's default, so the proxy decides.
        assert set(child_flags.WORKER_SERVER_FLAGS) & set(worker.argv) == {"--write-timeout"}
        assert _flag(worker, "--write-timeout") == "120"
        options = server_options(_worker_args(worker))
        assert options == dataclasses.replace(default, host=options.host, port=options.port,
                                              write_timeout_s=120.0)
    assert _flag(_children(tmp_path, "--heartbeat-interval", "12")[0], "--heartbeat-timeout") \
        == "36"


@pytest.mark.parametrize("argv,reason", [
    (["--max-inflight", "0"], "max_inflight"),
    (["--max-body-bytes", "0"], "max_body_bytes"),
    (["--body-timeout", "0"], "body_timeout"),
    (["--body-timeout", "inf"], "body_timeout"),
    (["--write-timeout", "-1"], "write_timeout"),
    (["--write-timeout", "inf"], "write_timeout"),
    (["--prefill-timeout", "0"], "prefill_timeout"),
    (["--prefill-timeout", "nan"], "prefill_timeout"),
    (["--decode-timeout", "inf"], "decode_timeout"),
    (["--connect-timeout", "nan"], "connect_timeout"),
    (["--affinity-max-imbalance", "nan"], "affinity_max_imbalance"),
    (["--decode-timeout", "-5"], "decode_timeout"),
    (["--connect-timeout", "0"], "connect_timeout"),
    (["--max-attempts", "0"], "max_attempts"),
    (["--affinity-prefix-chars", "0"], "affinity_prefix_chars"),
    (["--affinity-max-imbalance", "-1"], "affinity_max_imbalance"),
    (["--prefill-overflow", "-1"], "must be >= 0"),  # refused before too
    (["--heartbeat-timeout", "0"], "must exceed --heartbeat-interval"),
    (["--heartbeat-timeout", "4", "--heartbeat-interval", "5"], "must exceed --heartbeat-interval"),
    (["--max-inflight", "lots"], "--max-inflight"),
    (["--engine-startup-timeout", "0"], "--engine-startup-timeout"),
    (["--log-stats-interval", "soon"], "--log-stats-interval"),
    (["--max-request-body-bytes", "1.5"], "--max-request-body-bytes"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_a_bad_value_is_refused_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        argv: list[str], reason: str) -> None:
    """``pdserve launch`` itself refuses what its proxy or workers would: no child started,
    no log directory made, no default model looked up, instead of a child dying at startup."""
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a child was started")

    monkeypatch.setattr(launch.Child, "start", refuse)
    monkeypatch.setattr("engine_core.default_model.default_model_path", refuse)
    log_dir = tmp_path / "logs"
    with pytest.raises(SystemExit) as exc:
        pdserve(["launch", "--log-dir", str(log_dir), *argv])
    assert exc.value.code not in (0, None)
    message = f"{exc.value.code}{capsys.readouterr().err}"
    assert reason in message and "unrecognized" not in message, message
    assert not log_dir.exists()


def test_workers_drain_within_launchs_stop_timeout() -> None:
    """--shutdown-timeout reaches every worker; one given that is not below --stop-timeout
    is refused (the launcher would kill workers mid-drain)."""
    argv = child_flags.worker_server_argv(_parse("--shutdown-timeout", "5"))
    assert argv[argv.index("--shutdown-timeout") + 1] == "5.0"
    with pytest.raises(SystemExit, match="--shutdown-timeout 20 must be below --stop-timeout 15"):
        child_flags.worker_server_argv(_parse("--shutdown-timeout", "20"))
    assert "--shutdown-timeout" not in child_flags.worker_server_argv(_parse("--stop-timeout", "5"))


def test_the_api_key_reaches_every_child_in_its_environment(tmp_path: Path) -> None:
    """``launch --api-key`` keys the proxy and every worker (each reads VLLM_API_KEY at its
    entry point), and the key is on no command line (``ps`` shows those)."""
    proxy, workers = _children(tmp_path, "--api-key", "cluster-key")
    for child in (proxy, *workers):
        assert child.env["VLLM_API_KEY"] == "cluster-key"
        assert not any("cluster-key" in arg for arg in child.argv)
    assert config_from_args(add_proxy_args(argparse.ArgumentParser()).parse_args(
        ["--api-key", "cluster-key"])).api_key == "cluster-key"


def test_placed_workers_bound_their_steps_to_the_proxys_tpot_target(tmp_path: Path) -> None:
    """Every placed worker gets --decode-step-target-ms: the proxy's --slo-tpot-ms less the
    placement's headroom (the placement sweep's ``@cell`` runs pass each cell's target
    this way); static and colocated workers do not; a value the user gives stands."""
    from proxy.placement import PlacementConfig

    proxy, workers = _children(tmp_path, "--slo-tpot-ms", "15")
    planned_ms = PlacementConfig(slo_tpot_s=0.015).decode_step_target_s * 1e3
    assert _proxy_config(proxy).slo_tpot_ms == 15
    targets = {w.name: _worker_args(w).decode_step_target_ms for w in workers}
    assert targets == {"prefill0": None, "decode0": None, "colocated0": None,
                       "worker0": pytest.approx(planned_ms)}
    assert _worker_args(_children(tmp_path)[1][-1]).decode_step_target_ms == pytest.approx(
        PlacementConfig().decode_step_target_s * 1e3)  # the proxy's default target
    _, workers = _children(tmp_path, "--slo-tpot-ms", "15", "--decode-step-target-ms", "9")
    assert float(_flag(workers[-1], "--decode-step-target-ms")) == 9
    assert workers[-1].argv.count("--decode-step-target-ms") == 1
