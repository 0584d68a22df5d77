"""`pdserve launch` wiring without processes: GPUs, ports, kv-transfer JSON, env, engine flags."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from deploy.cli import build_parser
from deploy.launch import build_children, engine_argv
from engine_core.server.worker import worker_kv_config


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["launch", "--model", "/m", *argv])


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.usefixtures("no_cuda_visible_devices")  # plans --gpus
def test_gpus_one_per_worker_and_env_passes_through(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    args = _parse("--prefill", "2", "--decode", "1", "--gpus", "4,5,6", "--port", "12345")
    proxy, workers, url = build_children(args, engine_argv(args), tmp_path)
    assert url == "http://127.0.0.1:12345"
    assert _flag(proxy.argv, "--port") == "12345"
    reg_port = int(_flag(proxy.argv, "--registration-port"))
    assert [w.name for w in workers] == ["prefill0", "prefill1", "decode0"]
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["4", "5", "6"]
    ports = set()
    for worker in workers:
        assert worker.env["NCCL_SOCKET_IFNAME"] == "lo"
        assert "--device" not in worker.argv
        kv = json.loads(_flag(worker.argv, "--kv-transfer-config"))
        assert kv["kv_role"] == ("kv_producer" if worker.name.startswith("prefill")
                                 else "kv_consumer")
        extra = kv["kv_connector_extra_config"]
        assert (extra["proxy_ip"], extra["proxy_port"]) == ("127.0.0.1", reg_port)
        assert extra["http_port"] == int(_flag(worker.argv, "--port"))
        assert worker.http_address == f"127.0.0.1:{extra['http_port']}"
        ports |= {extra["http_port"], kv["kv_port"]}
    assert len(ports) == 6
    assert len({w.log_path for w in workers}) == 3


def test_proxy_flags_reach_the_proxy(tmp_path: Path) -> None:
    from proxy.__main__ import add_proxy_args, config_from_args

    args = _parse("--prefill", "1", "--decode", "1", "--prefill-overflow", "6",
                  "--no-first-token-from-prefill")
    proxy, _, _ = build_children(args, engine_argv(args), tmp_path)
    assert _flag(proxy.argv, "--prefill-overflow") == "6"
    assert "--no-first-token-from-prefill" in proxy.argv
    default, _, _ = build_children(_parse(), engine_argv(_parse()), tmp_path)
    assert "--prefill-overflow" not in default.argv
    parser = argparse.ArgumentParser()
    add_proxy_args(parser)
    config = config_from_args(parser.parse_args(proxy.argv[proxy.argv.index("proxy") + 1:]))
    assert config.prefill_overflow == 6 and not config.first_token_from_prefill
    with pytest.raises(SystemExit):  # by the proxy's own check, before any child starts
        build_children(_parse("--prefill-overflow", "-1"), [], tmp_path)


@pytest.mark.usefixtures("no_cuda_visible_devices")  # plans --gpus
def test_too_few_gpus(tmp_path: Path) -> None:
    args = _parse("--gpus", "0")
    with pytest.raises(SystemExit, match="need 2 GPUs"):
        build_children(args, [], tmp_path)


def test_cpu_workers_get_device_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    _, workers, _ = build_children(_parse(), [], tmp_path)
    assert all(_flag(w.argv, "--device") == "cpu" for w in workers)
    assert all(w.env.get("CUDA_VISIBLE_DEVICES") == "" for w in workers)


def test_cpu_workers_split_the_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    _, workers, _ = build_children(_parse("--prefill", "2", "--decode", "1"), [], tmp_path)
    assert [w.env["OMP_NUM_THREADS"] for w in workers] == ["2", "2", "2"]  # 8 cores // 3
    _, workers, _ = build_children(_parse("--prefill", "8", "--decode", "8"), [], tmp_path)
    assert {w.env["OMP_NUM_THREADS"] for w in workers} == {"1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stands
    _, workers, _ = build_children(_parse(), [], tmp_path)
    assert {w.env["OMP_NUM_THREADS"] for w in workers} == {"3"}


@pytest.mark.usefixtures("no_cuda_visible_devices")  # plans --gpus
def test_gpu_workers_keep_omp_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _, workers, _ = build_children(_parse("--gpus", "0,1"), [], tmp_path)
    assert all("OMP_NUM_THREADS" not in w.env for w in workers)


@pytest.mark.usefixtures("no_cuda_visible_devices")  # plans --gpus
def test_one_gpu_pair_over_the_cpu_transport(tmp_path: Path) -> None:
    """``--gpus 0,0 --kv-transport cpu``: P and D share GPU0; their KV goes over ZMQ."""
    _, workers, _ = build_children(_parse("--gpus", "0,0", "--kv-transport", "cpu"), [], tmp_path)
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["0", "0"]
    for worker in workers:
        kv = json.loads(_flag(worker.argv, "--kv-transfer-config"))
        assert kv["kv_connector_extra_config"]["transport"] == "cpu"
    _, workers, _ = build_children(_parse("--gpus", "0,1"), [], tmp_path)
    kv = json.loads(_flag(workers[0].argv, "--kv-transfer-config"))
    assert kv["kv_connector_extra_config"]["transport"] == "auto"


def test_engine_flags_forwarded() -> None:
    args = _parse("--max-model-len", "256", "--no-enable-prefix-caching", "--enforce-eager",
                  "--kv-transfer-config", "{}")
    assert engine_argv(args) == ["--max-model-len", "256", "--no-enable-prefix-caching",
                                 "--enforce-eager"]


def test_worker_kv_config_role() -> None:
    from engine_core.config import KVTransferConfig

    ns = argparse.Namespace(port=9000, kv_port=None, proxy_address=["10.0.0.1:30002"])
    kv = worker_kv_config(None, "kv_consumer", ns)
    assert (kv.kv_role, kv.http_port, kv.proxy_ip, kv.proxy_port) == (
        "kv_consumer", 9000, "10.0.0.1", 30002)
    with pytest.raises(SystemExit, match="kv_producer"):
        worker_kv_config(KVTransferConfig(kv_role="kv_producer"), "kv_consumer", ns)


def test_restart_backs_off_and_resets_after_a_healthy_run() -> None:
    """``--restart`` waits 0.5 s, then twice as long after each quick death, up to 30 s;
    a child that ran a minute starts over (a crash loop no longer restarts twice a second)."""
    from deploy.supervisor import RESTART_MAX_DELAY_S, restart_delay

    delays, restarts = [], 0
    for _ in range(10):
        delay, restarts = restart_delay(restarts, ran_s=2.0)
        delays.append(delay)
    assert delays[:4] == [0.5, 1.0, 2.0, 4.0] and delays[-1] == RESTART_MAX_DELAY_S
    assert restarts == 10
    assert restart_delay(restarts, ran_s=120.0) == (0.5, 1)


@pytest.mark.parametrize("proxy_host,expected", [("127.0.0.1", "127.0.0.1"), ("[::1]", "::1")])
def test_colocated_worker_advertises_the_address_it_reaches_the_proxy_from(
        proxy_host: str, expected: str) -> None:
    """A colocated worker bound to 0.0.0.0 registered as 127.0.0.1 whatever the proxy's
    host, so a proxy on another machine could not reach it; it now advertises the local
    address of its route to the proxy (loopback here: no traffic leaves the machine)."""
    import socket

    from engine_core.addresses import route_source_host

    if ":" in expected and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    assert route_source_host(proxy_host) == expected


def test_kv_ip_not_given_is_the_address_the_proxy_is_reached_from() -> None:
    """vLLM's example configs give no kv_ip (its engine uses the host's own address); ours
    defaulted to 127.0.0.1, which a proxy on another host was told and could not reach. It
    is now the address this host reaches the proxy from, re-derived with --proxy-address."""
    from engine_core.addresses import route_source_host
    from engine_core.config import KVTransferConfig

    remote = "10.255.255.1"
    kv = KVTransferConfig.from_json({"kv_role": "kv_producer", "kv_port": 21001,
                                     "kv_connector_extra_config": {"proxy_ip": remote,
                                                                   "proxy_port": 30001}})
    assert not kv.kv_ip_given and kv.kv_ip == route_source_host(remote)
    given = KVTransferConfig.from_json({"kv_role": "kv_producer", "kv_ip": "10.0.0.7",
                                        "kv_connector_extra_config": {"proxy_ip": remote}})
    assert given.kv_ip_given and given.kv_ip == "10.0.0.7"
    local = KVTransferConfig.from_json({"kv_role": "kv_consumer"})
    assert not local.kv_ip_given and local.kv_ip == "127.0.0.1"  # no proxy named: loopback
    args = argparse.Namespace(port=8100, kv_port=None, proxy_address=["10.255.255.2:30001"])
    moved = worker_kv_config(kv, "kv_producer", args)
    assert moved.kv_ip == route_source_host("10.255.255.2") and moved.proxy_port == 30001
    assert worker_kv_config(given, "kv_producer", args).kv_ip == "10.0.0.7"
    default = worker_kv_config(None, "kv_producer", args)
    assert default.kv_ip == route_source_host("10.255.255.2")


def test_ports_are_distinct_and_heartbeats_checked(tmp_path: Path) -> None:
    """Every port of a launch is picked at once, so no two sockets get the same one (one at
    a time, 16-worker launches collided in ~3.5% of builds); the proxy drops a worker only
    after 3 heartbeat intervals (at least 10 s), and an interval must be > 0."""
    from deploy.launch import free_ports

    ports = free_ports(64, avoid=(8000,))
    assert len(set(ports)) == 64 and 8000 not in ports
    args = _parse("--prefill", "8", "--decode", "8", "--heartbeat-interval", "12")
    proxy, workers, _ = build_children(args, engine_argv(args), tmp_path)
    taken = [int(_flag(proxy.argv, "--registration-port"))]
    for worker in workers:
        kv = json.loads(_flag(worker.argv, "--kv-transfer-config"))
        taken += [kv["kv_port"], kv["kv_connector_extra_config"]["http_port"]]
    assert len(set(taken)) == len(taken) == 33
    assert _flag(proxy.argv, "--heartbeat-timeout") == "36"
    default, _, _ = build_children(_parse(), engine_argv(_parse()), tmp_path)
    assert _flag(default.argv, "--heartbeat-timeout") == "10"
    for bad in ("0", "-1", "inf"):
        with pytest.raises(SystemExit):
            _parse("--heartbeat-interval", bad)


@pytest.mark.usefixtures("no_cuda_visible_devices")  # plans --gpus
def test_workers_sharing_a_gpu_send_kv_over_zmq_by_default(tmp_path: Path) -> None:
    """NCCL takes no two ranks on one GPU: with --gpus 0,0 and the default transport (auto),
    the workers now get the CPU transport instead of failing their first transfer."""
    _, workers, _ = build_children(_parse("--gpus", "0,0"), [], tmp_path)
    for worker in workers:
        kv = json.loads(_flag(worker.argv, "--kv-transfer-config"))
        assert kv["kv_connector_extra_config"]["transport"] == "cpu"


@pytest.mark.parametrize("kv", ['{"kv_role": "kv_both"}', '{"kv_port": 21001}'])
def test_serve_with_a_kv_both_connector_is_a_worker(kv: str, monkeypatch) -> None:
    """`pdserve serve --kv-transfer-config` with kv_both (also the default without a kv_role)
    starts the worker `pdserve worker` starts: it prefills, decodes and serves whole."""
    import engine_core.server.worker as worker
    from deploy.cli import main

    served = []
    monkeypatch.setattr(worker, "serve_worker", lambda config, options, factory, interval:
                        served.append(config.kv_transfer))
    assert main(["serve", "--demo-random", "--device", "cpu", "--kv-transfer-config", kv]) == 0
    (kv_config,) = served
    assert kv_config.kv_role == "kv_both" and kv_config.is_producer and kv_config.is_consumer
    assert worker.ROLE_LETTER[kv_config.kv_role] == "worker"


def test_a_users_kv_transfer_config_reaches_every_p_and_d_worker(tmp_path: Path) -> None:
    """`pdserve launch --kv-transfer-config` used to be accepted and dropped; its keys now go
    into each P and D worker's config, while what launch assigns per worker stays launch's."""
    user = {"kv_buffer_size": "5e9", "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {"send_type": "GET", "transfer_timeout_s": 60}}
    args = _parse("--prefill", "1", "--decode", "1", "--kv-transfer-config", json.dumps(user))
    _, workers, _ = build_children(args, engine_argv(args), tmp_path)
    for worker in workers:
        kv = json.loads(_flag(worker.argv, "--kv-transfer-config"))
        assert (kv["kv_buffer_size"], kv["kv_load_failure_policy"]) == ("5e9", "fail")
        extra = kv["kv_connector_extra_config"]
        assert (extra["send_type"], extra["transfer_timeout_s"]) == ("GET", 60)
        assert extra["proxy_ip"] == "127.0.0.1" and kv["kv_role"] in ("kv_producer", "kv_consumer")
    for bad in ('{"kv_port": 1}', '{"kv_connector_extra_config": {"proxy_port": 1}}',
                '{"kv_buffer_size": "lots"}', "{not json"):
        with pytest.raises(SystemExit):
            build_children(_parse("--kv-transfer-config", bad), [], tmp_path)


def test_a_dead_childs_leftovers_are_killed(tmp_path: Path) -> None:
    """A worker that dies can leave its engine process behind (its own process group),
    holding the GPU a restarted worker needs: its group is now killed when its death is
    seen and at shutdown."""
    import os
    import sys
    import time

    from deploy.launch import Child

    script = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
              "'import time; time.sleep(60)']); print(p.pid, flush=True)")
    child = Child("w", [sys.executable, "-c", script], dict(os.environ), tmp_path / "w.log")
    child.start()
    assert child.proc is not None
    child.proc.wait(30)
    assert child.log is not None
    child.log.flush()
    deadline = time.monotonic() + 10
    while not (tmp_path / "w.log").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    leftover = int((tmp_path / "w.log").read_text().split()[0])
    os.kill(leftover, 0)  # alive after its parent died
    child.kill_group()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(leftover, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the dead child's leftover process is still running")
    child.log.close()


@pytest.mark.usefixtures("no_cuda_visible_devices")  # plans --gpus
def test_workers_are_the_default_and_static_roles_stay(tmp_path: Path) -> None:
    """Without --prefill/--decode, launch starts workers the proxy places requests on
    (kv_both, `pdserve worker`); --prefill/--decode keep their static meaning."""
    from deploy.launch import topology

    assert topology(_parse()).describe() == "2 workers"
    assert topology(_parse("--workers", "3", "--colocated", "1")).describe() == (
        "3 workers + 1 colocated")
    assert topology(_parse("--colocated", "2")).describe() == "2 colocated"
    assert topology(_parse("--prefill", "2")).describe() == "2P1D"
    # The benchmark sweep's spelling: every count given, zeros included.
    assert topology(_parse("--prefill", "0", "--decode", "0", "--colocated", "0",
                           "--workers", "2")).describe() == "2 workers"
    assert topology(_parse("--prefill", "0", "--decode", "0", "--colocated", "2",
                           "--workers", "0")).describe() == "2 colocated"
    assert topology(_parse("--workers", "2", "--decode", "1")).describe() == "2 workers + 1P1D"
    _, workers, _ = build_children(_parse("--gpus", "0,1"), [], tmp_path)
    assert [w.name for w in workers] == ["worker0", "worker1"]
    for index, worker in enumerate(workers):
        assert worker.argv[3] == "worker" and worker.env["CUDA_VISIBLE_DEVICES"] == str(index)
        kv = json.loads(_flag(worker.argv, "--kv-transfer-config"))
        assert kv["kv_role"] == "kv_both"
        assert kv["kv_connector_extra_config"]["transport"] == "auto"  # two GPUs: NCCL
