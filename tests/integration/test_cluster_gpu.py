"""`pdserve launch --prefill 1 --decode 1` on two GPUs, KV over NCCL (run on the GPU machine).

1. A checkpoint served by the 1P1D cluster (prefill on GPU0, decode on GPU1) gives the same
   greedy text and usage as one colocated `pdserve serve` of it (float32: exact kernels),
   with D computing the first token and with the proxy streaming P's (first-token handoff).
2. Qwen3-0.6B- and Qwen3-8B-shaped dummy models serve 200 mixed requests through the
   cluster without an error, every one with its full completion.
3. Long prompts (2k-5k tokens, as the disaggregation report sends: prefill-worker steps of up
   to 8192 tokens, eager, several requests' KV gathered per layer) through a Qwen3-8B-shaped
   1P1D: every request completes, every KV load lands (none recomputed on D) and the
   prefill worker is alive at the end; over NCCL on two GPUs, and with P and D sharing one
   GPU over the CPU transport.
4. A decode worker killed with SIGKILL mid-stream (P on GPU0, two D on GPU1, KV over NCCL):
   its streams continue on the other D, P sending the prompt's KV again over NCCL, with the
   greedy text of an undisturbed colocated run.

    source .device/env.sh && python3 -m pytest -m gpu -q tests/integration/test_cluster_gpu.py
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from benchmarks.model_shapes import write_model_dir
from deploy.launch import free_port
from tests.integration.cluster_harness import (
    MODEL,
    ROOT,
    Req,
    build_tiny_checkpoint,
    check_matches,
    child_env,
    children_of,
    get_json,
    labelled_counter,
    mixed_requests,
    run_all,
    scrape,
    stop_process,
    wait_http,
    with_limit,
)

pytestmark = pytest.mark.gpu
STARTUP_S = 600.0


def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    pytest.importorskip("cupy")


def _start_cluster(tmp_path: Path, model: Path, engine: list[str], gpus: str = "0,1",
                   launch_flags: tuple[str, ...] = (),
                   topology: tuple[str, ...] = ("--prefill", "1", "--decode", "1"),
                   ready: str = "ready: 1P1D") -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = tmp_path / "launch.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.launch", *topology,
             "--model", str(model), "--gpus", gpus, "--port", str(port),
             "--log-dir", str(tmp_path / "logs"), "--heartbeat-interval", "1", *launch_flags,
             *engine],
            cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + STARTUP_S
    while ready not in log.read_text():
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}", log


def _worker(proxy: str, role: str) -> str:
    workers = get_json(f"{proxy}/instances")["workers"]
    found = [w["http_address"] for w in workers if w["role"] == role]
    assert len(found) == 1, workers
    return found[0]


def _decode_bytes_received(proxy: str) -> float:
    return scrape(_worker(proxy, "D")).get("pdserve:kv_transfer_bytes_received_total", 0.0)


def _plane(plane: str) -> tuple[str, list[str]]:
    """GPUs and engine flags of a 1P1D: NCCL between two GPUs, or P and D sharing one GPU
    over the CPU transport (which on CUDA keeps NCCL's stream discipline)."""
    if plane == "nccl-two-gpus":
        _two_gpus()
        return "0,1", []
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return "0,0", ["--kv-transport", "cpu", "--gpu-memory-utilization", "0.42"]


def _colocated_answers(tmp_path: Path, ckpt: Path, engine: list[str], reqs: list[Req]) -> list:
    """``reqs`` answered by one colocated ``pdserve serve`` of ``ckpt`` on GPU 0."""
    serve_port = free_port()
    with open(tmp_path / "serve.log", "wb") as out:
        colocated = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "serve", str(ckpt), "--port", str(serve_port),
             *engine], cwd=ROOT, env=dict(child_env(), CUDA_VISIBLE_DEVICES="0"),
            stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{serve_port}/health", time.monotonic() + STARTUP_S,
                  [colocated], [tmp_path / "serve.log"])
        return run_all(f"http://127.0.0.1:{serve_port}", reqs)
    finally:
        stop_process(colocated)


PLANES = ["nccl-two-gpus", "cpu-transport-one-gpu"]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("plane", PLANES)
@pytest.mark.parametrize("launch_flags", [("--no-first-token-from-prefill",), ()],
                         ids=["d-first-token", "p-first-token"])
