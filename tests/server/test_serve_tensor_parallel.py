"""`pdserve serve --demo-random -tp 2` on CPU: rank 0 serves HTTP and drives rank 1; its greedy
completion equals the single-rank engine's, /metrics reports the worker once, and the
rank process exits with the server."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from deploy.launch import free_port
from tests.integration.cluster_harness import alive, children_of, wait_http
from tests.server.test_cli import _command

PROMPT = [11, 250, 37, 401, 9, 77, 512, 3, 64]
ENGINE_FLAGS = ["--device", "cpu", "--num-gpu-blocks-override", "64", "--max-model-len", "256",
                "--dtype", "float32"]


def _rank_workers(server_pid: int) -> list[int]:
    """Pids of tensor-parallel rank processes under the server (its engine's children)."""
    found = []
    for engine in children_of(server_pid):
        for pid in children_of(engine):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"rank_worker" in cmdline:
                found.append(pid)
    return found


@pytest.mark.slow
def test_serve_tp2_completion_equals_tp1(tmp_path: Path) -> None:
    from engine_core.demo_model import random_demo_model_path
    from engine_core.llm import LLM
    from engine_core.sampling_params import SamplingParams

    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(_command() + ["serve", "--demo-random", "-tp", "2", "--port", str(port)]
                                + ENGINE_FLAGS, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    ranks: list[int] = []
    try:
        wait_http(url + "/health", time.monotonic() + 240, [proc], [log])
        ranks = _rank_workers(proc.pid)
        assert len(ranks) == 1, "expected one rank process beside rank 0"
        request = urllib.request.Request(
            url + "/v1/completions", method="POST",
            data=json.dumps({"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                             "ignore_eos": True}).encode(),
            headers={"Content-Type": "application/json"})
        body = json.loads(urllib.request.urlopen(request, timeout=120).read())
        metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-4000:]
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in ranks), "a rank outlived its server"
    # One worker's series: each gauge appears once, not once per rank.
    usage = [line for line in metrics.splitlines()
             if line.startswith("vllm:kv_cache_usage_perc")]
    assert len(usage) == 1, usage

    llm = LLM(str(random_demo_model_path()), device="cpu", num_gpu_blocks_override=64,
              max_model_len=256, dtype="float32")
    expected = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12,
                                                     ignore_eos=True))[0]
    assert body["choices"][0]["text"] == expected.outputs[0].text
    assert body["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("command", ["prefill", "decode", "worker"])
def test_pd_worker_with_tp_and_sleep_mode_refuses_to_start(
        command: str, caplog: pytest.LogCaptureFixture) -> None:
    """A P/D worker may be tensor-parallel (its ranks move KV rank to rank), but sleep mode
    with TP is refused before anything starts."""
    from deploy.cli import main

    assert main([command, "--demo-random", "-tp", "2", "--enable-sleep-mode", "--device",
                 "cpu", "--port", str(free_port())]) == 1
    assert "--enable-sleep-mode with --tensor-parallel-size 2 is not supported" in caplog.text
