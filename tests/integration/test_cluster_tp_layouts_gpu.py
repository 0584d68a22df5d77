"""KV transfer between tensor-parallel layouts on real devices.

1. Two GPUs: a prefill worker of TP=2 on GPUs 0 and 1 feeds a decode worker of TP=1 on GPU 0
   over the CPU transport (NCCL cannot pair a GPU with itself), each prefill rank sending
   only its KV heads from its own GPU.
2. Four GPUs: P and D on separate GPU groups, KV over NCCL rank pair by rank pair, for
   P TP=2 -> D TP=2, P TP=2 -> D TP=1 and P TP=1 -> D TP=2; greedy float32 answers equal a
   colocated TP=1 server's.

Each serves 200 mixed requests; every KV load lands (none recomputed on D) and nothing is
held at the end.

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
    Outcome,
    Req,
    build_tiny_checkpoint,
    check_matches,
    child_env,
    get_json,
    idle_violations,
    mixed_requests,
    run_all,
    scrape,
    stop_process,
    wait_http,
    wait_idle,
)

pytestmark = pytest.mark.gpu
STARTUP_S = 600.0
ENGINE = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "512"]
REQUESTS = mixed_requests(200, max_words=120, max_tokens=32)


def _need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, {torch.cuda.device_count()} present")


def _colocated(tmp_path: Path, checkpoint: Path, reqs: list[Req]) -> list[Outcome]:
    """The reference: one colocated TP=1 ``pdserve serve`` on GPU 0."""
    port = free_port()
    with open(tmp_path / "serve.log", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "serve", str(checkpoint), "--port", str(port),
             *ENGINE, "--gpu-memory-utilization", "0.3"], cwd=ROOT,
            env=dict(child_env(), CUDA_VISIBLE_DEVICES="0"), stdout=out,
            stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", time.monotonic() + STARTUP_S, [proc],
                  [tmp_path / "serve.log"])
        return run_all(f"http://127.0.0.1:{port}", reqs, concurrency=32, timeout_s=600.0)
    finally:
        stop_process(proc)


def _serve_layout(tmp_path: Path, checkpoint: Path, prefill_tp: int, decode_tp: int,
                  gpus: str, transport: list[str]) -> list[Outcome]:
    """Launch 1P1D of the given layout, answer REQUESTS, check every route landed and the
    workers are idle afterwards; the answers."""
    port, log = free_port(), tmp_path / "launch.log"
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "deploy.launch", "--prefill", "1", "--decode", "1",
             "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp), "--gpus", gpus,
             *transport, "--model", str(checkpoint), "--port", str(port),
             "--log-dir", str(tmp_path / "logs"), "--heartbeat-interval", "1", *ENGINE,
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
        assert len(workers["P"]["kv_ranks"]["addresses"]) == prefill_tp
        assert len(workers["D"]["kv_ranks"]["addresses"]) == decode_tp

        got = run_all(proxy, REQUESTS, concurrency=32, timeout_s=600.0)
        failed = [(r.body, o) for r, o in zip(REQUESTS, got) if not o.ok]
        assert not failed, failed[:3]
        for req, answer in zip(REQUESTS, got):
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
        return got
    finally:
        stop_process(launcher)


@pytest.mark.timeout(1500)
def test_gpu_prefill_tp2_feeds_decode_tp1(tmp_path: Path) -> None:
    _need_gpus(2)
    checkpoint = build_tiny_checkpoint(tmp_path / "ckpt")  # 2 KV heads: one a prefill rank
    _serve_layout(tmp_path, checkpoint, 2, 1, "0,1,0", ["--kv-transport", "cpu"])


@pytest.mark.timeout(1500)
@pytest.mark.parametrize(("prefill_tp", "decode_tp", "gpus"), [
    (2, 2, "0,1,2,3"), (2, 1, "0,1,2"), (1, 2, "0,1,2")], ids=["P2-D2", "P2-D1", "P1-D2"])
def test_gpu_layouts_over_nccl_match_colocated(tmp_path: Path, prefill_tp: int,
                                               decode_tp: int, gpus: str) -> None:
    _need_gpus(4 if prefill_tp + decode_tp == 4 else 3)
    pytest.importorskip("cupy")
    checkpoint = build_tiny_checkpoint(tmp_path / "ckpt")
    want = _colocated(tmp_path, checkpoint, REQUESTS)
    got = _serve_layout(tmp_path, checkpoint, prefill_tp, decode_tp, gpus, [])
    check_matches(REQUESTS, got, want)
