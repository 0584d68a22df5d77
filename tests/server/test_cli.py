"""`pdserve serve --demo-random` as a real subprocess answers requests; bad flags get clear errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from deploy.cli import build_parser
from deploy.launch import free_port


def _command() -> list[str]:
    exe = shutil.which("pdserve")
    return [exe] if exe else [sys.executable, "-m", "deploy.cli"]


def test_unknown_flag_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--demo", "--no-such-flag"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_vllm_flags_parse_into_config():
    from engine_core.arg_utils import engine_config_from_args

    args = build_parser().parse_args([
        "serve", "/models/x", "--dtype", "bfloat16", "--max-model-len", "1024",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--block-size", "32",
        "--no-enable-prefix-caching", "--kv-cache-dtype", "fp8", "--seed", "3",
        "--served-model-name", "m", "--no-enable-chunked-prefill", "--load-format", "dummy",
        "--kv-transfer-config", '{"kv_connector":"P2pNcclConnector","kv_role":"kv_producer",'
        '"kv_port":"21001","kv_connector_extra_config":{"send_type":"PUT"}}'])
    config = engine_config_from_args(args)
    assert config.model.name == "m" and config.model.max_model_len == 1024
    assert config.cache.block_size == 32 and not config.cache.enable_prefix_caching
    assert config.scheduler.max_num_seqs == 8 and not config.scheduler.enable_chunked_prefill
    assert config.kv_transfer.kv_port == 21001 and config.kv_transfer.send_type == "PUT"
    assert config.device.triton_pdl and not config.model.allow_long_max_model_len


def test_engine_environment_variables_become_config_at_the_entry_point(monkeypatch):
    """The engine reads no environment variable: ``apply_environment`` folds them into the
    parsed flags the config is built from."""
    from engine_core.arg_utils import engine_config_from_args
    from engine_core.server.server_args import apply_environment

    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    monkeypatch.setenv("PDSERVE_TRITON_PDL", "0")
    args = build_parser().parse_args(["serve", "/models/x"])
    apply_environment(args)
    config = engine_config_from_args(args)
    assert config.model.allow_long_max_model_len and not config.device.triton_pdl


@pytest.mark.slow
def test_pdserve_serve_demo_subprocess():
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": "k"}
    proc = subprocess.Popen(
        _command() + ["serve", "--demo-random", "--port", str(port), "--num-gpu-blocks-override", "256",
                      "--max-model-len", "512"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        request = urllib.request.Request(
            url + "/v1/completions", method="POST",
            data=json.dumps({"prompt": "Hello", "max_tokens": 4}).encode(),
            headers={"Authorization": "Bearer k", "Content-Type": "application/json"})
        body = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert body["model"] == "pdserve-demo-random"
        assert body["usage"]["completion_tokens"] == 4
        # VLLM_SERVER_DEV_MODE exposes the admin routes; they still need the key.
        reset = urllib.request.Request(url + "/reset_prefix_cache", method="POST", data=b"")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(reset, timeout=30)
        assert refused.value.code == 401
        reset.add_header("Authorization", "Bearer k")
        assert urllib.request.urlopen(reset, timeout=30).status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
    assert proc.returncode == 0, output
    assert "listening on" in output and "Engine core started" in output


@pytest.mark.slow
def test_server_exits_nonzero_when_its_engine_dies():
    """A server whose engine-core process dies shuts down and exits 1, so a supervisor (or
    ``pdserve launch --restart``) sees a failure, not a clean stop."""
    from tests.integration.cluster_harness import children_of

    port = free_port()
    proc = subprocess.Popen(
        _command() + ["serve", "--demo-random", "--port", str(port), "--num-gpu-blocks-override", "64",
                      "--max-model-len", "256"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        engines = children_of(proc.pid)
        assert engines, "no engine-core process"
        for pid in engines:
            os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, output
    assert "engine core died" in output


def test_a_taken_http_port_fails_before_the_engine_starts() -> None:
    """The server binds once the model is loaded; a taken port used to show only then
    (minutes on a GPU). It is now probed first, and `pdserve serve` exits 1 at once."""
    import socket
    import time

    from deploy.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        assert main(["serve", "--demo-random", "--device", "cpu", "--host", "127.0.0.1",
                     "--port", str(port)]) == 1
        assert time.monotonic() - started < 20  # no engine was started