def test_gpu_1p1d_matches_colocated(tmp_path: Path, launch_flags: tuple[str, ...],
                                    plane: str) -> None:
    gpus, extra = _plane(plane)
    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    engine = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256"]
    reqs = mixed_requests(64)
    want = _colocated_answers(tmp_path, ckpt, engine, reqs)
    cluster, proxy, log = _start_cluster(tmp_path, ckpt, [*engine, *extra], gpus, launch_flags)
    try:
        check_matches(reqs, run_all(proxy, reqs), want)
        assert _decode_bytes_received(proxy) > 0, "no KV went over the connector"
        handoffs = labelled_counter(proxy.removeprefix("http://"),
                                    "pdserve:proxy_first_token_handoffs")
        if not launch_flags:  # the default: every stream of the mix took the handoff
            assert handoffs.get("prefill") == sum(r.stream for r in reqs), handoffs
    finally:
        stop_process(cluster)


def _set_capabilities(proxy: str, worker: str, capabilities: list[str] | None) -> None:
    request = urllib.request.Request(
        f"{proxy}/instances/capabilities", method="POST",
        data=json.dumps({"worker": worker, "capabilities": capabilities}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


@pytest.mark.timeout(1200)
def test_gpu_placed_workers_match_colocated(tmp_path: Path) -> None:
    """`launch --workers 2` on two GPUs: placed requests (whole, and prefilled on one GPU and
    decoded on the other over NCCL) give colocated's greedy output."""
    _two_gpus()
    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    engine = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256"]
    reqs = mixed_requests(48)
    want = _colocated_answers(tmp_path, ckpt, engine, reqs)
    cluster, proxy, _ = _start_cluster(
        tmp_path, ckpt, engine, "0,1", ("--placement-short-prompt-tokens", "12"),
        topology=("--workers", "2"), ready="ready: 2 workers")
    try:
        check_matches(reqs[:24], run_all(proxy, reqs[:24]), want[:24])
        first, second = (w["http_address"] for w in get_json(f"{proxy}/instances")["workers"])
        _set_capabilities(proxy, first, ["prefill"])
        _set_capabilities(proxy, second, ["decode"])
        check_matches(reqs[24:], run_all(proxy, reqs[24:]), want[24:])
        received = scrape(second).get("pdserve:kv_transfer_bytes_received_total", 0.0)
        assert received > 0, "no KV went over NCCL while worker1 only decoded"
    finally:
        stop_process(cluster)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-8b"])
def test_gpu_dummy_shapes_serve_200(tmp_path: Path, shape: str) -> None:
    _two_gpus()
    model = write_model_dir(shape, tmp_path / shape)
    engine = ["--served-model-name", MODEL, "--load-format", "dummy", "--dtype", "bfloat16",
              "--max-model-len", "4096"]
    # Prompts of 3..~300 words; completions of 4..63 tokens; 32 in flight at once.
    reqs = mixed_requests(200, max_words=300, max_tokens=64)
    cluster, proxy, _ = _start_cluster(tmp_path, model, engine)
    try:
        started = time.monotonic()
        got = run_all(proxy, reqs, concurrency=32, timeout_s=600.0)
        elapsed = time.monotonic() - started
        failed = [(r.body, o) for r, o in zip(reqs, got) if not o.ok]
        assert not failed, failed[:3]
        for req, out in zip(reqs, got):
            assert out.usage is not None and out.usage["completion_tokens"] == req.limit, (req, out)
        assert _decode_bytes_received(proxy) > 0
        print(f"{shape}: 200 requests in {elapsed:.1f} s")
    finally:
        stop_process(cluster)


def _long_prompt_requests(n: int, vocab: int, seed: int = 7) -> list[Req]:
    """Random token-id prompts (as the report's random dataset): mostly 2048 tokens, every
    fourth 5000 (two of them overflow an 8192-token step: chunked prefill on P)."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        length = 5000 if i % 4 == 3 else 2048
        prompt = [rng.randrange(vocab) for _ in range(length)]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        reqs.append(Req("/v1/completions", False, body, 8))
    return reqs


@pytest.mark.timeout(900)
@pytest.mark.parametrize("plane", PLANES)
def test_gpu_1p1d_long_prompts(tmp_path: Path, plane: str) -> None:
    gpus, extra = _plane(plane)
    model = write_model_dir("qwen3-8b", tmp_path / "qwen3-8b")
    engine = ["--served-model-name", MODEL, "--load-format", "dummy", "--dtype", "bfloat16",
              "--max-model-len", "10240", *extra]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    reqs = _long_prompt_requests(16, vocab)
    cluster, proxy, _ = _start_cluster(tmp_path, model, engine, gpus)
    try:
        prefill, decode = _worker(proxy, "P"), _worker(proxy, "D")
        got = run_all(proxy, reqs, concurrency=8, timeout_s=600.0)
        failed = [(len(r.body["prompt"]), o.status, o.error, o.exception)
                  for r, o in zip(reqs, got) if not o.ok]
        assert not failed, failed[:3]
        for req, out in zip(reqs, got):
            assert out.usage is not None and out.usage["completion_tokens"] == req.limit, out
        with urllib.request.urlopen(f"http://{prefill}/health", timeout=15) as response:
            assert response.status == 200  # P's engine core still runs
        assert _worker(proxy, "P") == prefill
        d = scrape(decode)
        lost = {k: d.get(f"pdserve:kv_transfer_{k}_total", 0.0)
                for k in ("transfers_failed", "transfers_timed_out", "messages_rejected")}
        assert not any(lost.values()), lost
        assert d.get("pdserve:kv_transfer_transfers_received_total", 0.0) == len(reqs), d
    finally:
        stop_process(cluster)


def _server_pid(http_address: str) -> int:
    """The pid of the ``pdserve`` API process listening on ``http_address``."""
    port = http_address.rsplit(":", 1)[1]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"deploy.cli" in argv and b"--port" in argv and port.encode() in argv:
            return int(entry.name)
    raise AssertionError(f"no process serves {http_address}")


def _kill_tree(pid: int) -> None:
    for child in children_of(pid):
        _kill_tree(child)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


MIGRATION_TOKENS = 1500


@pytest.mark.timeout(900)
def test_gpu_dead_decode_streams_move_over_nccl(tmp_path: Path) -> None:
    _two_gpus()
    from engine_core.demo_model import build_checkpoint

    # Long streams: the kill lands mid-stream.
    ckpt = build_checkpoint(tmp_path / "ckpt", max_position_embeddings=4096)
    engine = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "4096"]
    reqs = []
    for i, req in enumerate(mixed_requests(8, offset=3)):
        long = with_limit(req, MIGRATION_TOKENS, stream=i < 6)
        reqs.append(Req(long.path, long.stream, {**long.body, "ignore_eos": True}, long.limit))
    want = _colocated_answers(tmp_path, ckpt, engine, reqs)
    cluster, proxy, _ = _start_cluster(
        tmp_path, ckpt, [*engine, "--kv-transport", "nccl", "--gpu-memory-utilization", "0.3"],
        "0,1,1", ("--no-first-token-from-prefill",),
        topology=("--prefill", "1", "--decode", "2"), ready="ready: 1P2D")
    try:
        decoders = [w["http_address"] for w in get_json(f"{proxy}/instances")["workers"]
                    if w["role"] == "D"]
        assert len(decoders) == 2, decoders
        victim = decoders[0]
        got: list = []
        sender = threading.Thread(target=lambda: got.extend(
            run_all(proxy, reqs, concurrency=len(reqs), timeout_s=300.0)))
        sender.start()
        ttft = "vllm:time_to_first_token_seconds_count"
        deadline = time.monotonic() + 60
        while scrape(victim).get(ttft, 0.0) < 2:  # two of the requests decode on the victim
            assert time.monotonic() < deadline, "no request started on the victim"
            time.sleep(0.05)
        time.sleep(0.5)  # mid-stream: tokens already sent to the clients
        _kill_tree(_server_pid(victim))
        sender.join(timeout=400)
        assert not sender.is_alive(), "requests hung after the kill"
        check_matches(reqs, got, want)
        moved = labelled_counter(proxy.removeprefix("http://"), "pdserve:proxy_migrations")
        assert sum(moved.values()) >= 2, moved
        survivor = scrape(decoders[1])
        assert survivor.get("pdserve:kv_transfer_bytes_received_total", 0.0) > 0
    finally:
        stop_process(cluster)
