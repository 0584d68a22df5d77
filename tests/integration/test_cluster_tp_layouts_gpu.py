"""KV transfer between tensor-parallel layouts on real devices (two GPUs): a prefill worker of
TP=2 on GPUs 0 and 1 feeds a decode worker of TP=1 on GPU 0 over the CPU transport (NCCL
cannot pair a GPU with itself), each prefill rank sending only its KV heads from its own
GPU; 200 mixed requests complete and every KV load lands.

    source .device/env.sh && python3 -m pytest -m gpu -q tests/integration/test_cluster_tp_layouts_gpu.py
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deploy.launch import free_port
from tests.integration.cluster_harness import (
    MODEL,
    ROOT,
    build_tiny_checkpoint,
    child_env,
    get_json,
    idle_violations,
    mixed_requests,
    run_all,
    scrape,
    wait_idle,
)

pytestmark = pytest.mark.gpu
STARTUP_S = 600.0


@pytest.mark.timeout(1500)
def test_gpu_prefill_tp2_feeds_decode_tp1(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    checkpoint = build_tiny_checkpoint(tmp_path / "ckpt")  # 2 KV heads: one a prefill rank
    port, log = free_port(), tmp_path / "launch.log"
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "deploy.launch", "--prefill", "1", "--decode", "1",
             "--prefill-tp", "2", "--decode-tp", "1", "--gpus", "0,1,0",
             "--kv-transport", "cpu", "--model", str(checkpoint), "--port", str(port),
             "--log-dir", str(tmp_path / "logs"), "--heartbeat-interval", "1",
             "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "512",
             "--gpu-memory-utilization", "0.4"],
            cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
    proxy = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while "ready: 1P1D" not in log.read_text():
            assert launcher.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        workers = {w["role"]: w for w in get_json(f"{proxy}/instances")["workers"]}
        assert len(workers["P"]["kv_ranks"]["addresses"]) == 2

        reqs = mixed_requests(200, max_words=120, max_tokens=32)
        got = run_all(proxy, reqs, concurrency=32, timeout_s=600.0)
        failed = [(r.body, o) for r, o in zip(reqs, got) if not o.ok]
        assert not failed, failed[:3]
        for req, answer in zip(reqs, got):
            assert answer.usage is not None
            assert answer.usage["completion_tokens"] == req.limit, (req, answer)

        addresses = [workers["P"]["http_address"], workers["D"]["http_address"]]
        scraped = wait_idle(addresses, 60.0)
        assert not idle_violations(scraped), idle_violations(scraped)
        decode = scrape(workers["D"]["http_address"])
        prefill = scrape(workers["P"]["http_address"])
        received = decode["pdserve:kv_transfer_transfers_received_total"]
        assert received > 0
        assert received == prefill["pdserve:kv_transfer_transfers_sent_total"]  # every route
        assert decode["pdserve:kv_transfer_transfers_failed_total"] == 0
        assert decode["pdserve:kv_transfer_transfers_timed_out_total"] == 0
        decode_log = (tmp_path / "logs" / "decode0.log").read_text()
        assert "recomputing the prompt locally" not in decode_log, decode_log[-4000:]
        assert "kv load" not in decode_log, decode_log[-4000:]
    finally:
        launcher.terminate()
        try:
            launcher.wait(60)
        except subprocess.TimeoutExpired:
            launcher.kill()
